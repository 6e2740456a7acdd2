"""A stored fused projection against the kernels kept apart, the whole train step, interleaved in one process.

``separate`` keeps W^Q, W^K, W^V as three (D, N, H) parameters and projects with three matmuls
(``qkvjax.attention.core.project``). The lever (performance round 3): keep the groups of a scheme whose kernels
have one shape as ONE parameter ``w_qkv: (D, G, N, H)`` (nanoGPT's ``c_attn`` is one (D, 3D) matrix), project with
one (B T, D) @ (D, G N H) matmul and take each group's output as a slice: no concatenation of kernels at run time,
no split of their gradient. This script traces the model once as it is and once with ``tied_projections``
and ``module.project`` replaced by the fused form (nothing in the library changes), checks both compute the same
loss from the same weights, and times the two train steps alternately.

    python benchmarks/levers/fused_projection.py --sizes 48,96,160 --steps 30 \
        --json benchmarks/results/fused_projection_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from experiments.ladder import size_config  # noqa: E402
from qkvjax import axes  # noqa: E402
from qkvjax.attention import core, module  # noqa: E402
from qkvjax.config import DataConfig, apply_overrides  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402

FUSED = "w_fused"


def fused_projections(original):
    """``tied_projections`` with the groups' kernels stored as one (D, G, C, H) parameter when they share a
    shape (else as before); ``kernels[FUSED]`` holds it, ``kernels[group]`` a slice for whoever reads them."""

    def projections(cfg, d, reads_kv, make):
        scheme = cfg.tying
        groups = scheme.groups
        shapes = {(scheme.heads(g, cfg.num_heads, cfg.kv_heads), cfg.width(g)) for g in groups}
        if reads_kv or cfg.use_bias or scheme.bilinear or len(groups) == 1 or len(shapes) != 1:
            return original(cfg, d, reads_kv, make)
        ((heads, width),) = shapes
        names = (axes.EMBED, None, axes.HEADS, axes.HEAD_DIM)
        # fan-in init over D per group, as three (D, C, H) kernels: batch axis G, out axes (C, H)
        w = make.make_kernel(FUSED, (d, len(groups), heads, width), names, 0, (2, 3), 1.0, 1)
        slices = {f"w_{g}": w[:, i] for i, g in enumerate(groups)}

        class Sliced:  # the original makes everything else; its group kernels are the fused one's slices
            make_param = staticmethod(make.make_param)

            @staticmethod
            def make_kernel(name, *a, **k):
                return slices[name] if name in slices else make.make_kernel(name, *a, **k)

        p = original(cfg, d, reads_kv, Sliced)
        return dataclasses.replace(p, kernels={FUSED: w, **p.kernels})

    return projections


def fused_project(original):
    def project(x_q, x_kv, p, scheme, call):
        if FUSED not in p.kernels or not call.self_attention or call.kv is not None:
            return original(x_q, x_kv, p, scheme, call)
        w = p.kernels[FUSED]  # (D, G, C, H)
        b, t, d = x_q.shape
        y = core.dense(x_q, w.reshape(d, -1)).reshape(b, t, *w.shape[1:])  # BTD,D(GCH)->BTGCH
        out = {g: y[:, :, i] for i, g in enumerate(scheme.groups)}
        return out, module.KV.fresh({g: out[g] for g in scheme.kv_groups})

    return project


def fuse_params(tree, groups):
    """The apart model's parameters in the fused model's layout: each layer's w_<group> stacked on axis 1."""
    if not isinstance(tree, dict):
        return tree
    names = [f"w_{g}" for g in groups]
    if all(n in tree for n in names):
        rest = {k: v for k, v in tree.items() if k not in names}
        return rest | {FUSED: jnp.stack([nn.meta.unbox(tree[n]) for n in names], axis=1)}
    return {k: fuse_params(v, groups) for k, v in tree.items()}


def same_loss(cfg) -> float:
    """|loss_fused - loss_apart| / loss_apart on one batch, the fused model given the apart model's weights."""
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, cfg.seq_len + 1), 0, cfg.model.vocab_size)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss(model, params):
        logits = model.apply({"params": params}, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))

    model = DecoderLM(cfg.model)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), x)["params"])
    apart = loss(model, params)
    with patched():
        fused = loss(DecoderLM(cfg.model), fuse_params(params, cfg.model.attention.tying.groups))
    return float(abs(fused - apart) / apart)


@contextlib.contextmanager
def patched():
    originals = module.tied_projections, module.project
    module.tied_projections = fused_projections(originals[0])
    module.project = fused_project(originals[1])
    try:
        yield
    finally:
        module.tied_projections, module.project = originals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="48,96,160", help="the scaling protocol's widths (experiments/scaling.py)")
    p.add_argument("--schemes", default="separate,shared_qk", help="schemes with 2+ groups of one shape")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for scheme in args.schemes.split(","):
            cfg = size_config(size, "separate", 4e-3, 0, 1, DataConfig(dataset="tiny_shakespeare"))
            cfg = apply_overrides(cfg, {"model.attention.scheme": scheme})
            apart = bench.prepare_train(DecoderLM(cfg.model), cfg)
            with patched():
                fused = bench.prepare_train(DecoderLM(cfg.model), cfg)
            error = same_loss(cfg)
            if error > 1e-5:
                raise SystemExit(f"d{size} {scheme}: the fused model's loss differs by {error:.2e} (relative)")
            a, f = bench.interleaved(apart["step"], fused["step"], args.steps)
            tokens = apart["tokens"]
            rows.append({"size": size, "scheme": scheme, "apart_tokens_per_s": tokens / a,
                         "fused_tokens_per_s": tokens / f, "ratio": a / f, "loss_rel_diff": error})  # fmt: skip
            print(f"d{size} {scheme:10s} kernels apart {tokens / a:>9,.0f} tok/s, stored fused {tokens / f:>9,.0f} "
                  f"tok/s: x{a / f:.3f} (medians of {args.steps} steps, alternated)", flush=True)  # fmt: skip
    bench.write_rows(args.json, "fused_projection.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
