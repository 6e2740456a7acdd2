"""Scores and mixing: one attention call's queries, keys, values and masks (:class:`Scores`), and the five ways
to compute ``softmax(scores) V`` from them, a table of named kernels (:data:`KERNELS`) tried in order.

Every kernel computes the same function up to float rounding (tested against :func:`attend` on the same
inputs); they differ in what they hold and skip:

========== ==============================================================================================
chunked    ``implementation='chunked'``, plain q.k scores over fresh keys: blocks of keys with an online
           softmax, never the (T, S) scores (:func:`core.chunked_attention`). Long contexts, large batches.
blocks     causal self-attention over fresh keys with no other mask (any score function, einsum path):
           query blocks scored only up to the diagonal (:func:`core.causal_attention`). Training, prefill.
prefix     reading a decode cache: only the shortest prefix of slots holding the longest row
           (:func:`core.within_prefix`). Decoding.
einsum     everything else this package computes itself (:func:`attend`): custom scores (bilinear forms,
           Reformer's self-mask, a relative bias), attention dropout, a cache, values wider than keys, or
           ``implementation='einsum'``; the one path that also hands its (T, S) weights to analysis.
xla        plain q.k scores with nothing above: ``jax.nn.dot_product_attention`` picks (cuDNN flash
           attention with ``implementation='cudnn'``).
========== ==============================================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax import Array

from qkvjax.attention import core
from qkvjax.attention.cache import CACHED, FRESH


@dataclasses.dataclass(frozen=True)
class Scores:
    """What the kernels read. Queries are either finished (B, T, N, H) ``q``, or, for a bilinear form, the
    inputs ``x_q`` (B, T, D) and ``w_qk`` (N, D, D). ``read(p)`` gives the keys (bilinear: the key side's
    inputs (B, S, D)) and values of key slots 0..p-1, as the scores use them, in ``layout``."""

    q: Array | None
    x_q: Array | None
    w_qk: Array | None
    read: Callable[[int], tuple[Array, Array]]
    layout: str  # FRESH (B, S, K, H) or CACHED (B, K, S, H)
    length: int  # S, key slots
    t: int  # T, queries
    index_q: Array  # (B|1, T): query indices (causal masks, relative offsets)
    index_k: Array  # (1, S)
    mask: Array | None  # the caller's, boolean (B|1, N|1, T|1, S|1)
    full_mask: Array | None  # the caller's and the causal triangle, combined
    self_mask: Array | None  # (B|1, K, T G, S): each query's own key (Reformer), else None
    causal: bool
    rel_table: Array | None  # (N, 2 R + 1) relative bias per head and offset, or None
    kv_heads: int
    group_size: int
    head_dim: int
    value_dim: int
    start: Array | None  # (B,) rows' first new position when reading a cache
    implementation: str  # 'einsum', 'chunked', 'xla', 'cudnn'
    chunk_size: int
    causal_block: int
    dropout_rate: float  # 0 when deterministic
    dropout_rng: Array | None
    collecting: bool  # analysis collects the (T, S) logits and weights (``mutable=["intermediates"]``)
    sow: Callable[[str, Array], None] = lambda name, value: None

    @property
    def custom(self) -> bool:
        """Scores or weights only this package computes: bilinear, self-mask, relative bias, dropout."""
        return self.q is None or self.self_mask is not None or self.rel_table is not None or self.dropout_rate > 0


def logits(s: Scores, lo: int, hi: int, keys: Array, layout: str) -> Array:
    """Folded scores (B, K, (hi - lo) G, S') of queries lo..hi-1 against ``keys`` (bilinear: key-side inputs)."""
    if s.q is None:
        out = core.bilinear_logits(s.x_q[:, lo:hi], s.w_qk, keys, s.kv_heads, s.head_dim)
    else:
        out = core.qk_logits(s.q[:, lo:hi], keys, layout)
    if s.rel_table is not None:
        key_index = s.index_k[:, : out.shape[-1]]
        out = out + core.relative_bias(s.rel_table.astype(out.dtype), s.index_q[:, lo:hi], key_index, s.kv_heads)
    return out


def attend(s: Scores, p: int) -> Array:
    """Scores over key slots 0..p-1, masked softmax in float32, values mixed: (B, T, N, Hv)."""
    keys, v = s.read(p)
    scores = logits(s, 0, s.t, keys, s.layout)
    s.sow("attention_logits", scores)  # (B, K, T * G, S), before masking
    weights = core.softmax_weights(
        scores,
        None if s.full_mask is None else core.grouped(s.full_mask[..., :p], s.kv_heads, s.group_size, s.t),
        None if s.self_mask is None else s.self_mask[..., :p],
        dropout_rate=s.dropout_rate,
        dropout_rng=s.dropout_rng,
    )
    s.sow("attention_weights", weights)  # (B, K, T * G, S), for analysis
    return core.mix_values(weights, v, s.t, s.layout)


def _chunked(s: Scores) -> Array:
    k, v = s.read(s.length)
    return core.chunked_attention(s.q, k, v, s.mask, s.index_q, s.index_k, s.causal, s.chunk_size)


def _blocks(s: Scores) -> Array:
    k, v = s.read(s.length)
    keys = k if s.q is None else k.transpose(0, 2, 1, 3)  # BSKH -> BKSH once, sliced per block
    key_axis = 1 if s.q is None else 2
    return core.causal_attention(
        lambda lo, hi: logits(s, lo, hi, jax.lax.slice_in_dim(keys, 0, hi, axis=key_axis), CACHED),
        v,
        s.causal_block,
        mask_self=s.self_mask is not None,
    )


def _prefix(s: Scores) -> Array:
    return core.within_prefix(lambda p: attend(s, p), jax.numpy.max(s.start) + s.t, s.length, s.causal_block)


def _xla(s: Scores) -> Array:
    only_causal = s.mask is None and s.causal
    k, v = s.read(s.length)
    return jax.nn.dot_product_attention(
        s.q, k, v, mask=None if only_causal else s.full_mask, is_causal=only_causal, implementation=s.implementation
    )


def _blocks_apply(s: Scores) -> bool:
    """Causal self-attention over fresh keys (masked by index, so the mask is the plain triangle), no other mask,
    at least two blocks, and nobody collecting the (T, S) logits and weights."""
    plain = s.custom or s.implementation == "einsum"
    return bool(
        plain and not s.dropout_rate and s.causal_block and s.causal and s.mask is None and s.layout == FRESH
        and s.length == s.t and s.t >= 2 * s.causal_block and not s.collecting
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    applies: Callable[[Scores], bool]
    run: Callable[[Scores], Array]


KERNELS = (
    Kernel("chunked", lambda s: s.implementation == "chunked" and not s.custom and s.layout == FRESH, _chunked),
    Kernel("blocks", _blocks_apply, _blocks),
    # the prefix's branches cannot hold attention dropout's random draws, nor hand out the whole (T, S) weights
    Kernel(
        "prefix",
        lambda s: bool(s.causal_block and s.start is not None and not s.dropout_rate and not s.collecting),
        _prefix,
    ),  # fmt: skip
    # jax.nn.dot_product_attention wants one width for keys and values, and fresh (B, S, K, H) keys
    Kernel(
        "einsum",
        lambda s: (
            s.custom or s.implementation in ("einsum", "chunked") or s.layout == CACHED or s.value_dim != s.head_dim
        ),
        lambda s: attend(s, s.length),
    ),  # fmt: skip
    Kernel("xla", lambda s: True, _xla),
)


def choose(s: Scores) -> Kernel:
    """The first kernel of :data:`KERNELS` that applies."""
    return next(k for k in KERNELS if k.applies(s))


def mix(s: Scores) -> Array:
    """softmax(scores) V of every query, (B, T, N, Hv), by the kernel :func:`choose` picks."""
    return choose(s).run(s)
