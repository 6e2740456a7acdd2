"""One markdown table from several ``qkvjax analyze --json`` files: each measure trained / initial / random.

    python experiments/analyze_table.py experiments/results/scaling_cpu/analyze/d160-*.json
    python experiments/analyze_table.py --over-seeds experiments/results/scaling_corpus2/analyze/d160-*.json

A row per file (its scheme from the analysis' ``source``); each similarity cell reads *trained / the run's own
initialisation W_0 / Gaussian control* (means over heads and layers, as ``qkvjax analyze`` prints them on its
``all layers``, ``initial`` and ``random`` lines), so a reader can tell training from the initial statistics
(experiments/README.md, "How similar do W^Q, W^K, W^V become?"). A measure that is 1 in every head and layer is
fixed by the scheme's tie and shows as ``(1)`` (and the Gaussian control of the K/V rank error, which
draws W^K and W^V apart, as ``—`` where K = V); one the scheme does not have (``bilinear`` has no W^Q, W^K) as
``—``. Drift is |W - W_0|_F / |W_0|_F over the attention's input kernels (every kernel but ``w_o``): the mean
over kernels and layers, and its range; then its control, what weight decay alone moves a kernel in as many steps
of the run's optimizer with zero gradients (``drift_decay_only``, which ``qkvjax analyze --workdir`` writes; with
``--ladder``, an older file from ``experiments/scaling.py`` without it gets it from its run name: size, rate, step).
With ``--over-seeds``, one row per scheme instead: each trained value as mean ± std over that scheme's files (its
seeds), the controls averaged over them, and a fourth, mismatched heads.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MEASURES = ("qk_cos", "kv_cos", "symmetry", "trace_ratio", "effective_rank", "kv_rank_err")
HEADER = ("qk_cos", "kv_cos", "symmetry", "trace ratio", "eff. rank of W^Q W^K^T", "kv_rank_err")
TIED = 1e-9  # a std over heads and layers this small, at 1.0: the tie fixes the measure


def _fixed(a: dict, key: str) -> bool:
    return abs((a["mean"].get(key) or 0.0) - 1.0) < TIED and (a["mean"].get(f"{key}_std") or 0.0) < TIED


def _label(a: dict) -> str:
    """``'<run> step N (scheme)'`` -> the scaling ladder's variant where the run is one of its runs (``gqa``,
    ``bilinear_params``: two variants of one scheme must not be read as seeds of one row), else ``scheme``; with
    ``K=k`` where the keys have fewer heads than the queries."""
    source = a["source"]
    scheme = source.rsplit("(", 1)[-1].rstrip(")") if source.endswith(")") else source
    name = m["variant"] if (m := LADDER_RUN.match(source)) else scheme
    return name + (f" (K={a['num_kv_heads']})" if a.get("num_kv_heads", 0) < a.get("num_heads", 0) else "")


def _cell(group: list[dict], key: str, controls: tuple[str, ...] = ("initial", "random")) -> str:
    """One measure of one scheme over its files (one, or its seeds): the trained mean over heads and layers (as
    mean ± std over the files where there are several), then each control averaged over the files: the run's own
    W_0, the Gaussian draw, and where asked the mismatched heads (head n's Q against head n+1's K and V, where a
    subspace all heads share shows up without any per-head alignment)."""
    a = group[0]
    if a["mean"].get(key) is None:
        return "—"
    if all(_fixed(g, key) for g in group):
        return "(1)"
    fmt = "{:.1f}" if key == "effective_rank" else "{:.3f}"
    trained = [g["mean"][key] for g in group]
    spread = "" if len(trained) < 2 else " ± " + fmt.format(statistics.stdev(trained))
    cells = [fmt.format(statistics.fmean(trained)) + spread]
    for control in controls:
        values = [(g.get(control) or {}).get(key) for g in group]
        if control == "random" and key == "kv_rank_err" and _fixed(a, "kv_cos"):
            values = [None]  # the Gaussian control draws W^K and W^V apart; the run's own W_0 is the control of K = V
        cells.append("—" if None in values else fmt.format(statistics.fmean(values)))
    text = " / ".join(cells)
    return f"{text} (of {a['max_rank']})" if key == "effective_rank" else text


def _drift_values(a: dict) -> list[float]:
    """The drift of every attention input kernel in every layer (``w_o`` left out)."""
    return [v for layer in a.get("drift") or [] for k, v in layer.items() if k not in ("layer", "w_o")]


def _decay_alone(a: dict) -> str:
    decay = a.get("drift_decay_only")
    return "" if not decay else f"; decay alone {decay['drift']:.2f}"


def _drift(a: dict) -> str:
    values = _drift_values(a)
    if not values:
        return "—"
    return f"{statistics.fmean(values):.2f} ({min(values):.2f}-{max(values):.2f}){_decay_alone(a)}"


LADDER_RUN = re.compile(r"^\w+-d(?P<size>\d+)-(?P<variant>\w+)-lr(?P<lr>[\d.e-]+)-seed(?P<seed>\d+) step (?P<step>\d+)")


def ladder_decay_only(source: str) -> dict | None:
    """The decay-alone control of a scaling-ladder run named in ``source`` (None if it is not one): its
    optimizer rebuilt by ``experiments/ladder.py`` from the size, the rate and the step reached."""
    from experiments.ladder import BATCH, CONTEXT, size_config
    from qkvjax.config import DataConfig
    from qkvjax.sources import decay_only_drift

    m = LADDER_RUN.match(source)
    if not m:
        return None
    step = int(m["step"])
    tokens = step * BATCH * CONTEXT  # size_config's step count back: ceil(tokens / (BATCH * CONTEXT))
    cfg = size_config(int(m["size"]), m["variant"], float(m["lr"]), int(m["seed"]), tokens, DataConfig())
    return decay_only_drift(cfg.train, step)


def table(analyses: list[dict]) -> str:
    lines = ["| scheme | drift | " + " | ".join(HEADER) + " |", "|---|---|" + "---|" * len(HEADER)]
    for a in analyses:
        lines.append(f"| {_label(a)} | {_drift(a)} | " + " | ".join(_cell([a], k) for k in MEASURES) + " |")
    return "\n".join(lines)


def _seed_drift(group: list[dict]) -> str:
    """The drift over kernels and layers (``w_o`` left out), mean ± std over the seeds, and weight decay's alone."""
    means = [statistics.fmean(values) for g in group if (values := _drift_values(g))]
    if not means:
        return "—"
    spread = "" if len(means) < 2 else f" ± {statistics.stdev(means):.2f}"
    return f"{statistics.fmean(means):.2f}{spread}{_decay_alone(group[0])}"


