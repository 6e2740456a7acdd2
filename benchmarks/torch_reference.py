"""The qkvjax decoder LM (``separate`` scheme, GQA allowed) written in PyTorch, for speed comparisons only.

    pip install torch==2.13.0        # optional; a CPU build on this kind of machine
    python benchmarks/torch_reference.py --config experiments/configs/shakespeare_char.py --batch-size 8 --steps 10

Same shapes and maths as ``qkvjax.models.lm.DecoderLM``: token embedding (V, D) tied with the output, learned
positions, pre-norm blocks (LayerNorm without bias, eps 1e-6), bias-free Q/K/V/O projections with
``scaled_dot_product_attention`` (causal, GQA through ``enable_gqa``), a tanh-GELU MLP, a final LayerNorm; the same
initial scales (normal 0.02 embeddings, normal 0.01 positions, truncated-normal fan-in kernels); AdamW with the
config's betas, weight decay on matrices only, global-norm clipping. :func:`load_flax_params` copies a qkvjax
parameter tree in, so the logits can be compared (``tests/test_torch_reference.py``). Written for this project.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the repository (or this folder) importable
    sys.path.insert(0, str(REPO))

from qkvjax.config import Config, TrainConfig, apply_overrides, load_config_file  # noqa: E402
from qkvjax.models.lm import ModelConfig  # noqa: E402


def _trunc_fan_in(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    # flax's variance_scaling(1, "fan_in", "truncated_normal"): std 1/sqrt(fan_in), cut at 2 std, rescaled
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    return nn.init.trunc_normal_(torch.empty(shape), std=std, a=-2 * std, b=2 * std)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        att = cfg.attention
        d, n, k, h, f = cfg.d_model, att.num_heads, att.kv_heads, att.head_dim, cfg.mlp_width
        self.n, self.k, self.h = n, k, h
        self.ln_attention = nn.LayerNorm(d, eps=1e-6, bias=False)
        self.w_q = nn.Parameter(_trunc_fan_in((d, n * h), d))  # (D, N*H)
        self.w_k = nn.Parameter(_trunc_fan_in((d, k * h), d))  # (D, K*H)
        self.w_v = nn.Parameter(_trunc_fan_in((d, k * h), d))
        self.w_o = nn.Parameter(_trunc_fan_in((n * h, d), n * h))  # (N*H, D)
        self.ln_mlp = nn.LayerNorm(d, eps=1e-6, bias=False)
        self.w_in = nn.Parameter(_trunc_fan_in((d, f), d))
        self.w_out = nn.Parameter(_trunc_fan_in((f, d), f))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.ln_attention(x)
        q = (y @ self.w_q).view(b, t, self.n, self.h).transpose(1, 2)  # BTNH -> BNTH
        k = (y @ self.w_k).view(b, t, self.k, self.h).transpose(1, 2)
        v = (y @ self.w_v).view(b, t, self.k, self.h).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.k != self.n)
        x = x + o.transpose(1, 2).reshape(b, t, self.n * self.h) @ self.w_o
        return x + F.gelu(self.ln_mlp(x) @ self.w_in, approximate="tanh") @ self.w_out


class TorchLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        att = cfg.attention
        plain = not (att.use_bias or att.rope or att.qk_norm or att.v_norm or att.relative_bias or cfg.layers)
        plain = plain and att.value_dim == att.head_dim
        if att.scheme != "separate" or not plain or not cfg.tie_embeddings or cfg.dropout_rate:
            raise ValueError(
                "the PyTorch reference covers the separate scheme in every layer without biases, rotary, norms or "
                "dropout, tied"
            )
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(cfg.max_len, cfg.d_model) * 0.01)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_final = nn.LayerNorm(cfg.d_model, eps=1e-6, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens] + self.pos_embed[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_final(x) @ self.embed.T  # BTD,VD->BTV


def load_flax_params(model: TorchLM, params) -> None:
    """Copies a qkvjax ``separate`` parameter tree (plain arrays) into ``model``."""

    def t(x, shape=None):
        a = torch.from_numpy(np.asarray(x, dtype=np.float32).copy())
        return a.reshape(shape) if shape is not None else a

    with torch.no_grad():
        model.embed.copy_(t(params["embed"]))
        model.pos_embed.copy_(t(params["pos_embed"]))
        model.ln_final.weight.copy_(t(params["ln_final"]["scale"]))
        for i, block in enumerate(model.blocks):
            p = params[f"block_{i}"]
            att = p["attention"]
            block.ln_attention.weight.copy_(t(p["ln_attention"]["scale"]))
            block.ln_mlp.weight.copy_(t(p["ln_mlp"]["scale"]))
            for name in ("w_q", "w_k", "w_v"):
                w = np.asarray(att[name])  # (D, N, H) -> (D, N*H)
                getattr(block, name).copy_(t(w, (w.shape[0], -1)))
            w_o = np.asarray(att["w_o"])  # (N, H, D) -> (N*H, D)
            block.w_o.copy_(t(w_o, (-1, w_o.shape[-1])))
            block.w_in.copy_(t(p["mlp"]["w_in"]))
            block.w_out.copy_(t(p["mlp"]["w_out"]))


def make_optimizer(model: TorchLM, tc: TrainConfig) -> torch.optim.Optimizer:
    """AdamW at the peak learning rate (the benchmark times steps, not the schedule); decay on matrices only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    fused = next(model.parameters()).is_cuda  # one kernel for the whole update on a GPU (as nanoGPT does)
    return torch.optim.AdamW(groups, lr=tc.learning_rate, betas=(tc.b1, tc.b2), eps=1e-8, fused=fused)


