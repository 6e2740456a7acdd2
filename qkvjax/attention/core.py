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


def dense(x: Array, w: Array, contract: int = 1) -> Array:
    """``x`` (..., A) times ``w`` (A, C) over the ``contract`` axes A they share, as one 2-D matmul:
    (prod ..., prod A) @ (prod A, prod C), then reshaped to (..., C). E.g. ``BTD,DNH->BTNH`` or ``BTNH,NHD->BTD``
    (contract=2). The reshapes are free (row-major), and XLA's CPU backend runs a 2-D dot much faster than the
    same product as one rank-3/4 ``dot_general`` (an einsum): the whole train step 1.12-1.25x faster
    (``benchmarks/levers/dense_2d.py``)."""
    lead, inner = x.shape[: x.ndim - contract], math.prod(w.shape[:contract])
    if x.shape[x.ndim - contract :] != w.shape[:contract]:
        raise ValueError(f"dense: x {x.shape} and w {w.shape} do not share their {contract} contracted axes")
    return (x.reshape(-1, inner) @ w.reshape(inner, -1)).reshape(*lead, *w.shape[contract:])


def project(x: Array, kernels: Sequence[Array], biases: Sequence[Array] | None = None) -> list[Array]:
    """Each distinct projection of one input once: ``BTD,DNH->BTNH`` per kernel (``BTD,DKH->BTKH`` for a K/V group).

    One einsum over the kernels concatenated on heads was slower (forward + backward) on the CPU: the
    concatenation and the split of its gradient cost more than the one larger matmul saves
    (``benchmarks/levers/attention_layouts.py``).
    """
    ys = [dense(x, w) for w in kernels]  # BTD,DNH->BTNH
    if biases is not None:
        ys = [y + b[None, None] for y, b in zip(ys, biases, strict=True)]
    return ys


