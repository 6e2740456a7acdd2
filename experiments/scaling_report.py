"""Tables and plots of the scaling sweep (experiments/scaling.py) from its runs.csv; works on a partial sweep.

    python experiments/scaling_report.py experiments/results/scaling_cpu

Writes ``summary.md`` (the learning-rate sweeps, each size's final losses with the difference to ``separate``
paired by seed and its 95% t interval, in nats/byte and as relative per-byte perplexity exp(delta) - 1, the
ranking at one shared rate against each scheme's own, epochs and overfitting: each variant's training loss beside
its validation loss, since at many epochs a tie that fits the training text worse can still generalise as well;
the conversion to per-token units)
and ``delta_vs_params.png`` (the difference against parameters, log axis, one line per scheme, with a fitted
trend in log parameters where three sizes are in; two panels: the schemes that keep ``separate``'s K/V cache, and
those that shrink it, each named with its fraction of the cache) and ``frontier.png`` (final loss against
training compute).
Speed is not taken from the sweep (its runs share the machine with other work): ``summary.md``'s speed table
copies each variant's train-step tokens/s at each size from a benchmark run (``--speed``, by default
``benchmarks/results/scaling_speed_cpu_deferred.json`` from ``benchmarks/scaling_speed.py``), with its command,
machine and date.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import textwrap
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import report
from experiments.report import detectable, t_quantile
from experiments.rows import PROTOCOL_FILE, read_csv

BYTES_PER_TOKEN = (3.5, 4.5)  # GPT-2-style BPE on English prose: the range used to convert to per-token units
SHARED_LR = 2e-3
CORPUS_TITLES = {"shakespeare": "Tiny Shakespeare", "python_docs": "Python documentation"}  # corpus -> heading
KAYYAM_KV = (("300M", 3.1), ("1.2B", 2.5))  # K = V's per-token perplexity penalty in Kayyam et al. 2026
KAYYAM_PARAMS = (300e6, 1.2e9)
SPEED = Path(__file__).resolve().parents[1] / "benchmarks/results/scaling_speed_cpu_deferred.json"


def sweep_means(rows: list[dict]) -> dict[tuple, dict[float, tuple[float, int]]]:
    """(corpus, size, variant) -> {rate: (mean final loss over the sweep seeds finished there, how many)}."""
    by_seed = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        if r["stage"].startswith("lr-"):
            by_seed[r["corpus"], int(r["size"]), r["variant"]][float(r["learning_rate"])].append(
                float(r["final_val_loss"])
            )
    return {cell: {lr: (statistics.fmean(v), len(v)) for lr, v in by_lr.items()} for cell, by_lr in by_seed.items()}


def best_rates(rows: list[dict]) -> dict[tuple, float]:
    """(corpus, size, variant) -> the rate of the lowest final loss averaged over the sweep seeds, among the rates
    every sweep seed of the cell has finished (as ``scaling.py`` picks it)."""
    out = {}
    for cell, by_lr in sweep_means(rows).items():
        full = max(n for _, n in by_lr.values())
        out[cell] = min((lr for lr, (_, n) in by_lr.items() if n == full), key=lambda lr: by_lr[lr][0])
    return out


def finals(rows: list[dict]) -> dict[tuple, dict[int, dict]]:
    """(corpus, size, variant) -> {seed: row} of the runs at the rate the protocol chose for that cell: the size's
    own sweep, else the middle size's (larger sizes and the second corpus), read off each row's rate."""
    out = collections.defaultdict(dict)
    for r in rows:  # a sweep seed's run at the winning rate is that seed's final run (the seeded stage skips it)
        out[r["corpus"], int(r["size"]), r["variant"]].setdefault(int(r["seed"]), []).append(r)
    best = best_rates(rows)
    chosen = {}
    for key, by_seed in out.items():
        corpus, size, variant = key
        rates = {
            float(r["learning_rate"]) for runs in by_seed.values() for r in runs if not r["stage"].startswith("lr-")
        }
        rate = best.get(key) or (min(rates) if len(rates) == 1 else None)
        if rate is None:
            continue
        picked = {s: r for s, runs in by_seed.items() for r in runs if math.isclose(float(r["learning_rate"]), rate)}
        if picked:
            chosen[key] = picked
    return chosen


def paired(cells: dict, corpus: str, size: int, variant: str, against: str = "separate") -> dict | None:
    """Mean, std and the difference to ``against`` (paired by seed) with its 95% t interval."""
    runs, ref = cells.get((corpus, size, variant), {}), cells.get((corpus, size, against), {})
    if not runs:
        return None
    losses = [float(r["final_val_loss"]) for r in runs.values()]
    first = next(iter(runs.values()))
    out = {
        "variant": variant, "params": int(first["params"]), "lr": float(first["learning_rate"]), "n": len(losses),
        "mean": statistics.fmean(losses), "std": statistics.stdev(losses) if len(losses) > 1 else float("nan"),
        "epochs": float(first["epochs"]), "tokens": int(first["tokens"]),
        "kv": int(first["kv_cache_bytes_per_token"]),
    }  # fmt: skip
    if ref:
        out["ref_params"] = int(next(iter(ref.values()))["params"])  # the size's x position on plots
    diffs = [float(runs[s]["final_val_loss"]) - float(ref[s]["final_val_loss"]) for s in runs if s in ref]
    if variant != against and diffs:
        out["delta"], out["delta_n"], out["diffs"] = statistics.fmean(diffs), len(diffs), diffs
        if len(diffs) > 1:
            half = t_quantile(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
            out["ci"] = (out["delta"] - half, out["delta"] + half)
            out["detectable"] = detectable(diffs)
    return out


def _delta_ci(e: dict) -> str:
    """``+0.045 [-0.011, +0.100] d 0.071``: the mean, its 95% interval and the smallest difference the seeds could
    detect (80% power, paired); the mean alone where one seed gives no interval."""
    if "ci" not in e:
        return f"{e['delta']:+.3f}"
    return f"{e['delta']:+.3f} [{e['ci'][0]:+.3f}, {e['ci'][1]:+.3f}] d {e['detectable']:.3f}"


def _fmt_delta(e: dict) -> str:
    if "delta" not in e:
        return "—"
    text = _delta_ci(e)
    if "ci" in e:
        if e["ci"][0] <= 0 <= e["ci"][1]:
            text += " (interval holds 0)"
    else:
        text += f" (n={e['delta_n']}, no interval)"
    ppl = math.expm1(e["delta"]) * 100
    return text + f"; ppl/byte {ppl:+.1f}%"


def trend(points: list[tuple[float, float]]) -> dict | None:
    """Least-squares line of Δ against log10(params) through every seed's paired difference (so the seed spread
    enters the uncertainty): slope per decade, its standard error and 95% t interval (n - 2 degrees of freedom),
    the mean log10(params) and Δ it passes through, n and the number of sizes. None below two sizes or three
    points."""
    sizes = {p for p, _ in points}
    if len(sizes) < 2 or len(points) < 3:
        return None
    xs, ys = [math.log10(p) for p, _ in points], [d for _, d in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, ys, strict=True)]
    s2 = sum(r * r for r in resid) / (len(xs) - 2)  # the residual variance
    se = math.sqrt(s2 / sxx)
    half = t_quantile(len(xs) - 2) * se
    return {"slope": slope, "se": se, "ci": (slope - half, slope + half), "mx": mx, "my": my,
            "n": len(xs), "sizes": len(sizes), "sxx": sxx, "s2": s2}  # fmt: skip


def trend_by_size(points: list[tuple[float, float]]) -> dict | None:
    """The trend with the size as the unit (experiments/preregistered/trend_by_size.md): per size the mean paired Δ
    m_i and its standard error s_i (sizes with one seed are left out), weighted least squares of m_i on
    x_i = log10(params) with w_i = 1 / s_i^2; slope b = Σ c_i m_i, c_i = w_i (x_i - x̄) / Σ w_j (x_j - x̄)^2, its
    variance V = Σ c_i^2 s_i^2 and 95% interval b ± t(ν) sqrt(V) with ν Welch-Satterthwaite's degrees of freedom
    V^2 / Σ (c_i^2 s_i^2)^2 / (n_i - 1). Beside it: the residual χ² on k - 2 df and its p-value (k >= 3), and the
    unweighted line through the k means (``ols``: slope, 95% t interval on k - 2 df; k >= 3). None below two
    sizes with two seeds each."""
    from scipy import stats

    by_size = collections.defaultdict(list)
    for p, d in points:
        by_size[p].append(d)
    sizes = [(math.log10(p), statistics.fmean(ds), statistics.stdev(ds) / math.sqrt(len(ds)), len(ds))
             for p, ds in sorted(by_size.items()) if len(ds) > 1]  # fmt: skip
    if len(sizes) < 2 or any(s == 0 for _, _, s, _ in sizes):
        return None
    w = [1 / s**2 for _, _, s, _ in sizes]
    xbar = sum(wi * x for wi, (x, *_) in zip(w, sizes, strict=True)) / sum(w)
    mbar = sum(wi * m for wi, (_, m, *_) in zip(w, sizes, strict=True)) / sum(w)
    sxx = sum(wi * (x - xbar) ** 2 for wi, (x, *_) in zip(w, sizes, strict=True))
    c = [wi * (x - xbar) / sxx for wi, (x, *_) in zip(w, sizes, strict=True)]
    slope = sum(ci * m for ci, (_, m, *_) in zip(c, sizes, strict=True))
    parts = [ci**2 * s**2 for ci, (_, _, s, _) in zip(c, sizes, strict=True)]
    var = sum(parts)
    nu = var**2 / sum(q**2 / (n - 1) for q, (*_, n) in zip(parts, sizes, strict=True))
    half = float(stats.t.ppf(0.975, nu)) * math.sqrt(var)
    out = {"slope": slope, "se": math.sqrt(var), "ci": (slope - half, slope + half), "df": nu, "sizes": len(sizes),
           "seeds": [n for *_, n in sizes]}  # fmt: skip
    if len(sizes) > 2:
        chi2 = sum(wi * (m - mbar - slope * (x - xbar)) ** 2 for wi, (x, m, *_) in zip(w, sizes, strict=True))
        out["chi2"], out["chi2_p"] = chi2, float(stats.chi2.sf(chi2, len(sizes) - 2))
        out["ols"] = trend([(10**x, m) for x, m, *_ in sizes])  # one point per size: the unweighted line
    return out


def trend_band(fit: dict, log10_params: float) -> tuple[float, float, float]:
    """The fitted line at log10(params) and its 95% confidence band: t * s * sqrt(1/n + (x - mean x)^2 / Sxx)."""
    x = log10_params - fit["mx"]
    y = fit["my"] + fit["slope"] * x
    half = t_quantile(fit["n"] - 2) * math.sqrt(fit["s2"] * (1 / fit["n"] + x * x / fit["sxx"]))
    return y, y - half, y + half


def tail_train_loss(curves: list[dict], tail: float = 0.05) -> dict[str, float]:
    """run -> its training loss averaged over the last ``tail`` of its logged steps (one batch per step is noisy;
    the mean over the tail is not)."""
    train = collections.defaultdict(list)
    for c in curves:
        if c["train_loss"]:
            train[c["run"]].append((int(c["step"]), float(c["train_loss"])))
    out = {}
    for run, steps in train.items():
        last = max(step for step, _ in steps)
        out[run] = statistics.fmean(x for step, x in steps if step >= (1 - tail) * last)
    return out


def generalisation(cells: dict, train: dict[str, float]) -> list[dict]:
    """Per (corpus, size), over the runs the protocol chose: epochs, the tail training loss, the final validation
    loss, their difference val - train (the generalisation gap, mean ± std over the runs), and how many runs end
    above their best evaluation (validation loss rising: overfitting in the strict sense)."""
    by_size = collections.defaultdict(list)
    for (corpus, size, _), runs in cells.items():
        for r in runs.values():
            if r["run"] in train:
                by_size[corpus, size].append((r, train[r["run"]]))
    out = []
    for (corpus, size), runs in sorted(by_size.items()):
        gaps = [float(r["final_val_loss"]) - t for r, t in runs]
        rising = sum(float(r["last_eval_loss"]) > float(r["best_eval_loss"]) for r, _ in runs if r["best_eval_loss"])
        out.append({
            "corpus": corpus, "size": size, "runs": len(runs), "epochs": float(runs[0][0]["epochs"]),
            "train": statistics.fmean(t for _, t in runs),
            "val": statistics.fmean(float(r["final_val_loss"]) for r, _ in runs),
            "gap": statistics.fmean(gaps), "gap_std": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
            "rising": rising,
        })  # fmt: skip
    return out


def repetition(
    cells: dict, train_tokens: dict[str, int], batch: int, context: int, sampling: str = "random"
) -> list[dict]:
    """Per (corpus, size): the share of the targets a run trained on that it had trained on before, counted by
    replaying the run's own window order (:func:`qkvjax.data.pipeline.targets_repeated`: the ``sampling`` the
    folder's protocol names, random offsets unless it says disjoint), mean and range over the seeds of the cell's
    runs. ``train_tokens``: each corpus' training split length (a corpus whose file is not here is left out)."""
    from qkvjax.data.pipeline import targets_repeated

    seeds = collections.defaultdict(set)
    steps = {}
    for (corpus, size, _), runs in cells.items():
        for seed, r in runs.items():
            if r.get("steps"):  # rows written before the column existed say nothing here
                seeds[corpus, size].add(seed)
                steps[corpus, size] = int(r["steps"])
    out = []
    for (corpus, size), chosen in sorted(seeds.items()):
        if corpus not in train_tokens:
            continue
        shares = []
        for seed in sorted(chosen):
            repeated, trained = targets_repeated(train_tokens[corpus], context, batch, seed, steps[corpus, size],
                                                 sampling)  # fmt: skip
            shares.append(repeated / trained)
        out.append({"corpus": corpus, "size": size, "seeds": len(shares), "steps": steps[corpus, size],
                    "repeated": statistics.fmean(shares), "low": min(shares), "high": max(shares)})  # fmt: skip
    return out