COMPILES = ("off", "model", "step")  # nothing compiled; the model only (nanoGPT's); the whole step (below)
MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes (the last two use CUDA graphs on a GPU)
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")  # "auto": torch's own pick, recorded as such


def train_step_fn(model: TorchLM, opt: torch.optim.Optimizer, tc: TrainConfig, dtype: str = "float32", forward=None,
                  compile: str = "off", mode: str = "default"):  # fmt: skip
    """One AdamW step. ``dtype`` 'bfloat16' runs the forward under autocast (float32 parameters, bfloat16
    matmuls and attention: what qkvjax's ``dtype='bfloat16'`` computes); ``forward`` is the model or its
    ``torch.compile``d form. ``compile='step'`` compiles the whole step as the strongest fair reference does: the
    forward and the loss in one graph (AOTAutograd compiles its backward with it), and the gradient clipping with
    the AdamW update in another (PyTorch's "compiling the optimizer" recipe), both in ``mode``; only the
    ``.backward()`` call and the loss's ``.item()`` (the host sync qkvjax's loop makes when it logs) stay in Python."""
    device_type = next(model.parameters()).device.type
    autocast = dtype != "float32"
    forward = model if forward is None else forward  # a compiled module refuses bool()

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=autocast):
            logits = forward(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()

    if compile == "step":
        loss_of, update = torch.compile(loss_of, mode=mode), torch.compile(update, mode=mode)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = loss_of(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        update()
        return loss.item()  # a host sync, as qkvjax's loop does when it logs

    return step


def _sdpa(backend: str):
    """The context that forces ``backend`` for ``scaled_dot_product_attention`` ("auto": none)."""
    import contextlib

    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "math": "MATH"}  # fmt: skip
    return sdpa_kernel(getattr(SDPBackend, names[backend]))


def runner(config: Config, batch_size: int, seed: int = 0, device: str = "cpu", compile: bool | str = False,
           mode: str = "default", sdpa: str = "auto"):  # fmt: skip
    """A zero-argument function that runs one timed train step on random bytes and returns its seconds (after
    two warm-up steps, whose seconds, compiling included, are its ``warmup_s``), for ``benchmarks/bench.py`` to
    interleave with the qkvjax step. On a GPU the config's compute dtype runs under autocast, attention is
    ``scaled_dot_product_attention`` (``sdpa``: a backend forced, or torch's pick), AdamW is fused; ``compile``:
    True or 'model' wraps the model in ``torch.compile``, 'step' compiles the whole step (:func:`train_step_fn`),
    each in ``mode``."""
    compile = {True: "model", False: "off"}.get(compile, compile)
    if compile not in COMPILES or mode not in MODES or sdpa not in SDPA_BACKENDS:
        raise ValueError(f"compile={compile!r}, mode={mode!r}, sdpa={sdpa!r}; allowed: {COMPILES}, {MODES}, "
                         f"{SDPA_BACKENDS}")  # fmt: skip
    torch.manual_seed(seed)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as JAX's default precision on a GPU
        torch.backends.cudnn.allow_tf32 = True
    model = TorchLM(config.model).to(device)
    forward = torch.compile(model, mode=mode) if compile == "model" else model
    dtype = config.model.attention.dtype
    step = train_step_fn(model, make_optimizer(model, config.train), config.train, dtype, forward, compile, mode)
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(0, config.model.vocab_size, (batch_size, config.seq_len + 1))).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses = []
    start = time.perf_counter()
    with _sdpa(sdpa):
        for _ in range(2):
            losses.append(step(inputs, targets))
    warmup_s = time.perf_counter() - start

    def one_step() -> float:
        start = time.perf_counter()
        with _sdpa(sdpa):
            losses.append(step(inputs, targets))
        return time.perf_counter() - start

    one_step.warmup_s = warmup_s
    one_step.losses = losses  # every step's loss, warm-up included (a compiled step must train as eager does)
    return one_step


def time_train_steps(config: Config, batch_size: int, steps: int, seed: int = 0, compile: str = "off",
                     mode: str = "default", sdpa: str = "auto") -> list[float]:  # fmt: skip
    """Seconds per step of ``steps`` steps after two warm-up steps, on random bytes."""
    one_step = runner(config, batch_size, seed, compile=compile, mode=mode, sdpa=sdpa)
    return [one_step() for _ in range(steps)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/shakespeare_char.py"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--compile",
        default="off",
        choices=COMPILES,
        help="off; model (torch.compile of the model); step (the whole step: forward, loss, backward, clipping, AdamW)",
    )
    p.add_argument("--mode", default="default", choices=MODES, help="torch.compile's mode")
    p.add_argument("--sdpa", default="auto", choices=SDPA_BACKENDS, help="scaled_dot_product_attention's backend")
    p.add_argument("--json", action="store_true", help="print one JSON line (for benchmarks/vs_torch.py)")
    args = p.parse_args(argv)
    # as qkvjax's side is timed: no dropout, no gradient accumulation
    config = apply_overrides(
        load_config_file(args.config), {"model.dropout_rate": "0.0", "train.grad_accum_steps": "1"}
    )
    times = time_train_steps(config, args.batch_size, args.steps, compile=args.compile, mode=args.mode, sdpa=args.sdpa)
    median = statistics.median(times)
    if args.json:
        print(
            json.dumps(
                {
                    "median_s": median,
                    "tokens": args.batch_size * config.seq_len,
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "compile": args.compile,
                    "mode": args.mode,
                    "sdpa": args.sdpa,
                }
            )
        )
        return 0
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads: {median * 1e3:.1f} ms/step, "
        f"{args.batch_size * config.seq_len / median:,.0f} tokens/s (median of {args.steps})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
