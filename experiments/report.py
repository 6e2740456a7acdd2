"""Tables and plots of a scheme comparison (``compare_schemes.py``'s results folder).

    python experiments/report.py DIR

Writes ``DIR/summary.md``: per matching and scheme, the final whole-split validation loss as mean ± sample std
over seeds, and the difference to ``separate`` of the same matching, paired by seed (same data order), with a
95% Student-t interval and the smallest difference the seeds could detect (``detectable``); a difference is
called *inside the seed spread* when it is no larger than the larger of the two schemes' seed standard
deviations. And the PNG plots: validation loss against step and against training wall-clock (mean line, min-max
band over seeds), final loss against parameters and against KV-cache bytes per token.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.rows import read_csv

MATCHING_TITLES = {
    "width": "same width (tied schemes have fewer parameters)",
    "params": "same parameter count (saved parameters go to the MLP)",
    "kv_cache": "same KV-cache size",
    "given": "each row's own model (--row NAME=OVERRIDES), its parameters and cache as stated",
}
PLOTS = ("curves_step.png", "curves_wall.png", "loss_vs_params.png", "loss_vs_kv_cache.png")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display here, on CI or on a GPU machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def t_quantile(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


@functools.cache
def power_factor(n: int, power: float = 0.8) -> float:
    """The noncentrality delta / (sd / sqrt(n)) at which a two-sided paired t test at 5% on ``n`` pairs rejects with
    probability ``power``. With T' = (Z + nc) / sqrt(V / df), Z standard normal, V chi-squared on df = n - 1:
    power(nc) = E_V[Phi(nc - t sqrt(V / df)) + Phi(-nc - t sqrt(V / df))], t the test's 97.5% quantile: the
    noncentral t, taken here as a mean over 2^14 evenly spaced quantiles of V (scipy's ``nct`` returns nan in its
    tail at df = 1). The usual shortcut t_0.975 + t_power is optimistic: x0.86 of this at n = 2, x0.95 at 3, x0.98
    at 4."""
    import numpy as np
    from scipy import optimize, stats

    df = n - 1
    quantiles = (np.arange(1 << 14) + 0.5) / (1 << 14)
    shift = t_quantile(df) * np.sqrt(stats.chi2.ppf(quantiles, df) / df)

    def achieved(nc: float) -> float:
        return float(np.mean(stats.norm.cdf(nc - shift) + stats.norm.cdf(-nc - shift)))

    return optimize.brentq(lambda nc: achieved(nc) - power, 0.0, 1e3, xtol=1e-9)


def detectable(diffs: list[float], power: float = 0.8) -> float:
    """The smallest mean paired difference these seeds could detect: a two-sided paired t test at 5% reaches
    ``power`` at ``power_factor(n) x sd / sqrt(n)``, taking the differences' observed standard deviation for the
    true one (nan with fewer than two)."""
    n = len(diffs)
    if n < 2:
        return float("nan")
    return power_factor(n, power) * statistics.stdev(diffs) / math.sqrt(n)


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (matching, scheme): seeds, loss mean/std, and the paired difference to separate."""
    groups = collections.defaultdict(dict)
    for r in rows:
        groups[r["matching"], r["scheme"]][int(r["seed"])] = r
    out = []
    for (matching, scheme), by_seed in groups.items():
        losses = [float(r["final_val_loss"]) for r in by_seed.values()]
        first = next(iter(by_seed.values()))
        speeds = [float(r["tokens_per_s"]) for r in by_seed.values() if r["tokens_per_s"]]
        entry = {
            "matching": matching,
            "scheme": scheme,
            "num_kv_heads": int(first["num_kv_heads"]),
            "mlp_dim": int(first["mlp_dim"]),
            "params": int(first["params"]),
            "kv_cache_bytes_per_token": int(first["kv_cache_bytes_per_token"]),
            "seeds": sorted(by_seed),
            "mean": statistics.fmean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else float("nan"),
            "tokens_per_s": statistics.median(speeds) if speeds else float("nan"),
        }
        ref = groups.get((matching, "separate"), {})
        diffs = [float(by_seed[s]["final_val_loss"]) - float(ref[s]["final_val_loss"]) for s in by_seed if s in ref]
        if scheme != "separate" and diffs:
            entry["delta"] = statistics.fmean(diffs)
            entry["delta_n"] = len(diffs)
            if len(diffs) > 1:
                half = t_quantile(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
                entry["delta_ci"] = (entry["delta"] - half, entry["delta"] + half)
                entry["detectable"] = detectable(diffs)
                ref_losses = [float(r["final_val_loss"]) for r in ref.values()]
                spread = max(entry["std"], statistics.stdev(ref_losses) if len(ref_losses) > 1 else 0.0)
                entry["inside_spread"] = abs(entry["delta"]) <= spread
        out.append(entry)
    order = {m: i for i, m in enumerate(MATCHING_TITLES)}
    return sorted(out, key=lambda e: (order.get(e["matching"], 9), e["scheme"] != "separate", e["mean"]))


def _label(e: dict, n_heads: int | None = None) -> str:
    heads = f" (K={e['num_kv_heads']})" if n_heads and e["num_kv_heads"] != n_heads else ""
    return e["scheme"] + heads


def delta_cells(e: dict, absent: str = "—") -> tuple[str, str, str, str]:
    """A ``summarize`` entry's Δ vs separate, its 95% interval, its detectable difference and whether it is inside
    the seed spread, as table cells; ``absent`` in all four for an entry with no Δ (``separate`` itself)."""
    if "delta" not in e:
        return (absent,) * 4
    ci = f"[{e['delta_ci'][0]:+.4f}, {e['delta_ci'][1]:+.4f}]" if "delta_ci" in e else "n/a (1 seed)"
    d = f"{e['detectable']:.4f}" if "detectable" in e else "n/a"
    inside = ("yes" if e["inside_spread"] else "**no**") if "inside_spread" in e else "n/a"
    return f"{e['delta']:+.4f}", ci, d, inside


def summary_markdown(out: Path, entries: list[dict], n_runs: int) -> str:
    protocol = json.loads((out / "protocol.json").read_text()) if (out / "protocol.json").exists() else {}
    heads = protocol.get("protocol", {}).get("model", {}).get("attention", {}).get("num_heads")
    lines = [
        f"# Scheme comparison: {out.name}",
        "",
        f"- command: `{protocol.get('command', '?')}`",
        f"- machine: {protocol.get('machine', '?')}; started {protocol.get('started', '?')}; {n_runs} runs finished",
        "- loss: next-byte cross-entropy in nats on the whole validation split, mean ± sample std over seeds;",
        "  Δ: minus `separate` of the same matching (under `given`: the row named `separate`), paired by seed,",
        "  with a 95% t interval; d: the smallest difference these seeds could detect (paired t test at 5%, 80%",
        '  power; a |Δ| under d cannot say "no difference" of an effect smaller than d);',
        "  *inside spread*: |Δ| ≤ the larger seed std of the two.",
        "- tokens/s and the wall-clock plot are as measured during the sweep, one run after another: anything else",
        "  running on the machine slows some runs and not others, so compare speed with `benchmarks/bench.py`",
        "  (interleaved timing), not here.",
        "",
    ]
    for matching, title in MATCHING_TITLES.items():
        rows = [e for e in entries if e["matching"] == matching]
        if not rows:
            continue
        lines += [
            f"## {matching}: {title}",
            "",
            "| scheme | F | params | KV bytes/token | seeds | val loss | Δ vs separate | 95% interval | d | "
            "inside spread | tokens/s |",
            "|---|---:|---:|---:|---:|---|---:|---|---:|---|---:|",
        ]
        for e in rows:
            delta, ci, d, inside = delta_cells(e, "—" if e["scheme"] == "separate" else "n/a")
            std = "" if math.isnan(e["std"]) else f" ± {e['std']:.4f}"
            lines.append(
                f"| {_label(e, heads)} | {e['mlp_dim']} | {e['params']:,} | {e['kv_cache_bytes_per_token']:,} | "
                f"{len(e['seeds'])} | {e['mean']:.4f}{std} | {delta} | {ci} | {d} | {inside} | "
                f"{e['tokens_per_s']:,.0f} |"
            )
        lines.append("")
    lines += ["Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def _colors(schemes) -> dict:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    from qkvjax.attention import SCHEMES

    order = list(SCHEMES) + sorted(set(schemes) - set(SCHEMES))
    return {s: cmap(i % 10) for i, s in enumerate(order)}


def plot_curves(out: Path, curves: list[dict], x: str, path: Path, labels: dict | None = None) -> None:
    plt = pyplot()
    import numpy as np

    matchings = [m for m in MATCHING_TITLES if any(c["matching"] == m for c in curves)]
    colors = _colors({c["scheme"] for c in curves})
    fig, axes = plt.subplots(1, max(len(matchings), 1), figsize=(6.2 * max(len(matchings), 1), 4.6), squeeze=False)
    for ax, matching in zip(axes[0], matchings, strict=False):
        by_scheme = collections.defaultdict(lambda: collections.defaultdict(dict))
        for c in curves:
            if c["matching"] == matching and c["val_loss"] != "":
                by_scheme[c["scheme"]][int(c["seed"])][int(c["step"])] = (float(c[x]), float(c["val_loss"]))
        for scheme, seeds in by_scheme.items():
            steps = sorted(set.intersection(*(set(s) for s in seeds.values())))
            if not steps:
                continue
            xs = np.array([[seeds[s][t][0] for t in steps] for s in seeds]).mean(0)
            ys = np.array([[seeds[s][t][1] for t in steps] for s in seeds])
            name = (labels or {}).get((matching, scheme), scheme)
            ax.plot(xs, ys.mean(0), color=colors[scheme], label=f"{name} ({len(seeds)})", lw=1.6, marker="o", ms=2.5)
            ax.fill_between(xs, ys.min(0), ys.max(0), color=colors[scheme], alpha=0.18, lw=0)
        ax.set_title(f"{matching}: {MATCHING_TITLES[matching]}", fontsize=10)
        ax.set_xlabel("step" if x == "step" else "training wall-clock (s)")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="scheme (seeds)", title_fontsize=8)
        # The first evaluations are far above the rest; show where the schemes differ.
        finals = [line.get_ydata()[-1] for line in ax.get_lines()]
        if finals:
            ax.set_ylim(min(finals) - 0.15, max(finals) + 0.6)
    title = f"{out.name}: validation loss (mean over seeds; band: min-max)"
    if x == "wall_s":  # the clock is whatever the machine gave each run; say so where the reader looks
        title += "\ntraining time as measured during the sweep: other work on the machine slows some runs"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def place_labels(ax, points: list[tuple], fontsize: float = 7, offset_px: float = 8) -> None:
    """Writes each ``(x, y, text, color)`` label right of its point, in the point's colour, moved up or down (with a
    leader line) only as far as it takes to overlap no label written before it and no other point. Greedy in display
    space, points taken from the lowest: where many rows share (nearly) one parameter count the labels fan out into
    a readable column instead of writing over each other. Call it last, after the axes' limits and the figure's
    layout are final (it reads the display transform); the x axis grows on the right, when linear, so the rightmost
    labels stay inside."""
    if not points:
        return
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    sizes = []
    for _, _, text, _ in points:
        probe = ax.text(0, 0, text, fontsize=fontsize)
        box = probe.get_window_extent(renderer)
        sizes.append((box.width, box.height))
        probe.remove()
    if ax.get_xscale() == "linear":  # room for the widest label right of the rightmost point
        x0, x1 = ax.get_xlim()
        room = ax.bbox.width - max(w for w, _ in sizes) - 2 * offset_px
        x_max = max(p[0] for p in points)
        if room > 0 and (x_max - x0) / (x1 - x0) * ax.bbox.width > room:
            ax.set_xlim(x0, x0 + (x_max - x0) * ax.bbox.width / room)
    to_display = ax.transData.transform
    spots = [tuple(to_display(p[:2])) for p in points]
    marker = 5.0  # half a marker's width in pixels: labels keep off every point
    placed = [_marker_box(spot, marker) for spot in spots]
    frame = ax.bbox
    label_y = {}  # display height of each label's centre
    for i in sorted(range(len(points)), key=lambda i: (spots[i][1], spots[i][0])):
        py, h = spots[i][1], sizes[i][1]
        own = _marker_box(spots[i], marker)
        others = [b for b in placed if b != own]
        y = py
        for k in range(2 * math.ceil(frame.height / (h / 2)) + 1):  # 0, +1, -1, +2, ... half heights off the point
            y = py + (k + 1) // 2 * (1 if k % 2 else -1) * h / 2
            box = _label_box(spots[i], sizes[i], y, offset_px)
            inside = frame.y0 <= box[1] and box[3] <= frame.y1
            if inside and not any(_overlap(box, b) for b in others):
                break
        else:
            y = py  # no free place: keep it by its point rather than out of sight
        placed.append(_label_box(spots[i], sizes[i], y, offset_px))
        label_y[i] = y
    _uncross(spots, sizes, label_y, marker, offset_px)
    for i, (px, py) in enumerate(spots):
        x, y_data = ax.transData.inverted().transform((px + offset_px, label_y[i]))
        text, color = points[i][2:]
        leader = {"arrowstyle": "-", "color": color, "lw": 0.7, "shrinkB": 4}  # only for a label moved off its point
        ax.annotate(
            text, points[i][:2], xytext=(x, y_data), textcoords="data", va="center", fontsize=fontsize, color=color,
            arrowprops=None if abs(label_y[i] - py) < 1 else leader,
        )  # fmt: skip


def _uncross(spots: list, sizes: list, label_y: dict, marker: float, offset_px: float) -> None:
    """Swaps the heights of two labels whose points share a column (closer than ``offset_px`` across) but whose
    labels stand in the other order, where both still overlap nothing: the greedy search tries above before below,
    so a higher point's label can land under a lower one's, and their leader lines would cross. Every swap removes
    an inversion of the pair; the rounds are bounded all the same."""

    markers = [_marker_box(spot, marker) for spot in spots]

    def box(i: int, y: float) -> tuple:
        return _label_box(spots[i], sizes[i], y, offset_px)

    def free(i: int, y: float, skip: int, y_skip: float) -> bool:  # label i at y, label ``skip`` at y_skip
        points = [b for k, b in enumerate(markers) if k != i]
        labels = [box(k, label_y[k]) for k in label_y if k not in (i, skip)] + [box(skip, y_skip)]
        return not any(_overlap(box(i, y), b) for b in points + labels)

    pairs = [(i, j) for i in label_y for j in label_y if i < j and abs(spots[i][0] - spots[j][0]) < offset_px]
    for _ in range(len(pairs) + 1):
        swapped = False
        for i, j in pairs:
            crossed = (spots[i][1] - spots[j][1]) * (label_y[i] - label_y[j]) < 0
            if crossed and free(i, label_y[j], j, label_y[i]) and free(j, label_y[i], i, label_y[j]):
                label_y[i], label_y[j] = label_y[j], label_y[i]
                swapped = True
        if not swapped:
            return


def _marker_box(spot: tuple, marker: float) -> tuple:
    """The display box (x0, y0, x1, y1) a label keeps off around a point at ``spot``."""
    px, py = spot
    return (px - marker, py - marker, px + marker, py + marker)


def _label_box(spot: tuple, size: tuple, y: float, offset_px: float) -> tuple:
    """The display box of a label of ``size`` (w, h) centred at height ``y``, ``offset_px`` right of its point."""
    (px, _), (w, h) = spot, size
    return (px + offset_px, y - h / 2 - 1, px + offset_px + w, y + h / 2 + 1)


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether boxes (x0, y0, x1, y1) intersect."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def plot_tradeoff(out: Path, entries: list[dict], key: str, xlabel: str, path: Path) -> None:
    plt = pyplot()

    markers = {"width": "o", "params": "s", "kv_cache": "^", "given": "D"}  # one per MATCHING_TITLES key
    colors = _colors({e["scheme"] for e in entries})
    fig, ax = plt.subplots(figsize=(7.5, 5) if len(entries) <= 12 else (10, 7))
    spots = {}  # one label per scheme and position: matchings of one scheme sit close together
    n_heads = max(e["num_kv_heads"] for e in entries)  # N: the K of every full multi-head model
    for e in entries:
        err = None if math.isnan(e["std"]) else e["std"]
        ax.errorbar(
            e[key], e["mean"], yerr=err, fmt=markers.get(e["matching"], "x"), color=colors[e["scheme"]],
            ms=7, capsize=3, alpha=0.9,
        )  # fmt: skip
        spots.setdefault((e[key], _label(e, n_heads)), (e["mean"], colors[e["scheme"]]))
    for matching, marker in markers.items():
        if any(e["matching"] == matching for e in entries):
            ax.plot([], [], marker, color="gray", label=matching)
    ax.legend(title="matching", fontsize=8)
    if key == "params":
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1e6:.2f}M")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final validation loss (nats/byte), mean ± std")
    ax.set_title(f"{out.name}: final validation loss against {xlabel.split(' (')[0]}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.margins(y=0.08)  # room above and below for labels pushed off a crowded column
    fig.tight_layout()
    place_labels(ax, [(x, y, label, color) for (x, label), (y, color) in spots.items()])
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path | str) -> Path:
    """summary.md and the plots from DIR's CSV files; returns the summary's path."""
    out = Path(out)
    rows, curves = read_csv(out / "runs.csv"), read_csv(out / "curves.csv")
    if not rows:
        raise ValueError(f"{out} has no finished runs (no rows in {out / 'runs.csv'})")
    entries = summarize(rows)
    (out / "summary.md").write_text(summary_markdown(out, entries, len(rows)))
    n_heads = max(e["num_kv_heads"] for e in entries)
    labels = {(e["matching"], e["scheme"]): _label(e, n_heads) for e in entries}
    plot_curves(out, curves, "step", out / PLOTS[0], labels)
    plot_curves(out, curves, "wall_s", out / PLOTS[1], labels)
    plot_tradeoff(out, entries, "params", "parameters (whole model)", out / PLOTS[2])
    plot_tradeoff(out, entries, "kv_cache_bytes_per_token", "KV-cache bytes per token (all layers)", out / PLOTS[3])
    return out / "summary.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python experiments/report.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("dir", metavar="DIR", help="compare_schemes.py's results folder (runs.csv)")
    args = parser.parse_args(argv)
    try:
        print(write_report(args.dir).read_text())
    except ValueError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
