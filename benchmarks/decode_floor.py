"""Decoding against its bytes floor, before and after the weights are cast once (issue 98, item 4, the CPU's part).

A decode step at batch B must read every weight once and the cache filled so far: at least (weight bytes as stored
+ B x filled positions x cache bytes per token) / read bandwidth. "As stored" is what the step reads: the
parameters in their own dtype (float32) when the step casts them itself at every token (before:
``generate_batch`` until 2026-12-07), or in the compute dtype when they are cast once before the loop (after:
:func:`qkvjax.sample.compute_params`, what ``qkvjax sample`` does). For each, the compiled one-token step's
kernels per layer (the entry computation's fusions, products, copies and conditionals over the layers; on a GPU
each is a kernel launch) and its tokens/s (one jitted step per token, the cache donated, as ``qkvjax sample``'s
streamed loop), the two timed in alternating rounds, medians; the floor at the read bandwidth measured in the same
run (a jitted sum over 256 MiB).

    python benchmarks/decode_floor.py [--config experiments/configs/shakespeare_char.py]
        [--set model.attention.dtype=bfloat16] [--batches 1,8] [--tokens 64] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # run as a script: make the repository (or this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_decode  # noqa: E402
from decode_roofline import read_bandwidth  # noqa: E402

from qkvjax.config import apply_overrides, load_config_file  # noqa: E402
from qkvjax.models.lm import DecodeCache, DecoderLM, kv_cache_bytes_per_token  # noqa: E402
from qkvjax.sample import compute_params  # noqa: E402
from qkvjax.train.state import create_state, make_optimizer  # noqa: E402

KERNELS = ("fusion", "dot", "copy", "conditional", "custom-call", "convert", "dynamic-update-slice")


def make_step(model: DecoderLM):
    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, tok):  # one greedy token per row
        logits, cache = model.apply({"params": params}, tok, cache=cache)
        return cache, jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)

    return step


def kernel_counts(step, params, cache, tok) -> dict[str, int]:
    """The compiled step's entry-computation instructions that run as kernels, by kind."""
    text = step.lower(params, cache, tok).compile().as_text()
    entry = text[text.index("ENTRY") :]
    ops = collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", entry))
    return {k: ops[k] for k in KERNELS if ops[k]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/configs/shakespeare_char.py")
    p.add_argument("--set", action="append", default=[],
                   help="KEY=VALUE config override, e.g. model.attention.dtype=bfloat16")  # fmt: skip
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per timed generation")
    p.add_argument("--rounds", type=int, default=5, help="alternating before/after rounds")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}; allowed: comma-separated positive integers, e.g. 1,8")
    if min(batches) < 1 or args.tokens < 1 or args.rounds < 1:
        p.error(f"--batches {args.batches} --tokens {args.tokens} --rounds {args.rounds}; allowed: positive integers")
    overrides = {"model.dropout_rate": "0.0"}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}; allowed: KEY=VALUE")
        overrides[key] = value
    cfg = apply_overrides(load_config_file(args.config), overrides)
    model = DecoderLM(cfg.model)
    raw = create_state(model, cfg, make_optimizer(cfg.train), None).params
    variants = {"before": raw, "after": compute_params(model, raw)}  # the step casts per token / reads them cast
    n = min(args.tokens, cfg.model.max_len - 1)
    layers = cfg.model.num_layers
    cache_per_token = kv_cache_bytes_per_token(cfg.model)
    bandwidth = read_bandwidth()
    device = jax.devices()[0]
    weight_bytes = {k: sum(x.nbytes for x in jax.tree.leaves(v)) for k, v in variants.items()}
    mib = {k: v / 2**20 for k, v in weight_bytes.items()}
    print(f"device: {device.device_kind} ({device.platform}) | config {args.config} {' '.join(args.set)} | compute "
          f"{cfg.model.dtype}, params {cfg.model.param_dtype} | weights as stored: before {mib['before']:.1f} MiB, "
          f"after {mib['after']:.1f} MiB | read bandwidth {bandwidth / 1e9:.1f} GB/s | {n} tokens | "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)  # fmt: skip
    step = make_step(model)
    kernels = {  # per batch: XLA compiles each batch size on its own (a batch-1 product is another kernel)
        (b, name): kernel_counts(step, params, DecodeCache.empty(cfg.model, b), jnp.zeros((b, 1), jnp.int32))
        for b in batches
        for name, params in variants.items()
    }
    print(f"{'batch':>5} {'variant':>7} {'kernels/layer':>13} {'tok/s':>9} {'ms/token':>8} {'floor ms':>8} "
          f"{'of floor':>8} {'after/before':>12}")  # fmt: skip
    rows = []
    for b in batches:
        speeds = {name: [] for name in variants}
        for _ in range(args.rounds):  # alternate, so the machine's drift hits both alike
            for name, params in variants.items():
                speeds[name].append(bench_decode(model, params, cfg, b, n))  # the cache donated, median of 3
        filled = (n + 1) / 2  # positions in the cache, averaged over the run
        for name in variants:
            tps = statistics.median(speeds[name])
            step_s = b / tps
            floor_s = (weight_bytes[name] + b * filled * cache_per_token) / bandwidth
            row = {
                "batch": b, "variant": name, "kernels": kernels[b, name],
                "kernels_per_layer": sum(kernels[b, name].values()) / layers, "tokens_per_s": tps,
                "tokens_per_s_rounds": speeds[name], "ms_per_step": 1e3 * step_s, "floor_ms": 1e3 * floor_s,
                "of_floor": floor_s / step_s,
                "after_over_before": tps / statistics.median(speeds["before"]),
            }  # fmt: skip
            rows.append(row)
            print(f"{b:>5} {name:>7} {row['kernels_per_layer']:>13.1f} {tps:>9,.0f} {row['ms_per_step']:>8.2f} "
                  f"{row['floor_ms']:>8.2f} {100 * row['of_floor']:>7.1f}% {row['after_over_before']:>11.2f}x",
                  flush=True)  # fmt: skip
    for (b, name), counts in kernels.items():
        print(f"batch {b}, {name}: {counts} over {layers} layers")
    if args.json:
        meta = {
            "command": "python " + " ".join(["benchmarks/decode_floor.py", *(argv or sys.argv[1:])]),
            "device": f"{device.device_kind} ({device.platform})",
            "date": time.strftime("%Y-%m-%dT%H:%M"),
            "read_bandwidth_bytes_per_s": bandwidth,
            "weight_bytes": weight_bytes,
            "kv_cache_bytes_per_token": cache_per_token,
            "new_tokens": n,
            "layers": layers,
        }
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
