"""What every module of the zoo shares: one call signature (:class:`Call`), its checks, and parameters made with
logical axis names."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from qkvjax import checks
from qkvjax.attention.cache import FRESH, KV, cache_shapes
from qkvjax.attention.config import AttentionConfig


def kernel_init(in_axis, out_axis, scale: float = 1.0, batch_axis=()):
    """Fan-in truncated normal over the input axes (``scale`` / fan_in variance), per batch axis."""
    return nn.initializers.variance_scaling(
        scale, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
    )


@dataclasses.dataclass(frozen=True)
class Call:
    """One call's arguments (see :meth:`AttentionModule.__call__`), checked, with the key side's inputs resolved."""

    x_q: Array  # (B, T, D)
    x_kv: Array  # (B, S, D): inputs_kv, or inputs_q for self-attention
    self_attention: bool
    mask: Array | None  # boolean, broadcastable to (B, N, T, S)
    causal: bool
    positions: Array | None  # (B, T)
    decode: bool
    deterministic: bool
    kv: KV | None
    cache: KV | None
    hand_back: bool  # return (y, KV)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.x_q.shape

    @classmethod
    def of(cls, cfg, inputs_q, inputs_kv, mask, causal, positions, decode, deterministic, kv, cache, return_kv):
        """The call's arguments checked (:func:`check_inputs`) and resolved: the linen and NNX modules' one entry.
        Array-likes (nested lists, numpy) become arrays, as flax's layers take them; the switches must be booleans
        (``causal='no'`` read as true, a causal mask nobody asked for)."""
        inputs_q, inputs_kv, mask, positions = (
            _as_array(name, value)
            for name, value in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv), ("mask", mask),
                                ("positions", positions))
        )  # fmt: skip
        causal, decode, deterministic, return_kv = (
            _as_bool(name, value)
            for name, value in (("causal", causal), ("decode", decode), ("deterministic", deterministic),
                                ("return_kv", return_kv))
        )  # fmt: skip
        for name, value in (("kv", kv), ("cache", cache)):
            if value is not None:
                checks.instance(f"{name}=", value, KV)
        self_attention = inputs_kv is None
        x_kv = inputs_q if self_attention else inputs_kv
        check_inputs(cfg, inputs_q, x_kv, mask, positions, decode, self_attention, kv, cache)
        return cls(
            inputs_q, x_kv, self_attention, None if mask is None else mask.astype(jnp.bool_), causal, positions,
            decode, deterministic, kv, cache, return_kv or cache is not None,
        )  # fmt: skip


def _as_array(name: str, value):
    """``value`` as an array (None stays None), or one line naming the argument."""
    if value is None or isinstance(value, jax.Array | np.ndarray):
        return value
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} is a {type(value).__name__}; allowed: an array, or nested lists of numbers") from None


def _as_bool(name: str, value) -> bool:
    """A Python or numpy boolean, or a concrete 0-d boolean array, as a Python bool; else one line."""
    if isinstance(value, jax.core.Tracer):  # it picks the program's shape, so it must be known while tracing
        raise ValueError(f"{name} is a traced value; allowed: True or False, known when the call is traced")
    if isinstance(value, bool | np.bool_) or (np.ndim(value) == 0 and getattr(value, "dtype", None) == np.bool_):
        return bool(value)
    raise ValueError(f"{name}={value!r}; allowed: True or False")


class AttentionModule(nn.Module):
    """An attention layer of the zoo: its config, logically named parameters, and one call signature whose
    arguments are checked here and handed to the subclass's ``forward`` as a :class:`Call`."""

    config: AttentionConfig

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
        checks.instance(f"{type(self).__name__}'s config", self.config, AttentionConfig)
        args = (mask, causal, positions, decode, deterministic, kv, cache, return_kv)
        return self.forward(Call.of(self.config, inputs_q, inputs_kv, *args))

    def forward(self, call: Call):
        raise NotImplementedError

    # The parameter-making interface the stages' parameter functions call (``tied_projections``,
    # ``latent_projections``); :mod:`qkvjax.nnx` implements the same two methods with ``nnx.Param``.
    def make_param(self, name: str, shape, names, init):
        """A parameter ``name`` in the param dtype, annotated with its logical axis ``names``."""
        return self.param(name, nn.with_logical_partitioning(init, names), shape, jnp.dtype(self.config.param_dtype))

    def make_kernel(self, name: str, shape, names, in_axis, out_axis, scale: float = 1.0, batch_axis=()) -> Array:
        """A projection kernel (fan-in truncated normal over ``in_axis``) in the compute dtype."""
        init = kernel_init(in_axis, out_axis, scale, batch_axis)
        return self.make_param(name, shape, names, init).astype(jnp.dtype(self.config.dtype))

    @property
    def collecting(self) -> bool:
        """Analysis collects the (T, S) logits and weights (``mutable=["intermediates"]``)."""
        return self.is_mutable_collection("intermediates")


