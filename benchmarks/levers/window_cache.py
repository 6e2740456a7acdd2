"""Decoding sliding-window layers from a ring of their last W tokens (``DecodeCache.empty``'s default for them)
against a cache of every position with the window as a mask (what it held before): the cache's bytes and
decode tokens/s at a long context, and the same greedy tokens from both.

A model of ``--layers`` layers, every one windowed (W = ``--window``), prefills ``--prompt`` random tokens per
row, then makes ``--tokens`` greedy tokens on the device (``lax.scan``, as ``qkvjax sample`` does). The two caches
are timed in turns (``--rounds``, each the median of 3), compiled first; the ratio is ring over full. Run:

    python benchmarks/levers/window_cache.py [--batches 1,8] [--json benchmarks/results/window_cache_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from qkvjax import AttentionConfig, DecoderLM, ModelConfig
from qkvjax.models.lm import DecodeCache


def model_config(args) -> ModelConfig:
    att = AttentionConfig(num_heads=4, head_dim=32, rope=True, sliding_window=args.window)
    return ModelConfig(attention=att, vocab_size=256, d_model=128, num_layers=args.layers, max_len=args.max_len,
                       learned_positions=False)  # fmt: skip


def caches(cfg: ModelConfig, batch: int) -> dict[str, DecodeCache]:
    """The ring (W slots per windowed layer) and a cache of every position (no rings: the window is a mask)."""
    unwindowed = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, sliding_window=None))
    every = DecodeCache.empty(unwindowed, batch)
    return {"ring": DecodeCache.empty(cfg, batch), "full": every}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=1536, help="prompt tokens per row before decoding")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens timed per generation")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = model_config(args)
    model = DecoderLM(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]

    @functools.partial(jax.jit, donate_argnums=0)
    def prefill(cache, tokens):
        logits, cache = model.apply({"params": params}, tokens, cache=cache)
        return cache, jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)

    @jax.jit  # returns the tokens only: the cache it reads is not donated
    def generate(cache, tok):
        def body(carry, _):
            cache, tok = carry
            logits, cache = model.apply({"params": params}, tok, cache=cache)
            tok = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
            return (cache, tok), tok[:, 0]

        (_, _), out = jax.lax.scan(body, (cache, tok), None, length=args.tokens)
        return out.T

    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        prompt = jax.random.randint(jax.random.key(b), (b, args.prompt), 0, cfg.vocab_size, jnp.int32)
        nbytes = {name: c.nbytes for name, c in caches(cfg, b).items()}
        started = {name: prefill(c, prompt) for name, c in caches(cfg, b).items()}  # compiles both
        made = {name: np.asarray(generate(*s)) for name, s in started.items()}  # compiles both
        assert (made["ring"] == made["full"]).all(), "the ring and the full cache generate different tokens"
        times: dict[str, list[float]] = {"ring": [], "full": []}
        for _ in range(args.rounds):
            for name in times:
                runs = []
                for _ in range(3):
                    cache, tok = prefill(caches(cfg, b)[name], prompt)
                    jax.block_until_ready(cache)
                    start = time.perf_counter()
                    jax.block_until_ready(generate(cache, tok))
                    runs.append(time.perf_counter() - start)
                times[name].append(statistics.median(runs))
        tps = {name: b * args.tokens / statistics.median(t) for name, t in times.items()}
        rows.append({"batch": b, "bytes_ring": nbytes["ring"], "bytes_full": nbytes["full"], "tok_s_ring": tps["ring"],
                     "tok_s_full": tps["full"], "speed_ratio": tps["ring"] / tps["full"]})  # fmt: skip
    print(f"{args.layers} layers, all windowed W={args.window}, max_len {args.max_len}, prompt {args.prompt}, "
          f"{args.tokens} greedy tokens on the device; same tokens from both caches")  # fmt: skip
    print(f"{'batch':>5} {'cache ring':>12} {'cache full':>12} {'bytes':>7} {'tok/s ring':>11} {'tok/s full':>11} "
          f"{'ratio':>6}")  # fmt: skip
    for r in rows:
        share = r["bytes_ring"] / r["bytes_full"]
        print(f"{r['batch']:>5} {r['bytes_ring']:>12,} {r['bytes_full']:>12,} {share:>7.3f} "
              f"{r['tok_s_ring']:>11,.0f} {r['tok_s_full']:>11,.0f} {r['speed_ratio']:>6.2f}")  # fmt: skip
    if args.json:
        meta = {"machine": platform.node(), "processor": platform.processor(), "device": str(jax.devices()[0]),
                "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
