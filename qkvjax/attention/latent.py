"""Multi-head Latent Attention (DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, section 2.1), the ``mla`` scheme.

Keys and values of head j come out of one latent per token, shared by K and V and by every head::

    c_s = norm(x_s W^DKV)                      w_kv_down: (D, R), kv_norm_scale: (R,)
    k_{s,j} = [c_s W^UK_j ; rope(x_s W^KR)]     w_k_up: (R, K, H), w_k_rope: (D, H_r)  (the rotary part is shared;
                                                with ``rope_key_per_head``, rope(x_s W^KR_j) and (D, K, H_r))
    v_{s,j} = c_s W^UV_j                        w_v_up: (R, K, Hv)
    q_{t,n} = [x_t W^Q_n ; rope(x_t W^QR_n)]    w_q: (D, N, H), w_q_rope: (D, N, H_r)
                                                (or from c^Q_t = norm(x_t W^DQ): w_q_down (D, Rq), w_q_up, w_q_rope_up)
    o_t = sum_n softmax_s(q_{t,n} . k_{s,j(n)} / sqrt(H + H_r)) v_{s,j(n)} W^O_n       w_o: (N, Hv, D)

With ``use_bias`` the queries' non-rotary part gets a bias ``b_q: (N, H)`` and the output ``b_o: (D,)`` (as
``output_bias`` says): the only places a bias changes what the layer computes. A key bias would add q . b_k, the
same for every key, which the softmax removes; a value bias reaches the output as sum_n b_v W^O_n, a constant the
output bias holds. So ``qkvjax convert --to mla`` carries a biased model (GPT-2, Qwen2 without rotary) exactly.

The layer runs the pipeline of :mod:`qkvjax.attention.module` (:class:`qkvjax.attention.Attention` takes a latent
config as any other); :class:`Latent` is its stages. Training and a
forward pass without a cache use the form as written: the slots' reader up-projects K and V from the latents, and
any kernel of :data:`qkvjax.attention.kernels.KERNELS` applies (``chunked``, ``blocks``, ...). Decoding caches only
``c`` (R per token) and the rotated ``x W^KR`` (H_r) and is read by the ``absorbed`` kernel: since
``q . (c W^UK_j) = (q (W^UK_j)^T) . c``, queries are taken into the latent space once per step, scores are taken
against the cached latents, the latents are mixed with the weights and ``W^UV`` is applied to the R-wide mixture:
no (S, K, H) key or value tensor is ever made from the cache. The rotary part stays apart
because a position-dependent rotation between ``W^Q`` and ``W^UK`` would not let them merge; that is why
DeepSeek-V2 decouples it. With R = K (H + Hv) and ``w_kv_down`` = [W^K, W^V] the layer is ``separate`` (or GQA)
exactly (tested); ``qkvjax convert --to mla --rank R`` starts from there by truncated SVD. A rotary model's keys
are rotated per head, so it converts to MHA2MLA's form (Ji et al. 2025, arXiv:2502.14837): a few frequency pairs
of every head stay rotated, as a rotary key per KV head (``rope_key_per_head``), the rest lose their rotation and
go into the latent (``convert --rope-dim``).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from qkvjax import axes
from qkvjax.attention import core, kernels
from qkvjax.attention.base import Call
from qkvjax.attention.cache import FRESH, KV, prefix
from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.module import Attention, Positions, Stages, register_latent_stages


@dataclasses.dataclass(frozen=True)
class LatentProjections:
    """One latent layer's parameters in the compute dtype (see the module docstring for the maths): ``w_q``
    (D, N, H) or, with a low-rank query path, ``w_q_down`` (D, Rq), ``q_norm_scale`` (Rq,) and ``w_q`` (Rq, N, H);
    ``b_q`` (N, H); ``w_q_rope`` (D or Rq, N, P); ``w_kv_down`` (D, R), ``kv_norm_scale`` (R,); ``w_k_rope`` (D, P)
    or (D, K, P); ``w_k_up`` (R, K, H), ``w_v_up`` (R, K, U); ``w_o`` (N, U, D), ``b_o`` (D,). Absent parts are
    None."""

    w_q_down: Array | None
    q_norm_scale: Array | None
    w_q: Array
    b_q: Array | None
    w_kv_down: Array
    w_k_up: Array
    w_v_up: Array
    w_o: Array
    kv_norm_scale: Array | None
    w_q_rope: Array | None
    w_k_rope: Array | None
    b_o: Array | None


@dataclasses.dataclass(frozen=True)
class Latent(Stages):
    """MLA's stages: queries (through the low-rank path if any) with their decoupled rotary part, the latent and
    the rotary key (rotated once, when made: it is key-only); slots read by up-projection, or, from a cache, by
    the ``absorbed`` kernel."""

    config: AttentionConfig
    p: LatentProjections

    w_o = property(lambda self: self.p.w_o)
    b_o = property(lambda self: self.p.b_o)

    def project(self, x_q: Array, x_kv: Array, call: Call) -> tuple[dict[str, Array], KV]:
        p, eps = self.p, self.config.norm_eps
        q_in = x_q if p.w_q_down is None else norm(core.dense(x_q, p.w_q_down), p.q_norm_scale, eps)  # BTD,DR->BTR
        queries = {"q": core.dense(q_in, p.w_q)}  # BTD,DNH->BTNH (BTR,RNH->BTNH)
        if p.b_q is not None:
            queries["q"] = queries["q"] + p.b_q[None, None]
        if p.w_q_rope is not None:
            queries["q_rope"] = core.dense(q_in, p.w_q_rope)  # BTD,DNP->BTNP
        fresh = {"latent": norm(core.dense(x_kv, p.w_kv_down), p.kv_norm_scale, eps)}  # BSD,DR->BSR
        if p.w_k_rope is not None:  # BSD,DKP->BSKP, or BSD,DP->BSP: one rotary key for every head
            fresh["k_rope"] = core.dense(x_kv, p.w_k_rope)
        return queries, KV.fresh(fresh)

    def finish_new(self, tensors: dict[str, Array], pos: Array) -> dict[str, Array]:
        if "k_rope" not in tensors:
            return tensors
        k = tensors["k_rope"]
        shared = k.ndim == 3
        k = k[:, :, None] if shared else k  # BSP -> BS1P, one head for all
        k = self._rotary(k, jnp.broadcast_to(pos, k.shape[:2]))
        return tensors | {"k_rope": k[:, :, 0] if shared else k}

    def queries(self, queries: dict[str, Array], x_q: Array, pos: Positions) -> kernels.Queries:
        q = queries["q"]
        if "q_rope" in queries:  # [q ; rope(q_rope)]: (B, T, N, H + P), scored against [k ; k_rope]
            q_rope = self._rotary(queries["q_rope"], jnp.broadcast_to(pos.q, q.shape[:2]))
            q = jnp.concatenate([q, q_rope], -1)
        return kernels.Queries(q, pos.index_q, q.shape[-1])

    def slots(self, side: KV, pos: Positions) -> kernels.Slots:
        cfg, p = self.config, self.p
        k_rope = side.tensors.get("k_rope")

        def read(n: int) -> tuple[Array, Array]:  # slots 0..n-1 as written: K and V up-projected, (B, n, K, .)
            latent = prefix(side.tensors["latent"], n, FRESH)
            k, v = core.dense(latent, p.w_k_up), core.dense(latent, p.w_v_up)  # BSR,RKH->BSKH; BSR,RKU->BSKU
            if k_rope is None:
                return k, v
            rope = prefix(k_rope, n, side.layout)
            if rope.ndim == 3:  # BSP -> BSKP: a shared rotary key part is the same for every head
                rope = rope[:, :, None]
            elif side.is_cache:
                rope = rope.transpose(0, 2, 1, 3)  # BKSP -> BSKP
            return jnp.concatenate([k, jnp.broadcast_to(rope, k.shape[:3] + rope.shape[3:])], -1), v

        absorbed = None
        if side.is_cache:
            absorbed = kernels.Absorbed(side.tensors["latent"], k_rope, p.w_k_up, p.w_v_up)
        return kernels.Slots(
            read, FRESH, side.length, pos.index_k, side.start, cfg.kv_heads, cfg.value_dim, absorbed, bool(side.ring)
        )  # fmt: skip

    def _rotary(self, x: Array, pos: Array) -> Array:
        cfg = self.config
        return core.rotary(x, pos, cfg.rope_base, 1, cfg.rope_interleaved)


def norm(x: Array, scale: Array | None, eps: float) -> Array:
    """A latent's RMS norm with its learned scale; no norm without one (``latent_norm=False``)."""
    return x if scale is None else core.rms_norm(x, scale, eps)


