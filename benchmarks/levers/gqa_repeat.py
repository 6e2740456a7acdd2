"""GQA's causal-blocks kernel two ways, the whole train step, timed in turns with ``separate`` in one process.

``folded`` (the library's ``kernels._blocks``): the G = N / K query heads that read one key/value head are
folded into its query rows (``core.fold_queries``, BTNH -> BKTGH -> (B, K, T G, H)), so each score matmul is
(T G, H) @ (H, S) per kv head and K/V are never copied. ``repeat`` (the lever): K and V copied to N heads first
(``jnp.repeat``, BSKH -> BSNH, head n reading kv head n // G), then the G = 1 path: more, smaller score matmuls
and the copy's gradient summed back over each group, but no fold/unfold transposes of the queries. This script
traces the gqa model once as the library has it and once with the blocks kernel replaced by the repeat form
(nothing in the library changes), checks both give the same loss, and times separate / folded / repeat in turns.

    python benchmarks/levers/gqa_repeat.py --sizes 48,96,160 --steps 30 --json benchmarks/results/gqa_repeat_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from experiments.ladder import DEFAULT_SIZES, size_config  # noqa: E402
from qkvjax.attention import core, kernels  # noqa: E402
from qkvjax.config import DataConfig  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402


def _repeat_blocks(a: kernels.Inputs):
    """The blocks kernel with K/V copied to every query head (G = 1 inside)."""
    k, v = a.slots.read(a.slots.length)
    k, v = jnp.repeat(k, a.group_size, axis=2), jnp.repeat(v, a.group_size, axis=2)  # BSKH -> BSNH
    kt = k.transpose(0, 2, 1, 3)  # BSNH -> BNSH once, sliced per block
    q = a.queries.q
    logits_of = lambda lo, hi: core.qk_logits(q[:, lo:hi], kt[:, :, :hi], "BKSH")  # noqa: E731
    return core.causal_attention(logits_of, v, a.how.causal_block)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="d_model of each size")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (in turns)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    original = kernels.KERNELS
    rows = []
    for size in [int(x) for x in args.sizes.split(",")]:
        configs = {
            v: size_config(size, v, 4e-3, 0, 1, DataConfig(dataset="tiny_shakespeare")) for v in ("separate", "gqa")
        }
        runs = {"separate": bench.prepare_train(DecoderLM(configs["separate"].model), configs["separate"])}
        runs["folded"] = bench.prepare_train(DecoderLM(configs["gqa"].model), configs["gqa"])
        repeat = tuple(kernels.Kernel(k.name, k.applies, _repeat_blocks) if k.name == "blocks" else k for k in original)
        with bench.replaced(kernels, "KERNELS", repeat):  # traced and compiled here, with the replaced kernel
            runs["repeat"] = bench.prepare_train(DecoderLM(configs["gqa"].model), configs["gqa"])
        times = bench.alternate({v: r["step"] for v, r in runs.items()}, args.steps)
        losses = {v: r["last_loss"]() for v, r in runs.items()}
        if abs(losses["folded"] - losses["repeat"]) > 1e-4 * abs(losses["folded"]):
            raise SystemExit(f"d{size}: the two gqa forms disagree: {losses}")
        ref = statistics.median(times["separate"])
        for v, t in times.items():
            m = statistics.median(t)
            row = {"size": size, "variant": v, "tokens_per_s": runs[v]["tokens"] / m, "x_separate": ref / m}
            rows.append(row)
            print(
                f"d{size:<4d} {v:9s} {row['tokens_per_s']:>9,.0f} tok/s  x{row['x_separate']:.3f} separate", flush=True
            )
    bench.write_rows(args.json, "gqa_repeat.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
