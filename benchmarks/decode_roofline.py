"""How fast cached decoding could be at all on this machine: measured decode steps against a roofline bound.

Each decode step (one new token per row) must read every weight once and the cache filled so far, and do about
2 x params x B FLOPs. Its time is at least max(bytes / read bandwidth, FLOPs / matmul peak), whatever loop drives
it; both rates are measured in the same run (a jitted sum over a 256 MiB float32 array, and the large ``jnp.dot``
of ``bench.py``'s MFU). The table gives the host loop (one jitted step per token) and the on-device loop
(``lax.scan`` over all tokens in one call), both reading the cache only as far as it is filled
(``core.within_prefix``), and the host loop reading the whole cache every step (``causal_block=0``, the decoder
before the prefixes), timed alternately, and the largest speedup any decoder could still have over the host loop:
host step time over the bound.

    python benchmarks/decode_roofline.py [--config experiments/configs/shakespeare_char.py] [--batches 1,8]

The bound is generous to a faster decoder: it counts the cache only up to the positions filled (the average over
the run), no activation traffic, and the best of ``--repeats`` bandwidth samples.
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
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import bench_decode, bench_decode_on_device  # noqa: E402

from qkvjax.config import apply_overrides, load_config_file  # noqa: E402
from qkvjax.models.lm import DecoderLM, kv_cache_bytes_per_token  # noqa: E402
from qkvjax.perf import measure_peak_flops  # noqa: E402
from qkvjax.train.state import create_state, make_optimizer  # noqa: E402


def read_bandwidth(mib: int = 256, repeats: int = 10) -> float:
    """Bytes/s of a jitted float32 sum over ``mib`` MiB (far beyond the caches), best of ``repeats``."""
    x = jnp.ones((mib * (1 << 20) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/configs/shakespeare_char.py")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per timed generation")
    p.add_argument("--rounds", type=int, default=5, help="alternating host/device rounds (each a median of 3)")
    p.add_argument("--repeats", type=int, default=10, help="samples of the bandwidth and peak")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}; allowed: comma-separated positive integers, e.g. 1,8")
    if min(batches) < 1 or args.tokens < 1 or args.rounds < 1:
        p.error("--batches, --tokens and --rounds must be positive")

    cfg = apply_overrides(load_config_file(args.config), {"model.dropout_rate": "0.0"})
    model = DecoderLM(cfg.model)
    whole = DecoderLM(apply_overrides(cfg, {"model.attention.causal_block": "0"}).model)  # reads every slot
    params = create_state(model, cfg, make_optimizer(cfg.train), None).params
    n_tokens = min(args.tokens, cfg.model.max_len)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    param_count = sum(x.size for x in jax.tree.leaves(params))
    cache_per_token = kv_cache_bytes_per_token(cfg.model)
    itemsize = jnp.dtype(cfg.model.attention.dtype).itemsize
    bandwidth = read_bandwidth(repeats=args.repeats)
    peak = measure_peak_flops(cfg.model.attention.dtype, repeats=args.repeats)
    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({device.platform}) | config {args.config} | params {param_count:,} "
        f"({param_bytes / 2**20:.1f} MiB) | read bandwidth {bandwidth / 1e9:.1f} GB/s | peak matmul "
        f"{peak / 1e9:.1f} GFLOP/s | {n_tokens} new tokens | {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    header = (
        f"{'batch':>5} {'whole-cache host ms':>19} {'host ms/step':>12} {'device ms/step':>14} {'dev/host':>8} "
        f"{'dev/whole':>9} {'bound ms':>8} {'bytes-bound':>11} {'FLOP-bound':>10} {'host/bound':>10}"
    )
    print(header)
    rows = []
    for b in batches:
        old, host, dev = [], [], []
        for _ in range(args.rounds):  # alternate, so drift in the machine's speed hits all alike
            old.append(b * n_tokens / bench_decode(whole, params, cfg, b, n_tokens))
            host.append(b * n_tokens / bench_decode(model, params, cfg, b, n_tokens))
            dev.append(b * n_tokens / bench_decode_on_device(model, params, cfg, b, n_tokens))
        old_s = statistics.median(old) / n_tokens  # per step
        host_s, dev_s = statistics.median(host) / n_tokens, statistics.median(dev) / n_tokens
        filled = (n_tokens + 1) / 2  # positions in the cache, averaged over the run
        bytes_step = param_bytes + b * filled * cache_per_token
        # 2 FLOPs per weight and row; 2 per cached value and row (q.k over keys, p.v over values; G = 1)
        flops_step = 2 * param_count * b + 2 * b * filled * cache_per_token / itemsize
        bytes_s, flops_s = bytes_step / bandwidth, flops_step / peak
        bound = max(bytes_s, flops_s)
        row = {
            "batch": b,
            "whole_cache_host_ms_per_step": 1e3 * old_s,
            "host_ms_per_step": 1e3 * host_s,
            "device_ms_per_step": 1e3 * dev_s,
            "device_speedup": host_s / dev_s,
            "device_speedup_over_whole_cache_host": old_s / dev_s,
            "bound_ms": 1e3 * bound,
            "bytes_bound_ms": 1e3 * bytes_s,
            "flop_bound_ms": 1e3 * flops_s,
            "max_speedup_over_host": host_s / bound,
        }
        rows.append(row)
        print(
            f"{b:>5} {row['whole_cache_host_ms_per_step']:>19.2f} {row['host_ms_per_step']:>12.2f} "
            f"{row['device_ms_per_step']:>14.2f} {row['device_speedup']:>7.2f}x "
            f"{row['device_speedup_over_whole_cache_host']:>8.2f}x {row['bound_ms']:>8.2f} "
            f"{row['bytes_bound_ms']:>11.2f} {row['flop_bound_ms']:>10.2f} {row['max_speedup_over_host']:>9.2f}x",
            flush=True,
        )
    if args.json:
        meta = {
            "command": "python " + " ".join(["benchmarks/decode_roofline.py", *(argv or sys.argv[1:])]),
            "device": f"{device.device_kind} ({device.platform})",
            "date": time.strftime("%Y-%m-%dT%H:%M"),
            "read_bandwidth_bytes_per_s": bandwidth,
            "peak_flops": peak,
            "param_bytes": param_bytes,
            "kv_cache_bytes_per_token": cache_per_token,
            "new_tokens": n_tokens,
        }
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
