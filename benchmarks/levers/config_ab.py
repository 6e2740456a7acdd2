"""A lever that a config can state, timed at the model level: the train step of a base config and of each variant
(config overrides), in turns, medians and ratios against the base; plus each one's training loss after the same
steps on the same batch from the same seed, so a lever that changes the numbers says by how much.

    python benchmarks/levers/config_ab.py --config experiments/configs/scaling_middle.py \
        --variant "bf16=model.attention.dtype=bfloat16" --steps 30 --json benchmarks/results/lever_bf16_cpu.json

Each ``--variant NAME=KEY=VALUE;KEY=VALUE`` is a set of ``--config.KEY=VALUE`` overrides of the base. Run it on a
quiet machine: the figures are ratios measured in one process, steps of all variants taken in turns
(``bench.alternate``), so drift in the machine's speed hits every variant alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from qkvjax.config import apply_overrides  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402


def _variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition("=")
    overrides = {}
    for item in filter(None, (x.strip() for x in rest.split(";"))):
        key, eq, value = item.partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"--variant {text!r}; allowed: NAME=KEY=VALUE;KEY=VALUE")
        overrides[key.strip()] = value.strip()
    return name, overrides


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/scaling_middle.py"))
    p.add_argument("--variant", type=_variant, action="append", required=True, metavar="NAME=KEY=VALUE;...")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (in turns)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        base = bench.timing_config(args.config)
        configs = {"base": base} | {name: apply_overrides(base, o) for name, o in args.variant}
    except ValueError as e:
        p.error(str(e))
    runners = {name: bench.prepare_train(DecoderLM(c.model), c) for name, c in configs.items()}
    times = bench.alternate({name: r["step"] for name, r in runners.items()}, args.steps)
    ref = statistics.median(times["base"])
    rows = []
    for name, r in runners.items():
        median = statistics.median(times[name])
        loss = r["last_loss"]()
        rows.append({"variant": name, "overrides": dict(args.variant).get(name, {}), "ms_per_step": median * 1e3,
                     "tokens_per_s": r["tokens"] / median, "x_base": ref / median, "loss_after": loss,
                     "spread": (max(times[name]) - min(times[name])) / median})  # fmt: skip
        print(f"{name:14s} {median * 1e3:8.1f} ms/step {rows[-1]['tokens_per_s']:>9,.0f} tok/s  "
              f"x{ref / median:.3f} base  loss after {loss:.5f}", flush=True)  # fmt: skip
    bench.write_rows(args.json, "config_ab.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
