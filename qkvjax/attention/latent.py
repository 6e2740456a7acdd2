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

Training and a forward pass without a cache use this form as written (K and V materialised; the ``chunked``
implementation applies). Decoding caches only ``c`` (R per token) and the rotated ``x W^KR`` (H_r) and uses the
*absorbed* form: since ``q . (c W^UK_j) = (q (W^UK_j)^T) . c``, queries are taken into the latent space once per
step, scores are taken against the cached latents, the latents are mixed with the weights and ``W^UV`` is applied
to the R-wide mixture: no (S, K, H) key or value tensor is ever made from the cache. The rotary part stays apart
because a position-dependent rotation between ``W^Q`` and ``W^UK`` would not let them merge; that is why
DeepSeek-V2 decouples it. With R = K (H + Hv) and ``w_kv_down`` = [W^K, W^V] the layer is ``separate`` (or GQA)
exactly (tested); ``qkvjax convert --to mla --rank R`` starts from there by truncated SVD. A rotary model's keys
are rotated per head, so it converts to MHA2MLA's form (Ji et al. 2025, arXiv:2502.14837): a few frequency pairs
of every head stay rotated, as a rotary key per KV head (``rope_key_per_head``), the rest lose their rotation and
go into the latent (``convert --rope-dim``).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from qkvjax import axes
from qkvjax.attention import core, kernels
from qkvjax.attention.base import AttentionModule, Call
from qkvjax.attention.cache import FRESH, KV, write
from qkvjax.attention.module import positions


