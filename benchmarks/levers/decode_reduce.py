"""Decoding's scores and value mix as multiply-reduce loops instead of matmuls, on-device generation timed in turns
with the library's form.

At batch 8 the decode step copies the cache prefix it reads (``core.within_prefix``: a slice of the (B, K, S, H)
cache, strided across rows, which a ``dot`` cannot read in place). Written as broadcast multiply + sum over H
(scores) and over S (mix), the slice could fuse into the loop that reads it, so the cache is read once and never
copied. This script traces the on-device decoder (``bench.bench_decode_on_device``, 64 new tokens) once as the
library has it and once with ``core.qk_logits`` / ``core.mix_values`` replaced for one-query cache reads (nothing
in the library changes), in turns for ``--rounds`` rounds.

    python benchmarks/levers/decode_reduce.py --config experiments/configs/shakespeare_char.py --batches 1,8 --rounds 3
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from qkvjax.attention import core  # noqa: E402
from qkvjax.config import apply_overrides, load_config_file  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402
from qkvjax.train.state import create_state, make_optimizer  # noqa: E402

QK, MIX = core.qk_logits, core.mix_values


def qk_reduce(q, k, kv_layout="BSKH"):
    """Scores of one query per row against a cache (BKSH) as a multiply-reduce over H; else the library's."""
    if kv_layout != "BKSH" or q.shape[1] > 1:
        return QK(q, k, kv_layout)
    qf = core.fold_queries(q / math.sqrt(q.shape[-1]), k.shape[1])  # (B, K, G, H)
    return jnp.sum(qf[:, :, :, None, :] * k[:, :, None, :, :], -1)  # BKGH x BKSH -> BKGS


def mix_reduce(weights, v, t, kv_layout="BSKH"):
    """Values mixed for one query per row from a cache (BKSH) as a multiply-reduce over S; else the library's."""
    if kv_layout != "BKSH" or t > 1:
        return MIX(weights, v, t, kv_layout)
    return core.unfold_queries(jnp.sum(weights.astype(v.dtype)[..., None] * v[:, :, None, :, :], axis=3), t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/shakespeare_char.py"))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = apply_overrides(load_config_file(args.config), {"model.dropout_rate": "0.0"})
    model = DecoderLM(cfg.model)
    params = create_state(model, cfg, make_optimizer(cfg.train), None).params
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        lib, red = [], []
        for _ in range(args.rounds):
            lib.append(bench.bench_decode_on_device(model, params, cfg, b, 64))
            with bench.replaced(core, "qk_logits", qk_reduce), bench.replaced(core, "mix_values", mix_reduce):
                red.append(bench.bench_decode_on_device(model, params, cfg, b, 64))  # traced with the replacements
        row = {"config": args.config, "batch": b, "matmul_tokens_per_s": statistics.median(lib),
               "reduce_tokens_per_s": statistics.median(red)}  # fmt: skip
        row["x_matmul"] = row["reduce_tokens_per_s"] / row["matmul_tokens_per_s"]
        rows.append(row)
        print(f"batch {b}: matmul {row['matmul_tokens_per_s']:,.0f} tok/s, multiply-reduce "
              f"{row['reduce_tokens_per_s']:,.0f} tok/s: x{row['x_matmul']:.3f}", flush=True)  # fmt: skip
    bench.write_rows(args.json, "decode_reduce.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
