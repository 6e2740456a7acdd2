"""Where trained attention goes: per layer and head, the weight a query puts on its own position (``self``), on
the position before it (``previous``), how far back it reads on average (``distance``, in positions) and how
spread its weights are (``entropy``, nats), over the first windows of each run's validation split.

Why the token itself: with W^Q = W^K (``shared_qk``) a query's score against its own key is |q_t|^2 / sqrt(H), the
largest score q_t can give any key no longer than itself (Cauchy-Schwarz), so the tie pulls attention onto the
token itself. Reformer masks that score for this reason (Kitaev et al. 2020, arXiv:2001.04451, section 2, "Causal
masking for shared-QK attention": a query's product with itself almost always exceeds its product with another
position, so a token attends to itself only where it has no other target). Under rotary positions the rotation
cancels in that one score (R_t q . R_t q = |q|^2), so no position can lower it against the others. ``self``
measures how much of the weight trained models give it; the expectation was written here before the first run.

Finished runs only (a run writes its ``params/`` export when it reaches its last step; others are skipped with a
note, so a glob over a sweep's scratch folder takes what is done). Rows t >= 1 only (the first query has no other
key). Every statistic is computed in float64 from the weights the
model computes (collecting them takes the einsum kernel, the one path that hands them out, whatever the run's
implementation; the maths of every path is the same), unfolded from the grouped layout (B, K, T G, S) to
(B, N, T, S), query head n = k G + g with each layer's own N and K (a per-layer pattern may vary them; a layer
reading another's K/V reads them with its own queries, so it has maps of its own).

    python experiments/attention_stats.py --out experiments/results/scaling_rope/attention RUN_DIR [RUN_DIR ...]

writes ``attention.csv`` (one row per run, layer and head), ``attention.md`` (per size and variant: the mean over
heads and layers, mean ± std over seeds, and each layer's ``self``) and ``attention_self.png`` (``self`` per layer,
a line per run).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.rows import read_csv, replace_rows
from qkvjax.workdir import exported_steps

STATS = ("self", "previous", "distance", "entropy")
COLUMNS = ("run", "positions", "size", "variant", "learning_rate", "seed", "windows", "layer", "head", *STATS)
# the scaling sweep's run names: corpus-d<size>-<variant>-lr<rate>-seed<seed>
SWEEP_NAME = re.compile(r"-d(\d+)-(.+)-lr([0-9.e+-]+)-seed(\d+)$")


def unfold(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """(B, K, T G, S) -> (B, N, T, S): the grouped layout (queries of the G heads reading one K/V head folded t-major
    into one axis, Q = T G) back to one (T, S) map per query head n = k G + g."""
    b, k, q, s = weights.shape
    g = num_heads // k
    return weights.reshape(b, k, q // g, g, s).transpose(0, 1, 3, 2, 4).reshape(b, num_heads, q // g, s)


def head_stats(weights: np.ndarray) -> dict[str, np.ndarray]:
    """Each statistic per head, (N,), from causal weights (B, N, T, T): the mean over batch rows and query
    positions t >= 1 of a[t, t], a[t, t - 1], sum_s a[t, s] (t - s) and -sum_s a[t, s] log a[t, s]."""
    w = np.asarray(weights, dtype=np.float64)
    t = w.shape[-1]
    rows = np.arange(1, t)
    lag = np.maximum(np.arange(t)[:, None] - np.arange(t)[None, :], 0)  # t - s where s <= t (0 where masked)
    plogp = np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0)
    per_row = {
        "self": w[:, :, rows, rows],
        "previous": w[:, :, rows, rows - 1],
        "distance": (w * lag).sum(-1)[:, :, 1:],
        "entropy": -plogp.sum(-1)[:, :, 1:],
    }
    return {name: v.mean(axis=(0, 2)) for name, v in per_row.items()}


def describe(workdir: str) -> dict:
    """The run's positions (a learned table, rotary, both or none), size, variant, rate and seed: the variant from a
    sweep run's folder name where it has one, else its layer pattern, else the scheme."""
    from qkvjax.workdir import load_config

    config = load_config(workdir)
    match = SWEEP_NAME.search(os.path.basename(os.path.normpath(workdir)))
    rope, table = config.model.attention.rope, config.model.learned_positions
    return {
        "run": os.path.basename(os.path.normpath(workdir)),
        "positions": "+".join(["learned"] * table + ["rope"] * rope) or "none",
        "size": config.model.d_model,
        "variant": match.group(2) if match else config.model.layers or config.model.attention.scheme,
        "learning_rate": config.train.learning_rate,
        "seed": config.seed,
    }


