"""The linen ``Attention`` module: parameters from the scheme, then five stages, the same for every scheme.

    project  ->  finish keys and queries  ->  cache  ->  scores and mixing  ->  output projection

Where a scheme differs from ``separate`` is data, read at two lines: which kernels exist (:meth:`Attention.
projections`: one ``w_<group>`` per group of its partition, or the merged ``w_qk_merged`` of a bilinear form) and
which group answers for each role (:func:`project`; ``scheme.group_of``). Reformer's extras are two flags that
the finishing (``normalize_keys``) and the masks (``mask_self``) read.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from qkvjax import axes
from qkvjax.attention import core, kernels
from qkvjax.attention.base import AttentionModule, Call
from qkvjax.attention.cache import FRESH, KV, linen_cache, prefix, write
from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.schemes import Scheme

__all__ = ["KV", "Attention", "AttentionModule"]


@dataclasses.dataclass(frozen=True)
class Projections:
    """One layer's parameters, in the compute dtype: ``kernels[group]`` (D, N or K, H) and ``biases[group]``
    (N or K, H) for each group it projects; ``w_qk`` (N, D, D) of a bilinear form; ``w_o`` (N, Hv, D), ``b_o``
    (D,); ``norm_scale[role]`` (H,) of QK-norm; ``rel_bias`` (N, 2 R + 1); ``temperature`` (N,), log scale."""

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

    def run(x, groups):
        biases = None if p.biases is None else [p.biases[g] for g in groups]
        return dict(zip(groups, core.project(x, [p.kernels[g] for g in groups], biases), strict=True))

    extra = {"x": x_kv} if scheme.bilinear else {}
    if call.kv is not None:
        return run(x_q, scheme.query_groups), call.kv
    if call.self_attention:  # queries, keys and values from one input: every group in one product
        out = run(x_q, scheme.groups)
        return out, KV.fresh({g: out[g] for g in scheme.kv_groups} | extra)
    queries = run(x_q, scheme.query_groups) if scheme.query_groups else {}
    return queries, KV.fresh(run(x_kv, scheme.kv_groups) | extra)


@dataclasses.dataclass(frozen=True)
class Finishing:
    """Stage 2: norms, Reformer's unit-length keys and rotary positions, and when keys get them.

    A key-only projection (not shared with values) is finished once, when made (``keys_at_write``): it is cached
    and handed to other layers finished, so decoding does not rotate the whole cache at every step (that cost
    6-13x the rest of the step, ``benchmarks/rope_cache.py``). Keys shared with values (K = V) stay raw, so their
    cache stays halved, and are finished on read, over the slots read only."""

    config: AttentionConfig
    scheme: Scheme
    norm_scale: dict[str, Array]
    temperature: Array | None = None

    @property
    def keys_at_write(self) -> bool:
        return not self.scheme.bilinear and self.scheme.group_of("k") == "k"

    def keys(self, k: Array, pos: Array, seq_axis: int) -> Array:
        """k (B, S, K, H) with ``seq_axis`` 1, or (B, K, S, H) with 2; pos (B|1, S)."""
        cfg = self.config
        if cfg.qk_norm:
            k = core.rms_norm(k, self.norm_scale["k"])
        if self.scheme.normalize_keys:
            k = core.unit_length(k)
        if cfg.rope:
            pos = jnp.broadcast_to(pos, (k.shape[0], k.shape[seq_axis]))
            k = core.rotary(k, pos, cfg.rope_base, seq_axis, cfg.rope_interleaved)
        return k

    def queries(self, q: Array, pos: Array) -> Array:
        """q (B, T, N, H) at positions pos (B|1, T)."""
        if self.config.qk_norm:
            q = core.rms_norm(q, self.norm_scale["q"])
        if self.config.rope:
            cfg = self.config
            q = core.rotary(q, jnp.broadcast_to(pos, q.shape[:2]), cfg.rope_base, 1, cfg.rope_interleaved)
        if self.temperature is not None:  # q.k exp(tau_n): the score's scale per head, free of |q|
            q = (q.astype(jnp.float32) * jnp.exp(self.temperature)[None, None, :, None]).astype(q.dtype)
        return q

    def values(self, v: Array) -> Array:
        return core.rms_norm(v) if self.config.v_norm else v


def positions(side: KV, call: Call, length: int) -> tuple[Array, Array, Array, Array]:
    """(q_pos, k_pos, index_q, index_k): rotary positions and mask indices of the queries and the key slots.
    Fresh keys sit at the query positions (or 0..S-1 for cross-attention) and are masked causally by index, as
    flax's ``make_causal_mask``; a cache's row b has its queries at start_b + t and its slots at 0..S-1."""
    t = call.shape[1]
    if not side.is_cache:
        q_pos = jnp.arange(t)[None] if call.positions is None else call.positions
        k_pos = q_pos if call.self_attention else jnp.arange(length)[None]
        return q_pos, k_pos, jnp.arange(t)[None], jnp.arange(length)[None]
    index_q = side.start[:, None] + jnp.arange(t)[None]
    return index_q, jnp.arange(length)[None], index_q, jnp.arange(length)[None]


class Attention(AttentionModule):
    """Multi-head attention whose Q/K/V projections are tied as ``config.scheme`` says.

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
    bilinear form needs it (:mod:`qkvjax.attention.cache`).
    """

    @nn.compact
    def forward(self, call: Call):
        cfg, scheme = self.config, self.config.tying
        if scheme.latent:
            raise ValueError(
                f"scheme {cfg.scheme!r} is a latent scheme: its module is qkvjax.attention.LatentAttention "
                "(qkvjax.attention.attention_module(config) picks the module for any config)"
            )
        b, t, _ = call.shape
        dtype = jnp.dtype(cfg.dtype)
        p = self.projections(call.shape[2], reads_kv=call.kv is not None)
        x_q, x_kv = call.x_q.astype(dtype), call.x_kv.astype(dtype)
        finish = Finishing(cfg, scheme, p.norm_scale, p.temperature)

        queries, fresh = project(x_q, x_kv, p, scheme, call)  # 1. project
        cache, store = linen_cache(self, fresh, b) if call.decode else (call.cache, None)
        if finish.keys_at_write and call.kv is None:  # 2. this layer's new keys, finished at their positions
            if cache is None:
                new_pos = positions(fresh, call, x_kv.shape[1])[1]  # the fresh keys' own positions
            else:
                new_pos = positions(cache, call, 0)[0]  # the rows' next t positions
            fresh = KV.fresh(fresh.tensors | {"k": finish.keys(fresh.tensors["k"], new_pos, 1)})
        side = fresh if cache is None else write(cache, fresh.tensors, t)  # 3. cache
        if store is not None and cache is not None:
            store(side, t)

        length = side.tensors[scheme.group_of("v")].shape[side.seq_axis]  # S: key slots
        q_pos, k_pos, index_q, index_k = positions(side, call, length)
        causal = call.causal or side.is_cache  # what a cache row sees is causal by position

        def read(n: int) -> tuple[Array, Array]:  # key slots 0..n-1 (bilinear: the key side's inputs)
            v = finish.values(prefix(side.tensors[scheme.group_of("v")], n, side.layout))
            if scheme.bilinear:
                return prefix(side.tensors["x"], n, FRESH), v
            k = prefix(side.tensors[scheme.group_of("k")], n, side.layout)
            return (k if finish.keys_at_write else finish.keys(k, k_pos[:, :n], side.seq_axis)), v

        full_mask = core.combine_masks(call.mask, core.causal_mask(index_q, index_k) if causal else None)
        self_mask = None
        if scheme.mask_self and call.self_attention:
            own = index_k[:, None, None, :] == index_q[:, None, :, None]
            self_mask = core.grouped(own, cfg.kv_heads, cfg.group_size)
        dropout = cfg.dropout_rate > 0.0 and not call.deterministic
        scores = kernels.Scores(  # 4. scores and mixing
            q=None if scheme.bilinear else finish.queries(queries[scheme.group_of("q")], q_pos),
            x_q=x_q, w_qk=p.w_qk, read=read, layout=side.layout, length=length, t=t, index_q=index_q,
            index_k=index_k, mask=call.mask, full_mask=full_mask, self_mask=self_mask, causal=causal,
            rel_table=p.rel_bias, kv_heads=cfg.kv_heads, group_size=cfg.group_size, head_dim=cfg.head_dim,
            value_dim=cfg.value_dim, start=side.start,
            implementation=cfg.implementation or ("einsum" if jax.default_backend() == "cpu" else "xla"),
            chunk_size=cfg.chunk_size, causal_block=cfg.causal_block,
            dropout_rate=cfg.dropout_rate if dropout else 0.0,
            dropout_rng=self.make_rng("dropout") if dropout else None, collecting=self.collecting,
            sow=lambda name, value: self.sow("intermediates", name, value),
        )  # fmt: skip
        y = core.dense(kernels.mix(scores), p.w_o, 2)  # 5. output: BTNH,NHD->BTD
        if p.b_o is not None:
            y = y + p.b_o[None, None]
        return (y, side) if call.hand_back else y

    def projections(self, d: int, reads_kv: bool) -> Projections:
        """The layer's parameters. One kernel per group of the scheme's partition that this layer projects (only
        the query groups when it reads another layer's K/V), named ``w_`` + the group's roles."""
        cfg, scheme = self.config, self.config.tying
        n, h = cfg.num_heads, cfg.head_dim
        kernels_, biases = {}, {} if cfg.use_bias else None
        for group in scheme.query_groups if reads_kv else scheme.groups:
            heads, head_axis = scheme.heads(group, n, cfg.kv_heads), axes.HEADS if "q" in group else axes.KV_HEADS
            shape = (d, heads, cfg.width(group))
            kernels_[group] = self._kernel(f"w_{group}", shape, (axes.EMBED, head_axis, axes.HEAD_DIM), 0, (1, 2))
            if biases is not None:
                init = nn.initializers.zeros
                biases[group] = self._param(f"b_{group}", shape[1:], (head_axis, axes.HEAD_DIM), init).astype(cfg.dtype)
        w_qk = None
        if scheme.bilinear:  # Var(W_QK) = H / D^2 matches the product of two fan-in-initialised (D, H) kernels
            w_qk = self._kernel("w_qk_merged", (n, d, d), (axes.HEADS, axes.EMBED, None), 1, 2, h / d, 0)
        w_o = self._kernel("w_o", (n, cfg.value_dim, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), (0, 1), 2)
        b_o = None
        if cfg.has_output_bias:
            b_o = self._param("b_o", (d,), (axes.EMBED,), nn.initializers.zeros).astype(cfg.dtype)
        # a layer reading another layer's finished keys has no key norm of its own
        roles = ("q",) + (() if not scheme.bilinear and scheme.group_of("k") == "k" and reads_kv else ("k",))
        norm_scale = {
            r: self._param(f"{r}_norm_scale", (h,), (axes.HEAD_DIM,), nn.initializers.ones)
            for r in (roles if cfg.qk_norm else ())
        }
        rel_bias = None
        if cfg.relative_bias:
            shape = (n, 2 * cfg.relative_bias + 1)
            rel_bias = self._param("rel_bias", shape, (axes.HEADS, None), nn.initializers.zeros)
        temperature = None
        if cfg.learned_temperature:
            temperature = self._param("temperature", (n,), (axes.HEADS,), nn.initializers.zeros).astype(jnp.float32)
        return Projections(kernels_, biases, w_qk, w_o, b_o, norm_scale, rel_bias, temperature)
