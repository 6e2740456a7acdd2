"""What attention costs, read off the config and the scheme data: parameters, forward FLOPs, KV-cache bytes.

Per layer (:func:`attention_cost`) and per stack of layers (:func:`stack_cost`, which knows that a layer reading
another layer's K/V has no K/V kernels and caches nothing). Exact: the tests compare these numbers with the
parameters the modules create and the bytes of the caches they fill.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp

from qkvjax.attention.cache import cache_shapes
from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.layers import LayerAttention, expand
from qkvjax.attention.schemes import SCHEMES


@dataclasses.dataclass(frozen=True)
class AttentionCost:
    """What one attention layer costs.

    ``flops_per_token`` counts a forward pass (a multiply-add is 2 FLOPs) for one token that is projected in
    every role it plays and, as a query, attends to ``seq_len`` keys (no causal discount; a sliding window of W:
    min(seq_len, W) keys, :func:`keys_seen`): projections +
    scores (q.k and the weighted sum of values) + output projection. Norms are not counted.
    """

    scheme: str
    params: int
    projection_flops: int
    score_flops: int
    output_flops: int
    kv_cache_bytes_per_token: int

    @property
    def flops_per_token(self) -> int:
        return self.projection_flops + self.score_flops + self.output_flops


def keys_seen(config: AttentionConfig, seq_len: int) -> int:
    """Keys a query attends to at most: ``seq_len``, or its sliding window."""
    return seq_len if config.sliding_window is None else min(seq_len, config.sliding_window)


def causal_keys_seen(config: AttentionConfig, seq_len: int) -> float:
    """Keys a causal query sees on average over positions 0..T-1: (T + 1) / 2, or with a window of W < T,
    (W (W + 1) / 2 + (T - W) W) / T (each position sees min(t + 1, W))."""
    w = keys_seen(config, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def attention_cost(config: AttentionConfig, d_model: int, seq_len: int, kv_shared: bool = False) -> AttentionCost:
    """One layer; ``kv_shared``: the layer reads another layer's keys and values (no K/V kernels, no cache)."""
    scheme = config.tying
    seq_len = keys_seen(config, seq_len)
    cache_bytes = 0
    if not kv_shared:
        per_token = sum(math.prod(shape) for shape in cache_shapes(config, d_model, 1).values())
        cache_bytes = per_token * jnp.dtype(config.dtype).itemsize
    if scheme.latent:
        return _latent_cost(config, d_model, seq_len, cache_bytes)
    n, k, h, hv, d = config.num_heads, config.kv_heads, config.head_dim, config.value_dim, d_model
    bias = 1 if config.use_bias else 0
    params = n * hv * d + (d if config.has_output_bias else 0)  # w_o, b_o
    proj_flops = 0
    for group in scheme.groups:
        if kv_shared and group in scheme.kv_groups:
            continue
        heads, width = scheme.heads(group, n, k), config.width(group)
        params += d * heads * width + bias * heads * width
        proj_flops += 2 * d * heads * width
    if scheme.bilinear:
        params += n * d * d
        proj_flops += 2 * n * d * d  # x_t^T W_QK[n], once per query token
        score_flops = 2 * n * d * seq_len + 2 * n * hv * seq_len
    else:
        score_flops = 2 * n * h * seq_len + 2 * n * hv * seq_len  # q.k, then the weighted sum of values
    if config.relative_bias:
        params += n * (2 * config.relative_bias + 1)
        score_flops += n * seq_len  # one addition per score
    if config.learned_temperature:
        params += n
    if config.qk_norm:  # q_norm_scale, and k_norm_scale unless the layer reads another layer's K/V
        params += h if kv_shared else 2 * h
    return AttentionCost(
        scheme=scheme.name,
        params=params,
        projection_flops=proj_flops,
        score_flops=score_flops,
        output_flops=2 * n * hv * d,
        kv_cache_bytes_per_token=cache_bytes,
    )


def _latent_cost(config: AttentionConfig, d: int, seq_len: int, cache_bytes: int) -> AttentionCost:
    """MLA as trained (keys and values up-projected from the latents, :mod:`qkvjax.attention.latent`): every
    kernel is one matmul per token (2 FLOPs per weight); the norms' scales are parameters only."""
    n, k, h, hv, r, hr = (
        config.num_heads,
        config.kv_heads,
        config.head_dim,
        config.value_dim,
        config.latent_dim,
        config.rope_dim,
    )
    rq = config.q_rank
    kernels = (d if rq is None else rq) * n * (h + hr) + (0 if rq is None else d * rq)  # queries
    kernels += d * r + r * k * (h + hv) + d * config.rope_key_heads * hr  # w_kv_down, w_k_up, w_v_up, w_k_rope
    norms = (r + (rq or 0)) if config.latent_norm else 0
    biases = (n * h if config.use_bias else 0) + (d if config.has_output_bias else 0)  # b_q, b_o
    return AttentionCost(
        scheme=config.scheme,
        params=kernels + norms + biases + n * hv * d,
        projection_flops=2 * kernels,
        score_flops=2 * n * (h + hr) * seq_len + 2 * n * hv * seq_len,
        output_flops=2 * n * hv * d,
        kv_cache_bytes_per_token=cache_bytes,
    )


