"""Keys and values between layers and decode steps: the :class:`KV` a layer hands on, what a decode cache holds
(:func:`cache_shapes`), how new positions are written into it (:func:`update`: every position, or a
sliding-window layer's ring of its last W), and flax's ``decode=True`` variables as a thin adapter onto the same
cache (:func:`linen_cache`).

A model's container of every layer's cache is :class:`qkvjax.models.lm.DecodeCache`; it is built from
:func:`cache_shapes` and read and written only through the functions here.
"""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from qkvjax.attention import core
from qkvjax.attention.config import AttentionConfig

FRESH, CACHED = "BSKH", "BKSH"  # the two layouts of a K/V group's tensor


@flax.struct.dataclass
class KV:
    """The keys and values a layer attends over, as its scheme's K/V groups produced them: ``tensors`` maps each
    group (``"k"``, ``"v"``, ``"kv"``; ``"x"`` (B, S, D) for a bilinear key side; ``"latent"`` and ``"k_rope"`` for
    a latent scheme) to an array. A key-only tensor (``"k"``, ``"k_rope"``) holds finished keys (QK-norm and rotary
    applied, :attr:`Scheme.keys_finished_at_write`); every other group is raw (norms and rotary on read).

    ``layout`` says which of two kinds it is (build them with :meth:`fresh` and :meth:`cached`):

    * ``FRESH``: made by this forward pass, a group's tensor (B, S, K, H), at the query positions; ``start`` None;
    * ``CACHED``: a decode cache, (B, K, S, H) over S slots, with ``start`` (B,) int: row b's current queries sit at
      positions start_b + t and every slot before them is filled; slot s is visible to a query at position p when
      s <= p (so prompts of different lengths decode together, each row at its own position).

    Per-token tensors (``"x"``, ``"latent"``, a shared ``"k_rope"``) are (B, S, C) in both. ``KV(tensors, start)``
    without a layout (the positional form) is a cache when ``start`` is given.

    ``ring`` W > 0 marks a window-only cache as a call reads it (:func:`update`): its first W slots are a ring in
    which slot j holds the one position congruent to j mod W of the row's last W, and the slots after them, if
    any, this call's fresh tokens; :func:`slot_positions` says which position each slot holds.

    ``key_norm`` (H,): the producing layer's QK-norm key scale, handed on with raw keys (a group that is not
    key-only, as K = V's ``"kv"``) so that a layer reading them (``kv=``) finishes them as their producer does
    (Gemma 4's readers of K = V layers). It travels with a call's K/V only; a decode cache never stores it.
    """

    tensors: dict[str, Array]
    start: Array | None = None
    layout: str | None = flax.struct.field(pytree_node=False, default=None)
    ring: int = flax.struct.field(pytree_node=False, default=0)
    key_norm: Array | None = None

    def __post_init__(self):
        if self.layout is None:  # KV(tensors) or KV(tensors, start): the layout follows from the start
            object.__setattr__(self, "layout", FRESH if self.start is None else CACHED)
        if self.layout not in (FRESH, CACHED):
            raise ValueError(f"KV.layout={self.layout!r}; allowed: {FRESH!r} (fresh) or {CACHED!r} (cached)")

    @classmethod
    def fresh(cls, tensors: dict[str, Array]) -> KV:
        return cls(tensors, None, FRESH)

    @classmethod
    def cached(cls, tensors: dict[str, Array], start: Array) -> KV:
        return cls(tensors, start, CACHED)

    @property
    def is_cache(self) -> bool:
        return self.layout == CACHED

    @property
    def seq_axis(self) -> int:
        """The slot axis S of a group's 4-d tensor (per-token 3-d tensors: axis 1)."""
        return self.layout.index("S")

    @property
    def length(self) -> int:
        """S, the key slots."""
        tensor = next(iter(self.tensors.values()))
        return tensor.shape[self.seq_axis if tensor.ndim == 4 else 1]


def cache_shapes(config: AttentionConfig, d_model: int, length: int) -> dict[str, tuple[int, ...]]:
    """What one layer's decode cache holds per row, by name, for ``length`` positions: each K/V group's
    (heads, S, width) tensor, ``"x"`` (S, D) for a bilinear key side, or a latent scheme's ``"latent"`` (S, R)
    and ``"k_rope"`` (S, H_r) (or (K, S, H_r), one per KV head). The decode caches are built from this, and the
    accounting counts it."""
    scheme = config.tying
    if scheme.latent:
        if not config.rope_dim:
            rope = {}
        elif config.rope_key_per_head:  # one rotary key per KV head, laid out as a K/V group's
            rope = {"k_rope": (config.kv_heads, length, config.rope_dim)}
        else:
            rope = {"k_rope": (length, config.rope_dim)}
        return {"latent": (length, config.latent_dim)} | rope
    shapes = {
        g: (scheme.heads(g, config.num_heads, config.kv_heads), length, config.width(g)) for g in scheme.kv_groups
    }
    return shapes | ({"x": (length, d_model)} if scheme.bilinear else {})


def update(cache: KV, new: dict[str, Array], t: int) -> KV:
    """The cache a call reads after its ``t`` new tokens (fresh tensors ``new``): :func:`write` into a cache of
    every position, or :func:`ring_view` of a ring (``cache.ring``, as
    :meth:`qkvjax.models.lm.DecodeCache.entries` marks a sliding-window layer's)."""
    if set(new) != set(cache.tensors):
        raise ValueError(f"the cache holds {sorted(cache.tensors)} but this layer makes {sorted(new)}")
    return ring_view(cache, new, t) if cache.ring else write(cache, new, t)


