"""Stage 4, scores and mixing: what one attention call reads (:class:`Inputs`: :class:`Queries`, :class:`Slots`,
:class:`Rules`, :class:`How`) and the seven ways to compute ``softmax(scores) V`` from it, a table of named kernels
(:data:`KERNELS`) tried in order; :func:`choose` says which one runs.

Every kernel computes the same function up to float rounding (``tests/test_kernels.py`` runs each against a
float64 reference on the inputs its ``applies`` test accepts); they differ in what they hold and skip:

========== ==============================================================================================
absorbed   a latent scheme's decode cache (:class:`Absorbed`): queries taken into the latent space, scores
           against the cached latents, W^UV after mixing (DeepSeek-V2's absorbed form); over a prefix of
           slots as ``prefix`` below when that kernel's rule holds. Decoding MLA.
chunked    ``implementation='chunked'``, plain q.k scores over fresh keys: blocks of keys with an online
           softmax, never the (T, S) scores (:func:`core.chunked_attention`). Long contexts, large batches.
window     ``blocks`` below within a sliding window: each query block scored only against the band of keys it
           can see (:func:`core.banded_attention`). Training, prefill of windowed layers.
blocks     causal self-attention over fresh keys with no other mask (any score function, einsum path):
           query blocks scored only up to the diagonal (:func:`core.causal_attention`). Training, prefill.
prefix     reading a decode cache: only the shortest prefix of slots holding the longest row
           (:func:`core.within_prefix`). Decoding.
einsum     everything else this package computes itself (:func:`attend`): custom scores (bilinear forms,
           Reformer's self-mask, a relative bias), attention dropout, a cache, values wider than keys,
           analysis collecting the weights, or ``implementation='einsum'``; the one path that hands its (T, S)
           weights to analysis, so collecting them takes it whatever the implementation.
xla        plain q.k scores with nothing above: ``jax.nn.dot_product_attention`` (:func:`dot_product`): cuDNN
           flash attention with ``implementation='cudnn'``, and on a GPU by default where jax takes the call
           and XLA compiles it (:func:`falls_back_from_cudnn`).
========== ==============================================================================================

Every kernel that normalises whole rows of scores does it through :func:`weights`, the one masked softmax (and
the one place analysis collects logits and weights); ``chunked`` and ``blocks`` normalise blocks on the fly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax import Array
from jaxtyping import Bool, Float, Int

from qkvjax.attention import core
from qkvjax.attention.cache import CACHED, FRESH, prefix


@dataclasses.dataclass(frozen=True)
class Queries:
    """Finished queries ``q`` (QK-norm, rotary, temperature applied) at mask indices ``index``; or, for a
    bilinear form, no ``q`` but its query-side inputs ``x`` and per-head forms ``w_qk``, scaled by ``head_dim``."""

    q: Float[Array, "B T N H"] | None
    index: Int[Array, "#B T"]
    head_dim: int
    x: Float[Array, "B T D"] | None = None
    w_qk: Float[Array, "N D E"] | None = None

    @property
    def t(self) -> int:
        return (self.x if self.q is None else self.q).shape[1]

    @property
    def heads(self) -> int:
        return self.w_qk.shape[0] if self.q is None else self.q.shape[2]


@dataclasses.dataclass(frozen=True)
class Absorbed:
    """A latent scheme's decode cache as the absorbed kernel reads it: the cached ``latent`` (B, S, R) and rotated
    ``k_rope`` ((B, S, P) shared by every head, (B, K, S, P) one per KV head, or None), and the up-projections
    ``w_k_up`` (R, K, H) and ``w_v_up`` (R, K, U). The queries are [q ; q_rope], (B, T, N, H + P)."""

    latent: Float[Array, "B S R"]
    k_rope: Array | None
    w_k_up: Float[Array, "R K H"]
    w_v_up: Float[Array, "R K U"]


@dataclasses.dataclass(frozen=True)
class Slots:
    """The key slots 0..S-1 the queries read. ``read(p)`` gives the keys (bilinear: the key side's inputs
    (B, S, E)) and values of slots 0..p-1, finished as the scores use them, laid out as ``layout`` (FRESH
    (B, S, K, H) or CACHED (B, K, S, H)); ``index`` (1, S) the slots' mask indices; ``start`` (B,) each row's first
    new position when the slots are a decode cache, else None; ``absorbed`` a latent cache's own reading; ``ring``
    when the slots are a window-only cache's (:func:`cache.ring_view`): not in position order, ``index`` (B, S)."""

    read: Callable[[int], tuple[Array, Array]]
    layout: str
    length: int
    index: Int[Array, "#B S"]
    start: Int[Array, " B"] | None
    kv_heads: int
    value_dim: int
    absorbed: Absorbed | None = None
    ring: bool = False


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which scores count and what is added or dropped: the caller's ``mask`` (True = may attend), ``causal``,
    ``allowed`` (the mask, the causal triangle and the sliding window by index, combined), Reformer's ``self_mask``
    (each query's own slot, folded like the scores), a relative-bias table ``rel_table`` (N, 2 M + 1), attention
    dropout, and the sliding ``window`` W (0: none)."""

    mask: Bool[Array, "#B #N #T #S"] | None
    causal: bool
    allowed: Bool[Array, "#B #N #T #S"] | None
    self_mask: Bool[Array, "#B #K Q S"] | None = None
    rel_table: Float[Array, "N _"] | None = None  # (N, 2 M + 1)
    dropout_rate: float = 0.0  # 0 when deterministic
    dropout_rng: Array | None = None
    window: int = 0


@dataclasses.dataclass(frozen=True)
class How:
    """The config's kernel choices and what the caller collects: ``implementation`` ('einsum', 'chunked', 'xla',
    'cudnn', or 'auto': cuDNN's where jax takes the call, else XLA's), ``chunk_size``, ``causal_block``;
    ``collecting`` when analysis collects the (T, S) logits and weights (``mutable=["intermediates"]``), through
    ``sow(name, value)``."""

    implementation: str
    chunk_size: int
    causal_block: int
    collecting: bool = False
    sow: Callable[[str, Array], None] = lambda name, value: None


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One attention call's stage 4, all a kernel reads."""

    queries: Queries
    slots: Slots
    rules: Rules
    how: How

    @property
    def group_size(self) -> int:
        """G = N / K, the query heads that read one K/V head."""
        return self.queries.heads // self.slots.kv_heads

    @property
    def custom(self) -> bool:
        """Scores or weights only this package computes: bilinear, self-mask, relative bias, dropout."""
        r = self.rules
        return self.queries.q is None or r.self_mask is not None or r.rel_table is not None or r.dropout_rate > 0


