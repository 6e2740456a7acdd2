"""Decoding a K = V layer with rotary keys: cache the one tensor and rotate keys on every read (qkvjax's way, which
keeps the halved cache), or cache rotated keys and plain values separately (twice the cache, no rotation per step)?

Times one attention decode step (one new query against a full cache of S positions; scores, softmax, mixing, plus
the rotation of all S keys in the first layout) for both layouts, alternately, and prints the ratio. Run:

    python benchmarks/levers/rope_cache.py [--json benchmarks/results/rope_cache_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from qkvjax.attention import core


def steps(b: int, n: int, s: int, h: int):
    """The two decode steps, jitted, and their inputs: q (B, 1, N, H); caches (B, N, S, H)."""
    key = jax.random.key(0)
    q = jax.random.normal(key, (b, 1, n, h))
    kv = jax.random.normal(jax.random.fold_in(key, 1), (b, n, s, h))
    pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    k_rot = core.rotary(kv, pos, 10000.0, seq_axis=2)
    q_pos = jnp.full((b, 1), s - 1)

    @jax.jit
    def rotate_on_read(q, kv):
        qr = core.rotary(q, q_pos, 10000.0)
        k = core.rotary(kv, pos, 10000.0, seq_axis=2)
        w = core.softmax_weights(core.qk_logits(qr, k, "BKSH"), None)
        return core.mix_values(w, kv, 1, "BKSH")

    @jax.jit
    def rotated_cache(q, k, v):
        qr = core.rotary(q, q_pos, 10000.0)
        w = core.softmax_weights(core.qk_logits(qr, k, "BKSH"), None)
        return core.mix_values(w, v, 1, "BKSH")

    return (lambda: rotate_on_read(q, kv)), (lambda: rotated_cache(q, k_rot, kv))


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}) | {time.strftime('%Y-%m-%d')} | N=K={args.heads}, "
          f"H={args.head_dim}, float32; median of {args.repeats} alternating steps")  # fmt: skip
    print(f"{'B':>3} {'S':>6} {'rotate on read us':>18} {'rotated cache us':>17} {'x':>6} {'cache x':>8}")
    rows = []
    for b in (1, 8):
        for s in (256, 1024, 4096):
            a, c = steps(b, args.heads, s, args.head_dim)
            a(), c()  # compile
            ta, tc = [], []
            for _ in range(args.repeats):
                ta.append(timed(a))
                tc.append(timed(c))
            row = {"batch": b, "seq": s, "rotate_on_read_s": statistics.median(ta),
                   "rotated_cache_s": statistics.median(tc)}  # fmt: skip
            row["x"] = row["rotate_on_read_s"] / row["rotated_cache_s"]
            rows.append(row)
            print(f"{b:>3} {s:>6} {1e6 * row['rotate_on_read_s']:>18.1f} {1e6 * row['rotated_cache_s']:>17.1f} "
                  f"{row['x']:>6.2f} {2.0:>8.1f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": f"{device.device_kind} ({device.platform})", "date": time.strftime("%Y-%m-%d"),
                       "heads": args.heads, "head_dim": args.head_dim, "rows": rows}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