def ring_view(cache: KV, new: dict[str, Array], t: int) -> KV:
    """A window-only cache of W slots read with ``t`` new tokens at positions start_b + i (Mistral's rolling
    buffer, Jiang et al. 2023). One token (decoding) is written in place, at slot start_b mod W: the position it
    replaces, start_b - W, is outside the window of every query from start_b on, so the view is the ring. More
    tokens are appended after the ring, unwritten (W + t slots): a later new token would replace a slot that an
    earlier one still sees; :func:`settle` keeps each row's last W positions of that view."""
    w = cache.ring
    if cache.length != w:
        raise ValueError(f"a ring of W={w} slots has {cache.length}; allowed: W slots, as DecodeCache.empty makes")
    if t == 1:
        tensors = {name: core.write_rows(cache.tensors[name], new[name], cache.start % w) for name in cache.tensors}
    else:  # BTKH -> BKTH (a group's) or BTC (per token) after the ring's slots
        laid = {name: x.transpose(0, 2, 1, 3) if x.ndim == 4 else x for name, x in new.items()}
        tensors = {
            name: jnp.concatenate([x, laid[name].astype(x.dtype)], axis=2 if x.ndim == 4 else 1)
            for name, x in cache.tensors.items()
        }
    return KV(tensors, cache.start, CACHED, ring=w)


def slot_positions(kv: KV) -> Array:
    """(B, S) for a ring view, else (1, S): the position each slot holds. A cache of every position holds
    position s in slot s; a ring whose newest token is at E holds E - ((E - j) mod W) in slot j (negative: empty)
    and a view's fresh slot W + i the new token start + i."""
    if not kv.ring:
        return jnp.arange(kv.length)[None]
    w, fresh = kv.ring, kv.length - kv.ring
    newest = (kv.start - (1 if fresh else 0))[:, None]  # no fresh slots: the one new token was written
    ring = newest - (newest - jnp.arange(w)[None]) % w
    return jnp.concatenate([ring, kv.start[:, None] + jnp.arange(fresh)[None]], axis=1)


def settle(kv: KV, valid: Array | None = None) -> dict[str, Array]:
    """What the cache keeps of a call's view ``kv``: its tensors, or a ring view's W slots for each row's last W
    positions once ``valid`` (B,) of the call's new tokens count (None: all; the rest is right padding). With
    E = start + valid - 1, slot j keeps position p = E - ((E - j) mod W): the old ring's slot j when p < start,
    else the fresh slot W + p - start."""
    if not kv.ring or kv.length == kv.ring:
        return kv.tensors
    w, start = kv.ring, kv.start[:, None]
    newest = start + (kv.length - w if valid is None else valid[:, None]) - 1
    j = jnp.arange(w)[None]
    p = newest - (newest - j) % w
    source = jnp.where(p < start, j, w + p - start)  # (B, W) slots of the view

    def take(x: Array) -> Array:
        index = source[:, None, :, None] if x.ndim == 4 else source[:, :, None]  # BKSH, or BSC
        return jnp.take_along_axis(x, index, axis=2 if x.ndim == 4 else 1)

    return {name: take(x) for name, x in kv.tensors.items()}


def write(cache: KV, new: dict[str, Array], t: int) -> KV:
    """``cache`` with ``new`` (fresh tensors: (B, T, K, H), or (B, T, D) / (B, T, R) for the per-token ones)
    written at each row's start; the positions of the ``t`` new tokens, per row, are start_b .. start_b + t - 1."""
    length, start = cache.length, cache.start
    # a concrete start is checked on the host (also one a traced function closes over); under jit the caller checks
    last = None if isinstance(start, jax.core.Tracer) else int(np.max(np.asarray(start)))
    if last is not None and last + t > length:
        raise ValueError(
            f"decoding {t} more position(s) at cache index {last} overflows the cache of {length} "
            "positions (its length is the input length of the init call with decode=True, or the cache's S)"
        )
    tensors = {name: core.write_rows(cache.tensors[name], new[name], start) for name in cache.tensors}
    return KV(tensors, start, CACHED)


def prefix(tensor: Array, p: int, layout: str) -> Array:
    """Key slots 0..p-1 of a K/V group's tensor in ``layout`` (per-token (B, S, C) tensors: axis 1)."""
    axis = layout.index("S") if tensor.ndim == 4 else 1
    return jax.lax.slice_in_dim(tensor, 0, p, axis=axis)


def linen_cache(module: nn.Module, fresh: KV, batch: int):
    """flax's ``decode=True`` convention as an adapter onto :func:`write`: variables ``cached_<group>`` (shaped
    after ``fresh``, BSKH -> BKSH) and ``cache_index`` (one position for the whole batch) in the ``cache``
    collection. Returns ``(cache, store)``: the cache as a :class:`KV` (None on the initialising call, which
    only creates the variables) and ``store(updated, t)``, which writes an updated cache back."""
    initialized = module.has_variable("cache", "cache_index")
    shapes = {k: v.transpose(0, 2, 1, 3).shape if v.ndim == 4 else v.shape for k, v in fresh.tensors.items()}
    slots = {
        name: module.variable("cache", f"cached_{name}", jnp.zeros, shape, fresh.tensors[name].dtype)
        for name, shape in shapes.items()
    }
    index = module.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
    if not initialized:
        return None, lambda updated, t: None

    def store(updated: KV, t: int) -> None:
        kept = settle(updated)
        for name, slot in slots.items():
            slot.value = kept[name]
        index.value = index.value + t

    cache = KV.cached({k: slot.value for k, slot in slots.items()}, jnp.broadcast_to(index.value, (batch,)))
    return cache, store
