"""The attention pipeline: five stages, the same for every module and scheme, and the linen ``Attention``.

    1 project  ->  2 finish keys and queries  ->  3 cache  ->  4 scores and mixing  ->  5 output projection

:func:`run` is the pipeline. A module hands it its :class:`Stages`: how it projects (stage 1), which of its new
key tensors it finishes when made and how it finishes its queries (stage 2), and how its key slots are read
(stage 4's :class:`~qkvjax.attention.kernels.Slots`). Everything else is written here once: the cache (stage 3,
:mod:`qkvjax.attention.cache`), positions (:func:`positions`), the rules of stage 4 (masks, causality by index,
Reformer's self-mask, dropout: :func:`rules`), the output projection (stage 5). Stage 4's kernel is the first row
of :data:`qkvjax.attention.kernels.KERNELS` whose ``applies`` test holds. Two kinds of stages exist (:func:`stages`
picks one from the config): :class:`Tied` (every partition scheme and the bilinear form) and
:class:`qkvjax.attention.latent.Latent` (MLA); the linen :class:`Attention` and :class:`qkvjax.nnx.Attention` run
either, so one module takes every scheme.

Where a partition scheme differs from ``separate`` is data (:mod:`qkvjax.attention.schemes`), read at four places,
all in :func:`tied_projections` and :class:`Tied`:

1. parameters (:func:`tied_projections`): one kernel ``w_<group>`` per group of the partition, (D, N, H) if it
   makes queries, else (D, K, H); a bilinear form's ``w_qk_merged`` (N, D, D) instead of queries and keys;
2. roles (:func:`project`): each role reads its group's tensor (``scheme.group_of``), so tied roles are one tensor;
3. what is cached and handed on: one tensor per K/V group (``scheme.kv_groups``), plus a bilinear key side's ``x``;
4. when keys are finished (:attr:`Scheme.keys_finished_at_write`): a key-only group at write, once; keys tied to
   values (K = V) or to queries on read, over the slots read (the K = V cache stays raw and one tensor).

Reformer's two extras are flags that finishing (``normalize_keys``) and the rules (``mask_self``) read.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float, Int

from qkvjax import axes
from qkvjax.attention import core, kernels
from qkvjax.attention.base import AttentionModule, Call
from qkvjax.attention.cache import FRESH, KV, linen_cache, prefix, slot_positions, update
from qkvjax.attention.config import AttentionConfig, resolve_implementation
from qkvjax.attention.schemes import Scheme

__all__ = ["KV", "Attention", "AttentionModule", "Positions", "Stages", "Tied", "positions", "run", "stages"]


@dataclasses.dataclass(frozen=True)
class Positions:
    """Rotary positions ``q``, ``k`` and mask indices ``index_q``, ``index_k`` of the queries and the key slots."""

    q: Int[Array, "#B T"]
    k: Int[Array, "#B S"]
    index_q: Int[Array, "#B T"]
    index_k: Int[Array, "#B S"]


def positions(call: Call, start: Array | None, length: int, slots: Array | None = None) -> Positions:
    """Fresh keys (``start`` None) sit at the query positions (or 0..S-1 for cross-attention) and are masked
    causally by index, as flax's ``make_causal_mask``; a cache's row b has its queries at start_b + t and its
    ``length`` slots at 0..S-1, or at ``slots`` (B, S) (a ring's, :func:`cache.slot_positions`). A new key's
    position is ``q`` (a cache) or ``k`` (fresh)."""
    t, slots = call.shape[1], jnp.arange(length)[None] if slots is None else slots
    if start is None:
        q = jnp.arange(t)[None] if call.positions is None else call.positions
        return Positions(q, q if call.self_attention else slots, jnp.arange(t)[None], slots)
    index_q = start[:, None] + jnp.arange(t)[None]
    return Positions(index_q, slots, index_q, slots)


class Stages:
    """What a module hands :func:`run`: its output projection ``w_o`` (N, U, D) and ``b_o`` (D,) or None, its
    score extras (Reformer's ``mask_self``, a relative-bias table ``rel_table`` (N, 2 M + 1)), and four stages."""

    w_o: Array
    b_o: Array | None
    mask_self: bool = False
    rel_table: Array | None = None

    def project(self, x_q: Array, x_kv: Array, call: Call) -> tuple[dict[str, Array], KV]:
        """Stage 1: the query side's tensors by name, and this layer's fresh keys and values (or ``call.kv``)."""
        raise NotImplementedError

    def finish_new(self, tensors: dict[str, Array], pos: Array) -> dict[str, Array]:
        """Stage 2 at write: the fresh K/V tensors with each key-only one finished at its positions (B|1, S)."""
        raise NotImplementedError

    def queries(self, queries: dict[str, Array], x_q: Array, pos: Positions) -> kernels.Queries:
        """Stage 2 on the query side: the finished queries."""
        raise NotImplementedError

    def slots(self, side: KV, pos: Positions) -> kernels.Slots:
        """Stage 4's key slots: how ``side`` is read, finished as the scores use it."""
        raise NotImplementedError

    def hand_on(self, side: KV) -> KV:
        """The K/V a call hands back, with what a reader needs to finish them as this layer does."""
        return side


def run(module: AttentionModule, call: Call, stages: Stages):
    """The five stages of one call: (B, T, D) -> (B, T, D), or ``(y, KV)`` when the call hands K/V back."""
    cfg, (b, t, _) = module.config, call.shape
    dtype = jnp.dtype(cfg.dtype)
    x_q, x_kv = call.x_q.astype(dtype), call.x_kv.astype(dtype)

    queries, fresh = stages.project(x_q, x_kv, call)  # 1. project
    cache, store = linen_cache(module, fresh, b) if call.decode else (call.cache, None)
    if call.kv is None:  # 2. this layer's new key-only tensors, finished once, at their own positions
        start = None if cache is None else cache.start
        new = positions(call, start, x_kv.shape[1])
        fresh = KV.fresh(stages.finish_new(fresh.tensors, new.k if start is None else new.q))
    side = fresh if cache is None else update(cache, fresh.tensors, t)  # 3. cache
    if store is not None and cache is not None:
        store(side, t)
    pos = positions(call, side.start, side.length, slot_positions(side))
    inputs = kernels.Inputs(  # 4. scores and mixing
        stages.queries(queries, x_q, pos), stages.slots(side, pos), rules(module, call, side, pos, stages), how(module)
    )
    y = core.dense(kernels.mix(inputs), stages.w_o, 2)  # 5. output: BTNU,NUD->BTD
    if stages.b_o is not None:
        y = y + stages.b_o[None, None]
    return (y, stages.hand_on(side)) if call.hand_back else y


def rules(module: AttentionModule, call: Call, side: KV, pos: Positions, stages: Stages) -> kernels.Rules:
    """What a query may see: the caller's mask, the causal triangle by index (a cache row's view is always causal
    by position), the sliding window, a ring's empty slots; each query's own slot for Reformer's self-mask;
    attention dropout when not deterministic."""
    cfg = module.config
    causal = call.causal or side.is_cache
    window = cfg.sliding_window or 0
    allowed = core.combine_masks(
        call.mask,
        core.causal_mask(pos.index_q, pos.index_k) if causal else None,
        core.window_mask(pos.index_q, pos.index_k, window) if window else None,
        (pos.index_k >= 0)[:, None, None, :] if side.ring else None,  # (B, 1, 1, S): slots that hold a token
    )
    self_mask = None
    if stages.mask_self and call.self_attention:
        own = pos.index_k[:, None, None, :] == pos.index_q[:, None, :, None]
        self_mask = core.grouped(own, cfg.kv_heads, cfg.group_size)
    dropout = cfg.dropout_rate > 0.0 and not call.deterministic
    return kernels.Rules(
        call.mask, causal, allowed, self_mask, stages.rel_table, cfg.dropout_rate if dropout else 0.0,
        module.make_rng("dropout") if dropout else None, window,
    )  # fmt: skip


def how(module: AttentionModule) -> kernels.How:
    """The config's kernel choices (:func:`~qkvjax.attention.config.resolve_implementation` when unset), and
    analysis' collection."""
    cfg = module.config
    return kernels.How(
        resolve_implementation(cfg.implementation, jax.default_backend()), cfg.chunk_size,
        cfg.causal_block, module.collecting, lambda name, value: module.sow("intermediates", name, value),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Projections:
    """One layer's parameters, in the compute dtype: ``kernels[group]`` (D, N or K, H) and ``biases[group]``
    (N or K, H) for each group it projects; ``w_qk`` (N, D, E) of a bilinear form; ``w_o`` (N, U, D), ``b_o``
    (D,); ``norm_scale[role]`` (H,) of QK-norm; ``rel_bias`` (N, 2 M + 1); ``temperature`` (N,), log scale."""

    kernels: dict[str, Array]
    biases: dict[str, Array] | None
    w_qk: Array | None
    w_o: Array
    b_o: Array | None
    norm_scale: dict[str, Array]
    rel_bias: Array | None
    temperature: Array | None = None


def project(x_q: Array, x_kv: Array, p: Projections, scheme: Scheme, call: Call) -> tuple[dict[str, Array], KV]:
    """Stage 1: ``x W`` for each of the scheme's groups, ``BTD,DNH->BTNH`` in one product per input (biases
    added), as the query side's groups and this layer's fresh keys and values; a layer reading another layer's
    K/V (``call.kv``) projects its queries only. A bilinear form also hands on the key side's inputs ``"x"``."""

    def run_groups(x, groups):
        biases = None if p.biases is None else [p.biases[g] for g in groups]
        return dict(zip(groups, core.project(x, [p.kernels[g] for g in groups], biases), strict=True))

    extra = {"x": x_kv} if scheme.bilinear else {}
    if call.kv is not None:
        return run_groups(x_q, scheme.query_groups), call.kv
    if call.self_attention:  # queries, keys and values from one input: every group in one product
        out = run_groups(x_q, scheme.groups)
        return out, KV.fresh({g: out[g] for g in scheme.kv_groups} | extra)
    queries = run_groups(x_q, scheme.query_groups) if scheme.query_groups else {}
    return queries, KV.fresh(run_groups(x_kv, scheme.kv_groups) | extra)


@dataclasses.dataclass(frozen=True)
class Tied(Stages):
    """The stages of a partition scheme (and the bilinear form): its groups' projections, QK-norm, Reformer's
    unit-length keys, rotary positions and a learned temperature."""

    config: AttentionConfig
    p: Projections

    @property
    def scheme(self) -> Scheme:
        return self.config.tying

    w_o = property(lambda self: self.p.w_o)
    b_o = property(lambda self: self.p.b_o)
    mask_self = property(lambda self: self.scheme.mask_self)
    rel_table = property(lambda self: self.p.rel_bias)

    def project(self, x_q: Array, x_kv: Array, call: Call) -> tuple[dict[str, Array], KV]:
        return project(x_q, x_kv, self.p, self.scheme, call)

    def finish_new(self, tensors: dict[str, Array], pos: Array) -> dict[str, Array]:
        if not self.scheme.keys_finished_at_write:
            return tensors
        return tensors | {"k": self.finish_keys(tensors["k"], pos, 1, self.p.norm_scale.get("k"))}

    def hand_on(self, side: KV) -> KV:
        # raw keys (finished on read) go on with this layer's key scale; a reader's side already carries its donor's
        if self.config.qk_norm and not self.scheme.keys_finished_at_write and "k" in self.p.norm_scale:
            return side.replace(key_norm=self.p.norm_scale["k"])
        return side

    def finish_keys(
        self, k: Float[Array, "B S K H"] | Float[Array, "B K S H"], pos: Array, seq_axis: int, scale: Array | None
    ) -> Array:
        """QK-norm (key scale ``scale`` (H,)), unit length (Reformer), rotary: k laid out (B, S, K, H)
        (``seq_axis`` 1) or (B, K, S, H) (2); pos (B|1, S)."""
        cfg = self.config
        if cfg.qk_norm:
            k = core.rms_norm(k, scale, cfg.norm_eps)
        if self.scheme.normalize_keys:
            k = core.unit_length(k)
        if cfg.rope:
            pos = jnp.broadcast_to(pos, (k.shape[0], k.shape[seq_axis]))
            k = core.rotary(k, pos, cfg.rope_base, seq_axis, cfg.rope_interleaved, cfg.rope_pairs)
        return k

    def queries(self, queries: dict[str, Array], x_q: Array, pos: Positions) -> kernels.Queries:
        cfg = self.config
        if self.scheme.bilinear:  # no queries: the scores are x_t^T W_QK[n] x_s
            return kernels.Queries(None, pos.index_q, cfg.head_dim, x=x_q, w_qk=self.p.w_qk)
        q = queries[self.scheme.group_of("q")]
        if cfg.qk_norm:
            q = core.rms_norm(q, self.p.norm_scale["q"], cfg.norm_eps)
        if cfg.rope:
            q = core.rotary(
                q, jnp.broadcast_to(pos.q, q.shape[:2]), cfg.rope_base, 1, cfg.rope_interleaved, cfg.rope_pairs
            )
        if self.p.temperature is not None:  # q.k exp(tau_n): the score's scale per head, free of |q|
            q = (q.astype(jnp.float32) * jnp.exp(self.p.temperature)[None, None, :, None]).astype(q.dtype)
        return kernels.Queries(q, pos.index_q, cfg.head_dim)

    def slots(self, side: KV, pos: Positions) -> kernels.Slots:
        cfg, scheme = self.config, self.scheme
        # the key scale of the layer that made the keys: this layer's, or for a reader (no key scale of its own)
        # the producer's, handed on with its K/V
        key_scale = self.p.norm_scale.get("k", side.key_norm)
        if cfg.qk_norm and key_scale is None and not scheme.keys_finished_at_write and not scheme.bilinear:
            raise ValueError(
                "this layer reads raw keys from another layer (kv=) and neither it nor the K/V carries "
                "a key-norm scale; pass the KV the producing layer handed back (return_kv=True)"
            )

        def read(n: int) -> tuple[Array, Array]:  # key slots 0..n-1 (bilinear: the key side's inputs)
            v = prefix(side.tensors[scheme.group_of("v")], n, side.layout)
            v = core.rms_norm(v, None, cfg.norm_eps) if cfg.v_norm else v
            if scheme.bilinear:
                return prefix(side.tensors["x"], n, FRESH), v
            k = prefix(side.tensors[scheme.group_of("k")], n, side.layout)
            if scheme.keys_finished_at_write:
                return k, v
            return self.finish_keys(k, pos.k[:, :n], side.seq_axis, key_scale), v

        return kernels.Slots(
            read, side.layout, side.length, pos.index_k, side.start, cfg.kv_heads, cfg.value_dim,
            ring=bool(side.ring),
        )  # fmt: skip


class Attention(AttentionModule):
    """Multi-head attention whose Q/K/V projections are tied as ``config.scheme`` says: every scheme of the zoo,
    the latent one (MLA, :mod:`qkvjax.attention.latent`, with its own parameters and cache) included.

    ``out_t = sum_n softmax_s(score_n(t, s)) v_{s,n} W^O_n`` with ``score_n(t, s) = q_{t,n} . k_{s,kv(n)} / sqrt(H)``
    (or ``x_t^T W_QK[n] x_s / sqrt(H)`` for a bilinear scheme), where each distinct projection is one kernel
    ``w_<roles>`` of shape (D, N, H) if it makes queries, else (D, K, H); ``w_o`` is (N, H, D). See
    :mod:`qkvjax.attention.schemes` for the schemes and their papers. With ``qk_norm``, q and k are RMS-normalised
    (learned scales ``q_norm_scale``, ``k_norm_scale``: (H,)) and with ``v_norm`` v is (no scale), before rotary.

    Keys and values can come from elsewhere, and the layer can hand its own on (both as :class:`KV`):

    * ``kv=``: attend over another layer's keys and values (Cross-Layer Attention, Brandon et al. 2024); the
      layer then has no K/V kernels. ``return_kv=True`` returns ``(y, kv)`` with the K/V this layer used.
    * ``cache=``: a functional decode cache: the new positions' K/V are written into it at each row's ``start``,
      attention reads the cache, and the call returns ``(y, updated cache)``.
    * ``decode=True``: flax's convention (``flax.linen.MultiHeadDotProductAttention``), kept for code written
      against it: initialise with ``decode=True`` on an input of the maximum length to create the ``cache``
      collection, then call with ``decode=True, mutable=["cache"]``; one position counter for the whole batch.

    Caches hold each K/V group once (one tensor for ``shared_kv``), plus the input ``x`` when the key side of a
    bilinear form needs it (:mod:`qkvjax.attention.cache`). A latent scheme caches its latent and rotary key part
    and takes ``cache=`` only (neither ``decode=True`` nor ``kv=``).
    """

    @nn.compact
    def forward(self, call: Call):
        return run(self, call, stages(self.config, call.shape[2], call.kv is not None, self))


def stages(cfg: AttentionConfig, d: int, reads_kv: bool, make) -> Stages:
    """Any config's stages, their parameters made by ``make`` (the linen module or :mod:`qkvjax.nnx`'s maker): a
    latent scheme's (:class:`qkvjax.attention.latent.Latent`), else a partition's or the bilinear form's
    (:class:`Tied`)."""
    if cfg.tying.latent:
        return LATENT_STAGES[0](cfg, d, make)
    return Tied(cfg, tied_projections(cfg, d, reads_kv, make))


# The latent scheme's stages builder, ``(cfg, d, make) -> Stages``: qkvjax.attention.latent builds on this module's
# pipeline and registers itself here when imported (the package's __init__ imports it), so this module never
# imports the module above it.
LATENT_STAGES: list = []


def register_latent_stages(build) -> None:
    LATENT_STAGES[:] = [build]


def tied_projections(cfg: AttentionConfig, d: int, reads_kv: bool, make) -> Projections:
    """A partition scheme's (or the bilinear form's) parameters, made by ``make`` (``make_kernel``/``make_param``:
    the linen module itself, or :mod:`qkvjax.nnx`'s). One kernel per group of the scheme's partition that the layer
    projects (only the query groups when it reads another layer's K/V), named ``w_`` + the group's roles."""
    scheme = cfg.tying
    n, h = cfg.num_heads, cfg.head_dim
    kernels_, biases = {}, {} if cfg.use_bias else None
    for group in scheme.query_groups if reads_kv else scheme.groups:
        heads, head_axis = scheme.heads(group, n, cfg.kv_heads), axes.HEADS if "q" in group else axes.KV_HEADS
        shape = (d, heads, cfg.width(group))
        kernels_[group] = make.make_kernel(f"w_{group}", shape, (axes.EMBED, head_axis, axes.HEAD_DIM), 0, (1, 2))
        if biases is not None:
            init = nn.initializers.zeros
            biases[group] = make.make_param(f"b_{group}", shape[1:], (head_axis, axes.HEAD_DIM), init).astype(cfg.dtype)
    w_qk = None
    if scheme.bilinear:  # Var(W_QK) = H / D^2 matches the product of two fan-in-initialised (D, H) kernels
        w_qk = make.make_kernel("w_qk_merged", (n, d, d), (axes.HEADS, axes.EMBED, None), 1, 2, h / d, 0)
    w_o = make.make_kernel("w_o", (n, cfg.value_dim, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), (0, 1), 2)
    b_o = None
    if cfg.has_output_bias:
        b_o = make.make_param("b_o", (d,), (axes.EMBED,), nn.initializers.zeros).astype(cfg.dtype)
    # a layer reading another layer's K/V has no key norm of its own: the keys are finished as their producer
    # finishes them (at write, or on read with the scale handed on with them, KV.key_norm)
    roles = ("q",) if reads_kv else ("q", "k")
    norm_scale = {
        r: make.make_param(f"{r}_norm_scale", (h,), (axes.HEAD_DIM,), nn.initializers.ones)
        for r in (roles if cfg.qk_norm else ())
    }
    rel_bias = None
    if cfg.relative_bias:
        shape = (n, 2 * cfg.relative_bias + 1)
        rel_bias = make.make_param("rel_bias", shape, (axes.HEADS, None), nn.initializers.zeros)
    temperature = None
    if cfg.learned_temperature:
        temperature = make.make_param("temperature", (n,), (axes.HEADS,), nn.initializers.zeros).astype(jnp.float32)
    return Projections(kernels_, biases, w_qk, w_o, b_o, norm_scale, rel_bias, temperature)
