"""The retrofit study's table, answer and plot (experiments/preregistered/retrofit_tokens.md) from its runs.csv;
works on a partial study.

    python experiments/retrofit_report.py [experiments/results/retrofit_linux]

Writes ``summary.md``: per target and uptraining budget, the final validation loss after uptraining, the
from-scratch reference at the same total tokens (budgets of 1% and 3% against the scheme trained on N, 10% against
1.1 N, 30% against 1.3 N), the gap retrofit - scratch paired by seed with its 95% t interval and the cell's
detectable difference as pre-registered (t_0.975,n-1 x sd / sqrt(n) of the paired gaps; the 80%-power one of the
other reports beside it), and per target the answer:
the smallest budget whose gap's upper bound is below that difference ("not within 30%" otherwise; "open" while a
budget lacks seeds). And ``loss_vs_uptrain_tokens.png``: loss against uptraining tokens, a panel per target, the
from-scratch reference each budget is read against as a band over its seeds.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.report import detectable, t_quantile
from experiments.rows import read_csv

REFERENCE_SCALE = {0.01: 1.0, 0.03: 1.0, 0.1: 1.1, 0.3: 1.3}  # budget -> the from-scratch length it is read against
DEFAULT = Path(__file__).resolve().parent / "results" / "retrofit_linux"


def losses(rows: list[dict]) -> dict[tuple, dict[int, float]]:
    """(stage, target, budget) -> {seed: final validation loss}."""
    out = collections.defaultdict(dict)
    for r in rows:
        out[r["stage"], r["target"], float(r["budget"])][int(r["seed"])] = float(r["final_val_loss"])
    return out


def gaps(cells: dict) -> list[dict]:
    """One entry per (target, budget) with an uptraining result: its mean, the reference's, the paired gap."""
    out = []
    for (stage, target, budget), up in sorted(cells.items()):
        if stage != "uptrain":
            continue
        ref = cells.get(("scratch", target, REFERENCE_SCALE[budget]), {})
        paired = [up[s] - ref[s] for s in sorted(up) if s in ref]
        e = {"target": target, "budget": budget, "loss": statistics.fmean(up.values()), "n": len(up),
             "ref": statistics.fmean(ref.values()) if ref else None, "pairs": len(paired)}  # fmt: skip
        if paired:
            e["gap"] = statistics.fmean(paired)
        if len(paired) > 1:
            half = t_quantile(len(paired) - 1) * statistics.stdev(paired) / math.sqrt(len(paired))
            e["ci"], e["d"] = (e["gap"] - half, e["gap"] + half), half
            e["d80"] = detectable(paired)  # the other reports' detectable difference (80% power), printed beside
        out.append(e)
    return out


def answer(entries: list[dict], seeds: int = 3) -> dict[str, str]:
    """Per target: the smallest budget whose gap's upper bound is below its detectable difference."""
    out = {}
    for target in dict.fromkeys(e["target"] for e in entries):
        mine = sorted((e for e in entries if e["target"] == target), key=lambda e: e["budget"])
        out[target] = "not within 30%"
        for e in mine:
            if e["pairs"] < seeds:
                out[target] = f"open (the {e['budget']:.0%} budget has {e['pairs']} of {seeds} paired seeds)"
                break
            if e["ci"][1] < e["d"]:
                out[target] = f"{e['budget']:.0%} of the base's tokens"
                break
    return out


def fourth_seed_due(entries: list[dict], answers: dict[str, str]) -> dict[str, list[float]]:
    """Per decided target, the budgets on which its answer turns (the pre-registration's rule for a fourth seed):
    those up to the answer's budget (every budget for "not within 30%") whose gap's interval holds the detectable
    difference, so that more seeds could move the answer."""
    out = {}
    for target, said in answers.items():
        if said.startswith("open"):
            continue
        mine = sorted((e for e in entries if e["target"] == target and "ci" in e), key=lambda e: e["budget"])
        last = float(said.split("%")[0]) / 100 if said[0].isdigit() else 1.0
        turns = [e["budget"] for e in mine if e["budget"] <= last + 1e-9 and e["ci"][0] < e["d"] < e["ci"][1]]
        if turns:
            out[target] = turns
    return out


