"""Projections as 2-D matmuls (``qkvjax.attention.core.dense``) against the same products as rank-3/4
``dot_general`` (what ``jnp.einsum("BTD,DNH->BTNH", ...)`` lowers to), the whole train step, interleaved in one
process: the model is traced once with ``core.dense`` replaced by ``jnp.tensordot`` (the einsum form) and once as
it is.

    python benchmarks/levers/dense_2d.py --config experiments/configs/compare_cpu.py --batch-size 12 --steps 40
    python benchmarks/levers/dense_2d.py --batch-size 8 --steps 10
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from qkvjax.attention import core  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/shakespeare_char.py"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = bench.timing_config(args.config, args.batch_size)
    two_d = core.dense
    core.dense = lambda x, w, contract=1: jnp.tensordot(x, w, axes=contract)  # the einsum form
    try:
        einsum = bench.prepare_train(DecoderLM(cfg.model), cfg)
    finally:
        core.dense = two_d
    dense = bench.prepare_train(DecoderLM(cfg.model), cfg)
    a, b = bench.interleaved(einsum["step"], dense["step"], args.steps)
    tokens = dense["tokens"]
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "config": args.config,
        "batch_size": args.batch_size,
        "einsum_tokens_per_s": tokens / a,
        "dense_2d_tokens_per_s": tokens / b,
        "ratio": a / b,
    }
    print(
        f"{args.config} batch {args.batch_size}: rank-n dot_general {tokens / a:,.0f} tok/s, 2-D matmuls "
        f"{tokens / b:,.0f} tok/s: x{a / b:.3f} (medians of {args.steps} steps, alternated)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