def rotary(
    x: Array, positions: Array, base: float, seq_axis: int = 1, interleaved: bool = False, pairs: int | None = None
) -> Array:
    """Rotary position embedding (Su et al. 2021): x (B, T, N, H) (or (B, K, S, H) with ``seq_axis=2``), positions
    (B, T). Feature pair i (frequency ``base^(-i / (H/2))``) is (i, i + H/2) in the half-split form (Hugging Face's
    ``rotate_half``), or (2i, 2i + 1) when ``interleaved``. With ``pairs``, only pairs i < ``pairs`` (the highest
    frequencies) turn; the others have frequency 0 and carry no position (Gemma 4's "proportional" rotary)."""
    if interleaved:  # (..., H) -> (..., H/2, 2) -> pairs split across halves, rotated, and back
        h = x.shape[-1]
        split = jnp.swapaxes(x.reshape(*x.shape[:-1], h // 2, 2), -1, -2).reshape(x.shape)
        out = rotary(split, positions, base, seq_axis, pairs=pairs)
        return jnp.swapaxes(out.reshape(*x.shape[:-1], 2, h // 2), -1, -2).reshape(x.shape)
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (H/2,)
    if pairs is not None:
        inv_freq = jnp.where(jnp.arange(half) < pairs, inv_freq, 0.0)
    pos = positions.astype(jnp.float32)
    pos = pos[:, :, None, None] if seq_axis == 1 else pos[:, None, :, None]
    angle = pos * inv_freq[None, None, None, :]  # BT1(H/2) or B1S(H/2)
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def unit_length(x: Array, eps: float = 1e-6) -> Array:
    """x / |x| over the head dim, computed in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rms_norm(x: Array, scale: Array | None = None, eps: float = 1e-6) -> Array:
    """x / rms(x) over the head dim (times ``scale`` (H,) if given), computed in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
    return y.astype(x.dtype)


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of boolean masks of equal rank (None entries are skipped)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


def causal_mask(q_pos: Array, k_pos: Array) -> Array:
    """(B|1, 1, T, S): True where the key's position <= the query's. q_pos (B|1, T), k_pos (B|1, S)."""
    return k_pos[:, None, None, :] <= q_pos[:, None, :, None]


def window_mask(q_pos: Array, k_pos: Array, window: int) -> Array:
    """(B|1, 1, T, S): True where the key is fewer than ``window`` positions from the query, |t - s| < W (with
    :func:`causal_mask`: keys t - W + 1 .. t, Mistral's and Gemma's sliding window)."""
    return jnp.abs(k_pos[:, None, None, :] - q_pos[:, None, :, None]) < window


# Grouped-query layout. The G query heads that share a kv head are folded into the query axis, Q = T * G
# (t-major), so every score einsum is a plain batched matmul over (B, K): logits are (B, K, Q, S), the natural
# output order of dot_general, with no transposes of the scores. Against a five-axis (B, K, G, T, S) layout it is
# faster forward + backward for every G (benchmarks/levers/attention_layouts.py); for G = 1 it is plain multi-head.


def fold_queries(x: Array, num_kv_heads: int) -> Array:
    """(B, T, N, H) -> (B, K, Q, H), Q = T * G (any last axis: H, P, E)."""
    b, t, n, e = x.shape
    g = n // num_kv_heads
    return x.reshape(b, t, num_kv_heads, g, e).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, t * g, e)


def unfold_queries(x: Array, t: int) -> Array:
    """(B, K, Q, U) -> (B, T, N, U), Q = T * G."""
    b, kv, q, h = x.shape
    return x.reshape(b, kv, t, q // t, h).transpose(0, 2, 1, 3, 4).reshape(b, t, kv * (q // t), h)


def grouped(mask: Array, num_kv_heads: int, group_size: int, queries: int | None = None) -> Array:
    """A (B|1, N|1, T|1, S) mask as (B|1, K|1, T * G, S) (or (B|1, 1, 1, S) left as it is), matching folded
    logits. A per-head mask broadcast over queries (N heads, T = 1) needs ``queries`` = T (its rows repeat per
    query, ordered (t, g) as the folded logits are); without it T = 1 is taken as one query (decoding)."""
    b, n, t, s = mask.shape
    if n == 1 and t == 1:
        return mask  # the same for every head and query: broadcasts against any folded logits
    if t == 1 and n > 1 and queries is not None:
        mask, t = jnp.broadcast_to(mask, (b, n, queries, s)), queries
    if n == 1:
        return jnp.broadcast_to(mask[:, :, :, None], (b, 1, t, group_size, s)).reshape(b, 1, t * group_size, s)
    m = mask.reshape(b, num_kv_heads, group_size, t, s).transpose(0, 1, 3, 2, 4)  # BKGTS -> BKTGS
    return m.reshape(b, num_kv_heads, t * group_size, s)


def qk_logits(q: Array, k: Array, kv_layout: str = "BSKH") -> Array:
    """Grouped scores q.k / sqrt(H): q (B, T, N, H), k (B, S, K, H) or, with ``kv_layout="BKSH"`` (the decode
    cache), (B, K, S, H) -> (B, K, T * G, S)."""
    h = q.shape[-1]
    kv = k.shape[kv_layout.index("K")]
    return jnp.einsum(f"BKQH,{kv_layout}->BKQS", fold_queries(q / math.sqrt(h), kv), k)


def bilinear_logits(x_q: Array, w_qk: Array, x_kv: Array, num_kv_heads: int, head_dim: int) -> Array:
    """Scores x_t^T W_QK[n] x_s / sqrt(H): x_q (B, T, D), w_qk (N, D, D), x_kv (B, S, D) -> (B, K, T * G, S)."""
    qx = jnp.einsum("BTD,NDE->BTNE", x_q / math.sqrt(head_dim), w_qk)
    return jnp.einsum("BKQE,BSE->BKQS", fold_queries(qx, num_kv_heads), x_kv)


def relative_bias(table: Array, q_pos: Array, k_pos: Array, num_kv_heads: int) -> Array:
    """A learned score bias per head and relative offset, b_n(clip(s - t, -M, M)): table (N, 2M + 1), positions
    (B|1, T), (B|1, S) -> (B|1, K, T * G, S), folded like the logits. b(d) and b(-d) are separate parameters, so
    the term is asymmetric in (t, s)."""
    n, width = table.shape
    m = (width - 1) // 2
    offsets = jnp.clip(k_pos[:, None, :] - q_pos[:, :, None], -m, m) + m  # (B, T, S) in [0, 2M]
    bias = jnp.take(table, offsets, axis=1).transpose(1, 0, 2, 3)  # NBTS -> BNTS
    return grouped(bias, num_kv_heads, n // num_kv_heads)


def write_rows(cache: Array, new: Array, start: Array) -> Array:
    """Writes ``new`` into ``cache`` at a position per row: cache (B, K, S, H) with new (B, T, K, H), or cache
    (B, S, D) with new (B, T, D); start (B,) int. Row b's positions start_b .. start_b + T - 1 are replaced."""
    if new.ndim == 4:
        new = new.transpose(0, 2, 1, 3)  # BTKH -> BKTH

    def one(c, n, i):
        return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (0,) * (c.ndim - 2) + (i, 0))

    return jax.vmap(one)(cache, new, start)


def masked_logits(logits: Array, mask: Array | None, self_mask: Array | None = None) -> Array:
    """Scores in float32 ready for a softmax over S: each query's own key (``self_mask``) set to
    :data:`SELF_PENALTY`, then the disallowed ones (``mask`` False) to the lowest float32."""
    logits = logits.astype(jnp.float32)
    if self_mask is not None:
        logits = jnp.where(self_mask, jnp.float32(SELF_PENALTY), logits)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return logits


def softmax_weights(
    logits: Array,
    mask: Array | None,
    self_mask: Array | None = None,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
) -> Array:
    """Masked softmax over S in float32: logits (B, K, Q, S); masks (B|1, K|1, Q, S), True = allowed.

    ``self_mask`` marks each query's own position: its score becomes :data:`SELF_PENALTY` before the mask is
    applied, so the token gets weight only if every other target is masked out (Reformer).
    """
    weights = jax.nn.softmax(masked_logits(logits, mask, self_mask), axis=-1)
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), jnp.float32(0.0))
    return weights


def chunked_attention(
    q: Array, k: Array, v: Array, mask: Array | None, q_index: Array, k_index: Array, causal: bool, chunk: int
) -> Array:
    """Softmax attention over blocks of ``chunk`` keys with an online softmax (Milakov & Gimelshein 2018; the
    recurrence of FlashAttention, Dao et al. 2022): q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv), mask None or
    (B|1, N|1, T, S) boolean, indices (B|1, T), (B|1, S) -> (B, T, N, Hv). Equal to :func:`qk_logits` +
    :func:`softmax_weights` + :func:`mix_values` up to float rounding, but holds one (B, K, T * G, chunk) block
    of scores at a time, forward and backward (each block is recomputed in the backward pass)."""
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = n // kv
    pad = -s % chunk
    qf = fold_queries(q / math.sqrt(h), kv)  # (B, K, Q, H), Q = T * G
    q_rows = jnp.repeat(q_index, g, axis=-1)  # (B|1, Q): each folded row's query index
    allowed = None if mask is None else grouped(mask, kv, g, t)  # (B|1, K|1, Q|1, S)

    def blocks(x, axis, fill):  # split the key axis into (S + pad) / chunk blocks, leading
        x = jnp.pad(x, [(0, 0)] * axis + [(0, pad)] + [(0, 0)] * (x.ndim - axis - 1), constant_values=fill)
        x = x.reshape(x.shape[:axis] + (-1, chunk) + x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    ks, vs = blocks(k, 1, 0), blocks(v, 1, 0)  # (n_blocks, B, chunk, K, H)
    idx = blocks(jnp.broadcast_to(k_index, (k_index.shape[0], s)), 1, -1)  # pad keys: index -1, never allowed
    ms = None if allowed is None else blocks(allowed, 3, False)
    low = jnp.finfo(jnp.float32).min

    @jax.checkpoint
    def step(carry, block):
        m, l, acc = carry
        kb, vb, ib, mb = block
        logits = jnp.einsum("BKQH,BSKH->BKQS", qf, kb).astype(jnp.float32)
        ok = (ib >= 0)[:, None, None, :]
        if causal:
            ok = ok & (ib[:, None, None, :] <= q_rows[:, None, :, None])
        if mb is not None:
            ok = ok & mb
        logits = jnp.where(ok, logits, low)
        m_new = jnp.maximum(m, logits.max(-1))
        p = jnp.exp(logits - m_new[..., None])
        scale = jnp.exp(m - m_new)
        l = l * scale + p.sum(-1)
        acc = acc * scale[..., None] + jnp.einsum("BKQS,BSKU->BKQU", p.astype(vb.dtype), vb).astype(jnp.float32)
        return (m_new, l, acc), None

    q_len = qf.shape[2]
    init = (
        jnp.full((b, kv, q_len), low, jnp.float32),
        jnp.zeros((b, kv, q_len), jnp.float32),
        jnp.zeros((b, kv, q_len, v.shape[-1]), jnp.float32),
    )
    (_, l, acc), _ = jax.lax.scan(step, init, (ks, vs, idx, ms))
    return unfold_queries((acc / l[..., None]).astype(v.dtype), t)


def causal_attention(logits_of, v: Array, block: int, mask_self: bool = False) -> Array:
    """Causal self-attention with the scores above the diagonal never computed: query t sees keys 0..t.

    ``logits_of(lo, hi)`` gives the folded scores (B, K, (hi - lo) G, hi) of queries lo..hi-1 against keys
    0..hi-1 (:func:`block_logits` for plain q.k; any score function: bilinear forms, a relative bias); v is
    (B, T, K, Hv); the result (B, T, N, Hv). With ``mask_self`` each query's own key gets
    :data:`SELF_PENALTY` (Reformer), as :func:`softmax_weights`' ``self_mask``.

    The queries are cut into blocks of ``block`` positions (the last may be shorter); block i, queries
    [i c, (i + 1) c), is scored only against keys [0, (i + 1) c), and only its last c x c square needs the
    triangular mask. For T = n c that is n (n + 1) / 2 blocks of scores out of n^2: the score and mixing FLOPs
    (and the scores held for the backward pass) drop to (n + 1) / 2n of :func:`softmax_weights` and
    :func:`mix_values` over the full (T, T), which it equals up to float rounding. The blocks are unrolled
    (T / c of them in the program). On the CPU the attention core's forward and backward ran 1.4-2.0x faster at
    T = 256 and 1.8-1.9x at T = 1024 with c = 64 (``benchmarks/levers/causal_blocks.py``).

    Each block is normalised after the value mix, as FlashAttention's epilogue: exp(s - max) V divided by the row
    sums, a (c G, Hv) division instead of a (c G, S) one (the max is held out of the gradient: the softmax does
    not depend on it). The train step ran x1.10-1.13 faster than with the weights normalised first at d_model 48,
    x1.06 at 96 and x1.00-1.02 at 160 and 384 (``benchmarks/levers/deferred_norm.py``)."""
    return _blockwise(lambda lo, hi, start: logits_of(lo, hi), v, block, mask_self, window=0)


def banded_attention(logits_of, v: Array, block: int, window: int, mask_self: bool = False) -> Array:
    """Causal self-attention within a sliding window (Beltagy et al. 2020, Longformer; Mistral 7B, Jiang et al.
    2023): query t sees keys t - W + 1 .. t, W = ``window``. As :func:`causal_attention`, in query blocks, but
    block [lo, hi) is scored only against keys [max(0, lo - W + 1), hi): ``logits_of(lo, hi, start)`` gives the
    folded scores of queries lo..hi-1 against keys start..hi-1. The score FLOPs drop from about T^2 / 2 to about
    T (W + block)."""
    return _blockwise(logits_of, v, block, mask_self, window)


def _blockwise(logits_of, v: Array, block: int, mask_self: bool, window: int) -> Array:
    t = v.shape[1]
    vt = v.transpose(0, 2, 1, 3)  # BSKU -> BKSU, once for every block
    outs = []
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        start = max(0, lo - window + 1) if window else 0
        logits = logits_of(lo, hi, start)
        g = logits.shape[2] // (hi - lo)
        rows, cols = jnp.arange(lo, hi)[:, None], jnp.arange(start, hi)[None, :]
        visible = (rows >= cols) & (rows - cols < window) if window else rows >= cols
        causal, own = _fold_rows(visible, g), _fold_rows(rows == cols, g) if mask_self else None
        logits = masked_logits(logits, causal, own)
        p = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))  # (B, K, c G, S)
        mixed = jnp.einsum("BKQS,BKSU->BKQU", p.astype(v.dtype), vt[:, :, start:hi]).astype(jnp.float32)
        outs.append((mixed / p.sum(-1)[..., None]).astype(v.dtype))
    return unfold_queries(jnp.concatenate(outs, axis=2), t)


def prefix_lengths(length: int, block: int) -> list[int]:
    """The key prefixes :func:`within_prefix` chooses from: block, 2 block, 4 block, ... below ``length``, and
    ``length`` itself (block 0: the whole length only)."""
    sizes = []
    while block and block < length:
        sizes.append(block)
        block *= 2
    return [*sizes, length]


def within_prefix(attend, filled: Array, length: int, block: int) -> Array:
    """``attend(p)`` (attention over the first p of ``length`` key slots, p static) for the shortest p of
    :func:`prefix_lengths` that holds the ``filled`` (scalar int) slots any query can see.

    Decoding from a cache of S slots whose rows hold only ``filled`` tokens: the slots past them are masked out,
    so scores over them are exp(-inf) = 0 and reading them is wasted. One branch per prefix (log2(S / block) + 1
    of them, ``lax.switch``) reads at most max(block, 2 filled) slots and gives the same softmax as the whole
    cache up to float rounding. The slices are copies, still far cheaper than scoring the whole cache: generating 64
    tokens at ``shakespeare_char`` (S = 256, 38 MB of cache at batch 8), a step went from 6.6 to 4.6 ms
    (``benchmarks/decode_roofline.py``)."""
    sizes = prefix_lengths(length, block)
    if len(sizes) == 1:
        return attend(length)
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), filled), len(sizes) - 1)  # first size >= filled
    return jax.lax.switch(index, [lambda p=p: attend(p) for p in sizes])


def _fold_rows(mask: Array, g: int) -> Array:
    return jnp.repeat(mask, g, axis=0)[None, None]  # (c, S) -> (1, 1, c G, S), rows ordered (t, g) as the logits


def block_logits(q: Array, k: Array):
    """``logits_of`` for :func:`causal_attention` from q (B, T, N, H) and k (B, T, K, H): q.k / sqrt(H) of query
    rows lo..hi-1 against keys 0..hi-1, k transposed to (B, K, T, H) once for all blocks."""
    kt = k.transpose(0, 2, 1, 3)  # BSKH -> BKSH
    return lambda lo, hi, start=0: qk_logits(q[:, lo:hi], kt[:, :, start:hi], "BKSH")


def mix_values(weights: Array, v: Array, t: int, kv_layout: str = "BSKH") -> Array:
    """Weighted sum of values: weights (B, K, T * G, S), v laid out as ``kv_layout`` (with U for H) -> (B, T, N, U)."""
    v_layout = kv_layout.replace("H", "U")  # BSKU or BKSU
    return unfold_queries(jnp.einsum(f"BKQS,{v_layout}->BKQU", weights.astype(v.dtype), v), t)