def seed_table(analyses: list[dict]) -> str:
    """One row per scheme over the files given for it (its seeds), in the order schemes first appear."""
    groups: dict[str, list[dict]] = {}
    for a in analyses:
        groups.setdefault(_label(a), []).append(a)
    lines = ["| scheme | seeds | drift | " + " | ".join(HEADER) + " |", "|---|---|---|" + "---|" * len(HEADER)]
    for label, group in groups.items():
        cells = " | ".join(_cell(group, k, ("initial", "random", "mismatched")) for k in MEASURES)
        lines.append(f"| {label} | {len(group)} | {_seed_drift(group)} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="files written by qkvjax analyze --json")
    p.add_argument("--ladder", action="store_true", help="files of experiments/scaling.py runs: the decay-alone "
                   "control from each run's name where the file lacks it")  # fmt: skip
    p.add_argument("--over-seeds", action="store_true", help="one row per scheme: each trained measure as mean ± "
                   "std over its files (seeds), then the controls: initial / random / mismatched heads")  # fmt: skip
    args = p.parse_args(argv)
    analyses = []
    for name in args.json:
        try:
            analyses.append(json.loads(Path(name).read_text()))
        except (OSError, ValueError) as e:
            print(f"analyze_table: error: {name}: {e}; allowed: a qkvjax analyze --json file", file=sys.stderr)
            return 2
        if "mean" not in analyses[-1] or "source" not in analyses[-1]:
            print(f"analyze_table: error: {name} has no 'mean'/'source'; allowed: a qkvjax analyze --json file",
                  file=sys.stderr)  # fmt: skip
            return 2
        if args.ladder and "drift_decay_only" not in analyses[-1]:
            analyses[-1]["drift_decay_only"] = ladder_decay_only(analyses[-1]["source"])
    print(seed_table(analyses) if args.over_seeds else table(analyses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
