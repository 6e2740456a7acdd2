"""Speed and memory of every tying scheme against a Flax baseline and the measured matmul peak, in one run.

For each scheme (on the preset's shapes): the jitted train step (forward + backward + AdamW) of the LM, next to
the same LM whose attention is ``flax.linen.MultiHeadDotProductAttention`` (same MLP, norms, embeddings);
model FLOPs utilisation against a large ``jnp.dot`` timed in the same run; cached decoding at batch 1 and a
larger batch; KV-cache bytes per token; XLA's memory plan for the train step.

    python benchmarks/bench.py --quick                      # a few minutes on a 2-core CPU
    python benchmarks/bench.py --config experiments/configs/gpt2_small.py --json results.json   # an accelerator

Timings are medians over repeated steps after compiling; compile time is reported on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

from qkvjax import SCHEMES, stack_cost
from qkvjax.attention import Attention, AttentionConfig
from qkvjax.attention.layers import example_layouts
from qkvjax.config import Config, apply_overrides, load_config_file
from qkvjax.models.lm import (
    DecodeCache,
    DecoderLM,
    kv_cache_bytes_per_token,
    mfu_flops_per_token,
    param_count,
    train_flops_per_token,
)
from qkvjax.perf import datasheet_peak, measure_peak_flops
from qkvjax.train.state import create_state, make_optimizer, uses_threefry_kernel
from qkvjax.train.step import make_train_step


class FlaxAttention(nn.Module):
    """The baseline: flax's own multi-head attention, called like ``qkvjax.Attention`` inside the same LM."""

    config: AttentionConfig

    @nn.compact
    def __call__(self, x, *, causal=False, positions=None, decode=False, deterministic=True):
        cfg = self.config
        mha = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            qkv_features=cfg.num_heads * cfg.head_dim,
            out_features=x.shape[-1],
            use_bias=cfg.use_bias,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            dropout_rate=cfg.dropout_rate,
            decode=decode,
        )
        mask = None if decode or not causal else nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        return mha(x, mask=mask, deterministic=deterministic)


CUDNN_ATTENTION = "__cudnn$fmha"  # the custom-call target of cuDNN's fused attention in a compiled GPU program


def prepare_train(model, config: Config) -> dict:
    """Compiles the train step (timed), runs one warm-up step; returns a zero-argument timed-step runner."""
    tx = make_optimizer(config.train)
    start = time.perf_counter()
    state = jax.block_until_ready(create_state(model, config, tx, None))
    init_s = time.perf_counter() - start  # its compile, mostly: the random draws
    b, t = config.train.batch_size, config.seq_len
    tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t + 1), 0, config.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    step = make_train_step(model, tx, config.train.grad_accum_steps, loss_chunk=config.train.loss_chunk)
    step_fn = jax.jit(step, donate_argnums=0)
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    start = time.perf_counter()
    holder = {"state": compiled(state, batch)[0]}
    jax.block_until_ready(holder["state"])
    warmup_s = time.perf_counter() - start

    def one_step() -> float:
        start = time.perf_counter()
        holder["state"], holder["metrics"] = compiled(holder["state"], batch)
        jax.block_until_ready(holder["metrics"]["loss"])
        return time.perf_counter() - start

    mem_bytes = None
    if memory is not None:
        mem_bytes = int(
            memory.temp_size_in_bytes
            + memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
        )
    return {"step": one_step, "tokens": b * t, "compile_s": compile_s, "init_s": init_s, "warmup_s": warmup_s,
            "init_threefry_kernel": uses_threefry_kernel(None),
            "xla_memory_bytes": mem_bytes, "cudnn_attention_calls": compiled.as_text().count(CUDNN_ATTENTION),
            "last_loss": lambda: float(holder["metrics"]["loss"])}  # fmt: skip


# What every train-step timing here runs with: no dropout (its masks are not what is measured), one micro-batch.
TIMING_OVERRIDES = {"model.dropout_rate": "0.0", "train.grad_accum_steps": "1"}


def timing_config(path: str, batch_size: int | None = None, overrides: dict | None = None) -> Config:
    """The config file at ``path`` with :data:`TIMING_OVERRIDES`, the batch size, and any ``overrides``."""
    over = dict(TIMING_OVERRIDES) | ({} if batch_size is None else {"train.batch_size": str(batch_size)})
    return apply_overrides(load_config_file(path), over | (overrides or {}))