def corpus_train_tokens(protocol: dict) -> dict[str, int]:
    """Each corpus' training split length in bytes (its 90% cut, as ``qkvjax.data.builders.split_text`` makes it),
    for the corpora whose file is here with the protocol's sha256: at the protocol's path, or
    ``experiments/corpora/NAME.txt``."""
    from experiments.build_corpus import sha256_file

    here = Path(__file__).resolve().parent
    out = {}
    for name, info in protocol.get("corpora", {}).items():
        for path in (Path(info.get("path", "")), here / "corpora" / f"{name}.txt"):
            if path.is_file() and sha256_file(path) == info.get("sha256"):
                out[name] = int(path.stat().st_size * 0.9)
                break
    return out


def train_delta(cells: dict, train: dict[str, float], corpus: str, size: int, variant: str) -> float | None:
    """The tail training loss's difference to separate, paired by seed and averaged: what the tie costs in
    fitting the training data, beside what it costs on held-out text."""
    runs, ref = cells.get((corpus, size, variant), {}), cells.get((corpus, size, "separate"), {})
    diffs = [train[runs[s]["run"]] - train[ref[s]["run"]] for s in runs
             if s in ref and runs[s]["run"] in train and ref[s]["run"] in train]  # fmt: skip
    return statistics.fmean(diffs) if diffs and variant != "separate" else None


