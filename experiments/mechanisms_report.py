"""Tables and plots of the mechanism studies (``compare_schemes.py --rows``; experiments/README.md, questions 3, 4).

    python experiments/mechanisms_report.py DIR [--rows experiments/configs/rows_reformer.txt ...]

Each rows file is one study (its rows in the file's order; a row may sit in several, ``separate`` in all). Writes
``DIR/mechanisms.md``: per study a table of the final whole-split validation loss (mean ± sample std over seeds),
the paired difference to ``separate`` with its 95% t interval, the smallest difference its seeds could detect
(80% power) and whether it is inside the seed spread (as ``report.py``), the paired difference (with its interval
and detectable difference) to each row's control: the row a ``# control: ROW = CONTROL`` line of the rows file
names for it, else the study's ``# reference: NAME`` row (``shared_qk`` for Reformer's parts, ``separate_norms``
for K = V under Gemma's norms), and the early phase: the difference to ``separate`` at a few early evaluations
(mean over seeds), the last evaluation at which the row was still ahead of ``separate``, and the steps each row
takes to reach the losses ``separate`` reaches at 10%, 30% and 100% of the run. Plots per study:
``DIR/<study>_delta.png``, the difference to ``separate`` at every evaluation (the early steps and the whole run),
and where a study's rows differ in cache, ``DIR/<study>_cache.png``, final loss against cache size.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import report
from experiments.rows import read_csv, rows_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROWS = [REPO / f"experiments/configs/rows_{name}.txt" for name in ("reformer", "equal_cache", "mla_lr")]
EARLY_EVALUATIONS = 3  # the early phase's columns: the first few evaluations after the first
EARLY_FRACTION = 0.3  # the early panel of the plots: this much of the run
TARGET_FRACTIONS = (0.1, 0.3, 1.0)  # steps-to-loss: the losses separate reaches at these fractions of the run


def val_curves(curves: list[dict]) -> dict[str, dict[int, dict[int, float]]]:
    """scheme -> seed -> step -> validation loss."""
    out: dict = collections.defaultdict(lambda: collections.defaultdict(dict))
    for c in curves:
        if c["matching"] == "given" and c["val_loss"] != "":
            out[c["scheme"]][int(c["seed"])][int(c["step"])] = float(c["val_loss"])
    return out


def delta_curve(curves, scheme: str, reference: str = "separate") -> tuple[list[int], list[list[float]]]:
    """Steps evaluated in every paired seed, and per seed the difference scheme - reference at each."""
    a, b = curves.get(scheme, {}), curves.get(reference, {})
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return [], []
    steps = sorted(set.intersection(*(set(a[s]) & set(b[s]) for s in seeds)))
    return steps, [[a[s][t] - b[s][t] for t in steps] for s in seeds]


def paired_stats(rows: list[dict], scheme: str, reference: str) -> tuple[float, float, float, float, int] | None:
    """``scheme - reference`` in final loss, paired by seed: mean, its 95% t interval and the smallest difference
    these seeds could detect (``report.detectable``; nan with one seed), seeds."""
    by = {(r["scheme"], int(r["seed"])): float(r["final_val_loss"]) for r in rows}
    diffs = [by[scheme, s] - by[reference, s] for (n, s) in by if n == scheme and (reference, s) in by]
    if not diffs:
        return None
    n, mean = len(diffs), statistics.fmean(diffs)
    half = report.t_quantile(n - 1) * statistics.stdev(diffs) / math.sqrt(n) if n > 1 else math.nan
    return mean, mean - half, mean + half, report.detectable(diffs), n


def paired(rows: list[dict], scheme: str, reference: str, digits: int = 4) -> str:
    """``paired_stats`` as a cell: ``+0.0123 [-0.0100, +0.0346] d 0.0400 (reference, n=3)``."""
    stats = paired_stats(rows, scheme, reference)
    if stats is None:
        return "—"
    mean, lo, hi, d, n = stats
    interval = "" if n < 2 else f" [{lo:+.{digits}f}, {hi:+.{digits}f}] d {d:.{digits}f}"
    return f"{mean:+.{digits}f}{interval} ({reference}, n={n})"


def steps_to_loss(curves, order: list[str]) -> list[str]:
    """A table: for each target, the loss ``separate`` reaches (mean over seeds) at its evaluation at
    TARGET_FRACTIONS of the run, the first evaluation at which each row is at or below it (mean over the seeds that
    got there; how many did, when not all): does a row train faster early, and until when?"""
    ref = curves.get("separate", {})
    if not ref:
        return []
    last = max(t for s in ref.values() for t in s)
    common = sorted(set.intersection(*(set(s) for s in ref.values())))
    marks = sorted({next(t for t in common if t >= f * last) for f in TARGET_FRACTIONS})
    targets = [(t, statistics.fmean(s[t] for s in ref.values())) for t in marks]
    lines = ["Steps to `separate`'s loss (first evaluation at or below it; mean over seeds):", "",
             "| row | " + " | ".join(f"to {loss:.3f} (separate's @{t})" for t, loss in targets) + " |",
             "|---|" + "---|" * len(targets)]  # fmt: skip
    for scheme in (s for s in order if s in curves):
        cells = []
        for _, loss in targets:
            reached = [min((t for t, v in c.items() if v <= loss), default=None) for c in curves[scheme].values()]
            got = [t for t in reached if t is not None]
            n = len(reached)
            cells.append("not reached" if not got else f"{statistics.fmean(got):.0f}"
                         + ("" if len(got) == n else f" ({len(got)} of {n} seeds)"))  # fmt: skip
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return lines + [""]


def study_markdown(
    name: str, order: list[str], controls: dict[str, str], entries: dict, rows: list[dict], curves, full: int
) -> list[str]:
    steps_all = sorted({t for seeds in curves.values() for s in seeds.values() for t in s})
    early = steps_all[1 : 1 + EARLY_EVALUATIONS]
    header = (
        "| row | params | KV cache x separate | seeds | val loss | Δ vs separate | 95% interval | d | inside spread | "
        "Δ vs its control [95%] d | " + " | ".join(f"Δ sep. @{t}" for t in early) + " | last step ahead of separate |"
    )
    lines = [f"## {name}", "", header, "|" + "---|" * (10 + len(early) + 1)]
    for scheme in order:
        e = entries.get(scheme)
        if e is None:
            lines.append(f"| {scheme} | | | 0 | not run yet |" + " |" * (6 + len(early)))
            continue
        std = "" if math.isnan(e["std"]) else f" ± {e['std']:.4f}"
        delta, ci, d, inside = report.delta_cells(e)
        vs_own = paired(rows, scheme, controls[scheme]) if scheme in controls else "—"
        steps, deltas = delta_curve(curves, scheme)
        means = [statistics.fmean(col) for col in zip(*deltas, strict=True)]
        at = dict(zip(steps, means, strict=True))
        early_cells = [f"{at[t]:+.3f}" if t in at else "" for t in early]
        ahead = [t for t, d in at.items() if d < 0]
        last = "—" if scheme == "separate" else (str(max(ahead)) if ahead else "never")
        lines.append(
            f"| {scheme} | {e['params']:,} | {e['kv_cache_bytes_per_token'] / full:.3g} | {len(e['seeds'])} | "
            f"{e['mean']:.4f}{std} | {delta} | {ci} | {d} | {inside} | {vs_own} | {' | '.join(early_cells)} | {last} |"
        )
    return lines + [""]


def _color(i: int):
    """Row i's colour: tab20's dark shades first, then its light ones, so neighbours never share a hue."""
    import matplotlib

    return matplotlib.colormaps["tab20"]((2 * i) % 20 + (i // 10) % 2)


def plot_deltas(out: Path, name: str, order: list[str], curves, path: Path) -> None:
    plt = report.pyplot()
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(15, 5.2))
    last = max((t for seeds in curves.values() for s in seeds.values() for t in s), default=1)
    for scheme in (s for s in order if s != "separate"):
        i = order.index(scheme)  # a row's colour is the same in every plot of its study
        steps, deltas = delta_curve(curves, scheme)
        if not steps:
            continue
        d = np.array(deltas)
        for ax, limit in zip(axes, (EARLY_FRACTION * last, last), strict=True):
            keep = np.array(steps) <= limit
            xs = np.array(steps)[keep]
            ax.plot(xs, d.mean(0)[keep], color=_color(i), lw=1.5, marker="o", ms=2,
                    label=f"{scheme} ({len(deltas)})")  # fmt: skip
            if len(deltas) > 1:
                ax.fill_between(xs, d.min(0)[keep], d.max(0)[keep], color=_color(i), alpha=0.12, lw=0)
    for ax, title in zip(
        axes, (f"early phase (first {EARLY_FRACTION:.0%} of the steps)", "the whole run"), strict=True
    ):
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss minus separate's (nats/byte)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    if axes[1].get_lines():
        # outside the axes: inside, a dozen rows would cover the curves they name
        axes[1].legend(fontsize=7, title="row (seeds); band: min-max", title_fontsize=7, loc="upper left",
                       bbox_to_anchor=(1.01, 1.0))  # fmt: skip
    fig.suptitle(f"{out.name}, {name}: each row minus separate at every evaluation (paired by seed; below 0 = ahead)",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_cache(out: Path, name: str, order: list[str], entries: dict, full: int, path: Path) -> None:
    plt = report.pyplot()

    fig, ax = plt.subplots(figsize=(10, 6))
    shown = [s for s in order if s in entries]
    fractions = sorted({entries[s]["kv_cache_bytes_per_token"] / full for s in shown})
    means = [entries[s]["mean"] for s in shown]
    gap = 0.045 * ((max(means) - min(means)) or 1.0)  # the least vertical distance between two labels
    label_y = {}
    for f in fractions:  # per cache size, labels in the points' order, pushed apart where they would collide
        column = sorted((entries[s]["mean"], s) for s in shown if entries[s]["kv_cache_bytes_per_token"] / full == f)
        low = -math.inf
        for y, scheme in column:
            label_y[scheme] = low = max(y, low + gap)
    for j, scheme in enumerate(shown):
        i, e = order.index(scheme), entries[scheme]
        x = fractions.index(e["kv_cache_bytes_per_token"] / full)
        jitter = (j % 5 - 2) * 0.05  # rows at one cache size side by side
        err = None if math.isnan(e["std"]) else e["std"]
        ax.errorbar(x + jitter, e["mean"], yerr=err, fmt="o", color=_color(i), ms=6, capsize=3)
        ax.annotate(f"{scheme} ({len(e['seeds'])})", (x + jitter, e["mean"]), xytext=(x + 0.2, label_y[scheme]),
                    fontsize=7, va="center", color=_color(i), zorder=3,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.85},
                    arrowprops={"arrowstyle": "-", "color": _color(i), "lw": 0.6})  # fmt: skip
    if "separate" in entries:
        ax.axhline(entries["separate"]["mean"], color="gray", lw=0.8, ls="--", label="separate (full cache)")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(fractions)), [f"{f:g} x separate's" for f in fractions])
    ax.set_xlim(-0.4, len(fractions) - 0.1)
    ax.margins(y=0.15)  # room for the labels above the highest point
    ax.set_xlabel("KV-cache bytes per token (all layers)")
    ax.set_ylabel("final validation loss (nats/byte), mean ± std (seeds)")
    ax.set_title(f"{out.name}, {name}: final loss at each cache size", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, studies: dict[str, tuple[list[str], dict[str, str]]]) -> Path:
    """``studies``: name -> (its rows in order, each row's control where it has one)."""
    rows = [r for r in read_csv(out / "runs.csv") if r["matching"] == "given"]
    if not rows:
        raise ValueError(f"{out} has no finished rows (no 'given' rows in {out / 'runs.csv'})")
    entries = {e["scheme"]: e for e in report.summarize(rows)}
    curves = val_curves(read_csv(out / "curves.csv"))
    full = entries["separate"]["kv_cache_bytes_per_token"] if "separate" in entries else max(
        e["kv_cache_bytes_per_token"] for e in entries.values())  # fmt: skip
    protocol = (out / "protocol.json").read_text() if (out / "protocol.json").exists() else "{}"
    lines = [
        f"# Mechanism studies: {out.name} ({len(rows)} runs finished)",
        "",
        f"Protocol and command: [protocol.json](protocol.json) ({len(protocol):,} bytes). Loss: next-byte "
        "cross-entropy (nats) on the whole validation split, mean ± sample std over seeds; Δ: minus the row "
        "`separate`, paired by seed, 95% t interval; d: the smallest difference these seeds could detect (paired t "
        'test at 5%, 80% power; a |Δ| under d cannot say "no difference" of an effect smaller than d); *inside '
        "spread*: |Δ| ≤ the larger seed std of the two. "
        "The early columns are Δ vs `separate` at the first evaluations (mean over seeds); the last column the last "
        "evaluation at which the row's mean Δ was below 0.",
        "",
    ]
    for name, (order, controls) in studies.items():
        lines += study_markdown(name, order, controls, entries, rows, curves, full)
        lines += steps_to_loss(curves, order)
        plots = [f"{name}_delta.png"]
        plot_deltas(out, name, order, curves, out / plots[0])
        if len({entries[s]["kv_cache_bytes_per_token"] for s in order if s in entries}) > 1:
            plots.append(f"{name}_cache.png")
            plot_cache(out, name, order, entries, full, out / plots[1])
        lines += ["Plots: " + ", ".join(f"[{p}]({p})" for p in plots), ""]
    path = out / "mechanisms.md"
    path.write_text("\n".join(lines))
    return path


def read_study(path: Path) -> tuple[list[str], dict[str, str]]:
    """A rows file's rows in order, and each row's control: a ``# control: ROW = CONTROL`` line's, else the row a
    ``# reference: NAME`` comment names (for every row but ``separate`` and the reference itself)."""
    rows = [row for row, _ in rows_file(str(path))]
    lines = path.read_text().splitlines()
    marks = [line.split(":", 1)[1].strip() for line in lines if line.startswith("# reference:")]
    if marks and marks[0] not in rows:
        raise argparse.ArgumentTypeError(f"{path}: '# reference: {marks[0]}' names no row; allowed: {rows}")
    controls = {row: marks[0] for row in rows if marks and row not in ("separate", marks[0])}
    for line in (x for x in lines if x.startswith("# control:")):
        row, _, control = (part.strip() for part in line.split(":", 1)[1].partition("="))
        if row not in rows or control not in rows:
            raise argparse.ArgumentTypeError(f"{path}: '{line}' names no row; allowed: {rows}")
        controls[row] = control
    return rows, controls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the results folder of compare_schemes.py --rows")
    p.add_argument("--rows", action="append", default=None, help="a study's rows file (repeatable); the study is named "
                   "after the file (rows_NAME.txt -> NAME)")  # fmt: skip
    args = p.parse_args(argv)
    files = [Path(f) for f in args.rows] if args.rows else DEFAULT_ROWS
    try:
        studies = {f.stem.removeprefix("rows_"): read_study(f) for f in files}
    except argparse.ArgumentTypeError as e:
        print(f"mechanisms_report: error: {e}", file=sys.stderr)
        return 2
    try:
        print(write(Path(args.out), studies).read_text())
    except ValueError as e:
        print(f"mechanisms_report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
