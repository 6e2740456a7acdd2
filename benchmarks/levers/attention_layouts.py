"""The layout choices inside ``qkvjax.attention.core``, each timed against its alternative (forward + backward).

    python benchmarks/levers/attention_layouts.py [--batch 8 --seq 256 --d-model 384 --heads 6 --head-dim 64]

1. projections: one einsum per kernel (what core.project does) vs one einsum over kernels concatenated on heads;
2. grouped scores: queries folded to (B, K, T*G, H) (what core does) vs a five-axis (B, K, G, T, S) layout, for
   K = N (multi-head), a GQA K and K = 1;
3. the whole attention layer: qkvjax (einsum and jax.nn.dot_product_attention paths) vs flax's
   MultiHeadDotProductAttention.

Runners are timed alternately and the median of 15 is printed with the ratio to the first row of each block.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from qkvjax import Attention, AttentionConfig
from qkvjax.attention import core


def timed(cases: dict, repeats: int = 15) -> None:
    fns = {
        name: jax.jit(jax.grad(lambda *a, f=f: _loss(f(*a)), argnums=tuple(range(len(args)))))
        for name, (f, args) in cases.items()
    }
    for name, fn in fns.items():
        jax.block_until_ready(fn(*cases[name][1]))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*cases[name][1]))
            times[name].append(time.perf_counter() - start)
    first = statistics.median(next(iter(times.values())))
    for name, t in times.items():
        m = statistics.median(t)
        print(f"  {name:<34} {1e3 * m:8.1f} ms   x{m / first:.2f}")


def _loss(out) -> jax.Array:
    return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in jax.tree.leaves(out))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args(argv)
    b, t, d, n, h = a.batch, a.seq, a.d_model, a.heads, a.head_dim
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    x = jax.random.normal(next(keys), (b, t, d))
    ws = [jax.random.normal(next(keys), (d, n, h)) / math.sqrt(d) for _ in range(3)]
    print(f"{jax.devices()[0].device_kind}: B={b} T={t} D={d} N={n} H={h}, forward + backward, median of 15")

    print("1. projections of one input")

    def per_kernel(x, *w):
        return core.project(x, list(w))

    def concatenated(x, *w):
        y = jnp.einsum("BTD,DCH->BTCH", x, jnp.concatenate(w, axis=1))
        return jnp.split(y, [n * (i + 1) for i in range(len(w) - 1)], axis=2)

    timed({"one einsum per kernel (qkvjax)": (per_kernel, (x, *ws)), "concatenated kernels": (concatenated, (x, *ws))})

    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    for kv in sorted({n, max(1, n // 3), 1}, reverse=True):
        g = n // kv
        q = jax.random.normal(next(keys), (b, t, n, h))
        k, v = (jax.random.normal(next(keys), (b, t, kv, h)) for _ in range(2))
        print(f"2. grouped scores, K={kv} (G={g})")

        def folded(q, k, v, kv=kv, g=g):
            mask = core.grouped(causal[None, None], kv, g)
            return core.mix_values(core.softmax_weights(core.qk_logits(q, k), mask), v, t)

        def five_axes(q, k, v, kv=kv, g=g):
            logits = jnp.einsum("BTKGH,BSKH->BKGTS", (q / math.sqrt(h)).reshape(b, t, kv, g, h), k)
            w = jax.nn.softmax(jnp.where(causal[None, None, None], logits, jnp.finfo(jnp.float32).min), axis=-1)
            return jnp.einsum("BKGTS,BSKH->BTKGH", w, v).reshape(b, t, n, h)

        timed(
            {
                "folded (B, K, T*G, S) (qkvjax)": (folded, (q, k, v)),
                "five axes (B, K, G, T, S)": (five_axes, (q, k, v)),
            }
        )

    print("3. the attention layer (self-attention, causal)")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from bench import FlaxAttention

    def layer(module):
        params = module.init(jax.random.PRNGKey(1), x, causal=True)
        return lambda p, x: module.apply(p, x, causal=True), (params, x)

    timed(
        {
            "qkvjax separate, einsum": layer(Attention(AttentionConfig(n, h, implementation="einsum"))),
            "qkvjax separate, jax.nn (xla)": layer(Attention(AttentionConfig(n, h, implementation="xla"))),
            "flax MultiHeadDotProductAttention": layer(FlaxAttention(AttentionConfig(n, h))),
            "qkvjax shared_kv": layer(Attention(AttentionConfig(n, h, scheme="shared_kv"))),
            "qkvjax shared_qkv": layer(Attention(AttentionConfig(n, h, scheme="shared_qkv"))),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