class LatentAttention(Attention):
    """:class:`qkvjax.attention.Attention`, which takes a latent scheme too; this name is kept for code written
    when MLA had a module of its own. Called with ``inputs_q`` (B, T, D), ``inputs_kv`` (B, S, D) or None,
    ``mask``, ``causal``, ``positions`` (B, T), ``cache=KV`` (a functional decode cache: ``{"latent": (B, S, R),
    "k_rope": (B, S, H_r)}`` and each row's start; ``"k_rope"`` is (B, K, S, H_r) with ``rope_key_per_head``) and
    ``return_kv``; flax's ``decode=True`` variables and cross-layer ``kv=`` are not supported."""


def latent_projections(cfg: AttentionConfig, d: int, make) -> LatentProjections:
    """A latent scheme's parameters, made by ``make`` (``make_kernel``/``make_param``: the linen module, or
    :mod:`qkvjax.nnx`'s) in a fixed order (it decides their initial values)."""
    n, kh, h, hv, r, hr = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.value_dim, cfg.latent_dim, cfg.rope_dim
    heads, kv_heads, hd, lat = axes.HEADS, axes.KV_HEADS, axes.HEAD_DIM, axes.LATENT

    def scale(name, width):
        return make.make_param(name, (width,), (lat,), nn.initializers.ones) if cfg.latent_norm else None

    if cfg.q_rank is None:
        w_q_down = q_scale = None
        q_width, q_axis, up = d, axes.EMBED, ""
    else:
        w_q_down = make.make_kernel("w_q_down", (d, cfg.q_rank), (axes.EMBED, lat), 0, 1)
        q_scale = scale("q_norm_scale", cfg.q_rank)
        q_width, q_axis, up = cfg.q_rank, lat, "_up"
    w_q = make.make_kernel(f"w_q{up}", (q_width, n, h), (q_axis, heads, hd), 0, (1, 2))
    b_q = None
    if cfg.use_bias:
        b_q = make.make_param("b_q", (n, h), (heads, hd), nn.initializers.zeros).astype(cfg.dtype)
    w_kv_down = make.make_kernel("w_kv_down", (d, r), (axes.EMBED, lat), 0, 1)
    w_k_up = make.make_kernel("w_k_up", (r, kh, h), (lat, kv_heads, hd), 0, (1, 2))
    w_v_up = make.make_kernel("w_v_up", (r, kh, hv), (lat, kv_heads, hd), 0, (1, 2))
    w_o = make.make_kernel("w_o", (n, hv, d), (heads, hd, axes.EMBED), (0, 1), 2)
    kv_scale = scale("kv_norm_scale", r)
    w_q_rope = w_k_rope = None
    if hr:
        w_q_rope = make.make_kernel(f"w_q_rope{up}", (q_width, n, hr), (q_axis, heads, hd), 0, (1, 2))
        if cfg.rope_key_per_head:
            w_k_rope = make.make_kernel("w_k_rope", (d, kh, hr), (axes.EMBED, kv_heads, hd), 0, (1, 2))
        else:
            w_k_rope = make.make_kernel("w_k_rope", (d, hr), (axes.EMBED, hd), 0, 1)
    b_o = None
    if cfg.has_output_bias:
        b_o = make.make_param("b_o", (d,), (axes.EMBED,), nn.initializers.zeros).astype(cfg.dtype)
    return LatentProjections(
        w_q_down, q_scale, w_q, b_q, w_kv_down, w_k_up, w_v_up, w_o, kv_scale, w_q_rope, w_k_rope, b_o
    )


register_latent_stages(lambda cfg, d, make: Latent(cfg, latent_projections(cfg, d, make)))