POSITIONS_TEXT = {None: "learned absolute positions", "rope": "rotary positions in every layer, no position table"}


def summary_markdown(rows: list[dict], curves: list[dict] = (), positions: str | None = None,
                     heads: int | None = None) -> str:  # fmt: skip
    """The summary of a results folder's rows; ``positions``, ``heads``: its protocol's (None: learned positions,
    the ladder's 4 heads)."""
    from experiments.ladder import NUM_HEADS, VARIANTS  # imports qkvjax: here, not for the module's other readers

    def kv(variant: str) -> int:  # its K/V heads at ``heads``, as ladder.size_config derives them
        return max(1, round(heads * VARIANTS[variant]["kv_heads_fraction"]))

    cells = finals(rows)
    train = tail_train_loss(curves)
    best = best_rates(rows)
    n = "" if heads in (None, NUM_HEADS) else (
        f"; {heads} heads per layer of width D / {heads} (each variant's K/V heads its fraction of them: `mqa`'s "
        f"quarter is {kv('mqa')} of {heads}, `gqa`'s half {kv('gqa')})"
    )  # fmt: skip
    lines = [f"# Scaling sweep: {len(rows)} finished runs", "", f"Models with {POSITIONS_TEXT[positions]}{n}.", ""]
    means = sweep_means(rows)
    sweep = {cell: {lr: m for lr, (m, _) in by_lr.items()} for cell, by_lr in means.items()}
    if sweep:
        seeds = sorted({n for by_lr in means.values() for _, n in by_lr.values()})
        lines += [f"## Learning-rate sweeps (final validation loss, nats/byte, the mean over the sweep seeds: "
                  f"{'/'.join(map(str, seeds))} per cell; best in bold, marked 'edge' where it is the lowest or "
                  "highest rate tried: a winner the sweep does not bracket)", ""]  # fmt: skip
        rates = sorted({lr for v in sweep.values() for lr in v})
        lines += ["| corpus | d | variant | " + " | ".join(f"{lr:g}" for lr in rates) + " |",
                  "|---|---|---|" + "---|" * len(rates)]  # fmt: skip
        for (corpus, size, variant), by_lr in sorted(sweep.items()):
            cols = []
            for lr in rates:
                if lr not in by_lr:
                    cols.append("")
                else:
                    v = f"{by_lr[lr]:.3f}"
                    edge = " edge" if lr in (min(by_lr), max(by_lr)) else ""
                    cols.append(f"**{v}**{edge}" if math.isclose(lr, best[corpus, size, variant]) else v)
            lines.append(f"| {corpus} | {size} | {variant} | " + " | ".join(cols) + " |")
        lines.append("")
    by_size = sorted({(c, s) for c, s, _ in cells})
    points = collections.defaultdict(list)
    for corpus, size in by_size:
        entries = [e for v in VARIANT_ORDER if (e := paired(cells, corpus, size, v))]
        lines += [f"## {corpus}, d_model {size}: final validation loss at each scheme's rate", "",
                  "d: the smallest difference these seeds could detect (paired t test at 5%, 80% power).", "",
                  "| variant | params | KV B/tok | lr | seeds | loss mean ± std | Δ vs separate [95%] d; per-byte "
                  "perplexity | Δ train loss | tokens | epochs |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for e in entries:
            dt = train_delta(cells, train, corpus, size, e["variant"])
            lines.append(
                f"| {e['variant']} | {e['params']:,} | {e['kv']:,} | {e['lr']:g} | {e['n']} | {e['mean']:.3f}"
                + ("" if e["n"] < 2 else f" ± {e['std']:.3f}")  # one seed has no spread
                + f" | {_fmt_delta(e)} | {'—' if dt is None else f'{dt:+.3f}'} | {e['tokens']:,} | {e['epochs']:.2f} |"
            )
            if "delta" in e:
                points[corpus, e["variant"]] += [(e["ref_params"], d) for d in e["diffs"]]
        lines.append("")
    lines += _delta_by_size(cells, train, by_size)
    lines += _head_to_head(cells, by_size)
    shared = _shared_rate_ranking(rows, best)
    if shared:
        lines += ["## One shared rate (2e-3) against each scheme's own (seed 0, Δ vs separate at the same rule)", "",
                  "| corpus | d | variant | Δ at 2e-3 | Δ at own rates |", "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {c} | {s} | {v} | {a:+.3f} | {b:+.3f} |" for c, s, v, a, b in shared]
        lines.append("")
    over = [r for r in rows if r["best_eval_loss"] and float(r["last_eval_loss"]) > float(r["best_eval_loss"]) + 0.01]
    lines += ["## Overfitting", "",
              f"{len(over)} of {len(rows)} runs end more than 0.01 nats/byte above their best evaluation"
              + (": " + ", ".join(r["run"] for r in over) if over else ".")]  # fmt: skip
    gen = generalisation(cells, train)
    if gen:
        lines += ["", "The chosen runs of each size: training loss (mean over each run's last 5% of steps) against the "
                  "final validation loss; the gap is val - train, mean ± std over the runs; 'rising' counts runs "
                  "whose last evaluation is above their best.", "",
                  "| corpus | d | epochs | runs | train loss | val loss | gap | rising |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {g['corpus']} | {g['size']} | {g['epochs']:.2f} | {g['runs']} | {g['train']:.3f} | "
                  f"{g['val']:.3f} | {g['gap']:+.3f} ± {g['gap_std']:.3f} | {g['rising']} |" for g in gen]  # fmt: skip
    lines += _trends(points)
    lines += time_spent(rows)
    lines += ["", "## Kayyam et al. (2026) in these units", "",
              "They report K = V's per-token perplexity penalty: +3.1% at 300M parameters and +2.5% at 1.2B. As a "
              "loss, ln(1 + p) nats per token, divided by b bytes per token (b = "
              f"{BYTES_PER_TOKEN[0]}-{BYTES_PER_TOKEN[1]}):", ""]  # fmt: skip
    for size, pct in KAYYAM_KV:
        per_token = math.log1p(pct / 100)
        lines.append(f"- {size}: +{pct}% ppl/token = {per_token:.4f} nats/token = {per_token / BYTES_PER_TOKEN[1]:.4f}"
                     f"-{per_token / BYTES_PER_TOKEN[0]:.4f} nats/byte")  # fmt: skip
    (small, p_small), (large, p_large) = KAYYAM_KV
    decades = math.log10(KAYYAM_PARAMS[1] / KAYYAM_PARAMS[0])
    slope = (math.log1p(p_large / 100) - math.log1p(p_small / 100)) / decades
    lines.append(f"- their trend, {small} -> {large}: {slope / BYTES_PER_TOKEN[1]:+.4f} to "
                 f"{slope / BYTES_PER_TOKEN[0]:+.4f} nats/byte per 10x parameters (2 points)")  # fmt: skip
    lines += ["", "## Per-token units", "",
              f"A difference of Δ nats/byte is Δ x b nats per token for b bytes per token; at b = {BYTES_PER_TOKEN[0]}"
              f"-{BYTES_PER_TOKEN[1]} (GPT-2-style BPE on English) per-token perplexity changes by exp(Δ b) - 1, e.g. "
              f"Δ = 0.01 is +{math.expm1(0.01 * BYTES_PER_TOKEN[0]) * 100:.1f}% to "
              f"+{math.expm1(0.01 * BYTES_PER_TOKEN[1]) * 100:.1f}%."]  # fmt: skip
    return "\n".join(lines) + "\n"


def time_spent(rows: list[dict]) -> list[str]:
    """Per corpus, size and device: runs, run-hours (the rows' ``wall_s`` summed: each run's own training clock, so
    two runs sharing a machine count twice while the wall-clock passes once), the median tokens/s, and when the
    first and last of them finished."""
    groups = collections.defaultdict(list)
    for r in (r for r in rows if r.get("wall_s")):  # every row scaling.py writes has its clock
        groups[r["corpus"], int(r["size"]), r.get("device") or "not recorded"].append(r)
    if not groups:
        return []
    lines = ["", "## Time spent", "",
             "Run-hours: the rows' `wall_s` summed, each run's training clock from its metrics log (runs that shared "
             "a machine each count their own hours); device 'not recorded': rows written before the `device` "
             "column.", "",
             "| corpus | d | device | runs | run-hours | median tokens/s | finished |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (corpus, size, device), group in sorted(groups.items()):
        hours = sum(float(r["wall_s"]) for r in group) / 3600
        speed = statistics.median(float(r["tokens_per_s"]) for r in group)
        done = sorted(r["finished_at"][:16].replace("T", " ") for r in group)
        lines.append(f"| {corpus} | {size} | {device} | {len(group)} | {hours:.1f} | {speed:,.0f} | "
                     f"{done[0]} to {done[-1]} UTC |")  # fmt: skip
    return lines


def _trends(points: dict[tuple[str, str], list[tuple[float, float]]]) -> list[str]:
    """Per corpus, each variant's trend of Δ against log10(parameters) with the size as the unit (the verdict:
    :func:`trend_by_size`), the per-seed line beside it, and where three sizes or more are in, the same without the
    largest size (whose runs may have seen the text many times over)."""
    lines = []
    for corpus in sorted({c for c, _ in points}):
        fits = []
        for v in VARIANT_ORDER:
            pts = points.get((corpus, v), [])
            largest = max((p for p, _ in pts), default=None)
            cut = [(p, d) for p, d in pts if p != largest]
            fits.append((v, pts, cut if len({p for p, _ in pts}) > 2 else None))
        if not any(trend(pts) for _, pts, _ in fits):
            continue
        lines += ["", f"## Trend of Δ with size ({CORPUS_TITLES.get(corpus, corpus)})", "",
                  "Slope of Δ per 10x parameters (negative: the penalty shrinks with size). **By size** (the "
                  "verdict; experiments/preregistered/trend_by_size.md): weighted least squares of each size's mean "
                  "Δ, weights 1 / its squared standard error, ± the slope's standard error [95% t interval, "
                  "Welch-Satterthwaite df]; with three sizes or more, the residual χ² (k - 2 df; a small p: no "
                  "straight line in log parameters) and the unweighted line through the means. **Per seed**: least "
                  "squares through every seed's Δ, as each earlier report fitted it. Where three sizes or more "
                  "were run, the same without the largest size follows.", ""]  # fmt: skip
        for v, pts, cut in fits:
            for label, group in (("", pts), ("; without the largest size", cut)):
                if group is None or (per_seed := trend(group)) is None:
                    continue
                lines.append(f"- {v}{label}: {_by_size_text(trend_by_size(group))}; per seed {_trend_text(per_seed)}")
    return lines


def trend_verdict(fit: dict | None) -> str:
    """The words a trend sentence uses, from the by-size fit's 95% interval."""
    if fit is None:
        return "no by-size fit (fewer than two sizes with two seeds)"
    lo, hi = fit["ci"]
    return "shrinks" if hi < 0 else "grows" if lo > 0 else "not told apart from zero"


def _by_size_text(fit: dict | None) -> str:
    if fit is None:
        return "by size: " + trend_verdict(fit)
    lo, hi = fit["ci"]
    text = (f"by size {fit['slope']:+.3f} ± {fit['se']:.3f} [{lo:+.3f}, {hi:+.3f}] (df {fit['df']:.1f}, "
            f"{fit['sizes']} sizes of {'/'.join(map(str, fit['seeds']))} seeds): **{trend_verdict(fit)}**")  # fmt: skip
    if "chi2" in fit:
        ols = fit["ols"]
        text += (f"; χ² {fit['chi2']:.2f} (p {fit['chi2_p']:.2f}); unweighted {ols['slope']:+.3f} "
                 f"[{ols['ci'][0]:+.3f}, {ols['ci'][1]:+.3f}]")  # fmt: skip
    return text


def _trend_text(t: dict) -> str:
    """A :func:`trend` as ``slope ± se [95% t] nats/byte per 10x parameters (n paired runs at k sizes)``."""
    lo, hi = t["ci"]
    return (f"{t['slope']:+.3f} ± {t['se']:.3f} [{lo:+.3f}, {hi:+.3f}] nats/byte per 10x parameters ({t['n']} paired "
            f"runs at {t['sizes']} sizes)")  # fmt: skip


def _delta_by_size(cells: dict, train: dict[str, float], by_size: list[tuple]) -> list[str]:
    """One table of every variant's Δ vs separate across the sizes and corpora (validation, with the 95% interval
    and the number of paired seeds), and the same for the tail training loss."""
    n_sizes = collections.Counter(c for c, _ in by_size)
    cols = sorted(by_size, key=lambda cs: (-n_sizes[cs[0]], cs[0], cs[1]))  # the main corpus (most sizes) first
    head = "| variant | " + " | ".join(f"{c} d={s}" for c, s in cols) + " |"
    rule = "|---|" + "---|" * len(cols)
    val, fit = [head, rule], [head, rule]
    for v in VARIANT_ORDER[1:]:
        cells_val, cells_fit = [], []
        for c, s in cols:
            e = paired(cells, c, s, v)
            cells_val.append("" if e is None or "delta" not in e else f"{_delta_ci(e)} ({e['delta_n']})")
            dt = train_delta(cells, train, c, s, v)
            cells_fit.append("" if dt is None else f"{dt:+.3f}")
        if any(cells_val):
            val.append(f"| {v} | " + " | ".join(cells_val) + " |")
            fit.append(f"| {v} | " + " | ".join(cells_fit) + " |")
    out = ["## Δ vs separate by size", "",
           "Final validation loss, paired by seed: mean [95% t interval] d (the smallest difference these seeds "
           "could detect: paired t test at 5%, 80% power) (paired seeds). A cell whose |mean| is under its d "
           "cannot say \"no difference\" of an effect smaller than d.", "", *val, ""]  # fmt: skip
    if len(fit) > 2 and train:
        out += ["Training loss (mean over each run's last 5% of steps), paired by seed: mean.", "", *fit, ""]
    return out


# appended, never inserted: a variant's colour in every plot is its index here
VARIANT_ORDER = (
    "separate", "gqa", "shared_kv", "bilinear", "bilinear_params", "shared_qk", "reformer_qk", "shared_qkv", "mla",
    "shared_qv", "mqa", "mla_half",
)  # fmt: skip
# past matplotlib's ten-colour cycle (C10 would repeat C0, separate's blue): colours none of C0-C9 is near
EXTRA_COLORS = ("black", "gold", "navy", "lime")


def variant_color(variant: str) -> str:
    """The variant's one colour in every plot, by its place in :data:`VARIANT_ORDER`."""
    i = VARIANT_ORDER.index(variant)
    return f"C{i}" if i < 10 else EXTRA_COLORS[i - 10]


# Two ties compared with each other, paired by seed: (variant, against, what the comparison asks). Data, so a new
# question is a row here, not a new branch.
HEAD_TO_HEAD = (
    ("shared_kv", "gqa", "K = V against GQA at the same cache bytes (half of separate's)"),
    ("bilinear_params", "bilinear", "The merged W_QK at separate's parameters (F = 3 D) against it at equal width"),
    ("reformer_qk", "shared_qk", "Reformer's attention (unit keys, no attending to oneself) against plain shared QK"),
    ("mla", "gqa", "A latent K/V (MLA) caching D per token and layer against GQA at the same cache bytes"),
    ("shared_qv", "shared_qk", "W^Q = W^V against W^Q = W^K, one tie each at equal parameters and cache"),
    ("mla_half", "mqa", "A latent K/V (MLA) caching D/2 against MQA at the same cache bytes (a quarter of separate's)"),
    ("mla_half", "mla", "Halving MLA's latent (D/2 against D per token and layer): what half the cache costs"),
)


def _head_to_head(cells: dict, by_size: list[tuple]) -> list[str]:
    """Per :data:`HEAD_TO_HEAD` pair: the difference ``variant - against`` paired by seed at every corpus and size
    both ran (negative: ``variant`` is better), and per corpus its trend with size (x: ``separate``'s parameters,
    as in the other trends)."""
    lines = []
    for variant, against, question in HEAD_TO_HEAD:
        rows, points = [], collections.defaultdict(list)
        for corpus, size in by_size:
            e = paired(cells, corpus, size, variant, against=against)
            if e is None or "delta" not in e:
                continue
            rows.append(f"| {corpus} | {size} | {_delta_ci(e)} | {e['delta_n']} |")
            ref = cells.get((corpus, size, "separate"))
            x = int(next(iter(ref.values()))["params"]) if ref else e["ref_params"]
            points[corpus] += [(x, d) for d in e["diffs"]]
        if not rows:
            continue
        lines += [f"## {question}: `{variant}` - `{against}`", "",
                  "Final validation loss, paired by seed: mean [95% t interval] d (the smallest difference these "
                  f"seeds could detect, 80% power). Negative: `{variant}` is better.", "",
                  "| corpus | d | Δ [95%] d | paired seeds |", "|---|---|---|---|", *rows]  # fmt: skip
        for corpus, pts in sorted(points.items()):
            if t := trend(pts):
                lines += ["", f"Trend ({CORPUS_TITLES.get(corpus, corpus)}): {_by_size_text(trend_by_size(pts))}; "
                          f"per seed {_trend_text(t)}."]  # fmt: skip
        lines.append("")
    return lines


def _shared_rate_ranking(rows: list[dict], best: dict) -> list[tuple]:
    # seed 0's runs, as the table's title says (a sweep over seeds 0 and 1 has two rows per rate)
    sweep = {(r["corpus"], int(r["size"]), r["variant"], float(r["learning_rate"])): float(r["final_val_loss"])
             for r in rows if r["stage"].startswith("lr-") and int(r["seed"]) == 0}  # fmt: skip
    out = []
    for (corpus, size, variant), lr in sorted(best.items()):
        ref = best.get((corpus, size, "separate"))
        keys = [(corpus, size, variant, SHARED_LR), (corpus, size, "separate", SHARED_LR)]
        if variant == "separate" or ref is None or any(k not in sweep for k in keys):
            continue
        at_shared = sweep[keys[0]] - sweep[keys[1]]
        at_own = sweep[corpus, size, variant, lr] - sweep[corpus, size, "separate", ref]
        out.append((corpus, size, variant, at_shared, at_own))
    return out


def cache_fractions(cells: dict, corpus: str) -> dict[str, float]:
    """Each scheme's K/V cache bytes per token as a fraction of ``separate``'s at the same size (on ``corpus``)."""
    out = {}
    for c, size, v in cells:
        if c != corpus or v == "separate":
            continue
        if ref := paired(cells, c, size, "separate"):
            out[v] = paired(cells, c, size, v)["kv"] / ref["kv"]
    return out


def _draw_delta(ax, cells: dict, corpus: str, variant: str, name: str) -> None:
    """One scheme's Δ against ``separate`` by size: mean and 95% interval per size, and its fitted trend."""
    entries = [paired(cells, c, s, v) for c, s, v in cells if c == corpus and v == variant]
    done = sorted((e for e in entries if e and "delta" in e), key=lambda e: e["ref_params"])  # small to large
    if not done:
        return
    # a 2-seed t interval (t = 12.7) would set the axis for everyone and says little: drawn from 3 seeds
    pts = [(e["ref_params"], e["delta"], e.get("ci") if e["delta_n"] >= 3 else None) for e in done]
    color = variant_color(variant)
    xs, ys = [p for p, _, _ in pts], [d for _, d, _ in pts]
    err = [[d - ci[0] if ci else 0 for _, d, ci in pts], [ci[1] - d if ci else 0 for _, d, ci in pts]]
    label = f"{name}: seeds {'/'.join(str(e['delta_n']) for e in done)}"  # 1 or 2 seeds: no interval drawn
    points = [(e["ref_params"], d) for e in done for d in e["diffs"]]
    fit = trend(points)
    if fit and fit["sizes"] >= 3:  # through two sizes the line would only repeat the segment
        by_size = trend_by_size(points)  # the verdict's fit (summary.md), beside the drawn per-seed line
        label += f", per 10x: by size {by_size['slope']:+.3f} ({trend_verdict(by_size)})" if by_size else ""
        label += f", per seed {fit['slope']:+.3f} ± {fit['se']:.3f}"
        grid = [min(xs) * (max(xs) / min(xs)) ** (k / 40) for k in range(41)]
        line, lo, hi = zip(*(trend_band(fit, math.log10(g)) for g in grid), strict=True)
        ax.plot(grid, line, color=color, ls="--", lw=0.8)
        ax.fill_between(grid, lo, hi, color=color, alpha=0.07, lw=0)
    dodge = 1.025 ** (VARIANT_ORDER.index(variant) - len(VARIANT_ORDER) / 2)  # schemes side by side at a size
    ax.errorbar([x * dodge for x in xs], ys, yerr=err, marker="o", ms=5, capsize=3, color=color, label=label)


def _count(n: int) -> str:
    """A parameter count on a tick: 129k, 1.29M."""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def plot(rows: list[dict], out: Path) -> list[Path]:
    plt = report.pyplot()
    from matplotlib import ticker

    cells = finals(rows)
    corpora = sorted({c for c, _, _ in cells})
    corpus = "shakespeare" if "shakespeare" in corpora or not corpora else corpora[0]  # the folder's own corpus
    title = CORPUS_TITLES.get(corpus, corpus)
    written = []
    # two panels, split by the data: the ties that keep separate's K/V cache, and the schemes that shrink it (their
    # question is a cost per byte saved); eleven schemes on one axis hid each other's intervals
    ratio = cache_fractions(cells, corpus)
    groups = [[v for v in VARIANT_ORDER if v in ratio and keep(ratio[v])]
              for keep in (lambda r: r >= 1, lambda r: r < 1)]  # fmt: skip
    groups = [g for g in groups if g]
    fig, axes = plt.subplots(1, max(len(groups), 1), figsize=(6.5 * max(len(groups), 1), 6.2), sharey=True,
                             sharex=True, squeeze=False)  # fmt: skip
    # the sizes as ticks, at separate's parameters: a log axis over less than a decade (a size or two so far) would
    # label its minor ticks, one over the other
    ticks = sorted({(int(next(iter(by_seed.values()))["params"]), size) for (c, size, v), by_seed in cells.items()
                    if c == corpus and v == "separate" and by_seed})  # fmt: skip
    for ax, group in zip(axes[0], groups, strict=False):
        smaller = ratio[group[0]] < 1
        ax.set_title("a smaller K/V cache than separate's (its fraction named)" if smaller
                     else "the same K/V cache as separate's", fontsize=9)  # fmt: skip
        for variant in group:
            _draw_delta(ax, cells, corpus, variant, f"{variant} (x{ratio[variant]:.2f})" if smaller else variant)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xscale("log")
        if ticks:
            ax.set_xticks([p for p, _ in ticks], [f"d={d}: {_count(p)}" for p, d in ticks])
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_xlim(ticks[0][0] / 1.4, ticks[-1][0] * 1.4)
        ax.set_xlabel("parameters (separate's at each size; log; the schemes drawn side by side)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), title="seeds small to large",
                  title_fontsize=8)  # fmt: skip
    axes[0][0].set_ylabel("Δ final validation loss vs separate (nats/byte)")
    sizes = len({s for c, s, v in cells if c == corpus and "delta" in (paired(cells, c, s, v) or {})})
    so_far = " so far" if sizes < 3 else ""
    fits = ("dashed: least-squares trend through every seed's Δ, shaded: its 95% band; legend: slopes by size (the "
            "verdict, summary.md) and per seed" if sizes >= 3
            else "the least-squares trend is drawn once 3 sizes are in (through two it repeats a segment)")  # fmt: skip
    head = (f"Tying penalty against model size: {title}, {sizes} of 3 sizes{so_far}; mean over seeds with 95% "
            "t intervals (3 or more seeds)")  # fmt: skip
    width = int(13 * fig.get_figwidth())  # characters of a 10-point line across the figure: one panel is narrow
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in (head, fits)), fontsize=10)
    fig.tight_layout()
    written.append(out / "delta_vs_params.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for variant in VARIANT_ORDER:
        runs = [r for (c, _, v), by_seed in cells.items() if c == corpus and v == variant
                for r in by_seed.values()]  # fmt: skip
        pts = [(6 * int(r["params"]) * int(r["tokens"]), float(r["final_val_loss"])) for r in runs]
        if pts:
            color = variant_color(variant)
            ax.scatter(*zip(*pts, strict=True), s=18, color=color, label=variant, alpha=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training compute, 6 x params x tokens (FLOPs; log)")
    ax.set_ylabel("final validation loss (nats/byte)")
    widths = ", ".join(str(s) for s in sorted({s for c, s, _ in cells if c == corpus}))
    ax.set_title(f"Loss against compute ({title}, every seed; the clusters are d_model {widths},\n"
                 "each trained on 10 tokens per separate parameter)", fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "frontier.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def speed_markdown(path: Path) -> str:
    """Each variant's train-step tokens/s at each size, from a ``benchmarks/scaling_speed.py --json`` file."""
    bench = json.loads(path.read_text())
    by = {(r["variant"], int(r["size"])): r for r in bench["rows"]}
    sizes = sorted({size for _, size in by})
    lines = ["## Speed per variant (from benchmarks/, not from the sweep)", "",
             f"Train step, tokens/s (x `separate` at the same size; what the saved FLOPs predict), measured by "
             f"`{bench['command']}` on {bench['machine']}, {bench['date']}, the variants timed in turns.", "",
             "| variant | " + " | ".join(f"d={d} tok/s | x separate (FLOPs predict)" for d in sizes) + " |",
             "|---|" + "---:|---|" * len(sizes)]  # fmt: skip
    for variant in sorted({v for v, _ in by}, key=lambda v: VARIANT_ORDER.index(v) if v in VARIANT_ORDER else 99):
        cells = []
        for d in sizes:
            r = by.get((variant, d))
            ratio = "" if r is None else f"x{r['x_separate']:.3f} (x{r['flop_ratio_predicts']:.3f})"
            cells += ["", ""] if r is None else [f"{r['tokens_per_s']:,.0f}", ratio]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def beside_markdown(rows: list[dict], other: list[dict], here: str, there: str) -> list[str]:
    """Each variant that both sweeps ran at a (corpus, size) both ran: its mean final loss in each, their
    difference, and its Δ vs separate in each (paired by seed within its own sweep); then each :data:`HEAD_TO_HEAD`
    difference both sweeps ran there, one column a sweep. Set beside, not tested against each other: the two sweeps
    train different models, each at its own rates."""
    cells, theirs = finals(rows), finals(other)
    lines = [f"## Beside `{there}`", "",
             "Every variant both sweeps ran, at the sizes both ran: mean final validation loss in each, here minus "
             "there, and Δ vs separate in each, paired by seed within its own sweep (mean [95% t interval] d). "
             "Different models at their own rates: set beside, not tested against each other.", "",
             f"| corpus | d | variant | loss `{there}` | loss `{here}` | here - there | Δ `{there}` | Δ `{here}` |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    shared = sorted({(c, s) for c, s, _ in cells} & {(c, s) for c, s, _ in theirs})
    for corpus, size in shared:
        for variant in VARIANT_ORDER:
            a, b = paired(theirs, corpus, size, variant), paired(cells, corpus, size, variant)
            if a is None or b is None:
                continue
            delta = [_delta_ci(e) + f" ({e['delta_n']})" if "delta" in e else "—" for e in (a, b)]
            lines.append(f"| {corpus} | {size} | {variant} | {a['mean']:.3f} ({a['n']}) | {b['mean']:.3f} ({b['n']}) "
                         f"| {b['mean'] - a['mean']:+.3f} | {delta[0]} | {delta[1]} |")  # fmt: skip
    pairs = []  # the HEAD_TO_HEAD questions both sweeps can answer, each sweep's answer paired within itself
    for variant, against, _ in HEAD_TO_HEAD:
        for corpus, size in shared:
            a, b = (paired(c, corpus, size, variant, against=against) for c in (theirs, cells))
            if a is not None and b is not None and "delta" in a and "delta" in b:
                pairs.append(f"| `{variant}` - `{against}` | {corpus} | {size} | {_delta_ci(a)} ({a['delta_n']}) "
                             f"| {_delta_ci(b)} ({b['delta_n']}) |")  # fmt: skip
    if pairs:
        lines += ["", "The head-to-head differences both sweeps ran, each paired by seed within its own sweep: mean "
                  "[95% t interval] d (paired seeds). Negative: the first variant is better.", "",
                  f"| difference | corpus | d | `{there}` | `{here}` |", "|---|---|---|---|---|", *pairs]  # fmt: skip
    return lines + [""] if shared else []


# protocol fields a lower folder (--lower) may differ in: how rates were swept and how windows were drawn, not the
# models, their budget or the corpus
LOWER_MAY_DIFFER = ("lr_grid", "sweep_seeds", "learning_rate", "sampling")


def lower_rungs(lower: Path, rows: list[dict], settings: dict) -> tuple[list[dict], list[dict], str]:
    """The rows and curves of ``lower``'s sizes that ``rows`` do not have, on their corpora, and the line that says
    where they come from: the smaller rungs of one ladder (the GPU rungs with the CPU ones below them,
    ``experiments/preregistered/gpu_ladder.md``), analysed together. Refused when the two protocols differ in
    anything but LOWER_MAY_DIFFER."""
    theirs = lower / PROTOCOL_FILE
    if not (lower / "runs.csv").exists() or not theirs.exists():
        raise ValueError(f"--lower {lower}: no runs.csv and protocol.json there; allowed: a scaling.py results folder")
    other = json.loads(theirs.read_text())["protocol"]
    changed = [f"{k}: {other.get(k)!r} there, {settings.get(k)!r} here" for k in sorted(set(other) | set(settings))
               if k not in LOWER_MAY_DIFFER and other.get(k) != settings.get(k)]  # fmt: skip
    if changed:
        raise ValueError(f"--lower {lower}: another protocol ({'; '.join(changed)}); allowed: a folder of the same "
                         f"ladder, differing only in {', '.join(LOWER_MAY_DIFFER)}")  # fmt: skip
    own = {(r["corpus"], int(r["size"])) for r in rows}
    corpora = {c for c, _ in own}
    picked = [r for r in read_csv(lower / "runs.csv") if r["corpus"] in corpora and (r["corpus"], int(r["size"]))
              not in own]  # fmt: skip
    curves = [c for c in read_csv(lower / "curves.csv") if c.get("corpus") in corpora and c.get("size")
              and (c["corpus"], int(c["size"])) not in own]  # fmt: skip
    sizes = sorted({int(r["size"]) for r in picked})
    note = (f"Sizes d={', '.join(map(str, sizes))} are `{lower.name}`'s ({len(picked)} rows, "
            f"{other.get('sampling') or 'random'} windows; this folder's own: {settings.get('sampling') or 'random'}),"
            " analysed with this folder's as one ladder.\n")  # fmt: skip
    return picked, curves, note


def write_report(
    out: Path | str, speed: Path | None = SPEED, beside: Path | str | None = None, lower: Path | str | None = None
) -> Path:
    """``summary.md`` and the plots of the results folder ``out``; ``beside``: another such folder whose variants
    the summary sets beside these (:func:`beside_markdown`); ``lower``: a folder whose other sizes join these as
    one ladder (:func:`lower_rungs`: their cells, trends and repetition)."""
    out = Path(out)
    rows = read_csv(out / "runs.csv")
    if not rows:
        raise ValueError(f"{out / 'runs.csv'} has no finished runs yet")
    protocol = out / PROTOCOL_FILE
    settings = json.loads(protocol.read_text())["protocol"] if protocol.exists() else {}
    curves, own_rows, note, lower_settings = read_csv(out / "curves.csv"), rows, "", {}
    if lower is not None:
        lower = Path(lower)
        picked, lower_curves, note = lower_rungs(lower, rows, settings)
        rows, curves = picked + rows, lower_curves + curves
        lower_settings = json.loads((lower / PROTOCOL_FILE).read_text())["protocol"]
    text = summary_markdown(rows, curves, settings.get("positions"), settings.get("heads"))
    if note:
        first, rest = text.split("\n", 1)
        text = f"{first}\n\n{note}{rest}"
    if beside is not None:
        other = read_csv(Path(beside) / "runs.csv")
        if not other:
            raise ValueError(f"--beside {beside}: no finished runs in its runs.csv; allowed: a scaling.py results "
                             "folder")  # fmt: skip
        text += "\n" + "\n".join(beside_markdown(rows, other, out.name, Path(beside).name))
    full = json.loads(protocol.read_text()) if protocol.exists() else {}
    lengths = corpus_train_tokens(full)
    sampling = settings.get("sampling") or "random"
    batch, context = settings.get("batch", 16), settings.get("context", 128)
    reps = repetition(finals(own_rows), lengths, batch, context, sampling)
    if lower is not None:  # the lower rungs' targets, replayed in their own window order
        low = repetition(finals(rows[: len(rows) - len(own_rows)]), lengths, batch, context,
                         lower_settings.get("sampling") or "random")  # fmt: skip
        reps = sorted(low + reps, key=lambda r: (r["corpus"], r["size"]))
    for name in sorted(set(full.get("corpora", {})) - set(lengths)):  # its repetition cannot be counted here
        print(f"scaling_report: warning: corpus {name!r} is not here with the protocol's sha256 (at its recorded "
              f"path or experiments/corpora/{name}.txt; experiments/build_corpus.py builds it): its repetition is "
              "left out of summary.md", file=sys.stderr)  # fmt: skip
    if reps:
        text += "\n" + "\n".join([
            "## How much of the training text repeats", "",
            "The share of each run's training targets that it had already trained on, counted by replaying its own "
            "window order ("
            + ("random offsets, reshuffled each epoch: windows overlap, so targets repeat within an epoch too"
               if sampling == "random" else "disjoint windows, each target once per epoch")
            + ("; the lower rungs' in their own" if lower is not None else "")
            + "), mean and range over the seeds of the size's runs:", "",
            "| corpus | d | steps | seeds | repeated | range |", "|---|---|---|---|---|---|",
            *[f"| {r['corpus']} | {r['size']} | {r['steps']:,} | {r['seeds']} | {100 * r['repeated']:.1f}% | "
              f"{100 * r['low']:.1f}-{100 * r['high']:.1f}% |" for r in reps],
        ]) + "\n"  # fmt: skip
    if speed is not None and speed.exists():
        text += "\n" + speed_markdown(speed)
    (out / "summary.md").write_text(text)
    plot(rows, out)
    return out / "summary.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the results folder of experiments/scaling.py")
    p.add_argument("--speed", type=Path, default=SPEED, help="a benchmarks/scaling_speed.py --json file "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--beside",
        type=Path,
        default=None,
        help="another results folder of experiments/scaling.py: its variants set beside these, size by size",
    )
    p.add_argument("--lower", type=Path, default=None, help="a results folder of the same ladder whose other "
                   "sizes join these as one ladder (the GPU rungs over the CPU ones)")  # fmt: skip
    args = p.parse_args(argv)
    if not args.speed.exists():
        print(f"scaling_report: error: --speed {args.speed}: no such file; allowed: a benchmarks/scaling_speed.py "
              "--json file", file=sys.stderr)  # fmt: skip
        return 2
    try:
        print(write_report(args.out, args.speed, args.beside, args.lower))
    except ValueError as e:
        print(f"scaling_report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