def _check_kv_layout(cfg, kv: KV, b: int, d: int) -> None:
    """``kv=`` (another layer's K/V) has the groups, batch, heads and widths this layer's config caches: a donor
    with more K/V heads was read as if it were this layer's layout, silently (a pattern's ``kv_from`` is checked
    when the model is built; this is the same check for a caller passing ``kv=`` by hand)."""
    want = cache_shapes(cfg, d, 1)  # per name: (K, 1, W) for a group, (1, C) per token
    got = {name: tuple(t.shape) for name, t in kv.tensors.items()}

    def fits(name: str, shape: tuple) -> bool:
        w = want[name]
        if len(w) == 2:  # (B, S, C), either layout
            return len(shape) == 3 and shape[0] == b and shape[2] == w[1]
        heads = shape[2] if kv.layout == FRESH else shape[1]  # (B, S, K, W) fresh, (B, K, S, W) cached
        return len(shape) == 4 and shape[0] == b and (heads, shape[3]) == (w[0], w[2])

    if set(got) != set(want) or not all(fits(name, shape) for name, shape in got.items()):
        group = "(B, S, {}, {})" if kv.layout == FRESH else "(B, {}, S, {})"
        layout = {name: group.format(w[0], w[2]) if len(w) == 3 else f"(B, S, {w[1]})" for name, w in want.items()}
        raise ValueError(
            f"kv= holds {got} ({kv.layout}); this layer (scheme {cfg.scheme!r}, K={cfg.kv_heads}) reads {layout} with "
            f"B={b}; allowed: the K/V of a layer with the same scheme, K/V heads and widths"
        )


def check_inputs(cfg, x_q, x_kv, mask, positions, decode, self_attention, kv, cache) -> None:
    """Shape errors at trace time, before XLA compiles anything."""
    if sum(x is not None and x is not False for x in (kv, cache, decode)) > 1:
        raise ValueError("pass at most one of kv= (another layer's K/V), cache= and decode=True")
    if kv is not None and (cfg.tying.ties_query_to_kv or cfg.tying.bilinear):
        raise ValueError(f"scheme {cfg.scheme!r} makes keys or values from the query projection; kv= is not allowed")
    if cfg.tying.latent and (decode or kv is not None):
        raise ValueError(
            f"scheme {cfg.scheme!r} decodes with the functional cache only (cache=, DecodeCache) and reads no other "
            "layer's K/V; decode=True and kv= are not supported"
        )
    if (kv is not None and kv.start is not None or cache is not None) and positions is not None:
        raise ValueError("a cache gives each row's positions (its start); pass positions=None")
    if cache is not None and not self_attention:
        raise ValueError("cache= caches self-attention only; pass inputs_kv=None")
    if kv is not None:
        _check_kv_layout(cfg, kv, x_q.shape[0], x_q.shape[2])
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
    if t == 0 or x_kv.shape[1] == 0:  # a softmax over no keys, or no queries, has no meaning to give
        raise ValueError(f"Attention needs T >= 1 queries and S >= 1 keys; got inputs_q {x_q.shape}, inputs_kv "
                         f"{x_kv.shape}")  # fmt: skip
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
        if mask.dtype != jnp.bool_ and not isinstance(mask, jax.core.Tracer) and np.any(np.asarray(mask) < 0):
            # flax's float masks are 1/0 (non-zero: may attend); an additive mask's -inf would read as True
            raise ValueError("mask holds negative values (an additive mask?); pass a boolean mask, True = may attend")