class LatentAttention(AttentionModule):
    """Attention of a latent scheme (``config.tying.latent``), called like :class:`qkvjax.attention.Attention`:
    ``inputs_q`` (B, T, D), ``inputs_kv`` (B, S, D) or None, ``mask``, ``causal``, ``positions`` (B, T),
    ``cache=KV`` (a functional decode cache: ``{"latent": (B, S, R), "k_rope": (B, S, H_r)}`` and each row's
    start; ``"k_rope"`` is (B, K, S, H_r) with ``rope_key_per_head``) and ``return_kv``. flax's ``decode=True``
    variables and cross-layer ``kv=`` are not supported."""

    @nn.compact
    def forward(self, call: Call):
        cfg = self.config
        if call.decode or call.kv is not None:
            raise ValueError(
                f"scheme {cfg.scheme!r} decodes with the functional cache only (cache=, DecodeCache) and reads no "
                "other layer's K/V; decode=True and kv= are not supported"
            )
        n, kh, h, hv, r, hr = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.value_dim, cfg.latent_dim, cfg.rope_dim
        b, t, d = call.shape
        dtype = jnp.dtype(cfg.dtype)
        heads, kv_heads, hd, lat = axes.HEADS, axes.KV_HEADS, axes.HEAD_DIM, axes.LATENT

        def norm(x, name, width):
            if not cfg.latent_norm:
                return x
            return core.rms_norm(x, self._param(name, (width,), (lat,), nn.initializers.ones))

        # 1. project: queries (optionally through a low-rank path), the latent, and the rotary parts
        x_q, x_kv = call.x_q.astype(dtype), call.x_kv.astype(dtype)
        if cfg.q_rank is None:
            q_in, q_axis, up = x_q, axes.EMBED, ""
        else:
            w_q_down = self._kernel("w_q_down", (d, cfg.q_rank), (axes.EMBED, lat), 0, 1)
            q_in = norm(jnp.einsum("BTD,DR->BTR", x_q, w_q_down), "q_norm_scale", cfg.q_rank)
            q_axis, up = lat, "_up"
        # C below is the query path's input width: D, or Rq with low-rank queries
        w_q = self._kernel(f"w_q{up}", (q_in.shape[-1], n, h), (q_axis, heads, hd), 0, (1, 2))
        q = jnp.einsum("BTC,CNH->BTNH", q_in, w_q)
        if cfg.use_bias:
            q = q + self._param("b_q", (n, h), (heads, hd), nn.initializers.zeros).astype(dtype)[None, None]
        w_kv_down = self._kernel("w_kv_down", (d, r), (axes.EMBED, lat), 0, 1)
        w_k_up = self._kernel("w_k_up", (r, kh, h), (lat, kv_heads, hd), 0, (1, 2))
        w_v_up = self._kernel("w_v_up", (r, kh, hv), (lat, kv_heads, hd), 0, (1, 2))
        w_o = self._kernel("w_o", (n, hv, d), (heads, hd, axes.EMBED), (0, 1), 2)
        fresh = {"latent": norm(jnp.einsum("BSD,DR->BSR", x_kv, w_kv_down), "kv_norm_scale", r)}

        # 2. positions: only the decoupled rotary parts are rotated (a rotation between W^UQ and W^UK would stop
        # them from being absorbed), the key part once, when made
        own = KV.fresh(fresh) if call.cache is None else call.cache
        q_pos, k_pos, index_q, _ = positions(own, call, x_kv.shape[1])
        if hr:
            w_q_rope = self._kernel(f"w_q_rope{up}", (q_in.shape[-1], n, hr), (q_axis, heads, hd), 0, (1, 2))
            q_rope = jnp.einsum("BTC,CNH->BTNH", q_in, w_q_rope)
            q_rope = core.rotary(q_rope, jnp.broadcast_to(q_pos, (b, t)), cfg.rope_base, 1, cfg.rope_interleaved)
            if call.cache is not None:  # the new keys' positions are the queries'
                k_pos = q_pos
            if cfg.rope_key_per_head:
                w_k_rope = self._kernel("w_k_rope", (d, kh, hr), (axes.EMBED, kv_heads, hd), 0, (1, 2))
                k_rope = jnp.einsum("BSD,DKH->BSKH", x_kv, w_k_rope)
            else:
                w_k_rope = self._kernel("w_k_rope", (d, hr), (axes.EMBED, hd), 0, 1)
                k_rope = jnp.einsum("BSD,DH->BSH", x_kv, w_k_rope)[:, :, None]  # BSH -> BS1H, one head for all
            k_pos = jnp.broadcast_to(k_pos, k_rope.shape[:2])
            k_rope = core.rotary(k_rope, k_pos, cfg.rope_base, 1, cfg.rope_interleaved)
            fresh["k_rope"] = k_rope if cfg.rope_key_per_head else k_rope[:, :, 0]

        # 3. cache: the latents (and rotated rotary keys) are what a row keeps
        side = KV.fresh(fresh) if call.cache is None else write(call.cache, fresh, t)
        latent = side.tensors["latent"]
        index_k = jnp.arange(latent.shape[1])[None]
        causal = call.causal or side.is_cache
        full_mask = core.combine_masks(call.mask, core.causal_mask(index_q, index_k) if causal else None)
        dropout = cfg.dropout_rate > 0.0 and not call.deterministic
        dropout_rng = self.make_rng("dropout") if dropout else None
        scale = 1.0 / math.sqrt(h + hr)

        # 4. scores and mixing
        if side.is_cache:  # absorbed: scores and mixing in the latent space, W^UV after mixing
            q_lat = jnp.einsum("BKQH,RKH->BKQR", core.fold_queries(q * scale, kh), w_k_up)

            def attend(p: int) -> Array:  # over cache slots 0..p-1
                logits = jnp.einsum("BKQR,BSR->BKQS", q_lat, latent[:, :p])
                if hr and cfg.rope_key_per_head:  # the cached rotary keys: (B, K, S, H_r)
                    logits = logits + jnp.einsum(
                        "BKQE,BKSE->BKQS", core.fold_queries(q_rope * scale, kh), side.tensors["k_rope"][:, :, :p]
                    )
                elif hr:  # one rotary key for every head: (B, S, H_r)
                    logits = logits + jnp.einsum(
                        "BKQE,BSE->BKQS", core.fold_queries(q_rope * scale, kh), side.tensors["k_rope"][:, :p]
                    )
                self.sow("intermediates", "attention_logits", logits)  # (B, K, T * G, S), before masking
                grouped = None if full_mask is None else core.grouped(full_mask[..., :p], kh, cfg.group_size, t)
                weights = core.softmax_weights(
                    logits, grouped, dropout_rate=cfg.dropout_rate if dropout else 0.0, dropout_rng=dropout_rng
                )
                self.sow("intermediates", "attention_weights", weights)
                mixed = jnp.einsum("BKQS,BSR->BKQR", weights.astype(dtype), latent[:, :p])
                return core.unfold_queries(jnp.einsum("BKQR,RKH->BKQH", mixed, w_v_up), t)

            length = latent.shape[1]
            if cfg.causal_block and not dropout and not self.collecting:  # read only as far as rows are filled
                out = core.within_prefix(attend, jnp.max(side.start) + t, length, cfg.causal_block)
            else:
                out = attend(length)
        else:  # as written: keys and values up-projected from the latents of this call, then any kernel
            k = jnp.einsum("BSR,RKH->BSKH", latent, w_k_up)
            v = jnp.einsum("BSR,RKH->BSKH", latent, w_v_up)
            if hr:  # BSH -> BSKH: a shared rotary key part is the same for every head
                k_rope = fresh["k_rope"] if cfg.rope_key_per_head else fresh["k_rope"][:, :, None]
                k_rope = jnp.broadcast_to(k_rope, k.shape[:3] + (hr,))
                q, k = jnp.concatenate([q, q_rope], -1), jnp.concatenate([k, k_rope], -1)
            scores = kernels.Scores(
                q=q, x_q=None, w_qk=None, read=lambda p: (k[:, :p], v[:, :p]), layout=FRESH, length=v.shape[1], t=t,
                index_q=index_q, index_k=index_k, mask=call.mask, full_mask=full_mask, self_mask=None,
                causal=causal, rel_table=None, kv_heads=kh, group_size=cfg.group_size, head_dim=h + hr,
                value_dim=hv, start=None, implementation="chunked" if cfg.implementation == "chunked" else "einsum",
                chunk_size=cfg.chunk_size, causal_block=cfg.causal_block,
                dropout_rate=cfg.dropout_rate if dropout else 0.0, dropout_rng=dropout_rng,
                collecting=self.collecting, sow=lambda name, value: self.sow("intermediates", name, value),
            )  # fmt: skip
            out = kernels.mix(scores)
        y = core.dense(out, w_o, 2)  # 5. output: BTNH,NHD->BTD
        if cfg.has_output_bias:
            y = y + self._param("b_o", (d,), (axes.EMBED,), nn.initializers.zeros).astype(dtype)[None, None]
        return (y, side) if call.hand_back else y