def summary_markdown(rows: list[dict]) -> str:
    cells = losses(rows)
    base = cells.get(("base", "separate", 1.0), {})
    entries = gaps(cells)
    lines = [f"# Retrofit study: {len(rows)} finished runs", "",
             "`separate` at d=96 on the Linux corpus (disjoint windows), converted and uptrained; against each "
             "target trained from scratch on the same total tokens (experiments/preregistered/retrofit_tokens.md).",
             ""]  # fmt: skip
    if base:
        lines += [f"Bases (`separate`, N tokens): {statistics.fmean(base.values()):.4f} over seeds "
                  f"{', '.join(map(str, sorted(base)))}.", ""]  # fmt: skip
    lines += ["| target | budget | seeds | loss after uptraining | from scratch | gap [95%] d | pairs |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in entries:
        ref = "—" if e["ref"] is None else f"{e['ref']:.4f}"
        gap = "—" if "gap" not in e else f"{e['gap']:+.4f}"
        if "ci" in e:
            gap += f" [{e['ci'][0]:+.4f}, {e['ci'][1]:+.4f}] d {e['d']:.4f} (80% power: {e['d80']:.4f})"
        lines.append(f"| {e['target']} | {e['budget']:.0%} | {e['n']} | {e['loss']:.4f} | {ref} | {gap} | "
                     f"{e['pairs']} |")  # fmt: skip
    lines += ["", "## The answer so far", ""]
    answers = answer(entries)
    due = fourth_seed_due(entries, answers)
    for t, a in answers.items():
        turns = ", ".join(f"{b:.0%}" for b in due.get(t, ()))
        pairs = min(e["pairs"] for e in entries if e["target"] == t)
        lines.append(f"- {t}: {a}" + (f" (with {pairs} paired seeds; another seed is due: the gap's interval at "
                                      f"{turns} holds its detectable difference)" if turns else ""))  # fmt: skip
    if not answers:
        lines.append("- no uptraining result yet")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path) -> Path:
    """One panel per target: the loss after each uptraining budget (mean over seeds, the seeds' range as error
    bars) against the uptraining tokens, beside the from-scratch reference each budget is read against (N, 1.1 N or
    1.3 N, REFERENCE_SCALE) as a band from its lowest to its highest seed, and the base's mean."""
    from experiments import report

    plt = report.pyplot()
    cells = losses(rows)
    n = next((int(r["tokens"]) for r in rows if r["stage"] == "base"), None) or 1
    targets = list(dict.fromkeys(r["target"] for r in rows if r["stage"] == "uptrain"))
    cols = min(3, len(targets))
    nrows = -(-len(targets) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), sharey=True, squeeze=False)
    base = cells.get(("base", "separate", 1.0))
    for ax, target in zip(axes.flat, targets, strict=False):  # the panels past the targets stay empty
        budgets = sorted(b for (s, t, b) in cells if s == "uptrain" and t == target)
        x = [b * n for b in budgets]
        ups = [list(cells["uptrain", target, b].values()) for b in budgets]
        mean = [statistics.fmean(v) for v in ups]
        spread = [
            [m - min(v) for m, v in zip(mean, ups, strict=True)],
            [max(v) - m for m, v in zip(mean, ups, strict=True)],
        ]
        ax.errorbar(x, mean, yerr=spread, fmt="o-", color="C0", capsize=3, label="uptrained (mean, seed range)")
        refs = [cells.get(("scratch", target, REFERENCE_SCALE[b])) for b in budgets]
        have = [(xi, list(r.values())) for xi, r in zip(x, refs, strict=True) if r]
        if have:
            rx = [xi for xi, _ in have]
            ax.fill_between(rx, [min(v) for _, v in have], [max(v) for _, v in have], color="C1", alpha=0.25,
                            step="mid", label="from scratch, same total tokens (seed range)")  # fmt: skip
            ax.plot(rx, [statistics.fmean(v) for _, v in have], "s--", color="C1", ms=4, lw=1)
        if base:
            ax.axhline(statistics.fmean(base.values()), color="gray", ls=":", lw=1.5, label="separate, the base (N)")
        seeds = sorted({s for v in cells.items() if v[0][1] == target for s in v[1]})
        ax.set_title(f"{target} (seeds {', '.join(map(str, seeds))})", fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("uptraining tokens (log)")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(targets) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("final validation loss (nats/byte)")
    axes.flat[0].legend(fontsize=7, loc="upper right")
    fig.suptitle("Retrofit from separate, d=96, Linux: loss against uptraining tokens, per target", fontsize=11)
    fig.tight_layout()
    path = out / "loss_vs_uptrain_tokens.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", type=Path, default=DEFAULT, help="the results folder of experiments/retrofit.py")
    args = p.parse_args(argv)
    rows = read_csv(args.out / "runs.csv")
    if not rows:
        p.error(f"{args.out / 'runs.csv'} has no finished runs yet; allowed: a folder experiments/retrofit.py wrote")
    (args.out / "summary.md").write_text(summary_markdown(rows))
    if any(r["stage"] == "uptrain" for r in rows):
        plot(rows, args.out)
    print(args.out / "summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