def logits(a: Inputs, lo: int, hi: int, keys: Array, layout: str, start: int = 0) -> Float[Array, "B K Q S"]:
    """Folded scores of queries lo..hi-1 against ``keys`` (bilinear: the key side's inputs), the slots start..,
    Q = (hi - lo) G."""
    q = a.queries
    if q.q is None:
        out = core.bilinear_logits(q.x[:, lo:hi], q.w_qk, keys, a.slots.kv_heads, q.head_dim)
    else:
        out = core.qk_logits(q.q[:, lo:hi], keys, layout)
    if a.rules.rel_table is not None:
        key_index = a.slots.index[:, start : start + out.shape[-1]]
        table = a.rules.rel_table.astype(out.dtype)
        out = out + core.relative_bias(table, q.index[:, lo:hi], key_index, a.slots.kv_heads)
    return out


def weights(a: Inputs, scores: Float[Array, "B K Q S"]) -> Float[Array, "B K Q S"]:
    """The masked softmax over key slots 0..S-1 (S = ``scores``' last axis), in float32, dropout applied; the
    logits before masking and the weights are collected for analysis."""
    p, r = scores.shape[-1], a.rules
    a.how.sow("attention_logits", scores)
    allowed = (
        None if r.allowed is None else core.grouped(r.allowed[..., :p], a.slots.kv_heads, a.group_size, a.queries.t)
    )
    out = core.softmax_weights(
        scores,
        allowed,
        None if r.self_mask is None else r.self_mask[..., :p],
        dropout_rate=r.dropout_rate,
        dropout_rng=r.dropout_rng,
    )
    a.how.sow("attention_weights", out)
    return out


def attend(a: Inputs, p: int) -> Float[Array, "B T N U"]:
    """Scores over key slots 0..p-1, :func:`weights`, values mixed."""
    keys, v = a.slots.read(p)
    return core.mix_values(weights(a, logits(a, 0, a.queries.t, keys, a.slots.layout)), v, a.queries.t, a.slots.layout)


def attend_absorbed(a: Inputs, p: int) -> Float[Array, "B T N U"]:
    """MLA's absorbed form over cache slots 0..p-1: q . (c W^UK_j) = (q (W^UK_j)^T) . c, so the queries' first H
    features go into the latent space once, score against the latents c, and the weights mix the latents before
    W^UV is applied; the last P features score against the rotated rotary keys. No (S, K, H) tensor is made."""
    ab, q = a.slots.absorbed, a.queries.q
    h, kv, t = ab.w_k_up.shape[-1], a.slots.kv_heads, a.queries.t
    folded = core.fold_queries(q / math.sqrt(q.shape[-1]), kv)  # (B, K, Q, H + P), scaled as qk_logits does
    latent = prefix(ab.latent, p, FRESH)
    q_lat = jax.numpy.einsum("BKQH,RKH->BKQR", folded[..., :h], ab.w_k_up)
    scores = jax.numpy.einsum("BKQR,BSR->BKQS", q_lat, latent)
    if ab.k_rope is not None and ab.k_rope.ndim == 4:  # one rotary key per KV head: (B, K, S, P)
        scores = scores + jax.numpy.einsum("BKQP,BKSP->BKQS", folded[..., h:], prefix(ab.k_rope, p, CACHED))
    elif ab.k_rope is not None:  # one rotary key for every head: (B, S, P)
        scores = scores + jax.numpy.einsum("BKQP,BSP->BKQS", folded[..., h:], prefix(ab.k_rope, p, FRESH))
    mixed = jax.numpy.einsum("BKQS,BSR->BKQR", weights(a, scores).astype(latent.dtype), latent)
    return core.unfold_queries(jax.numpy.einsum("BKQR,RKU->BKQU", mixed, ab.w_v_up), t)


