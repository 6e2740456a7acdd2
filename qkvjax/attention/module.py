"""The linen ``Attention`` module: parameters from the scheme, one code path for every scheme, a decode cache."""

from __future__ import annotations

import flax
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


@flax.struct.dataclass
class KV:
    """The keys and values a layer attends over, as its scheme's K/V groups produced them: ``tensors`` maps each
    group (``"k"``, ``"v"``, ``"kv"``; ``"x"`` (B, S, D) for a bilinear key side) to an array. A key-only group
    ``"k"`` holds finished keys (QK-norm and rotary applied); every other group is raw (norms, rotary on read).

    ``start`` None: fresh from this forward pass, (B, S, K, H), at the query positions. ``start`` (B,) int: a
    decode cache, (B, K, S, H) over S slots, where row b's current queries sit at positions start_b + t and every
    slot before them is filled; slot s is visible to a query at position p when s <= p (so prompts of different
    lengths decode together, each row at its own position).
    """

    tensors: dict[str, Array]
    start: Array | None = None


class AttentionModule(nn.Module):
    """What every module of the zoo shares: its config, and parameters made with logical axis names."""

    config: AttentionConfig

    def _param(self, name: str, shape, names, init):
        return self.param(name, nn.with_logical_partitioning(init, names), shape, jnp.dtype(self.config.param_dtype))

    def _blocked_causal(self, causal: bool, mask, start, t: int, s: int) -> bool:
        """Whether :func:`core.causal_attention` computes this call: causal self-attention over fresh keys
        (masked by index, so the mask is the plain triangle), no other mask, at least two blocks, and nobody
        collecting the (T, S) logits and weights (``mutable=["intermediates"]``, for analysis)."""
        block = self.config.causal_block
        return bool(
            block
            and causal
            and mask is None
            and start is None  # fresh keys (B, S, K, H), not a cache
            and s == t
            and t >= 2 * block
            and not self.is_mutable_collection("intermediates")
        )

    def _prefix_only(self, start, dropout: bool) -> bool:
        """Whether a call reading a cache (``start`` not None) goes through :func:`core.within_prefix`: blocks on,
        no attention dropout (its random draws cannot sit in a branch) and nobody collecting the (T, S) weights."""
        return bool(
            self.config.causal_block
            and start is not None
            and not dropout
            and not self.is_mutable_collection("intermediates")
        )


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
      attention reads the whole cache, and the call returns ``(y, updated cache)``.
    * ``decode=True``: flax's convention (``flax.linen.MultiHeadDotProductAttention``), kept for code written
      against it: initialise with ``decode=True`` on an input of the maximum length to create the ``cache``
      collection, then call with ``decode=True, mutable=["cache"]``; one position counter for the whole batch.

    Caches hold each K/V group once (one tensor for ``shared_kv``, raw: rotary and norms are applied to it on read),
    keys of a key-only group finished (normalised and rotated when made, so decoding does not rotate the whole cache
    at every step), plus the input ``x`` when the key side of a bilinear form needs it.
    """

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
        kv: KV | None = None,
        cache: KV | None = None,
        return_kv: bool = False,
    ):
        """inputs_q (B, T, D), inputs_kv (B, S, D) or None for self-attention, mask boolean and broadcastable
        to (B, N, T, S) with True = may attend, positions (B, T) for rotary embedding. Returns (B, T, D), or
        ``(y, KV)`` when ``cache`` is given or ``return_kv``."""
        cfg, scheme = self.config, self.config.tying
        if scheme.latent:
            raise ValueError(
                f"scheme {cfg.scheme!r} is a latent scheme: its module is qkvjax.attention.LatentAttention "
                "(qkvjax.attention.attention_module(config) picks the module for any config)"
            )
        n, kv_heads, h = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self_attention = inputs_kv is None
        x_kv_in = inputs_q if self_attention else inputs_kv
        _check_inputs(cfg, inputs_q, x_kv_in, mask, positions, decode, self_attention, kv, cache)
        b, t, d = inputs_q.shape
        dtype = jnp.dtype(cfg.dtype)

        own_groups = scheme.query_groups if kv is not None else scheme.groups
        kernels, biases = {}, {}
        for group in own_groups:
            heads = scheme.heads(group, n, kv_heads)
            head_axis = axes.HEADS if "q" in group else axes.KV_HEADS
            width = cfg.width(group)
            kernels[group] = self._param(
                f"w_{group}", (d, heads, width), (axes.EMBED, head_axis, axes.HEAD_DIM), _kernel_init(0, (1, 2))
            ).astype(dtype)
            if cfg.use_bias:
                biases[group] = self._param(
                    f"b_{group}", (heads, width), (head_axis, axes.HEAD_DIM), nn.initializers.zeros
                ).astype(dtype)
        if scheme.bilinear:
            # Var(W_QK) = H / D^2 matches the product of two fan-in-initialised (D, H) kernels.
            w_qk = self._param(
                "w_qk_merged", (n, d, d), (axes.HEADS, axes.EMBED, None), _kernel_init(1, 2, h / d, 0)
            ).astype(dtype)
        w_o = self._param(
            "w_o", (n, cfg.value_dim, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), _kernel_init((0, 1), 2)
        )
        w_o = w_o.astype(dtype)
        # A key-only projection (not shared with values) is handed on and cached as the scores use it: normalised
        # and rotated once, when made. Rotating every cached key again at every decode step cost 6-13x the rest of
        # the step (benchmarks/rope_cache.py). A K = V tensor stays raw (norms and rotary on read), so its cache
        # stays halved; a layer reading another layer's final keys uses them as they are.
        final_keys = not scheme.bilinear and scheme.group_of("k") == "k"
        norm_roles = ("q",) + (() if final_keys and kv is not None else ("k",))
        norm_scale = {
            role: self._param(f"{role}_norm_scale", (h,), (axes.HEAD_DIM,), nn.initializers.ones)
            for role in (norm_roles if cfg.qk_norm else ())
        }

        def prepare_keys(k, pos, seq_axis):
            """Key norms and rotary: k (B, S, K, H) with seq_axis 1, or (B, K, S, H) with 2; pos (B|1, S)."""
            if cfg.qk_norm:
                k = core.rms_norm(k, norm_scale["k"])
            if scheme.normalize_keys:
                k = core.unit_length(k)
            if cfg.rope:
                k = core.rotary(k, jnp.broadcast_to(pos, (b, k.shape[seq_axis])), cfg.rope_base, seq_axis=seq_axis)
            return k

        def run(x, groups):
            bs = [biases[g] for g in groups] if cfg.use_bias else None
            return dict(zip(groups, core.project(x, [kernels[g] for g in groups], bs), strict=True))

        x_q, x_kv = inputs_q.astype(dtype), x_kv_in.astype(dtype)
        if kv is not None:
            proj_q, fresh = run(x_q, scheme.query_groups), kv
        elif self_attention:
            proj_q = run(x_q, scheme.groups)
            fresh = KV({g: proj_q[g] for g in scheme.kv_groups} | ({"x": x_kv} if scheme.bilinear else {}))
        else:
            proj_q = run(x_q, scheme.query_groups) if scheme.query_groups else {}
            fresh = KV(run(x_kv, scheme.kv_groups) | ({"x": x_kv} if scheme.bilinear else {}))
        hand_back = return_kv or cache is not None
        if decode:  # flax's convention: the same functional cache, kept in linen variables
            slots, index = self._linen_cache(fresh.tensors)
            if index is not None:
                cache = KV({k: slot.value for k, slot in slots.items()}, jnp.broadcast_to(index.value, (b,)))
        if final_keys and kv is None:  # this layer's new keys, finished at their positions
            if cache is not None:
                new_pos = cache.start[:, None] + jnp.arange(t)[None]
            elif self_attention:
                new_pos = jnp.arange(t)[None] if positions is None else positions
            else:
                new_pos = jnp.arange(x_kv.shape[1])[None]
            fresh = KV(fresh.tensors | {"k": prepare_keys(fresh.tensors["k"], new_pos, 1)}, fresh.start)
        if cache is not None:
            fresh = KV(_write(cache, fresh.tensors, t), cache.start)
            if decode:
                for name, slot in slots.items():
                    slot.value = fresh.tensors[name]
                index.value = index.value + t
        kv_side = fresh.tensors

        kv_layout = "BSKH" if fresh.start is None else "BKSH"  # fresh K/V, or a cache
        seq_axis = kv_layout.index("S")
        length = kv_side[scheme.group_of("v")].shape[seq_axis]  # S: key slots
        if fresh.start is None:  # fresh keys at the query positions (or 0..S-1 for cross-attention)
            q_pos = jnp.arange(t)[None] if positions is None else positions
            k_pos = q_pos if self_attention else jnp.arange(length)[None]
            index_q, index_k = jnp.arange(t)[None], jnp.arange(length)[None]
        else:  # a cache (B, K, S, H): row b's queries at start_b + t; what they see is causal by position
            causal = True
            q_pos = index_q = fresh.start[:, None] + jnp.arange(t)[None]
            k_pos = index_k = jnp.arange(length)[None]
        rotary_q = jnp.broadcast_to(q_pos, (b, t))

        def read(p: int) -> tuple[Array, Array]:
            """Keys (bilinear: the key side's inputs) and values of key slots 0..p-1, as the scores use them."""
            v = jax.lax.slice_in_dim(kv_side[scheme.group_of("v")], 0, p, axis=seq_axis)
            if cfg.v_norm:
                v = core.rms_norm(v)
            if scheme.bilinear:
                return jax.lax.slice_in_dim(kv_side["x"], 0, p, axis=1), v
            k = jax.lax.slice_in_dim(kv_side[scheme.group_of("k")], 0, p, axis=seq_axis)
            if not final_keys:  # keys shared with values (or queries): finished here, on read
                k = prepare_keys(k, k_pos[:, :p], seq_axis)
            return k, v

        if not scheme.bilinear:
            q = proj_q[scheme.group_of("q")]
            if cfg.qk_norm:
                q = core.rms_norm(q, norm_scale["q"])
            if cfg.rope:
                q = core.rotary(q, rotary_q, cfg.rope_base)

        # Fresh keys are masked causally by index (as flax's make_causal_mask), not by rotary position.
        full_mask = core.combine_masks(
            None if mask is None else mask.astype(jnp.bool_),
            core.causal_mask(index_q, index_k) if causal else None,
        )
        self_mask = None
        if scheme.mask_self and self_attention:
            self_mask = core.grouped((index_k[:, None, None, :] == index_q[:, None, :, None]), kv_heads, cfg.group_size)
        dropout = cfg.dropout_rate > 0.0 and not deterministic

        implementation = cfg.implementation or ("einsum" if jax.default_backend() == "cpu" else "xla")
        custom = scheme.bilinear or self_mask is not None or dropout or cfg.relative_bias > 0
        table = None
        if cfg.relative_bias:
            table = self._param("rel_bias", (n, 2 * cfg.relative_bias + 1), (axes.HEADS, None), nn.initializers.zeros)

        def logits_of(lo: int, hi: int, keys: Array, layout: str) -> Array:
            """Folded scores (B, K, (hi - lo) G, S') of queries lo..hi-1 against ``keys`` (bilinear: inputs)."""
            if scheme.bilinear:
                logits = core.bilinear_logits(x_q[:, lo:hi], w_qk, keys, kv_heads, h)
            else:
                logits = core.qk_logits(q[:, lo:hi], keys, layout)
            if table is not None:
                key_index = index_k[:, : logits.shape[-1]]
                logits = logits + core.relative_bias(table.astype(logits.dtype), index_q[:, lo:hi], key_index, kv_heads)
            return logits

        def attend(p: int) -> Array:
            """Scores over key slots 0..p-1, masked softmax, values mixed: (B, T, N, Hv)."""
            keys, v = read(p)
            logits = logits_of(0, t, keys, kv_layout)
            self.sow("intermediates", "attention_logits", logits)  # (B, K, T * G, S), before masking
            weights = core.softmax_weights(
                logits,
                None if full_mask is None else core.grouped(full_mask[..., :p], kv_heads, cfg.group_size, t),
                None if self_mask is None else self_mask[..., :p],
                dropout_rate=cfg.dropout_rate if dropout else 0.0,
                dropout_rng=self.make_rng("dropout") if dropout else None,
            )
            self.sow("intermediates", "attention_weights", weights)  # (B, K, T * G, S), for analysis
            return core.mix_values(weights, v, t, kv_layout)

        may_block = (custom or implementation == "einsum") and not dropout
        if implementation == "chunked" and not custom and kv_layout == "BSKH":
            user_mask = None if mask is None else mask.astype(jnp.bool_)
            k, v = read(length)
            out = core.chunked_attention(q, k, v, user_mask, index_q, index_k, causal, cfg.chunk_size)
        elif may_block and self._blocked_causal(causal, mask, fresh.start, t, length):
            k, v = read(length)
            keys = k if scheme.bilinear else k.transpose(0, 2, 1, 3)  # BSKH -> BKSH once, sliced per block
            key_axis = 1 if scheme.bilinear else 2
            out = core.causal_attention(
                lambda lo, hi: logits_of(lo, hi, jax.lax.slice_in_dim(keys, 0, hi, axis=key_axis), "BKSH"),
                v,
                cfg.causal_block,
                mask_self=self_mask is not None,
            )
        elif self._prefix_only(fresh.start, dropout):  # decoding: read the cache only as far as rows are filled
            out = core.within_prefix(attend, jnp.max(fresh.start) + t, length, cfg.causal_block)
        elif custom or implementation in ("einsum", "chunked") or kv_layout == "BKSH" or cfg.value_dim != h:
            # (jax.nn.dot_product_attention wants one width for keys and values)
            out = attend(length)
        else:
            # Plain q.k logits: let jax pick the kernel (cuDNN flash attention when implementation='cudnn').
            only_causal = mask is None and causal
            k, v = read(length)
            out = jax.nn.dot_product_attention(
                q,
                k,
                v,
                mask=None if only_causal else full_mask,
                is_causal=only_causal,
                implementation=implementation,
            )
        y = core.dense(out, w_o, 2)  # BTNH,NHD->BTD
        if cfg.use_bias:
            y = y + self._param("b_o", (d,), (axes.EMBED,), nn.initializers.zeros).astype(dtype)[None, None]
        return (y, fresh) if hand_back else y

    def _linen_cache(self, new: dict[str, Array]):
        """flax's ``decode=True`` cache variables, shaped after ``new`` (BSKH -> BKSH), and the position counter
        (None on the initialising call, which only creates them)."""
        initialized = self.has_variable("cache", "cache_index")
        shapes = {k: v.transpose(0, 2, 1, 3).shape if v.ndim == 4 else v.shape for k, v in new.items()}
        slots = {
            name: self.variable("cache", f"cached_{name}", jnp.zeros, shape, new[name].dtype)
            for name, shape in shapes.items()
        }
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
        return slots, index if initialized else None


def _write(cache: KV, new: dict[str, Array], t: int) -> dict[str, Array]:
    """The cache's tensors with ``new`` (fresh, (B, T, K, H) or (B, T, D)) written at each row's start."""
    if set(new) != set(cache.tensors):
        raise ValueError(f"the cache holds {sorted(cache.tensors)} but this layer makes {sorted(new)}")
    length = next(iter(cache.tensors.values())).shape[-2]
    start = cache.start
    if not isinstance(start, jax.core.Tracer) and int(jnp.max(start)) + t > length:  # under jit the caller checks
        raise ValueError(
            f"decoding {t} more position(s) at cache index {int(jnp.max(start))} overflows the cache of {length} "
            "positions (its length is the input length of the init call with decode=True, or the cache's S)"
        )
    return {name: core.write_rows(cache.tensors[name], new[name], start) for name in cache.tensors}


def _check_inputs(cfg, x_q, x_kv, mask, positions, decode, self_attention, kv, cache) -> None:
    """Shape errors at trace time, before XLA compiles anything."""
    if sum(x is not None and x is not False for x in (kv, cache, decode)) > 1:
        raise ValueError("pass at most one of kv= (another layer's K/V), cache= and decode=True")
    if kv is not None and (cfg.tying.ties_query_to_kv or cfg.tying.bilinear):
        raise ValueError(f"scheme {cfg.scheme!r} makes keys or values from the query projection; kv= is not allowed")
    if (kv is not None and kv.start is not None or cache is not None) and positions is not None:
        raise ValueError("a cache gives each row's positions (its start); pass positions=None")
    if cache is not None and not self_attention:
        raise ValueError("cache= caches self-attention only; pass inputs_kv=None")
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
