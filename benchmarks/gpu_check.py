"""One visit to a GPU in one call: the machine, every scheme's numbers against a float64 host reference, training
speed at GPT-2 small beside PyTorch, a killed and resumed ``qkvjax train``, and sampling against its bytes floor.

    python benchmarks/gpu_check.py --out DIR                 # on the GPU machine (benchmarks/README.md, "GPU")
    python benchmarks/gpu_check.py --out DIR --smoke         # the same code paths on a CPU at toy shapes, seconds
    python benchmarks/gpu_check.py --out DIR --sections speed,torch   # some sections only

Each section runs in a process of its own (a fresh device memory pool, so peak memory is the section's own; a
crash or a hang costs that section only, under its own time limit), writes ``DIR/<section>.json`` and its output to
``DIR/gpu_check.log``; the driver merges them into ``DIR/gpu_check.json`` and prints one table last.

Sections:
  machine      device, memory, driver, versions; a large bf16 matmul's TFLOP/s and a device-to-device copy's GB/s
               (median of timed repeats on random data): the two ceilings the other sections are read against.
  correctness  a small LM of every scheme (and GQA, MLA with and without rotary, a CLA pattern) in float32 and
               bfloat16 on the device: logits and the loss's gradient against the same model in float64 on the
               host, |out - ref| / |ref|; cuDNN flash attention against XLA's; cached decoding (ragged prompts)
               against the full forward, which for MLA is the absorbed form against the materialised one.
  speed        train steps at ``gpt2_small`` (bf16, context 1024): tokens/s, MFU against the measured matmul
               ceiling, XLA's memory plan, compile time, per scheme and for flax's own attention.
  torch        the same model in PyTorch (``torch_reference.py``) with ``torch.compile``, autocast bf16 and SDPA.
  train        ``qkvjax train`` in bf16 on a local corpus: straight through, and killed (SIGKILL) after a
               checkpoint, then resumed; the two runs' losses and final parameters compared.
  sample       ``qkvjax.sample.generate_batch`` at batch 1 and 64 against the floor of reading every weight and
               the filled cache once per token at the measured copy bandwidth.
  levers       ``separate``'s train step again under each of ``LEVERS`` (XLA flags, a larger batch), each in a
               process of its own, against a baseline measured the same way in the same section.
  decode_levers  the sample section's rows again under each of ``DECODE_LEVERS`` (XLA flags), likewise; the
               baseline's process also traces batch 1 once (``jax.profiler``) and keeps a summary of the trace:
               each device's kernels per decode step and the busiest of them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

SECTIONS = ("machine", "correctness", "speed", "torch", "train", "sample", "levers", "decode_levers")
# Seconds each section may run before it is killed (a GPU visit has 10 minutes a call); --smoke: 120 each.
# seconds per section; correctness: 15-22 s a variant on an H200 (compiles; the first visit's 120 s reached
# eight, the fourth's two MLA variants took 45 s with the process's start), 12 variants
LIMITS = {
    "machine": 60, "correctness": 300, "speed": 420, "torch": 240, "train": 150, "sample": 240, "levers": 300,
    "decode_levers": 360,
}  # fmt: skip
# The levers section: `separate`'s speed row again, each in a process of its own under these XLA_FLAGS (a flag
# must be set before XLA starts) or batch, beside the baseline measured the same way in the same section. On the
# CPU (--smoke) only flags the CPU takes, so the code path runs.
LEVERS = {
    "baseline": ("", None),
    "latency_hiding": ("--xla_gpu_enable_latency_hiding_scheduler=true", None),
    "no_command_buffer": ("--xla_gpu_enable_command_buffer=", None),  # empty: no CUDA graphs
    "batch_64": ("", 64),
}
SMOKE_LEVERS = {"baseline": ("", None), "batch_4": ("", 4)}
# The decode_levers section: the sample section's one-program rows again, each in a process of its own under these
# XLA_FLAGS. The third visit decoded at 6% (batch 1) of the bytes floor, 140 us a layer, and one H200 ran a third
# slower than another: time on the host, which runs a while loop's condition (the scan over tokens) and each
# conditional (a layer's key prefix) unless they are in the CUDA graph; "+" adds to XLA's default command types.
# The fourth visit (benchmarks/README.md): 1,010 tok/s at batch 1 as on the first; +WHILE,+CONDITIONAL x0.95,
# unroll 8 x0.36; the trace: 240 kernels and 0.60 ms of kernel time in a 0.99 ms step.
# Not here: --xla_gpu_enable_dot_strength_reduction=false (issue 98's batch-1 matvec lever): jaxlib 0.10.2 registers
# no such XLA_FLAGS flag ("Unknown flag in XLA_FLAGS", fatal at start) and its CPU client refuses the DebugOptions
# field as a compile option ("No such compile option"), so it cannot be given to a run or tested here.
# name: (XLA flags, generate_batch's scan_unroll, batch 1 only: an unrolled loop compiles for longer)
DECODE_LEVERS = {
    "baseline": ("", 1, False),
    "graphs_while_cond": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", 1, False),
    "unroll_8": ("", 8, True),  # a loop iteration, and its condition read on the host, per 8 tokens
}
# batch sizes; "+eos": the same row given a stop id no row draws (vocab_size), so generate_batch runs its while
# loop, which ends once every row has stopped, for the whole length: what that loop costs against the scan
SAMPLE_ROWS = ("1", "64", "64+eos")
SMOKE_SAMPLE_ROWS = ("1", "8", "8+eos")
# most wanted first; "/xla": XLA's attention instead of cuDNN's; "/auto": the implementation left unset, as a user
# runs it (cuDNN's where jax takes the call); "+rope": MLA's decoupled rotary part; "124m:": GPT-2 124M with GPT-2's
# own vocabulary (experiments/configs/gpt2_124m.py: 50,304 ids, the output layer and loss 256 positions at a time),
# "/nochunk" the same with the whole sequence's logits at once
SPEED_ROWS = ("separate", "124m:separate", "124m:separate/nochunk", "124m:shared_kv", "124m:gqa", "124m:mla",
              "separate/auto", "flax", "shared_kv", "gqa", "shared_qk", "mla", "mla+rope", "separate/xla")  # fmt: skip
SMOKE_SPEED_ROWS = ("separate", "flax", "mla+rope", "124m:separate", "124m:separate/nochunk")
# the torch section's shapes: gpt2_small's (bytes) and GPT-2 124M's own vocabulary, each beside its qkvjax rows
TORCH_ROWS = ("small", "124m")
SMOKE_VARIANTS = ("separate", "mla+rope", "cla2", "window")  # each module class, a K/V hand-over, a ring
CORRECTNESS_VARIANTS = {  # name: config overrides on the small LM
    "separate": {},
    "shared_qk": {"model.attention.scheme": "shared_qk"},
    "reformer_qk": {"model.attention.scheme": "reformer_qk"},
    "shared_kv": {"model.attention.scheme": "shared_kv"},
    "shared_qv": {"model.attention.scheme": "shared_qv"},
    "shared_qkv": {"model.attention.scheme": "shared_qkv"},
    "bilinear": {"model.attention.scheme": "bilinear"},
    "gqa": {"model.attention.num_kv_heads": "3"},
    "mla": {"model.attention.scheme": "mla"},
    "mla+rope": {"model.attention.scheme": "mla", "model.attention.rope": "true"},
    "cla2": {"model.layers": "separate, [kv_from=-1]"},  # CLA2: layer 1 reads layer 0's K/V
    # a sliding window of 7 on layer 0: the window kernel in training, a ring of 7 slots that turns when decoding
    "window": {"model.layers": "[sliding_window=7], []"},
}
BOUNDS = {"float32": 1e-3, "bfloat16": 1e-2}  # |out - ref| / |ref| a precision must stay under


# ----------------------------------------------------------------------------------------------- helpers


def _versions() -> dict:
    """Package versions, and where torch is installed its CUDA, cuDNN and scaled-dot-product backends (the
    reference's speed depends on which SDPA kernel ran), and the driver nvidia-smi reports."""
    out = {"python": platform.python_version()}
    names = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint", "numpy",
             "torch", "triton", "transformers")  # fmt: skip
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    if "torch" in out:
        with contextlib.suppress(Exception):
            import torch

            out["torch_cuda"] = torch.version.cuda
            out["torch_cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
            out["torch_sdpa_enabled"] = {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
                                         for k in ("flash", "mem_efficient", "math", "cudnn")
                                         if hasattr(torch.backends.cuda, f"{k}_sdp_enabled")}  # fmt: skip
    with contextlib.suppress(Exception):
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out["driver"] = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip() or None
    return out


def run_group(cmd: list[str], limit: float, **popen) -> int | str:
    """``cmd``'s exit code, or "timeout" after ``limit`` seconds, when its whole process group (the training
    runs and lever processes a section starts, not only the section's own process) is killed and reaped, so
    nothing it started keeps the GPU busy while the next section times itself."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"
    finally:
        with contextlib.suppress(ProcessLookupError):  # a section that exited but left children behind
            os.killpg(proc.pid, signal.SIGKILL)


def _median_time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (which must block until its work is done) after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rel(out, ref) -> float:
    """|out - ref| / |ref| (Frobenius) over arrays or whole pytrees, in float64; NaN if anything is not finite."""
    import jax
    import numpy as np

    a = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(out)]
    b = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(ref)]
    a, b = np.concatenate(a), np.concatenate(b)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _config(path: str, overrides: dict):
    from qkvjax.config import apply_overrides, load_config_file

    return apply_overrides(load_config_file(str(REPO / path)), {k: str(v) for k, v in overrides.items()})


def _on_gpu() -> bool:
    import jax

    return jax.devices()[0].platform == "gpu"


# ----------------------------------------------------------------------------------------------- sections


def section_machine(args) -> dict:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    out = {"device_kind": device.device_kind, "platform": device.platform, "devices": jax.device_count()}
    out["versions"] = _versions()
    stats = device.memory_stats() or {}
    out["device_memory_bytes"] = stats.get("bytes_limit")
    if shutil.which("nvidia-smi"):
        query = "name,memory.total,driver_version,clocks.max.sm,power.limit"
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True
        )
        out["nvidia_smi"] = smi.stdout.strip()
    n = 512 if args.smoke else 8192
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    matmul = jax.jit(jnp.dot)
    for _ in range(3):  # compile, and let the clocks come up
        matmul(a, b).block_until_ready()
    seconds = _median_time(lambda: matmul(a, b).block_until_ready(), 5 if args.smoke else 30)
    out["matmul"] = {"n": n, "dtype": jnp.dtype(dtype).name, "seconds": seconds, "flops_per_s": 2 * n**3 / seconds}
    out["torch_matmul_flops_per_s"] = _torch_matmul(n)
    nbytes = (64 if args.smoke else 4096) << 20
    x = jax.random.bits(jax.random.PRNGKey(2), (nbytes // 4,), jnp.uint32)
    copy = jax.jit(jnp.copy)
    y = copy(x)
    assert bool((y[:1024] == x[:1024]).all()) and bool((y[-1024:] == x[-1024:]).all()), "the copy is wrong"
    seconds = _median_time(lambda: copy(x).block_until_ready(), 5 if args.smoke else 20)
    out["copy"] = {"bytes": nbytes, "seconds": seconds, "bytes_per_s": 2 * nbytes / seconds}  # read + write
    print(
        f"{device.device_kind}: matmul {out['matmul']['flops_per_s'] / 1e12:.1f} TFLOP/s ({out['matmul']['dtype']}, "
        f"{n}^3), copy {out['copy']['bytes_per_s'] / 1e9:.0f} GB/s (read + write)",
        flush=True,
    )
    return out


def _torch_matmul(n: int) -> float | None:
    """FLOP/s of torch's bf16 (n, n) product on the GPU (median of 30 after warm-up), or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a, b = torch.randn(2, n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    seconds = _median_time(lambda: ((a @ b), torch.cuda.synchronize()), 30)
    return 2 * n**3 / seconds


def _small_lm(overrides: dict, dtype: str, layers: int = 1):
    """The correctness model: ``layers`` layers, V 131, D 96, N 6 heads of H 16, context 64 (inputs B 3, T 37)."""
    base = {
        "model.vocab_size": 131,
        "model.d_model": 96,
        "model.num_layers": layers,
        "model.max_len": 64,
        "model.attention.num_heads": 6,
        "model.attention.head_dim": 16,
        "model.attention.causal_block": 16,
        "model.attention.dtype": dtype,
        "model.dropout_rate": 0.0,
    }
    return _config("experiments/configs/tiny.py", base | overrides).model


def _attention_stack(config):
    """x (B, T, D) -> the attention layers of ``config`` (a ModelConfig) in sequence on a residual, nothing
    else: each layer's module as the LM builds it, K/V handed from a producing layer to its readers."""
    import flax.linen as nn
    import jax.numpy as jnp

    from qkvjax.attention import attention_module

    class AttentionStack(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x.astype(config.dtype)
            made = {}
            for i, layer in enumerate(config.layer_attention):
                kv = None if layer.produces_kv else made[layer.kv_from]
                module = attention_module(layer.config)(layer.config, name=f"layer_{i}")
                y, used = module(x, causal=True, kv=kv, return_kv=True)
                made[i] = used
                x = x + y
            return x.astype(jnp.promote_types(x.dtype, jnp.float32))

    return AttentionStack()


def section_correctness(args) -> dict:
    import dataclasses

    import jax
    import numpy as np

    from qkvjax.models.lm import DecodeCache, DecoderLM

    gpu = _on_gpu()
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each visit, recorded
    rng = np.random.default_rng(seed)
    b, t, d = 3, 37, 96
    cpu = jax.devices("cpu")[0]

    def out_and_grads(module):
        """y = module(x) and the gradient of sum(y * c) w.r.t. the parameters and x (a fixed random c)."""

        def f(params, x, c):
            y = module.apply({"params": params}, x)
            return (y * c.astype(y.dtype)).sum(), y

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    cases = {}
    result = {"seed": seed, "bounds": BOUNDS, "f32_matmul_rel_error": _matmul_precision_probe(), "cases": cases}
    result["init"] = _init_probe(args)
    _save(args, result)
    names = args.variants.split(",") if args.variants else CORRECTNESS_VARIANTS if not args.smoke else SMOKE_VARIANTS
    variants = {k: CORRECTNESS_VARIANTS[k] for k in names}
    for name, over in variants.items():
        layers = 2 if "model.layers" in over else 1
        x = rng.standard_normal((b, t, d)).astype(np.float32)
        c = rng.standard_normal((b, t, d)).astype(np.float32)
        cfg32 = _small_lm(over, "float32", layers)
        key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
        params = jax.device_get(_attention_stack(cfg32).init(key, x))["params"]
        # the reference: the same layers and parameters in float64 on the host
        with jax.enable_x64(True) if hasattr(jax, "enable_x64") else _x64():
            cfg64 = _small_lm(over, "float64", layers)
            cfg64 = dataclasses.replace(cfg64, attention=dataclasses.replace(cfg64.attention, param_dtype="float64"))
            p64, x64, c64 = jax.device_put(jax.tree.map(lambda a: np.asarray(a, np.float64), (params, x, c)), cpu)
            (_, ref_y), ref_g = out_and_grads(_attention_stack(cfg64))(p64, x64, c64)
            ref_y, ref_g = np.asarray(ref_y, np.float64), jax.device_get(ref_g)
        row = {}
        try:
            for dtype in ("float32", "bfloat16"):
                (_, y), g = out_and_grads(_attention_stack(_small_lm(over, dtype, layers)))(params, x, c)
                row[dtype] = {"out": _rel(y, ref_y), "grads": _rel(g, ref_g)}
            if gpu and name in ("separate", "gqa", "mla", "mla+rope"):  # cuDNN flash attention against XLA's, bf16
                xc, cc = rng.standard_normal((2, b, 64, d)).astype(np.float32)
                cudnn = _small_lm(dict(over) | {"model.attention.implementation": "cudnn"}, "bfloat16", layers)
                xla = _small_lm(dict(over) | {"model.attention.implementation": "xla"}, "bfloat16", layers)
                (_, y), g = out_and_grads(_attention_stack(cudnn))(params, xc, cc)
                (_, yx), gx = out_and_grads(_attention_stack(xla))(params, xc, cc)
                row["cudnn_vs_xla"] = {"out": _rel(y, yx), "grads": _rel(g, gx)}
            lm = DecoderLM(_small_lm(over, "float32", 2 if layers == 1 else layers))
            row["decode"] = _decode_error(lm, rng, DecodeCache)
        except Exception as e:  # recorded, and the other variants still run
            row["error"] = _error(e)
            print(f"{name}: {row['error']}", flush=True)
        cases[name] = row
        cells = [f"{k} {v['out']:.1e}/{v['grads']:.1e}" for k, v in row.items() if isinstance(v, dict)]
        print(f"{name}: " + ", ".join(cells) + f", decode {row.get('decode', float('nan')):.1e}", flush=True)
        _save(args, result)  # what is done survives a timeout
    return result


def _init_probe(args) -> dict:
    """``create_state`` (its draws on jax's ThreeFry GPU kernel where ``uses_threefry_kernel`` says so) against the
    same init jitted with XLA's inlined lowering: whether every parameter is bit-identical, and both compile times,
    at ``gpt2_small``'s width with 2 layers (the tiny config under ``--smoke``)."""
    import flax.linen as nn
    import jax
    import numpy as np

    from qkvjax.models.lm import DecoderLM
    from qkvjax.train.state import create_state, init_fn, make_optimizer, uses_threefry_kernel

    path = "experiments/configs/tiny.py" if args.smoke else "experiments/configs/gpt2_small.py"
    cfg = _config(path, {"model.num_layers": 2})
    model, tx = DecoderLM(cfg.model), make_optimizer(cfg.train)
    out = {"layers": 2, "d_model": cfg.model.d_model}
    try:
        out["kernel_used"] = uses_threefry_kernel(None)
        start = time.perf_counter()
        chosen = jax.device_get(create_state(model, cfg, tx, None).params)
        out["create_state_s"] = time.perf_counter() - start
        init = init_fn(model, cfg, tx)
        start = time.perf_counter()
        inlined = jax.device_get(jax.jit(lambda rng: nn.meta.unbox(init(rng)))(jax.random.PRNGKey(cfg.seed)).params)
        out["xla_lowering_s"] = time.perf_counter() - start
        pairs = zip(jax.tree.leaves(chosen), jax.tree.leaves(inlined), strict=True)
        out["leaves"] = len(jax.tree.leaves(chosen))
        out["leaves_differing"] = sum(not np.array_equal(a, b) for a, b in pairs)
    except Exception as e:  # recorded; the correctness rows still run
        out["error"] = _error(e)
    print(f"init: {out}", flush=True)
    return out


@contextlib.contextmanager
def _x64():
    """jax_enable_x64 inside the block (jax versions without ``jax.enable_x64``)."""
    import jax

    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


def _matmul_precision_probe() -> float:
    """|A B - ref| / |ref| of a float32 (512, 512) product at default precision: ~1e-7 is float32, ~1e-4 TF32."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 512, 512)).astype(np.float32)
    out = np.asarray(jax.jit(jnp.dot)(a, b), np.float64)
    return _rel(out, a.astype(np.float64) @ b.astype(np.float64))


def _decode_error(model, rng, DecodeCache) -> float:
    """A float32 LM: ragged prompts (lengths 5, 11, 8) prefilled into one cache, then 9 tokens decoded one at a
    time per row; every logit against the full forward of the same rows, |dec - full| / |full|."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    lengths, steps = np.array([5, 11, 8], np.int32), 9
    total = int(lengths.max()) + steps
    tokens = rng.integers(0, model.config.vocab_size, (3, total), dtype=np.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(int(rng.integers(1 << 30))), tokens)["params"]
    full = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(params, tokens))
    prompts = np.where(np.arange(total)[None] < lengths[:, None], tokens, 0)[:, : lengths.max()]
    apply = jax.jit(lambda p, x, c, n: model.apply({"params": p}, x, cache=c, num_valid=n))
    logits, cache = apply(params, prompts, DecodeCache.empty(model.config, 3), jnp.asarray(lengths))
    got, want = [], []
    logits = np.asarray(logits)
    for i, n in enumerate(lengths):
        got.append(logits[i, :n])
        want.append(full[i, :n])
    for k in range(steps):
        step_tokens = tokens[np.arange(3), lengths + k][:, None]
        logits, cache = apply(params, step_tokens, cache, jnp.ones(3, jnp.int32))
        got.append(np.asarray(logits)[:, 0])
        want.append(full[np.arange(3), lengths + k])
    return _rel([np.concatenate([g.ravel() for g in got])], [np.concatenate([w.ravel() for w in want])])


def _speed_config(args, row: str):
    over = {"model.dropout_rate": 0.0, "train.grad_accum_steps": 1, "train.batch_size": args.batch_size}
    real_vocab = row.startswith("124m:")
    row = row.removeprefix("124m:")
    if row.endswith("/nochunk"):  # the whole sequence's float32 logits at once: what the chunked loss saves
        row = row.removesuffix("/nochunk")
        over["train.loss_chunk"] = "none"
    elif real_vocab and args.smoke:
        over["train.loss_chunk"] = 8  # the chunked path on the toy shapes
    scheme = row.split("/")[0]
    if scheme.endswith("+rope"):  # MLA's decoupled rotary part: keys H + P wide, values H (padded for cuDNN)
        scheme = scheme.removesuffix("+rope")
        over["model.attention.rope"] = True
    if scheme == "gqa":
        over["model.attention.num_kv_heads"] = 4 if not args.smoke else 2
    elif scheme not in ("separate", "flax"):
        over["model.attention.scheme"] = scheme
    if _on_gpu() and not row.endswith(("/xla", "/auto")) and row != "flax":
        over["model.attention.implementation"] = "cudnn"
    elif row.endswith("/xla"):
        over["model.attention.implementation"] = "xla"
    if real_vocab:
        over["data.prepared"] = "none"  # a speed row reads random tokens, no corpus
        if args.smoke:  # the toy model with a vocabulary that needs the chunked loss's path
            over["model.vocab_size"] = 1024
    path = "experiments/configs/gpt2_124m.py" if real_vocab and not args.smoke else (
        "experiments/configs/tiny.py" if args.smoke else "experiments/configs/gpt2_small.py")  # fmt: skip
    return _config(path, over)


def section_speed(args) -> dict:
    import dataclasses

    import bench  # beside this script
    import jax

    from qkvjax.models.lm import DecoderLM, mfu_flops_per_token, param_count, train_flops_per_token

    peak, source = _mfu_peak(args)
    rows = {}
    result = {"rows": rows, "peak_flops": peak, "peak_source": source}
    chosen = args.rows.split(",") if args.rows else SPEED_ROWS if not args.smoke else SMOKE_SPEED_ROWS
    for row in chosen:
        row_start = time.perf_counter()
        cfg = _speed_config(args, row)
        if row == "flax":  # flax's MHA inside the same LM: learned positions, no GQA, no rotary
            att = dataclasses.replace(cfg.model.attention, scheme="separate", rope=False, num_kv_heads=None)
            model_cfg = dataclasses.replace(cfg.model, attention=att, learned_positions=True)
            cfg = dataclasses.replace(cfg, model=model_cfg)
            model = DecoderLM(cfg.model, attention_cls=bench.FlaxAttention)
        else:
            model = DecoderLM(cfg.model)
        try:
            runner = bench.prepare_train(model, cfg)
            times = [runner["step"]() for _ in range(args.steps)]
        except Exception as e:  # recorded (a compile failure is one of the things a visit checks); the rows go on
            rows[row] = {"error": _error(e), "row_s": time.perf_counter() - row_start}
            print(f"{row}: {rows[row]['error']}", flush=True)
            runner = None  # a step that failed after prepare_train: its state's device buffers go now
            jax.clear_caches()
            _save(args, result)
            continue
        step_s = statistics.median(times)
        flops, causal = mfu_flops_per_token(cfg.model, cfg.seq_len), train_flops_per_token(cfg.model, cfg.seq_len)
        tps = runner["tokens"] / step_s
        rows[row] = {
            "params": param_count(cfg.model),
            "vocab_size": cfg.model.vocab_size,
            "loss_chunk": cfg.train.loss_chunk,
            "implementation": cfg.model.attention.implementation,
            "batch": cfg.train.batch_size,
            "seq_len": cfg.seq_len,
            "step_s": step_s,
            **_quartiles(times),
            "tokens_per_s": tps,
            "mfu_flops_per_token": flops,  # nanoGPT's and PaLM's count: MFU's numerator
            "train_flops_per_token": causal,  # qkvjax's causal count, labelled beside it
            "mfu": tps * flops / peak if peak else None,
            "mfu_causal": tps * causal / peak if peak else None,
            "compile_s": runner["compile_s"],
            "init_s": runner["init_s"],  # the state's init (jitted) and the warm-up step: where row_s goes
            "init_threefry_kernel": runner["init_threefry_kernel"],  # its draws lowered to jax's GPU kernel
            "warmup_s": runner["warmup_s"],
            "xla_memory_bytes": runner["xla_memory_bytes"],
            "cudnn_attention_calls": runner["cudnn_attention_calls"],  # cuDNN's fused attention in the program
            "loss": runner["last_loss"](),
            "row_s": time.perf_counter() - row_start,  # building, compiling and timing this row
        }
        times = f"compile {runner['compile_s']:.1f} s, init {runner['init_s']:.1f} s"
        print(f"{row}: {tps:,.0f} tok/s, {times}", flush=True)
        del runner
        jax.clear_caches()
        result["process_peak_device_bytes"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        _save(args, result)
    return result


def _mfu_peak(args, dtype: str | None = None) -> tuple[float | None, str]:
    """MFU's denominator, as the training loop's: the device's datasheet peak for the compute dtype where
    :data:`qkvjax.perf.DATASHEET` knows it, else the matmul the machine section measured (a CPU's smoke run)."""
    import jax

    from qkvjax.perf import datasheet_peak

    dtype = dtype or _speed_config(args, "separate").model.attention.dtype
    sheet = datasheet_peak(jax.devices()[0].device_kind, dtype)
    if sheet is not None:
        return sheet
    return _read(args.work, "machine", "matmul", "flops_per_s"), "the matmul measured in this call"


def _quartiles(times: list[float]) -> dict:
    """The timed steps' first and third quartiles: the spread a ratio between two rows is read against."""
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return {"step_s_q1": q1, "step_s_q3": q3}


def section_torch(args) -> dict:
    """The PyTorch reference at each of :data:`TORCH_ROWS`' shapes: ``gpt2_small``'s (the result's own fields, as
    on every visit) and GPT-2 124M's own vocabulary (``real_vocab``), each beside the speed section's rows."""
    out = _torch_row(args, "separate")
    _save(args, out)  # kept if the next shape runs out of time
    if "124m" in TORCH_ROWS:
        out["real_vocab"] = _torch_row(args, "124m:separate")
    return out


def _torch_row(args, row: str) -> dict:
    import torch
    import torch_reference  # beside this script

    cuda = torch.cuda.is_available()
    cfg = _speed_config(args, row)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # the strongest fair reference: the whole step compiled, in each CUDA-graph mode (the faster one is the row),
    # SDPA's backend forced and recorded (cuDNN's flash kernel, as qkvjax's default takes); the CPU smoke: eager
    modes, sdpa = (("reduce-overhead", "max-autotune"), "cudnn") if cuda else (("default",), "auto")
    tried = {}
    for mode in modes:
        one = torch_reference.runner(cfg, args.batch_size, device="cuda" if cuda else "cpu",
                                     compile="step" if cuda else "off", mode=mode, sdpa=sdpa)  # fmt: skip
        tried[mode] = (one, [one() for _ in range(args.steps)])
    mode = min(tried, key=lambda m: statistics.median(tried[m][1]))
    one_step, times = tried[mode]
    step_s = statistics.median(times)
    from qkvjax.models.lm import mfu_flops_per_token

    peak, _ = _mfu_peak(args)
    flops = mfu_flops_per_token(cfg.model, cfg.seq_len)
    tps = args.batch_size * cfg.seq_len / step_s
    out = {
        "torch": torch.__version__,
        "compiled": cuda,
        "compile": "step" if cuda else "off",  # forward, loss, backward, clipping and AdamW
        "mode": mode,
        "modes_step_s": {m: statistics.median(t) for m, (_, t) in tried.items()},
        "sdpa_backend": sdpa,
        "attention": f"scaled_dot_product_attention, backend {sdpa}",
        "dtype": cfg.model.attention.dtype,
        "vocab_size": cfg.model.vocab_size,
        "batch": args.batch_size,
        "step_s": step_s,
        **_quartiles(times),
        "tokens_per_s": tps,
        "mfu": tps * flops / peak if peak else None,
        "warmup_and_compile_s": one_step.warmup_s,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    print(f"torch ({row}): {tps:,.0f} tok/s (compile + 2 warm-up steps {one_step.warmup_s:.1f} s)", flush=True)
    return out


def _train_cmd(args, workdir: Path, steps: int, every: int) -> list[str]:
    corpus = args.corpus or str(REPO / "README.md")
    config = "experiments/configs/tiny.py" if args.smoke else "experiments/configs/shakespeare_char.py"
    over = {
        "data.dataset": "text_file",
        "data.source_path": corpus,
        "data.data_dir": str(workdir.parent / "tfds"),
        "model.attention.dtype": "bfloat16",
        "model.dropout_rate": 0.1,  # the dropout RNG must resume too
        "train.num_steps": steps,
        "train.checkpoint_every": every,
        "train.eval_every": steps,
        "train.eval_batches": 2,
        "train.log_every": 1,
        "train.warmup_steps": 5,
        "train.peak_flops": 1e12,  # the machine section measured it; no second measurement
    }
    return [sys.executable, "-m", "qkvjax.cli", "train", f"--config={REPO / config}", f"--workdir={workdir}"] + [
        f"--config.{k}={v}" for k, v in over.items()
    ]


def section_train(args) -> dict:
    import numpy as np

    steps, every = (12, 4) if args.smoke else (300, 100)
    root = Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # XLA's GPU scatter-add (the embedding's gradient) uses atomics, so two straight runs differ in the last bits
    # (seen on the first visit: final losses 2.2001 and 2.1983); deterministic ops make a resume comparable bit for bit
    deterministic = _on_gpu()
    if deterministic:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    straight, killed = root / "straight", root / "killed"
    start = time.perf_counter()
    proc = subprocess.run(_train_cmd(args, straight, steps, every), env=env, capture_output=True, text=True)
    straight_s = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"straight run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    # the run to kill: SIGKILL as soon as its first checkpoint is committed (orbax renames it into place last)
    log = open(root / "killed.log", "w")
    p = subprocess.Popen(_train_cmd(args, killed, steps, every), env=env, stdout=log, stderr=subprocess.STDOUT)
    first = killed / "checkpoints" / str(every)
    while p.poll() is None and not first.is_dir():
        time.sleep(0.02)
    killed_running = p.poll() is None
    p.send_signal(signal.SIGKILL)
    p.wait()
    log.close()
    left = sorted(int(n) for n in os.listdir(killed / "checkpoints") if n.isdigit())
    records = _metrics(killed)
    killed_at = max((r["step"] for r in records), default=0)
    proc = subprocess.run(_train_cmd(args, killed, steps, every), env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"resumed run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    resumed_line = next((ln for ln in proc.stdout.splitlines() if "resumed from checkpoint" in ln), "")
    a, b = _metrics(straight), _metrics(killed)
    loss_a, loss_b = [r["loss"] for r in a], [r["loss"] for r in b]
    pa, pb = _final_params(straight, steps), _final_params(killed, steps)
    max_param_diff = max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa)
    out = {
        "steps": steps,
        "checkpoint_every": every,
        "killed_while_running": killed_running,
        "killed_after_logged_step": killed_at,
        "checkpoints_left_at_kill": left,
        "resumed": resumed_line.strip(),
        "final_loss_straight": loss_a[-1],
        "final_loss_resumed": loss_b[-1],
        "losses_identical": loss_a == loss_b,
        "max_abs_loss_diff": max(abs(x - y) for x, y in zip(loss_a, loss_b, strict=True)),
        "params_identical": max_param_diff == 0.0,
        "max_abs_param_diff": max_param_diff,
        "straight_run_s": straight_s,
        "xla_gpu_deterministic_ops": deterministic,
    }
    print(f"train: straight {loss_a[-1]:.6f}, killed at step {killed_at} and resumed {loss_b[-1]:.6f}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return out


def _metrics(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if not r.get("eval")]


def _final_params(workdir: Path, step: int) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:  # the params-only export every checkpoint writes beside it
        tree = ckptr.restore(workdir / "params" / str(step))
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def section_sample(args) -> dict:
    import jax
    import numpy as np

    from qkvjax.config import apply_overrides
    from qkvjax.models.lm import DecoderLM, kv_cache_bytes_per_token
    from qkvjax.perf import datasheet_bandwidth
    from qkvjax.sample import compute_params, generate_batch

    bandwidth = _read(args.work, "machine", "copy", "bytes_per_s")
    sheet, sheet_source = datasheet_bandwidth(jax.devices()[0].device_kind) or (None, None)
    cfg = _speed_config(args, "separate")
    if args.smoke:  # key prefixes of 4, 8, 16 and all 32 slots: the smoke run's rows cross from one to the next
        cfg = apply_overrides(cfg, {"model.attention.causal_block": "4"})
    model = DecoderLM(cfg.model)
    rng = np.random.default_rng(0)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    # the floor counts the bytes decoding reads: the weights as generate_batch stores them (cast once to the
    # compute dtype, bf16 here) and the cache in its dtype; the float32 parameters' bytes beside it (the third and
    # fourth visits' floor counted those)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(compute_params(model, params)))
    prompt_len, new = (8, 16) if args.smoke else (32, 128)
    rows = {}
    result = {"param_bytes": param_bytes, "param_bytes_float32": sum(x.nbytes for x in jax.tree.leaves(params)),
              "datasheet_bandwidth": sheet, "datasheet_source": sheet_source, "measured_bandwidth": bandwidth,
              "prompt_len": prompt_len, "new_tokens": new, "rows": rows}  # fmt: skip
    # one program whose layers pick their key prefix per token with a lax.switch, as on every visit
    wanted = args.sample_rows.split(",") if args.sample_rows else SMOKE_SAMPLE_ROWS if args.smoke else SAMPLE_ROWS
    for name in wanted:
        batch, eos = int(name.split("+")[0]), name.endswith("+eos")
        draw = np.random.default_rng(batch)  # a row and its +eos twin decode the same prompts
        prompts = [draw.integers(0, cfg.model.vocab_size, prompt_len) for _ in range(batch)]
        stops = (cfg.model.vocab_size,) if eos else ()
        tokens, stats = generate_batch(
            model, params, prompts, new, seed=2, scan_unroll=args.scan_unroll, stop_ids=stops
        )  # no compiles
        mean_filled = prompt_len + new / 2
        bytes_per_step = param_bytes + batch * mean_filled * kv_cache_bytes_per_token(cfg.model)
        floor = batch * bandwidth / bytes_per_step if bandwidth else None
        sheet_floor = batch * sheet / bytes_per_step if sheet else None
        rows[name] = {
            "tokens_per_s": stats["tokens_per_s"],
            "bytes_per_step": bytes_per_step,
            "floor_tokens_per_s": floor,  # at the copy bandwidth the machine section measured
            "fraction_of_floor": stats["tokens_per_s"] / floor if floor else None,
            "datasheet_floor_tokens_per_s": sheet_floor,  # at the datasheet's memory bandwidth
            "fraction_of_datasheet_floor": stats["tokens_per_s"] / sheet_floor if sheet_floor else None,
            "prefill_and_compile_s": stats["prefill_and_compile_s"],
            "tokens_sha256": hashlib.sha256(np.asarray(tokens).tobytes()).hexdigest()[:16],  # agree across runs?
            "decode_steps": stats["decode_steps"],
        }
        twin = rows.get(str(batch)) if eos else None
        if twin:  # the while loop against the scan, measured in this process
            rows[name] |= {"x_scan": stats["tokens_per_s"] / twin["tokens_per_s"],
                           "same_tokens": rows[name]["tokens_sha256"] == twin["tokens_sha256"]}  # fmt: skip
        print(f"sample b{name}: {stats['tokens_per_s']:,.0f} tok/s (floor {floor or 0:,.0f})", flush=True)
        _save(args, result)  # a row kept if the next one runs out of time
    if args.profile:  # batch 1 once more under the profiler, apart from the timed rows (tracing slows them)
        trace = Path(tempfile.mkdtemp(prefix="gpu_check_trace_"))
        try:
            with jax.profiler.trace(str(trace)):
                generate_batch(model, params, [rng.integers(0, cfg.model.vocab_size, prompt_len)], new, seed=2)
            result["profile"] = {"decode_steps": new - 1} | _profile_summary(trace)
        finally:
            shutil.rmtree(trace, ignore_errors=True)
    return result


def _profile_summary(trace: Path, top: int = 25) -> dict:
    """What a ``jax.profiler`` trace holds, small enough to carry back: per plane (the host, each device) its
    busiest lines (threads, streams) with their events and busy time, and the ``top`` event names by total time
    with their counts (a device's kernels: how many a decode step launches, and which take the time)."""
    from jax.profiler import ProfileData

    files = sorted(trace.glob("**/*.xplane.pb"))
    if not files:
        return {"error": f"no .xplane.pb under {trace}"}
    planes = {}
    for plane in ProfileData.from_file(str(files[-1])).planes:
        lines, names = [], {}
        for line in plane.lines:
            busy, count = 0.0, 0
            for e in line.events:
                busy, count = busy + e.duration_ns, count + 1
                total, n = names.get(e.name, (0.0, 0))
                names[e.name] = (total + e.duration_ns, n + 1)
            lines.append({"line": line.name, "events": count, "busy_ms": busy / 1e6})
        if not lines:
            continue
        ranked = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
        planes[plane.name] = {
            "lines": sorted(lines, key=lambda x: -x["busy_ms"])[:8],
            "top_events": [{"name": k[:120], "count": n, "total_ms": t / 1e6} for k, (t, n) in ranked],
        }
    return {"planes": planes}


def section_levers(args) -> dict:
    """``separate``'s train step under each of :data:`LEVERS` (XLA flags or a batch), each in its own process
    through the speed section; tokens/s, the steps' quartiles and the ratio to the baseline measured here."""
    rows = {}
    result = {"rows": rows}
    for name, (flags, batch) in (SMOKE_LEVERS if args.smoke else LEVERS).items():
        out = _child(args, "speed", flags, ["--rows", "separate", "--batch-size", str(batch or args.batch_size)])
        row = out if "error" in out else out["rows"]["separate"]  # the section's error, or the row's own
        if "error" in row:
            rows[name] = {"flags": flags, "batch": batch, "error": row["error"]}
        else:
            rows[name] = {"flags": flags, "batch": row["batch"]} | {
                k: row[k] for k in ("tokens_per_s", "step_s", "step_s_q1", "step_s_q3", "compile_s", "xla_memory_bytes")
            }
            base = rows.get("baseline", {}).get("tokens_per_s")
            rows[name]["x_baseline"] = row["tokens_per_s"] / base if base else None
            print(f"lever {name}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
        _save(args, result)
    return result


def section_decode_levers(args) -> dict:
    """The sample section's one-program rows (batch 1 and 64) under each of :data:`DECODE_LEVERS`, each in its
    own process; tokens/s, the fraction of the bytes floor, the ratio to the baseline measured here, and whether
    the tokens are the baseline's."""
    rows = {}
    result = {"rows": rows}
    batches = "1,8" if args.smoke else "1,64"
    for name, (flags, unroll, first_only) in DECODE_LEVERS.items():  # the baseline's also traces batch 1, untimed
        extra = ["--sample-rows", batches.split(",")[0] if first_only else batches, "--scan-unroll", str(unroll)]
        out = _child(args, "sample", flags, extra + (["--profile"] if name == "baseline" else []))
        if "error" in out:
            rows[name] = {"flags": flags, "error": out["error"]}
        else:
            keep = ("tokens_per_s", "fraction_of_floor", "prefill_and_compile_s", "tokens_sha256")
            rows[name] = {"flags": flags, "batches": {b: {k: r[k] for k in keep} for b, r in out["rows"].items()}}
            if "profile" in out:
                result["baseline_profile"] = out["profile"]
            base = rows.get("baseline", {}).get("batches", {})
            for b, r in rows[name]["batches"].items():
                r["x_baseline"] = r["tokens_per_s"] / base[b]["tokens_per_s"] if b in base else None
                r["same_tokens"] = r["tokens_sha256"] == base[b]["tokens_sha256"] if b in base else None
                print(f"decode lever {name} b{b}: {r['tokens_per_s']:,.0f} tok/s", flush=True)
        _save(args, result)
    return result


def _child(args, section: str, flags: str, extra: list[str]) -> dict:
    """``section`` run again in a process of its own with ``flags`` added to XLA_FLAGS (XLA reads them once, at
    start), reading this run's machine ceilings: its json, or {"error": its last line of output}."""
    work = Path(tempfile.mkdtemp(prefix=f"gpu_check_{section}_"))
    try:
        if Path(args.work, "machine.json").exists():
            shutil.copy(Path(args.work, "machine.json"), work)
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        cmd = [sys.executable, __file__, "--section", section, "--out", str(work), "--work", str(work),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps)] + extra  # fmt: skip
        proc = subprocess.run(cmd + (["--smoke"] if args.smoke else []), env=env, capture_output=True, text=True)
        if proc.returncode:
            return {"error": (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]}
        return json.loads((work / f"{section}.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _read(work: str, section: str, *keys):
    """A number another section wrote (None if that section did not run or failed)."""
    path = Path(work) / f"{section}.json"
    if not path.exists():
        return None
    value = json.loads(path.read_text())
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else None
    return value


# ----------------------------------------------------------------------------------------------- driver


def _error(e: Exception) -> str:
    """An exception as one line for the JSON and the table: its type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def _save(args, result: dict) -> None:
    result["seconds"] = time.perf_counter() - args.t0
    Path(args.work, f"{args.section}.json").write_text(json.dumps(result, indent=2) + "\n")


def run_section(args) -> int:
    _save(args, globals()[f"section_{args.section}"](args))
    return 0


def drive(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    chosen = args.sections.split(",") if args.sections else list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        sys.exit(f"--sections {unknown}; allowed: {list(SECTIONS)}")
    lists = (
        ("--rows", args.rows, SPEED_ROWS),
        ("--variants", args.variants, CORRECTNESS_VARIANTS),
        ("--sample-rows", args.sample_rows, SMOKE_SAMPLE_ROWS if args.smoke else SAMPLE_ROWS),
    )
    for flag, given, allowed in lists:
        unknown = [x for x in (given.split(",") if given else []) if x not in allowed]
        if unknown:  # before any section starts, not after minutes of others
            sys.exit(f"{flag} {unknown}; allowed: {list(allowed)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if args.smoke:
        env.setdefault("JAX_PLATFORMS", "cpu")
        # one CPU device, whatever the caller set; toy shapes are compile-bound: XLA's backend at level 0 and its
        # elemental fusion emitters (as the test suite compiles, tests/conftest.py)
        env["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # each section's own peak, and room for torch
    work = out / "sections"  # each section's json; merged into gpu_check.json after every section
    work.mkdir(exist_ok=True)
    status = {}
    merged = merge(args, out, work, status)
    deadline = time.perf_counter() + args.budget_s
    for name in chosen:
        left = deadline - time.perf_counter()
        if left < 20:
            status[name] = {"rc": "not run: budget spent", "seconds": 0}
            continue
        cmd = [sys.executable, __file__, "--section", name, "--out", str(out), "--work", str(work),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps)]  # fmt: skip
        cmd += ["--rows", args.rows] if args.rows else []
        cmd += ["--variants", args.variants] if args.variants else []
        cmd += ["--sample-rows", args.sample_rows] if args.sample_rows else []
        cmd += (["--smoke"] if args.smoke else []) + (["--corpus", args.corpus] if args.corpus else [])
        limit = min(left, LIMITS[name] if not args.smoke else 120)
        start = time.perf_counter()
        with open(log, "a") as f:
            f.write(f"\n===== {name} ({time.strftime('%Y-%m-%d %H:%M:%S')}) =====\n")
            f.flush()
            rc = run_group(cmd, limit, env=env, stdout=f, stderr=subprocess.STDOUT)
        status[name] = {"rc": rc, "seconds": round(time.perf_counter() - start, 1)}
        print(f"[{name}] rc {rc}, {status[name]['seconds']} s", flush=True)
        if rc != 0:
            print("".join(log.read_text().splitlines(keepends=True)[-25:]), flush=True)
        merged = merge(args, out, work, status)
    shutil.rmtree(work, ignore_errors=True)
    print(table(merged))
    return 0 if all(s["rc"] == 0 for s in status.values()) else 1


def merge(args, out: Path, work: Path, status: dict) -> dict:
    """gpu_check.json: the run's date, commit, command and status, and every section's json found in ``work``
    (an earlier gpu_check.json's sections are kept where this run did not redo them)."""
    target = out / "gpu_check.json"
    merged = json.loads(target.read_text()) if target.exists() else {}
    merged.update({
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": _git_commit(),
        "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
        "smoke": args.smoke,
    })  # fmt: skip
    merged["status"] = merged.get("status", {}) | status
    for name in SECTIONS:
        path = work / f"{name}.json"
        if path.exists():
            merged[name] = json.loads(path.read_text())
    target.write_text(json.dumps(merged, indent=2) + "\n")
    return merged


def _git_commit() -> str | None:
    with contextlib.suppress(Exception):
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
        return sha + ("+dirty" if dirty.strip() else "")
    return None


def ceiling(m: dict) -> float | None:
    """The matmul ceiling MFU is read against: the better of JAX's and torch's bf16 products in this call."""
    mc = m.get("machine")
    if not mc:
        return None
    return max(mc["matmul"]["flops_per_s"], mc.get("torch_matmul_flops_per_s") or 0)


def table(m: dict) -> str:
    """The short table printed last: MFU by nanoGPT's count against the speed section's peak (the datasheet's on
    a known device), the causal count's beside it, and the measured :func:`ceiling` as a share of that peak."""
    lines = []
    measured = ceiling(m)
    peak = m.get("speed", {}).get("peak_flops") or measured
    if "machine" in m:
        mc = m["machine"]
        torch_mm = mc.get("torch_matmul_flops_per_s")
        lines.append(
            f"{mc['device_kind']} | {mc.get('nvidia_smi', '')} | jax {mc['versions'].get('jax')} | matmul "
            f"{mc['matmul']['flops_per_s'] / 1e12:.0f} TFLOP/s (torch {torch_mm / 1e12 if torch_mm else 0:.0f}) "
            f"| copy {mc['copy']['bytes_per_s'] / 1e9:,.0f} GB/s"
        )
    if "correctness" in m:
        c = m["correctness"]
        lines.append(
            f"correctness, |out-ref|/|ref| output / grads (bounds: f32 {BOUNDS['float32']:.0e}, bf16 "
            f"{BOUNDS['bfloat16']:.0e}); f32 matmul probe {c['f32_matmul_rel_error']:.1e}:"
        )
        for name, row in c["cases"].items():
            cells = []
            for k, v in row.items():
                if k == "decode":
                    cells.append(f"decode {v:.1e}{'' if v < BOUNDS['float32'] else ' FAIL'}")
                elif k == "error":
                    cells.append(f"ERROR {v}")
                else:
                    bound = BOUNDS["float32" if k == "float32" else "bfloat16"]
                    ok = all(x == x and x < bound for x in (v["out"], v["grads"]))  # NaN never passes
                    cells.append(f"{k} {v['out']:.1e}/{v['grads']:.1e}{'' if ok else ' FAIL'}")
            lines.append(f"  {name:<12} " + " | ".join(cells))
        if "init" in c:
            i = c["init"]
            lines.append(
                f"init ({i['layers']} layers, D {i['d_model']}): ERROR {i['error']}" if "error" in i else
                f"init ({i['layers']} layers, D {i['d_model']}): ThreeFry GPU kernel {i['kernel_used']}, "
                f"{i['leaves_differing']} of {i['leaves']} parameters differ from XLA's lowering; "
                f"{i['create_state_s']:.1f} s against {i['xla_lowering_s']:.1f} s"
            )  # fmt: skip
    if "speed" in m:
        s = m["speed"]["rows"]
        source = m["speed"].get("peak_source", "the measured matmul")
        share = f"; the measured matmul ceiling is {measured / peak:.0%} of it" if measured and peak else ""
        tflops = peak / 1e12 if peak else 0
        lines.append(f"MFU: nanoGPT's/PaLM's FLOP count over {tflops:,.1f} TFLOP/s ({source}){share}; causal: "
                     "qkvjax's causal count over the same peak")  # fmt: skip
        lines.append(
            f"{'train step':<22} {'tok/s':>10} {'IQR':>6} {'x sep':>6} {'MFU':>6} {'causal':>6} {'compile s':>9} "
            f"{'mem GiB':>7}"
        )
        lines += [f"{k:<22} ERROR {r['error']}" for k, r in s.items() if "error" in r]
        s = {k: r for k, r in s.items() if "error" not in r}
        rows = [(k, r, r.get("mfu_flops_per_token"), r["train_flops_per_token"], r["compile_s"], r["xla_memory_bytes"])
                for k, r in s.items()]  # fmt: skip
        if "torch" in m:  # each torch shape beside its own `separate` row, with that row's FLOP count
            for t, prefix in ((m["torch"], ""), (m["torch"].get("real_vocab"), "124m:")):
                if not t or "tokens_per_s" not in t:
                    continue
                label = prefix + ("torch.compile" if t["compiled"] else "torch eager")
                ref = s.get(prefix + "separate", {})
                rows.append((label, t, ref.get("mfu_flops_per_token"), ref.get("train_flops_per_token"),
                             t["warmup_and_compile_s"], t["peak_device_bytes"]))  # fmt: skip
        for name, r, flops, causal, compile_s, mem in rows:
            sep = s.get(("124m:" if name.startswith("124m:") else "") + "separate", {}).get("tokens_per_s")
            tps = r["tokens_per_s"]
            mfu = f"{100 * tps * flops / peak:.1f}%" if peak and flops else "n/a"
            mfu_causal = f"{100 * tps * causal / peak:.1f}%" if peak and causal else "n/a"
            ratio = f"{tps / sep:.2f}" if sep else "n/a"
            mem = f"{mem / 2**30:.1f}" if mem else "n/a"
            # the timed steps' interquartile range as +-% of the median step: a ratio inside it is noise
            iqr = f"{50 * (r['step_s_q3'] - r['step_s_q1']) / r['step_s']:.1f}%" if "step_s_q1" in r else "n/a"
            fused = f" cuDNN x{r['cudnn_attention_calls']}" if r.get("cudnn_attention_calls") else ""
            cells = f"{tps:>10,.0f} {iqr:>6} {ratio:>6} {mfu:>6} {mfu_causal:>6} {compile_s:>9.1f} {mem:>7}"
            lines.append(f"{name:<22} {cells}{fused}")
    if "train" in m:
        t = m["train"]
        lines.append(
            f"train/resume: killed after step {t['killed_after_logged_step']}, resumed from "
            f"{t['checkpoints_left_at_kill']}; final loss {t['final_loss_straight']:.6f} straight, "
            f"{t['final_loss_resumed']:.6f} resumed; identical: losses {t['losses_identical']}, "
            f"params {t['params_identical']} (max diff {t['max_abs_param_diff']:.1e})"
        )
    if "sample" in m:
        for b, r in m["sample"]["rows"].items():
            frac = f"{100 * r['fraction_of_floor']:.0f}% of floor" if r.get("fraction_of_floor") else ""
            if r.get("fraction_of_datasheet_floor"):
                frac += f" ({100 * r['fraction_of_datasheet_floor']:.0f}% at the datasheet's bandwidth)"
            twin = f", x{r['x_scan']:.2f} the scan, same tokens: {r['same_tokens']}" if "x_scan" in r else ""
            lines.append(f"sample b{b}: {r['tokens_per_s']:,.0f} tok/s {frac}{twin}")
    for name, r in m.get("levers", {}).get("rows", {}).items():
        if "error" in r:
            lines.append(f"lever {name}: ERROR {r['error']}")
            continue
        iqr = 50 * (r["step_s_q3"] - r["step_s_q1"]) / r["step_s"]
        ratio = f"x{r['x_baseline']:.3f}" if r.get("x_baseline") else ""
        lines.append(f"lever {name} (batch {r['batch']}): {r['tokens_per_s']:,.0f} tok/s ±{iqr:.1f}% {ratio}")
    for name, r in m.get("decode_levers", {}).get("rows", {}).items():
        if "error" in r:
            lines.append(f"decode lever {name}: ERROR {r['error']}")
            continue
        for b, x in r["batches"].items():
            ratio = f"x{x['x_baseline']:.2f}, same tokens: {x['same_tokens']}" if x.get("x_baseline") else ""
            lines.append(f"decode lever {name} b{b}: {x['tokens_per_s']:,.0f} tok/s {ratio}")
    prof = m.get("decode_levers", {}).get("baseline_profile", {})
    for plane, p in prof.get("planes", {}).items():  # a device's kernels per decode step, and the busiest
        if not plane.startswith("/device:"):  # the host's: Python frames and compiles, in the json only
            continue
        steps = prof["decode_steps"]  # a device's lines (its streams, XLA's op and module lines) each count apart
        busiest = ", ".join(f"{x['line'][:30]} {x['events'] / steps:.0f}" for x in p["lines"][:3])
        top = ", ".join(f"{e['name'][:40]} {e['total_ms'] / steps:.3f} ms" for e in p["top_events"][:4])
        lines.append(f"profile {plane}: events a decode step, busiest lines: {busiest}; per step: {top}")
    lines.append("status: " + ", ".join(f"{k} {v['rc']} ({v['seconds']} s)" for k, v in m["status"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json, gpu_check.log and each section's json")
    p.add_argument("--smoke", action="store_true", help="toy shapes on the CPU: the same code paths in seconds")
    p.add_argument("--sections", default=None, help=f"comma-separated, of {','.join(SECTIONS)} (default all)")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # one section, in the driver's child
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)  # where the child writes its json
    p.add_argument("--batch-size", type=int, default=None, help="train batch (default 32; 2 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed train steps (default 20; 3 with --smoke)")
    p.add_argument("--corpus", default=None, help="text for the train section (default README.md)")
    p.add_argument("--rows", default=None, help=f"speed rows, comma-separated, of {','.join(SPEED_ROWS)}")
    p.add_argument(
        "--variants", default=None, help=f"correctness rows, comma-separated, of {','.join(CORRECTNESS_VARIANTS)}"
    )
    p.add_argument(
        "--sample-rows",
        default=None,
        help=f"sample rows, comma-separated, of {','.join(SAMPLE_ROWS)} (default all; --smoke: "
        f"{','.join(SMOKE_SAMPLE_ROWS)})",
    )
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)  # the sample section traces batch 1
    p.add_argument("--scan-unroll", type=int, default=1, help=argparse.SUPPRESS)  # the sample section's loop
    p.add_argument("--budget-s", type=float, default=540, help="seconds for all sections; those left over are skipped")
    args = p.parse_args(argv)
    args.t0 = time.perf_counter()
    args.batch_size = args.batch_size or (2 if args.smoke else 32)
    args.steps = args.steps or (3 if args.smoke else 20)
    if args.section:
        return run_section(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