def stack_cost(layers: Sequence[LayerAttention], d_model: int, seq_len: int) -> list[AttentionCost]:
    """One :class:`AttentionCost` per layer of a stack."""
    return [attention_cost(layer.config, d_model, seq_len, kv_shared=not layer.produces_kv) for layer in layers]


def _head_dim(d_model: int, num_heads: int, head_dim: int | None) -> int:
    for name, value in (("d_model", d_model), ("num_heads", num_heads)):
        if value < 1:
            raise ValueError(f"{name}={value}; allowed: an integer >= 1")
    if head_dim is None:
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; pass head_dim")
        head_dim = d_model // num_heads
    return head_dim


def cost_table(
    d_model: int,
    num_heads: int,
    seq_len: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str = "bfloat16",
) -> str:
    """A text table of :func:`attention_cost` for every registered scheme, with ratios to ``separate``."""
    head_dim = _head_dim(d_model, num_heads, head_dim)
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}; allowed: an integer >= 1")
    base = attention_cost(AttentionConfig(num_heads, head_dim, num_kv_heads, "separate", dtype=dtype), d_model, seq_len)
    k = num_heads if num_kv_heads is None else num_kv_heads
    groups = {
        name: "{" + "}{".join(scheme.groups) + "}" + ("+W_QK" if scheme.bilinear else "@R" if scheme.latent else "")
        for name, scheme in SCHEMES.items()
    }
    w, g = max(map(len, ["scheme", *groups])), max(map(len, ["groups", *groups.values()]))  # columns that line up
    lines = [
        f"one attention layer: d_model={d_model}, N={num_heads}, K={k}, H={head_dim}, seq_len={seq_len}, "
        f"cache dtype={dtype}; FLOPs are forward, per token attending to seq_len keys",
        f"{'scheme':<{w}} {'groups':<{g}} {'params':>11} {'x sep':>6} {'proj FLOPs':>11} {'FLOPs/token':>12} "
        f"{'x sep':>6} {'KV bytes/tok':>12} {'x sep':>6}",
    ]
    for name in SCHEMES:
        try:
            cfg = AttentionConfig(num_heads, head_dim, num_kv_heads, name, dtype=dtype)
        except ValueError as e:
            lines.append(f"{name:<{w}} {groups[name]:<{g}} n/a: {str(e).split(';')[0]}")
            continue
        c = attention_cost(cfg, d_model, seq_len)
        lines.append(
            f"{name:<{w}} {groups[name]:<{g}} {c.params:>11,} {c.params / base.params:>6.2f} {c.projection_flops:>11,} "
            f"{c.flops_per_token:>12,} {c.flops_per_token / base.flops_per_token:>6.2f} "
            f"{c.kv_cache_bytes_per_token:>12,} {c.kv_cache_bytes_per_token / base.kv_cache_bytes_per_token:>6.2f}"
        )
    return "\n".join(lines)


def layout_table(
    layouts: dict[str, str],
    d_model: int,
    num_heads: int,
    num_layers: int,
    seq_len: int,
    head_dim: int | None = None,
    dtype: str = "bfloat16",
) -> str:
    """Whole attention stacks, one row per ``{name: layer pattern}`` (see :mod:`qkvjax.attention.layers`):
    attention parameters, KV-cache bytes per token over all layers, and the layers that cache K/V."""
    head_dim = _head_dim(d_model, num_heads, head_dim)
    base = AttentionConfig(num_heads, head_dim, dtype=dtype)
    rows = []
    for name, pattern in layouts.items():
        costs = stack_cost(expand(pattern, base, num_layers), d_model, seq_len)
        rows.append((name, pattern, sum(c.params for c in costs), sum(c.kv_cache_bytes_per_token for c in costs),
                     sum(c.kv_cache_bytes_per_token > 0 for c in costs)))  # fmt: skip
    ref_params, ref_cache = rows[0][2], rows[0][3]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"attention stacks: d_model={d_model}, N={num_heads}, H={head_dim}, L={num_layers}, seq_len={seq_len}, "
        f"cache dtype={dtype}; ratios to {rows[0][0]!r}",
        f"{'layout':<{width}} {'attn params':>12} {'x':>5} {'KV bytes/tok':>12} {'x':>5} {'KV MiB @ctx':>11} "
        f"{'caching':>7}  pattern",
    ]
    for name, pattern, params, cache, caching in rows:
        lines.append(
            f"{name:<{width}} {params:>12,} {params / ref_params:>5.2f} {cache:>12,} {cache / ref_cache:>5.2f} "
            f"{cache * seq_len / 2**20:>11.1f} {caching:>4}/{num_layers:<2}  {pattern or '(base everywhere)'}"
        )
    return "\n".join(lines)