def parse_set(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` arguments as config overrides; anything else is a one-line usage error."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}; allowed: KEY=VALUE, e.g. model.attention.chunk_size=64")
        overrides[key] = value
    return overrides


def write_rows(path: str | None, script: str, argv: list[str] | None, rows: list[dict]) -> None:
    """A benchmark's rows as JSON at ``path`` (if given), with the date, the machine and the command that made them."""
    if not path:
        return
    command = f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = f"{platform.node()} ({jax.devices()[0].device_kind}, {os.cpu_count()} cores)"
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine, "command": command, "rows": rows}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")


def decode_model(layers: int, d_model: int, max_len: int):
    """The decoding levers' model: ``layers`` layers of d_model, heads of 32 with a quarter as many K/V heads (GQA),
    rotary positions, byte vocabulary; random weights. Returns ``(model, params)``."""
    from qkvjax import ModelConfig

    heads = d_model // 32
    att = AttentionConfig(num_heads=heads, head_dim=32, num_kv_heads=max(1, heads // 4), rope=True)
    cfg = ModelConfig(attention=att, vocab_size=256, d_model=d_model, num_layers=layers, max_len=max_len,
                      learned_positions=False)  # fmt: skip
    model = DecoderLM(cfg)
    return model, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """``rows`` as a right-aligned table; ``columns``: (header, key, format spec) each, as wide as its widest cell."""
    cells = [[format(row[key], spec) for _, key, spec in columns] for row in rows]
    widths = [max([len(header)] + [len(c[i]) for c in cells]) for i, (header, _, _) in enumerate(columns)]
    for line in [[header for header, _, _ in columns], *cells]:
        print(" ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))


@contextlib.contextmanager
def replaced(obj, name: str, value):
    """``obj.name`` set to ``value`` inside the block, put back after it: a lever traced (and compiled) inside the
    block with one library function swapped, while the library itself stays as it is."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def alternate(runners: dict, rounds: int) -> dict[str, list[float]]:
    """Every runner's step times, timed in turns (a, b, c, b, c, a, c, a, b, ...), so that drift in the machine's
    speed (other load, clocks) hits all alike and their ratios stay honest. The order rotates each round: with a
    fixed order the runner timed last was seen 1-4% faster than the same step timed second (gqa_repeat.py)."""
    times = {name: [] for name in runners}
    names = list(runners)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(runners[name]())
    return times


def interleaved(a, b, steps: int) -> tuple[float, float]:
    """Median step times of two runners timed alternately (:func:`alternate`)."""
    times = alternate({"a": a, "b": b}, steps)
    return statistics.median(times["a"]), statistics.median(times["b"])


def bench_decode(model, params, config: Config, batch: int, new_tokens: int) -> float:
    """Tokens/s of greedy cached generation, one jitted step per token dispatched back to back: qkvjax's
    functional cache (:class:`DecodeCache`), or flax's ``decode=True`` cache for the flax baseline."""
    n = min(new_tokens, config.model.max_len)
    functional = model.attention_cls is Attention

    @functools.partial(jax.jit, donate_argnums=1)  # params passed in, as `qkvjax sample` does
    def step(params, cache, tok):
        if functional:
            logits, cache = model.apply({"params": params}, tok, cache=cache)
        else:
            logits, mutated = model.apply({"params": params, "cache": cache}, tok, decode=True, mutable=["cache"])
            cache = mutated["cache"]
        return cache, jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)

    def fresh_cache():
        if functional:
            return DecodeCache.empty(config.model, batch)
        zeros = jnp.zeros((batch, config.model.max_len), jnp.int32)
        return model.init(jax.random.PRNGKey(0), zeros, decode=True)["cache"]

    cache, tok = step(params, fresh_cache(), jnp.zeros((batch, 1), jnp.int32))  # compile
    jax.block_until_ready(tok)

    def run():
        cache, tok = fresh_cache(), jnp.zeros((batch, 1), jnp.int32)
        jax.block_until_ready(cache)
        start = time.perf_counter()
        for _ in range(n):
            cache, tok = step(params, cache, tok)
        jax.block_until_ready(tok)
        return time.perf_counter() - start

    return batch * n / statistics.median([run() for _ in range(3)])


def bench_decode_on_device(model, params, config: Config, batch: int, new_tokens: int) -> float:
    """Tokens/s of greedy cached generation with every token made on the device in one call (``lax.scan`` over
    the functional cache, as ``qkvjax sample`` does for a batch of prompts): no host round trip per token."""
    n = min(new_tokens, config.model.max_len)

    @functools.partial(jax.jit, donate_argnums=1)
    def run_all(params, cache, tok):
        def body(carry, _):
            cache, tok = carry
            logits, cache = model.apply({"params": params}, tok, cache=cache)
            tok = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
            return (cache, tok), None

        (cache, tok), _ = jax.lax.scan(body, (cache, tok), None, length=n)
        return cache, tok

    def run():
        cache, tok = DecodeCache.empty(config.model, batch), jnp.zeros((batch, 1), jnp.int32)
        jax.block_until_ready(cache)
        start = time.perf_counter()
        jax.block_until_ready(run_all(params, cache, tok))
        return time.perf_counter() - start

    run()  # compile
    return batch * n / statistics.median([run() for _ in range(3)])


def peak_memory() -> tuple[str, int]:
    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        return "device_peak_bytes", int(stats["peak_bytes_in_use"])
    return "process_peak_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def with_scheme(config: Config, scheme: str) -> Config | None:
    try:
        return apply_overrides(config, {"model.attention.scheme": scheme})
    except ValueError:
        return None  # e.g. bilinear with rotary: not a valid model, said in the table


def torch_comparison(config_path: str, cfg: Config, steps: int) -> dict:
    """The same model's train step in PyTorch eager (benchmarks/torch_reference.py) against qkvjax's, each in a
    process of its own, taking turns (``vs_torch.py``: in one process the two frameworks' spinning thread pools
    slow each other down); {} when torch is not installed or the reference does not cover the config."""
    import importlib.util

    if importlib.util.find_spec("torch") is None or cfg.model.attention.dtype != "float32":
        return {}
    import vs_torch  # beside this script

    try:
        out = vs_torch.compare(config_path, cfg.train.batch_size, steps, rounds=3, log=lambda line: None)
    except SystemExit as e:
        print(f"PyTorch reference skipped: {e}", flush=True)
        return {}
    print(
        f"separate vs PyTorch {out['torch']} eager (separate processes, 3 rounds): "
        f"{out['qkvjax_tokens_per_s']:,.0f} against {out['torch_tokens_per_s']:,.0f} tok/s, x{out['x_torch']:.2f}",
        flush=True,
    )
    return {
        "torch_tokens_per_s": out["torch_tokens_per_s"],
        "x_torch": out["x_torch"],
        "torch": out["torch"],
        "torch_side_qkvjax_tokens_per_s": out["qkvjax_tokens_per_s"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/configs/shakespeare_char.py")
    p.add_argument("--quick", action="store_true", help="small batch and few repeats: minutes on a 2-core CPU")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed train steps per scheme")
    p.add_argument("--decode-tokens", type=int, default=None)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--dtype", default=None, help="compute dtype override (float32, bfloat16)")
    p.add_argument("--implementation", default=None, help="jax.nn.dot_product_attention implementation (cudnn)")
    p.add_argument("--remat", default=None, choices=["none", "full", "dots"])
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config override, e.g. model.max_len=1024 or model.attention.chunk_size=64 (repeatable)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference even where torch is installed")
    p.add_argument(
        "--layout",
        action="append",
        default=None,
        metavar="NAME=PATTERN",
        help="a whole-stack layer pattern to time too (repeatable; default: the cross-layer K/V layouts of "
        "`qkvjax schemes --num-layers L` that fit the preset; 'none' for none)",
    )
    args = p.parse_args(argv)
    unknown = [s for s in args.schemes.split(",") if s not in SCHEMES]
    if unknown:  # before the baseline's minutes, not a "skipped" line after them
        p.error(f"--schemes: unknown {', '.join(map(repr, unknown))}; allowed: {', '.join(SCHEMES)}")
    for flag in ("batch_size", "steps", "decode_tokens", "decode_batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)}; allowed: an integer >= 1")

    overrides = dict(TIMING_OVERRIDES)
    if args.quick:
        overrides["train.batch_size"] = "8"
    if args.batch_size:
        overrides["train.batch_size"] = str(args.batch_size)
    if args.dtype:
        overrides["model.attention.dtype"] = args.dtype
    if args.implementation:
        overrides["model.attention.implementation"] = args.implementation
    if args.remat:
        overrides["model.remat"] = args.remat
    overrides |= parse_set(p, args.set)
    try:
        base = apply_overrides(load_config_file(args.config), overrides)
    except ValueError as e:
        p.error(str(e))
    steps = args.steps or (6 if args.quick else 20)
    decode_tokens = args.decode_tokens or (32 if args.quick else 128)
    dtype = base.model.attention.dtype
    device = jax.devices()[0]
    peak = measure_peak_flops(dtype)
    print(
        f"device: {device.device_kind} ({device.platform}, {jax.device_count()} device(s))"
        f" | peak {dtype} matmul {peak / 1e9:,.1f} GFLOP/s | config {args.config} batch {base.train.batch_size} "
        f"seq {base.seq_len} | {time.strftime('%Y-%m-%d')}",
        flush=True,
    )

    # The baseline: same shapes, scheme `separate` semantics inside flax's MHA (no rotary, no GQA).
    flax_cfg = dataclasses.replace(
        base,
        model=dataclasses.replace(
            base.model,
            attention=dataclasses.replace(base.model.attention, scheme="separate", rope=False, num_kv_heads=None),
            learned_positions=True,
        ),
    )
    flax_model = DecoderLM(flax_cfg.model, attention_cls=FlaxAttention)
    flax_runner = prepare_train(flax_model, flax_cfg)
    baseline = {"compile_s": flax_runner["compile_s"], "xla_memory_bytes": flax_runner["xla_memory_bytes"]}
    flax_step_s = statistics.median(flax_runner["step"]() for _ in range(steps))
    baseline["tokens_per_s"] = flax_runner["tokens"] / flax_step_s
    flax_params = create_state(flax_model, flax_cfg, make_optimizer(flax_cfg.train), None).params
    baseline["decode_1"] = bench_decode(flax_model, flax_params, flax_cfg, 1, decode_tokens)
    baseline["decode_b"] = bench_decode(flax_model, flax_params, flax_cfg, args.decode_batch, decode_tokens)
    print(f"flax baseline: {baseline['tokens_per_s']:,.0f} tok/s (compile {baseline['compile_s']:.1f}s)", flush=True)

    if args.layout is None:
        examples = example_layouts(base.model.num_layers, base.model.attention.num_heads)
        layouts = {k: v for k, v in examples.items() if "kv_from" in v}
    else:
        layouts = dict(item.partition("=")[::2] for item in args.layout if item != "none")
    rows = [(scheme, with_scheme(base, scheme)) for scheme in args.schemes.split(",")]
    rows += [(name, apply_overrides(base, {"model.layers": pattern})) for name, pattern in layouts.items()]

    results = []
    for scheme, cfg in rows:
        if cfg is None:
            print(f"{scheme}: skipped (not valid with this preset's attention config)", flush=True)
            continue
        model = DecoderLM(cfg.model)
        runner = prepare_train(model, cfg)
        step_s, base_s = interleaved(runner["step"], flax_runner["step"], steps)
        r = {"tokens_per_s": runner["tokens"] / step_s, "compile_s": runner["compile_s"]}
        r["xla_memory_bytes"] = runner["xla_memory_bytes"]
        flops = train_flops_per_token(cfg.model, cfg.seq_len)
        mfu_flops = mfu_flops_per_token(cfg.model, cfg.seq_len)  # MFU's count, as the training loop's
        params = create_state(model, cfg, make_optimizer(cfg.train), None).params
        att = sum(c.projection_flops for c in stack_cost(cfg.model.layer_attention, cfg.model.d_model, cfg.seq_len))
        sep_model = dataclasses.replace(
            cfg.model, attention=dataclasses.replace(cfg.model.attention, scheme="separate"), layers=""
        )
        sep = sum(c.projection_flops for c in stack_cost(sep_model.layer_attention, cfg.model.d_model, cfg.seq_len))
        row = {
            "scheme": scheme,
            "params": param_count(cfg.model),
            "tokens_per_s": r["tokens_per_s"],
            "baseline_tokens_per_s": flax_runner["tokens"] / base_s,  # timed alternately with this scheme
            "ratio": base_s / step_s,
            "mfu": r["tokens_per_s"] * mfu_flops / peak,  # nanoGPT's/PaLM's count
            "mfu_causal": r["tokens_per_s"] * flops / peak,  # qkvjax's causal count
            "mfu_flops_per_token": mfu_flops,
            "train_flops_per_token": flops,
            "projection_flop_ratio": att / sep,
            "compile_s": r["compile_s"],
            "xla_memory_bytes": r["xla_memory_bytes"],
            "decode_tokens_per_s": bench_decode(model, params, cfg, 1, decode_tokens),
            "decode_batch_tokens_per_s": bench_decode(model, params, cfg, args.decode_batch, decode_tokens),
            "decode_device_tokens_per_s": bench_decode_on_device(model, params, cfg, 1, decode_tokens),
            "decode_device_batch_tokens_per_s": bench_decode_on_device(
                model, params, cfg, args.decode_batch, decode_tokens
            ),
            "baseline_decode_tokens_per_s": baseline["decode_1"],
            "baseline_decode_batch_tokens_per_s": baseline["decode_b"],
            "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg.model),
        }
        if (
            scheme == "separate"
            and not args.no_torch
            and not (args.dtype or args.implementation or args.remat or args.set)
        ):
            row.update(torch_comparison(args.config, cfg, steps))
        results.append(row)
        print(
            f"{scheme}: {row['tokens_per_s']:,.0f} tok/s, x{row['ratio']:.2f} flax, mfu {100 * row['mfu']:.1f}%",
            flush=True,
        )

    peak = max(peak, measure_peak_flops(dtype))  # measured again at the end: the better of the two
    sheet = datasheet_peak(jax.devices()[0].device_kind, dtype)
    print("MFU: nanoGPT's/PaLM's FLOP count over "
          + (f"{sheet[0] / 1e12:,.1f} TFLOP/s ({sheet[1]}); the measured matmul reached {peak / sheet[0]:.0%} of it"
             if sheet else f"the measured {dtype} matmul, {peak / 1e9:,.1f} GFLOP/s (no datasheet entry for this "
             "device)") + "; MFU causal: qkvjax's causal count")  # fmt: skip
    peak = sheet[0] if sheet else peak
    for r in results:  # against the device's datasheet peak where perf.DATASHEET knows it, else the measured matmul
        r["mfu"] = r["tokens_per_s"] * r["mfu_flops_per_token"] / peak
        r["mfu_causal"] = r["tokens_per_s"] * r["train_flops_per_token"] / peak
    mem_key, mem_value = peak_memory()
    sep_row = next((r for r in results if r["scheme"] == "separate"), results[0])
    header = (
        f"{'scheme':<16} {'params':>11} {'tok/s':>9} {'x flax':>7} {'x sep':>6} {'FLOP speedup':>12} "
        f"{'proj FLOP x sep':>15} {'MFU':>6} "
        f"{'compile s':>9} {'XLA mem MB':>10} {'dec tok/s b1':>12} {'dev b1':>8} {'flax b1':>8} "
        f"{f'dec b{args.decode_batch}':>9} {f'dev b{args.decode_batch}':>9} {f'flax b{args.decode_batch}':>9} "
        f"{'KV B/tok':>9}"
    )
    print("\n" + header)
    for r in results:
        mem = f"{r['xla_memory_bytes'] / 2**20:,.1f}" if r["xla_memory_bytes"] is not None else "n/a"
        print(
            f"{r['scheme']:<16} {r['params']:>11,} {r['tokens_per_s']:>9,.0f} {r['ratio']:>7.2f} "
            f"{r['ratio'] / sep_row['ratio']:>6.2f} "
            f"{sep_row['train_flops_per_token'] / r['train_flops_per_token']:>12.2f} "
            f"{r['projection_flop_ratio']:>15.2f} "
            f"{100 * r['mfu']:>5.1f}% {r['compile_s']:>9.1f} {mem:>10} {r['decode_tokens_per_s']:>12,.0f} "
            f"{r['decode_device_tokens_per_s']:>8,.0f} {r['baseline_decode_tokens_per_s']:>8,.0f} "
            f"{r['decode_batch_tokens_per_s']:>9,.0f} {r['decode_device_batch_tokens_per_s']:>9,.0f} "
            f"{r['baseline_decode_batch_tokens_per_s']:>9,.0f} {r['kv_cache_bytes_per_token']:>9,}"
        )
    if "x_torch" in sep_row:
        print(
            f"PyTorch {sep_row['torch']} eager, same model: {sep_row['torch_tokens_per_s']:,.0f} tok/s; separate is "
            f"x{sep_row['x_torch']:.2f} its speed (processes taking turns, 3 rounds)"
        )
    print(
        f"flax baseline: {baseline['tokens_per_s']:,.0f} tok/s, compile {baseline['compile_s']:.1f}s; "
        f"{mem_key} {mem_value / 2**20:,.0f} MB"
    )
    if args.json:
        out = {
            "device": f"{device.device_kind} ({device.platform})",
            "peak_flops": peak,
            "date": time.strftime("%Y-%m-%d"),
            "config": args.config,
            "batch_size": base.train.batch_size,
            "seq_len": base.seq_len,
            "dtype": dtype,
            "baseline": baseline,
            mem_key: mem_value,
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