def reads_prefix(a: Inputs) -> bool:
    """The prefix rule: a decode cache read in blocks (``causal_block``), with no dropout (a branch cannot hold
    its random draws), nobody collecting the whole (T, S) weights, and slots in position order (not a ring)."""
    s = a.slots
    return bool(
        a.how.causal_block and s.start is not None and not s.ring and not a.rules.dropout_rate and not a.how.collecting
    )


def over_filled(a: Inputs, attend_p: Callable[[Inputs, int], Array]) -> Array:
    """``attend_p(a, p)`` over the shortest prefix of slots that holds every row's queries, when
    :func:`reads_prefix`; else over all S."""
    if not reads_prefix(a):
        return attend_p(a, a.slots.length)
    filled = jax.numpy.max(a.slots.start) + a.queries.t
    return core.within_prefix(lambda p: attend_p(a, p), filled, a.slots.length, a.how.causal_block)


def _chunked(a: Inputs) -> Array:
    k, v = a.slots.read(a.slots.length)
    r = a.rules
    return core.chunked_attention(
        a.queries.q, k, v, r.mask, a.queries.index, a.slots.index, r.causal, a.how.chunk_size
    )  # fmt: skip


def _blocks(a: Inputs) -> Array:
    k, v = a.slots.read(a.slots.length)
    bilinear = a.queries.q is None
    keys = k if bilinear else k.transpose(0, 2, 1, 3)  # BSKH -> BKSH once, sliced per block
    key_axis = 1 if bilinear else 2

    def logits_of(lo: int, hi: int, start: int = 0) -> Array:  # queries lo..hi-1 against keys start..hi-1
        return logits(a, lo, hi, jax.lax.slice_in_dim(keys, start, hi, axis=key_axis), CACHED, start)

    mask_self = a.rules.self_mask is not None
    if a.rules.window:
        return core.banded_attention(logits_of, v, a.how.causal_block, a.rules.window, mask_self)
    return core.causal_attention(logits_of, v, a.how.causal_block, mask_self=mask_self)


def _xla(a: Inputs) -> Array:
    r = a.rules
    only_causal = r.mask is None and r.causal and not r.window
    k, v = a.slots.read(a.slots.length)
    # dot_product_attention takes one head width for q, k and v; values narrower than the keys (MLA's decoupled
    # rotary part: H + P against Hv) are padded with zeros, which mix to zeros, and cut off again (DeepSeek's
    # FlashAttention route), so the fused kernel runs instead of materialising the scores
    width = v.shape[-1]
    if width < k.shape[-1]:  # only then: the common case of one width traces no pad and no slice
        v = jax.numpy.pad(v, [(0, 0)] * 3 + [(0, k.shape[-1] - width)])
    out = dot_product(a.queries.q, k, v, None if only_causal else r.allowed, only_causal, a.how.implementation)
    return out if out.shape[-1] == width else out[..., :width]


# What jax raises, while tracing, for a call cuDNN's kernel cannot take: NotImplementedError (not fp16/bf16, a head
# width over its limit or not a multiple of 8, an architecture it lacks), RuntimeError (no cuDNN: a CPU, ROCm),
# ValueError (a layout or window rule). A refusal traces nothing that stays: the fallback's ops replace it.
CUDNN_REFUSALS = (NotImplementedError, RuntimeError, ValueError)


@dataclasses.dataclass
class _AutoCudnn:
    """What 'auto' did in this process: ``taken`` once a trace took cuDNN's kernel; ``allowed`` until a program
    holding it failed to compile (:func:`falls_back_from_cudnn`), after which 'auto' means XLA's attention."""

    allowed: bool = True
    taken: bool = False


AUTO_CUDNN = _AutoCudnn()


