"""Pure functions of attention: projections, rotary embedding, grouped scores, masks, mixing values.

Shapes follow the legend in :mod:`qkvjax.axes`; ``E`` in an einsum is a second model-width axis (the key side
of a bilinear form). Every function is rank-exact, so it runs under ``jax_numpy_rank_promotion='raise'``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import Array

# Reformer replaces the self score with a finite penalty (not -inf), so a token whose only allowed target is
# itself still attends to itself. -1e4 is representable in float16 and bfloat16 and far below any key-normalised
# score (|q.k/|k|| / sqrt(H) <= |q| / sqrt(H)), and it stays above the mask value, which must win.
SELF_PENALTY = -1e4


def project(x: Array, kernels: Sequence[Array], biases: Sequence[Array] | None = None) -> list[Array]:
    """All projections of one input in one einsum: ``BTD,DCH->BTCH`` over the kernels stacked on heads.

    kernels: (D, C_i, H) each; biases: (C_i, H) each. Returns one (B, T, C_i, H) array per kernel.
    """
    w = kernels[0] if len(kernels) == 1 else jnp.concatenate(kernels, axis=1)
    y = jnp.einsum("BTD,DCH->BTCH", x, w)
    if biases is not None:
        b = biases[0] if len(biases) == 1 else jnp.concatenate(biases, axis=0)
        y = y + b[None, None]
    sizes = [k.shape[1] for k in kernels]
    splits = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    return jnp.split(y, splits, axis=2)


def rotary(x: Array, positions: Array, base: float) -> Array:
    """Rotary position embedding (Su et al. 2021), half-split form: x (B, T, N, H), positions (B, T)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (H/2,)
    angle = positions.astype(jnp.float32)[:, :, None, None] * inv_freq[None, None, None, :]  # BT1(H/2)
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def unit_length(x: Array, eps: float = 1e-6) -> Array:
    """x / |x| over the head dim, computed in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of boolean masks of equal rank (None entries are skipped)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


def causal_mask(q_index: Array, k_index: Array) -> Array:
    """(1, 1, T, S): True where the key's index <= the query's. q_index (T,), k_index (S,)."""
    return (k_index[None, :] <= q_index[:, None])[None, None]


def grouped(mask: Array, num_kv_heads: int) -> Array:
    """A (B|1, N|1, T, S) mask as (B|1, K|1, G|1, T, S) to match grouped logits."""
    b, n, t, s = mask.shape
    if n == 1:
        return mask[:, :, None]
    return mask.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def qk_logits(q: Array, k: Array) -> Array:
    """Grouped scores q.k / sqrt(H): q (B, T, N, H), k (B, S, K, H) -> (B, K, G, T, S)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, h)  # BTNH -> BTKGH
    return jnp.einsum("BTKGH,BSKH->BKGTS", q, k) / math.sqrt(h)


def bilinear_logits(x_q: Array, w_qk: Array, x_kv: Array, num_kv_heads: int, head_dim: int) -> Array:
    """Scores x_t^T W_QK[n] x_s / sqrt(H): x_q (B, T, D), w_qk (N, D, D), x_kv (B, S, D) -> (B, K, G, T, S)."""
    b, t, _ = x_q.shape
    n, _, e = w_qk.shape
    qx = jnp.einsum("BTD,NDE->BTNE", x_q, w_qk).reshape(b, t, num_kv_heads, n // num_kv_heads, e)
    return jnp.einsum("BTKGE,BSE->BKGTS", qx, x_kv) / math.sqrt(head_dim)


def softmax_weights(
    logits: Array,
    mask: Array | None,
    self_mask: Array | None = None,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
) -> Array:
    """Masked softmax over S in float32: logits (B, K, G, T, S); masks (B|1, K|1, G|1, T, S), True = allowed.

    ``self_mask`` marks each query's own position: its score becomes :data:`SELF_PENALTY` before the mask is
    applied, so the token gets weight only if every other target is masked out (Reformer).
    """
    logits = logits.astype(jnp.float32)
    if self_mask is not None:
        logits = jnp.where(self_mask, jnp.float32(SELF_PENALTY), logits)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), jnp.float32(0.0))
    return weights


def mix_values(weights: Array, v: Array) -> Array:
    """Weighted sum of values: weights (B, K, G, T, S), v (B, S, K, H) -> (B, T, N, H)."""
    b, kv, g, t, _ = weights.shape
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights.astype(v.dtype), v)
    return out.reshape(b, t, kv * g, v.shape[-1])  # BTKGH -> BTNH