def run_weights(workdir: str, windows: int, batch: int = 16) -> list[np.ndarray]:
    """Per layer, the (B, N, T, T) attention weights of the run's newest checkpoint over the first ``windows``
    windows of ``seq_len`` tokens of its validation split."""
    import jax

    from qkvjax.data.builders import load_splits
    from qkvjax.data.tokenizer import load_tokenizer, tokenize_splits
    from qkvjax.evaluate import load

    model, params, config = load(workdir)
    cfg = config.model
    text = load_splits(config.data.dataset, config.data.source_path, os.path.expanduser(config.data.data_dir))
    tokens = tokenize_splits({"validation": text["validation"]}, load_tokenizer(config.data.tokenizer, workdir))
    seq = config.seq_len
    ids = np.asarray(tokens["validation"])
    if len(ids) < windows * seq:
        raise ValueError(f"{workdir}: --windows={windows} needs {windows * seq} tokens; the split has {len(ids)}")
    ids = ids[: windows * seq].reshape(windows, seq).astype(np.int32)

    @jax.jit
    def collect(p, x):
        _, state = model.apply({"params": p}, x, mutable=["intermediates"])
        blocks = state["intermediates"]
        return [blocks[f"block_{i}"]["attention"]["attention_weights"][0] for i in range(cfg.num_layers)]

    per_layer: list[list[np.ndarray]] = [[] for _ in range(cfg.num_layers)]
    for lo in range(0, windows, batch):
        for i, w in enumerate(collect(params, ids[lo : lo + batch])):
            per_layer[i].append(unfold(np.asarray(w), cfg.layer_attention[i].config.num_heads))
    return [np.concatenate(ws) for ws in per_layer]


def rows_of(workdir: str, windows: int) -> list[dict]:
    """One row per layer and head of a run."""
    about = describe(workdir) | {"windows": windows}
    out = []
    for layer, w in enumerate(run_weights(workdir, windows)):
        stats = head_stats(w)
        for head in range(w.shape[1]):
            out.append({**about, "layer": layer, "head": head, **{k: float(stats[k][head]) for k in STATS}})
    return out