def dot_product(q: Array, k: Array, v: Array, mask: Array | None, causal: bool, implementation: str) -> Array:
    """``jax.nn.dot_product_attention`` (B, T, N, H) with ``implementation``; 'auto' asks cuDNN's flash kernel
    first and takes XLA's attention where jax refuses it for these shapes, dtypes or this machine, or where a
    program holding it failed to compile in this process."""
    if implementation == "auto":
        if AUTO_CUDNN.allowed:
            try:
                out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")
                AUTO_CUDNN.taken = True
                return out
            except CUDNN_REFUSALS:
                pass
        implementation = "xla"
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=implementation)


# How a failure inside cuDNN's attention reads when XLA compiles it: its custom call (__cudnn$fmha...), the cuDNN
# frontend ("No valid engine configs ... cudnn_frontend::HeurMode_t"), XLA's cuda_dnn.cc. Seen in jax's tracker for
# some shardings, cuDNN builds and multi-GPU runs, none of which jax can refuse while tracing.
CUDNN_FAILURE_WORDS = ("cudnn", "cuda_dnn", "fmha")


def falls_back_from_cudnn(step: Callable, say: Callable[[str], None]) -> Callable:
    """``step`` (a jitted function), called as it is, except that if the call fails to compile in cuDNN's
    attention that 'auto' chose, 'auto' takes XLA's attention for the rest of the process, the jit caches are
    cleared and the call is made again (``say`` gets one line): a GPU's default is never worse than
    ``implementation='xla'``. Raised as they are: an explicit 'cudnn' failing (the user asked for it), any other
    error, and a failure after the step began to run (a donated input already consumed)."""

    def call(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except jax.errors.JaxRuntimeError as error:
            text = str(error)
            cudnn = any(word in text.lower() for word in CUDNN_FAILURE_WORDS)
            consumed = any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves((args, kwargs)))
            if not (cudnn and AUTO_CUDNN.taken and AUTO_CUDNN.allowed) or consumed:
                raise
            AUTO_CUDNN.allowed = False
            jax.clear_caches()  # the traces that took cuDNN's kernel: the call below traces again without it
            say(
                f"warning: cuDNN's attention failed to compile ({text.strip().splitlines()[0][:200]}); this process "
                "uses XLA's attention instead (--config.model.attention.implementation=xla asks for it up front)"
            )
            return step(*args, **kwargs)

    return call


def _chunked_applies(a: Inputs) -> bool:
    s = a.slots
    return (
        a.how.implementation == "chunked" and not a.custom and not a.rules.window and s.start is None
        and not a.how.collecting
    )  # fmt: skip


def _window_applies(a: Inputs) -> bool:
    """What :func:`_blocks_applies` takes, within a sliding window."""
    return bool(a.rules.window) and _blocks_applies(a, window=a.rules.window)


def _blocks_applies(a: Inputs, window: int = 0) -> bool:
    """Causal self-attention over fresh keys (masked by index, so the mask is the plain triangle, cut to
    ``window`` when one is given), no other mask, at least two blocks, and nobody collecting the (T, S) logits and
    weights."""
    s, block = a.slots, a.how.causal_block
    plain = a.custom or a.how.implementation == "einsum"
    return bool(
        plain and not a.rules.dropout_rate and block and a.rules.causal and a.rules.mask is None and s.start is None
        and a.rules.window == window
        and s.layout == FRESH and s.length == a.queries.t and a.queries.t >= 2 * block and not a.how.collecting
    )  # fmt: skip


def _einsum_applies(a: Inputs) -> bool:
    """What ``jax.nn.dot_product_attention`` cannot take: custom scores, a cache, keys laid out (B, K, S, H),
    values wider than the keys (narrower ones are padded, :func:`_xla`), analysis collecting the (T, S) weights
    (no fused kernel hands them out, whatever the implementation); or asked for."""
    s, q = a.slots, a.queries
    return bool(
        a.custom or a.how.implementation in ("einsum", "chunked") or s.start is not None or s.layout == CACHED
        or s.value_dim > q.q.shape[-1] or a.how.collecting
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    applies: Callable[[Inputs], bool]
    run: Callable[[Inputs], Array]


KERNELS = (
    Kernel("absorbed", lambda a: a.slots.absorbed is not None, lambda a: over_filled(a, attend_absorbed)),
    Kernel("chunked", _chunked_applies, _chunked),
    Kernel("window", _window_applies, _blocks),
    Kernel("blocks", _blocks_applies, _blocks),
    Kernel("prefix", reads_prefix, lambda a: over_filled(a, attend)),
    Kernel("einsum", _einsum_applies, lambda a: attend(a, a.slots.length)),
    Kernel("xla", lambda a: True, _xla),
)


def choose(a: Inputs) -> Kernel:
    """The first kernel of :data:`KERNELS` that applies."""
    return next(k for k in KERNELS if k.applies(a))


def mix(a: Inputs) -> Float[Array, "B T N U"]:
    """softmax(scores) V of every query by the kernel :func:`choose` picks."""
    return choose(a).run(a)
