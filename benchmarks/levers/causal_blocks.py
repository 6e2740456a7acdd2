"""Causal attention without the scores above the diagonal (``AttentionConfig.causal_block``), against the full
masked square, at the attention core and at the train step, timed alternately in one process (medians).

    python benchmarks/levers/causal_blocks.py                                  # shakespeare_char, contexts 256 and 1024
    python benchmarks/levers/causal_blocks.py --config experiments/configs/compare_cpu.py --batch-size 12 --contexts 64

Core: forward + backward of the attention core alone (q, k, v (B, T, N, H) in, the output's cotangent in,
three gradients out) for each block size and the full square (``causal_block=0``). Step: the LM's jitted train
step with the default block against ``causal_block=0``; the ratio is tokens/s over the full square's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # run as a script: make the repository (or this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import alternate, prepare_train, timing_config  # noqa: E402

from qkvjax.attention import core  # noqa: E402
from qkvjax.config import load_config_file  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402


def full_square(q, k, v):
    t = q.shape[1]
    idx = jnp.arange(t)[None]
    mask = core.grouped(core.causal_mask(idx, idx), k.shape[2], q.shape[2] // k.shape[2])
    return core.mix_values(core.softmax_weights(core.qk_logits(q, k), mask), v, t)


def core_runner(b: int, t: int, n: int, kv: int, h: int, block: int):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h))
    k, v = (jax.random.normal(key, (b, t, kv, h)) for key in keys[1:3])
    dout = jax.random.normal(keys[3], (b, t, n, h))
    fn = full_square if block == 0 else (lambda q, k, v: core.causal_attention(core.block_logits(q, k), v, block))
    grads = jax.jit(lambda q, k, v, d: jax.vjp(fn, q, k, v)[1](d)).lower(q, k, v, dout).compile()
    jax.block_until_ready(grads(q, k, v, dout))

    def one() -> float:
        start = time.perf_counter()
        jax.block_until_ready(grads(q, k, v, dout))
        return time.perf_counter() - start

    return one


def medians(runners: dict, rounds: int) -> dict:
    return {name: statistics.median(ts) for name, ts in alternate(runners, rounds).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/configs/shakespeare_char.py")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--contexts", default="256,1024", help="comma-separated context lengths T")
    p.add_argument("--blocks", default="32,64,128", help="block sizes for the core timings")
    p.add_argument("--core-rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=8, help="timed train steps per variant, alternated")
    p.add_argument("--step-block", type=int, default=None, help="the block for the train step (default: the config's)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    att = load_config_file(args.config).model.attention
    rows = []
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {args.config} batch {args.batch_size} | {jax.devices()[0].device_kind}")
    for t in [int(x) for x in args.contexts.split(",")]:
        b = args.batch_size
        blocks = [c for c in (int(x) for x in args.blocks.split(",")) if 2 * c <= t]
        core_t = medians(
            {c: core_runner(b, t, att.num_heads, att.kv_heads, att.head_dim, c) for c in [0, *blocks]},
            args.core_rounds,
        )
        for c in blocks:
            speedup = core_t[0] / core_t[c]
            print(
                f"  T={t:5d} core fwd+bwd: full {1e3 * core_t[0]:8.2f} ms, blocks of {c:4d} {1e3 * core_t[c]:8.2f} ms"
                f"  x{speedup:.2f}"
            )
            rows.append(
                {
                    "what": "core",
                    "T": t,
                    "B": b,
                    "block": c,
                    "full_ms": 1e3 * core_t[0],
                    "blocked_ms": 1e3 * core_t[c],
                    "speedup": speedup,
                }
            )
        step_block = args.step_block or att.causal_block
        if 2 * step_block > t:
            continue
        runners = {}
        for c in (step_block, 0):
            cfg = timing_config(args.config, b, {"model.max_len": str(t), "model.attention.causal_block": str(c)})
            runners[c] = prepare_train(DecoderLM(cfg.model), cfg)
        step_t = medians({c: r["step"] for c, r in runners.items()}, args.steps)
        tokens = runners[0]["tokens"]
        speedup = step_t[0] / step_t[step_block]
        mem = {c: r["xla_memory_bytes"] for c, r in runners.items()}
        print(
            f"  T={t:5d} train step: full {tokens / step_t[0]:9,.0f} tok/s, blocks of {step_block} "
            f"{tokens / step_t[step_block]:9,.0f} tok/s  x{speedup:.2f}; XLA memory plan "
            f"{mem[0] / 2**20:,.0f} -> {mem[step_block] / 2**20:,.0f} MiB"
        )
        rows.append(
            {
                "what": "train_step",
                "T": t,
                "B": b,
                "block": step_block,
                "full_tok_s": tokens / step_t[0],
                "blocked_tok_s": tokens / step_t[step_block],
                "speedup": speedup,
                "full_mem": mem[0],
                "blocked_mem": mem[step_block],
            }
        )
    if args.json:
        meta = {"config": args.config, "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M")}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
