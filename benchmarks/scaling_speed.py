"""Tokens/s of every variant of the scaling protocol at each of its sizes, timed in turns within a size, against
``separate`` and against what the FLOP count predicts.

The models and batches are ``experiments/scaling.py``'s (``size_config``: 4 layers, 4 heads, context 128, batch
16); the train step is the library's (forward + backward + AdamW, jitted, state donated). Per size every
variant's step is timed in turns (a, b, c, a, b, c, ...: ``bench.alternate``), the median taken, and each
variant reported as its tokens/s, its speed x ``separate``'s, and the speed its training FLOPs per token predict
(``separate``'s FLOPs / its own). A variant slower than its FLOP ratio predicts spends time outside the matmuls
the count sees. Run it on a quiet machine (no sweep running): the figures are the sweep's speed, not a test.

    python benchmarks/scaling_speed.py --steps 30 --json benchmarks/results/scaling_speed_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from experiments.ladder import DEFAULT_SIZES, VARIANTS, size_config  # noqa: E402
from qkvjax.config import DataConfig  # noqa: E402
from qkvjax.models.lm import DecoderLM, train_flops_per_token  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="d_model of each size")
    p.add_argument("--variants", default=",".join(VARIANTS), help="experiments/scaling.py's VARIANTS")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (in turns)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r}; allowed: {','.join(VARIANTS)}")
    if "separate" not in variants:
        p.error("--variants must include separate (the reference of the ratios)")
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        configs = {v: size_config(size, v, 4e-3, 0, 1, DataConfig(dataset="tiny_shakespeare")) for v in variants}
        steps = {v: bench.prepare_train(DecoderLM(c.model), c) for v, c in configs.items()}
        times = bench.alternate({v: s["step"] for v, s in steps.items()}, args.steps)
        flops = {v: train_flops_per_token(c.model, c.seq_len) for v, c in configs.items()}
        ref = statistics.median(times["separate"])
        for v in variants:
            median = statistics.median(times[v])
            row = {
                "size": size,
                "variant": v,
                "tokens_per_s": steps[v]["tokens"] / median,
                "x_separate": ref / median,
                "flop_ratio_predicts": flops["separate"] / flops[v],
                "spread": (max(times[v]) - min(times[v])) / median,
            }
            rows.append(row)
            print(f"d{size:<4d} {v:12s} {row['tokens_per_s']:>9,.0f} tok/s  x{row['x_separate']:.3f} separate  "
                  f"(FLOPs predict x{row['flop_ratio_predicts']:.3f})", flush=True)  # fmt: skip
    bench.write_rows(args.json, "scaling_speed.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