def _mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def summary(rows: list[dict]) -> str:
    """Per size and (variant, rate): seeds, each statistic's mean over layers and heads (mean ± std over seeds),
    and ``self`` per layer (mean over heads and seeds)."""
    groups: dict[tuple, dict[int, list[dict]]] = {}
    for r in rows:
        key = (r["positions"], int(r["size"]), r["variant"], float(r["learning_rate"]))
        groups.setdefault(key, {}).setdefault(int(r["seed"]), []).append(r)
    layers = sorted({int(r["layer"]) for r in rows})
    windows = " or ".join(sorted({str(r["windows"]) for r in rows}))
    lines = [
        "# Where trained attention goes",
        "",
        f"Over the first {windows} windows of each run's validation split, query positions t >= 1; `self`: the "
        "weight on the token itself, `previous`: on the one before it, `distance`: the mean of t - s under the "
        "weights, `entropy`: nats (a uniform read of t + 1 keys has log(t + 1)). Each cell: the mean over layers and "
        "heads, mean ± std over seeds (`experiments/attention_stats.py`).",
    ]
    for positions, size in sorted({k[:2] for k in groups}):
        lines += ["", f"## d_model {size}, positions: {positions}", ""]
        header = ["variant", "lr", "seeds", *STATS, *(f"self L{i}" for i in layers)]
        lines += ["| " + " | ".join(header) + " |"]
        lines += ["|---" * len(header) + "|"]
        for (pos, s, variant, lr), by_seed in sorted(groups.items(), key=lambda kv: (kv[0][2] != "separate", kv[0])):
            if (pos, s) != (positions, size):
                continue
            every = [r for rs in by_seed.values() for r in rs]
            cells = [_mean_std([statistics.fmean(float(r[k]) for r in rs) for rs in by_seed.values()]) for k in STATS]
            per_layer = [[float(r["self"]) for r in every if int(r["layer"]) == i] for i in layers]
            cells += [f"{statistics.fmean(v):.3f}" if v else "—" for v in per_layer]
            seeds = ",".join(str(x) for x in sorted(by_seed))
            lines.append(f"| {variant} | {lr:g} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """``self`` per layer (the mean over heads), one thin line per run coloured by variant, a panel per positions
    and size."""
    from experiments import report
    from experiments.scaling_report import VARIANT_ORDER, variant_color

    plt = report.pyplot()
    panels = sorted({(r["positions"], int(r["size"])) for r in rows})
    known = [v for v in VARIANT_ORDER if v in {r["variant"] for r in rows}]  # the ladder's order and colours
    variants = known + sorted({r["variant"] for r in rows} - set(known))
    others = iter(plt.get_cmap("Dark2").colors)
    colour = {v: variant_color(v) if v in VARIANT_ORDER else next(others) for v in variants}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), sharey=True, squeeze=False)
    for ax, (positions, size) in zip(axes[0], panels, strict=True):
        runs = sorted({r["run"] for r in rows if (r["positions"], int(r["size"])) == (positions, size)})
        for run in runs:
            mine = [r for r in rows if r["run"] == run]
            layers = sorted({int(r["layer"]) for r in mine})
            value = [statistics.fmean(float(r["self"]) for r in mine if int(r["layer"]) == i) for i in layers]
            ax.plot(layers, value, "-o", ms=3, lw=1, alpha=0.8, color=colour[mine[0]["variant"]])
        ax.set_title(f"d_model {size}, {positions} positions: {len(runs)} runs", fontsize=10)
        ax.set_xlabel("layer")
        ax.set_xticks(layers)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("weight on the token itself (mean over heads, t >= 1)")
    axes[0][0].set_ylim(0, 1)
    handles = [plt.Line2D([], [], color=colour[v], marker="o", ms=3, label=v) for v in variants]
    fig.legend(handles=handles, loc="upper center", ncol=len(variants), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="training run folders (qkvjax workdirs with a checkpoint); none: the "
                   "summary and plot again from --out's attention.csv")  # fmt: skip
    p.add_argument("--out", required=True, help="folder of attention.csv (a run's rows replaced, others kept)")
    p.add_argument("--windows", type=int, default=64, help="validation windows of seq_len tokens (default 64)")
    args = p.parse_args(argv)
    out = Path(args.out)
    table = out / "attention.csv"
    try:
        if args.windows < 1:
            raise ValueError(f"--windows={args.windows}; allowed: an integer >= 1")
        missing = [r for r in args.runs if not os.path.isfile(os.path.join(r, "config.json"))]
        if missing:
            raise ValueError(f"{missing[0]} holds no run (no config.json); allowed: qkvjax training run folders")
        if not args.runs and not table.is_file():
            raise ValueError(f"no runs given and no {table} to report; allowed: run folders, or --out with one")
        finished = [r for r in args.runs if exported_steps(r)]  # params/ is written once a run reaches num_steps
        for run in sorted(set(args.runs) - set(finished)):
            print(f"attention_stats: skipped {run}: not finished (no params/ export yet)", file=sys.stderr)
        if args.runs and not finished:
            raise ValueError(f"none of the {len(args.runs)} runs has finished; allowed: runs with a params/ export")
        new = [row for run in finished for row in rows_of(run, args.windows)]
    except ValueError as e:
        print(f"attention_stats: error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    names = {r["run"] for r in new}
    rows = [r for r in read_csv(table) if r["run"] not in names] + new
    replace_rows(table, COLUMNS, rows)  # written beside, then renamed over: a kill leaves the old table or the new
    (out / "attention.md").write_text(summary(rows))
    plot(rows, out / "attention_self.png")
    print((out / "attention.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
