"""The linen ``Attention`` module: parameters from the scheme, one code path for every scheme, a decode cache."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from qkvjax import axes
from qkvjax.attention import core
from qkvjax.attention.config import AttentionConfig


def _kernel_init(in_axis, out_axis, scale: float = 1.0, batch_axis=()):
    return nn.initializers.variance_scaling(
        scale, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
    )


class Attention(nn.Module):
    """Multi-head attention whose Q/K/V projections are tied as ``config.scheme`` says.

    ``out_t = sum_n softmax_s(score_n(t, s)) v_{s,n} W^O_n`` with ``score_n(t, s) = q_{t,n} . k_{s,kv(n)} / sqrt(H)``
    (or ``x_t^T W_QK[n] x_s / sqrt(H)`` for a bilinear scheme), where each distinct projection is one kernel
    ``w_<roles>`` of shape (D, N, H) if it makes queries, else (D, K, H); ``w_o`` is (N, H, D). See
    :mod:`qkvjax.attention.schemes` for the schemes and their papers.

    Decoding follows ``flax.linen.MultiHeadDotProductAttention``: initialise with ``decode=True`` on an input of
    the maximum length to create the ``cache`` collection, then call with ``decode=True, mutable=["cache"]`` on
    one or more new positions at a time (attention over the cache is causal). The cache holds one (B, K, S, H)
    tensor per group that produces keys or values, before rotary embedding (``cached_kv`` for ``shared_kv``), and
    the input itself (``cached_x``, (B, S, D)) when the key side of a bilinear form needs it.
    """

    config: AttentionConfig

    def _param(self, name: str, shape, names, init):
        return self.param(name, nn.with_logical_partitioning(init, names), shape, jnp.dtype(self.config.param_dtype))

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        *,
        mask: Array | None = None,
        causal: bool = False,
        positions: Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
    ) -> Array:
        """inputs_q (B, T, D), inputs_kv (B, S, D) or None for self-attention, mask boolean and broadcastable
        to (B, N, T, S) with True = may attend, positions (B, T) for rotary embedding. Returns (B, T, D)."""
        cfg, scheme = self.config, self.config.tying
        n, kv, h = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self_attention = inputs_kv is None
        x_kv_in = inputs_q if self_attention else inputs_kv
        _check_inputs(cfg, inputs_q, x_kv_in, mask, positions, decode, self_attention)
        b, t, d = inputs_q.shape
        s = x_kv_in.shape[1]
        dtype = jnp.dtype(cfg.dtype)

        kernels, biases = {}, {}
        for group in scheme.groups:
            heads = scheme.heads(group, n, kv)
            head_axis = axes.HEADS if "q" in group else axes.KV_HEADS
            kernels[group] = self._param(
                f"w_{group}", (d, heads, h), (axes.EMBED, head_axis, axes.HEAD_DIM), _kernel_init(0, (1, 2))
            ).astype(dtype)
            if cfg.use_bias:
                biases[group] = self._param(
                    f"b_{group}", (heads, h), (head_axis, axes.HEAD_DIM), nn.initializers.zeros
                ).astype(dtype)
        if scheme.bilinear:
            # Var(W_QK) = H / D^2 matches the product of two fan-in-initialised (D, H) kernels.
            w_qk = self._param(
                "w_qk_merged", (n, d, d), (axes.HEADS, axes.EMBED, None), _kernel_init(1, 2, h / d, 0)
            ).astype(dtype)
        w_o = self._param("w_o", (n, h, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), _kernel_init((0, 1), 2))
        w_o = w_o.astype(dtype)

        def run(x, groups):
            bs = [biases[g] for g in groups] if cfg.use_bias else None
            return dict(zip(groups, core.project(x, [kernels[g] for g in groups], bs), strict=True))

        x_q, x_kv = inputs_q.astype(dtype), x_kv_in.astype(dtype)
        if self_attention:
            proj_q = proj_kv = run(x_q, scheme.groups)
        else:
            proj_q = run(x_q, scheme.query_groups) if scheme.query_groups else {}
            proj_kv = run(x_kv, scheme.kv_groups)
        kv_side = {g: proj_kv[g] for g in scheme.kv_groups}
        if scheme.bilinear:
            kv_side["x"] = x_kv

        q_index, k_index = jnp.arange(t), jnp.arange(s)
        cached = self._update_cache(kv_side, t) if decode else None
        kv_layout = "BSKH"
        if cached is not None:
            # The cache keeps keys and values as (B, K, S, H): what the score and mixing matmuls read without
            # transposing the whole cache at every step.
            kv_side, q_index, k_index = cached
            causal, kv_layout = True, "BKSH"
        q_pos = jnp.broadcast_to(q_index[None], (b, t)) if positions is None else positions
        k_pos = q_pos if self_attention and not decode else jnp.broadcast_to(k_index[None], (b, k_index.shape[0]))

        v = kv_side[scheme.group_of("v")]
        if not scheme.bilinear:
            q, k = proj_q[scheme.group_of("q")], kv_side[scheme.group_of("k")]
            if scheme.normalize_keys:
                k = core.unit_length(k)
            if cfg.rope:
                q = core.rotary(q, q_pos, cfg.rope_base)
                k = core.rotary(k, k_pos, cfg.rope_base, seq_axis=kv_layout.index("S"))

        # A causal mask is by index (as flax's make_causal_mask), not by rotary position.
        full_mask = core.combine_masks(
            None if mask is None else mask.astype(jnp.bool_),
            core.causal_mask(q_index, k_index) if causal else None,
        )
        self_mask = None
        if scheme.mask_self and self_attention:
            self_mask = core.grouped((k_index[None, :] == q_index[:, None])[None, None], kv, cfg.group_size)
        dropout = cfg.dropout_rate > 0.0 and not deterministic

        implementation = cfg.implementation or ("einsum" if jax.default_backend() == "cpu" else "xla")
        custom = scheme.bilinear or self_mask is not None or dropout or cfg.relative_bias > 0
        if custom or implementation == "einsum" or cached is not None:
            if scheme.bilinear:
                logits = core.bilinear_logits(x_q, w_qk, kv_side["x"], kv, h)
            else:
                logits = core.qk_logits(q, k, kv_layout)
            if cfg.relative_bias:
                table = self._param(
                    "rel_bias", (n, 2 * cfg.relative_bias + 1), (axes.HEADS, None), nn.initializers.zeros
                )
                logits = logits + core.relative_bias(table.astype(logits.dtype), q_index, k_index, kv)
            self.sow("intermediates", "attention_logits", logits)  # (B, K, T * G, S), before masking
            weights = core.softmax_weights(
                logits,
                None if full_mask is None else core.grouped(full_mask, kv, cfg.group_size),
                self_mask,
                dropout_rate=cfg.dropout_rate if dropout else 0.0,
                dropout_rng=self.make_rng("dropout") if dropout else None,
            )
            self.sow("intermediates", "attention_weights", weights)  # (B, K, T * G, S), for analysis
            out = core.mix_values(weights, v, t, kv_layout)
        else:
            # Plain q.k logits: let jax pick the kernel (cuDNN flash attention when implementation='cudnn').
            only_causal = mask is None and causal
            out = jax.nn.dot_product_attention(
                q,
                k,
                v,
                mask=None if only_causal else full_mask,
                is_causal=only_causal,
                implementation=implementation,
            )
        y = jnp.einsum("BTNH,NHD->BTD", out, w_o)
        if cfg.use_bias:
            y = y + self._param("b_o", (d,), (axes.EMBED,), nn.initializers.zeros).astype(dtype)[None, None]
        return y

    def _update_cache(self, kv_side: dict[str, Array], t: int):
        """Writes the new positions into the cache; None on the initialising call (which only creates it)."""
        initialized = self.has_variable("cache", "cache_index")
        new = {k: v if v.ndim == 3 else v.transpose(0, 2, 1, 3) for k, v in kv_side.items()}  # BSKH -> BKSH
        slots = {
            name: self.variable("cache", f"cached_{name}", jnp.zeros, value.shape, value.dtype)
            for name, value in new.items()
        }
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
        if not initialized:
            return None
        cur = index.value
        max_len = next(iter(slots.values())).value.shape[-2]
        if not isinstance(cur, jax.core.Tracer) and int(cur) + t > max_len:  # under jit the caller must check
            raise ValueError(
                f"decoding {t} more position(s) at cache index {int(cur)} overflows the cache of {max_len} positions "
                "(its length is the input length of the init call with decode=True)"
            )
        for name, slot in slots.items():  # every slot has its positions on axis -2: (B, K, S, H) or (B, S, D)
            start = (0,) * (slot.value.ndim - 2) + (cur, 0)
            slot.value = jax.lax.dynamic_update_slice(slot.value, new[name].astype(slot.value.dtype), start)
        index.value = cur + t
        return {name: slot.value for name, slot in slots.items()}, cur + jnp.arange(t), jnp.arange(max_len)


def _check_inputs(cfg, x_q, x_kv, mask, positions, decode, self_attention) -> None:
    """Shape errors at trace time, before XLA compiles anything."""
    if x_q.ndim != 3 or x_kv.ndim != 3:
        raise ValueError(
            f"Attention inputs must be (B, T, D) and (B, S, D); got inputs_q {x_q.shape}, inputs_kv {x_kv.shape}"
        )
    if x_kv.shape[0] != x_q.shape[0] or x_kv.shape[2] != x_q.shape[2]:
        raise ValueError(
            f"inputs_kv {x_kv.shape} must share batch and model width with inputs_q {x_q.shape} "
            "(projections may be tied across the two inputs)"
        )
    if decode and not self_attention:
        raise ValueError("decode=True caches self-attention only; pass inputs_kv=None")
    if decode and positions is not None:
        raise ValueError("decode=True takes positions from the cache index; pass positions=None")
    b, t, _ = x_q.shape
    if positions is not None and positions.shape != (b, t):
        raise ValueError(f"positions must have shape (B, T) = {(b, t)}; got {positions.shape}")
    if mask is not None:
        want = (b, cfg.num_heads, t, None)  # S is the cache length when decoding
        ok = mask.ndim == 4 and all(m == 1 or w is None or m == w for m, w in zip(mask.shape, want, strict=True))
        if not ok or (not decode and mask.shape[3] not in (1, x_kv.shape[1])):
            raise ValueError(
                f"mask must be boolean and broadcastable to (B, N, T, S) = {(b, cfg.num_heads, t, x_kv.shape[1])}; "
                f"got shape {mask.shape}"
            )
