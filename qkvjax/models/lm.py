"""A decoder-only language model whose attention is the zoo's ``Attention`` (GPT-2 layout, pre-norm).

``h_0 = E[x] (+ P)``, ``h_{l+1} = h_l + Attn(LN(h_l)) + MLP(LN(h_l + Attn(LN(h_l))))``, ``logits = LN(h_L) E^T``
(or a separate ``w_unembed``). Radford et al. 2019; the nanoGPT ``shakespeare_char`` and ``gpt2`` presets.
"""

from __future__ import annotations

import dataclasses
import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from qkvjax import axes, checks
from qkvjax.attention import KV, Attention, AttentionConfig, LayerAttention, core, stack_cost
from qkvjax.attention.cache import CACHED, cache_shapes, settle
from qkvjax.attention.costs import causal_keys_seen, keys_seen
from qkvjax.attention.layers import MAX_LAYERS, expand, producers
from qkvjax.models.family import Family, Mlp, dense_init, norm

REMAT_POLICIES = ("none", "full", "dots")


class BlockShape:
    """What a ``Block`` reads from its model's config, and the checks every such config shares (mixed into the
    LM's and the encoder's frozen dataclasses)."""

    def _check_shape(self) -> None:
        for field, kind in (("attention", AttentionConfig), ("family", Family)):
            value, allowed = getattr(self, field), f"a {kind.__name__}, or a dict of its fields (from JSON)"
            if isinstance(value, dict):
                unknown = sorted(set(value) - {f.name for f in dataclasses.fields(kind)})
                if unknown:
                    checks.refuse(self, field, f"{allowed}; {unknown} are not {kind.__name__} fields")
                object.__setattr__(self, field, kind(**value))
            elif not isinstance(value, kind):
                checks.refuse(self, field, allowed)
        for field in ("vocab_size", "d_model", "num_layers", "max_len"):
            checks.integer(self, field)
        # before the layers are expanded (an untrusted config.json's n_layer too; see MAX_LAYERS)
        if self.num_layers > MAX_LAYERS:
            checks.refuse(self, "num_layers", f"an integer in [1, {MAX_LAYERS}]")
        checks.integer(self, "mlp_dim", none="= 4 d_model")
        checks.number(self, "dropout_rate", low=0, high=1, open_high=True)
        checks.flag(self, "learned_positions")

    @property
    def mlp_width(self) -> int:
        return 4 * self.d_model if self.mlp_dim is None else self.mlp_dim

    @property
    def dtype(self):
        return jnp.dtype(self.attention.dtype)

    @property
    def param_dtype(self):
        return jnp.dtype(self.attention.param_dtype)


@dataclasses.dataclass(frozen=True)
class ModelConfig(BlockShape):
    """A decoder-only LM.

    Attributes:
      attention: the attention layer (its ``dtype``/``param_dtype`` are the model's), or the base that
        ``layers`` varies per layer.
      layers: a layer pattern (:mod:`qkvjax.attention.layers`): a scheme and options per layer, cross-layer K/V
        sharing; empty means ``attention`` in every layer. Expanded in ``layer_attention``.
      vocab_size: V; 256 for byte-level text.
      d_model: D.
      num_layers: blocks.
      mlp_dim: F; None means 4 D.
      max_len: the context length (learned position table size, decode cache length).
      learned_positions: add a learned absolute position embedding (use False with ``attention.rope``).
      tie_embeddings: logits use the token embedding transposed.
      family: the norms and the MLP (:class:`qkvjax.models.family.Family`); the default is GPT-2's layout
        without biases. Imported models set it (``qkvjax import``).
      dropout_rate: residual and embedding dropout.
      remat: activation checkpointing of each block: 'none', 'full' (recompute everything) or 'dots'
        (save matmul outputs, recompute the rest).
    """

    attention: AttentionConfig
    vocab_size: int = 256
    d_model: int = 384
    num_layers: int = 6
    mlp_dim: int | None = None
    max_len: int = 256
    learned_positions: bool = True
    tie_embeddings: bool = True
    dropout_rate: float = 0.0
    remat: str = "none"
    layers: str = ""
    family: Family = Family()

    def __post_init__(self):
        self._check_shape()
        checks.flag(self, "tie_embeddings")
        checks.choice(self, "remat", REMAT_POLICIES)
        if not isinstance(self.layers, str):
            raise ValueError(f"ModelConfig.layers={self.layers!r}; allowed: a layer pattern string ('' = all alike)")
        object.__setattr__(self, "_layer_attention", expand(self.layers, self.attention, self.num_layers))

    @property
    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention config and K/V donor, from ``attention`` and ``layers``."""
        return self._layer_attention


_dense_init = dense_init  # the name the encoder and older code import


def _layer_norm(cfg, name: str) -> nn.Module:
    """The config's norm (``cfg.family``'s; a LayerNorm without bias by default)."""
    return norm(cfg.family, cfg.dtype, cfg.param_dtype, name)


def token_table(module: nn.Module, cfg) -> Array:
    """``embed: (V, D)``, a parameter of ``module`` (``cfg`` has vocab_size, d_model, param_dtype)."""
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (axes.VOCAB, axes.EMBED))
    return module.param("embed", init, (cfg.vocab_size, cfg.d_model), cfg.param_dtype)


def rows_of(table: Array, ids: Array, dtype) -> Array:
    """``table[ids]``: (V, D) rows for (B, T) token ids (or learned positions) -> (B, T, D). An id outside [0, V)
    gives NaN rows, so the loss says so (the train step drops such a batch's update); a negative id would otherwise
    wrap to row V + id, silently."""
    ids = jnp.where(ids < 0, table.shape[0], ids)  # jnp.take fills past the end only
    return jnp.take(table, ids, axis=0).astype(dtype)


def as_tokens(tokens) -> Array:
    """Token ids given as nested lists or numpy, as an array (what flax's layers take); a string is refused."""
    if isinstance(tokens, jax.Array | np.ndarray):
        return tokens
    if isinstance(tokens, str | bytes):
        raise ValueError(f"tokens given as a {type(tokens).__name__}; allowed: integer ids (B, T) (encode text first)")
    return jnp.asarray(tokens)


def position_table(module: nn.Module, cfg, stddev: float) -> Array:
    """``pos_embed: (max_len, D)``, learned absolute positions, a parameter of ``module``."""
    init = nn.with_logical_partitioning(nn.initializers.normal(stddev), (None, axes.EMBED))
    return module.param("pos_embed", init, (cfg.max_len, cfg.d_model), cfg.param_dtype)


class Block(nn.Module):
    """Transformer block: causal self-attention, then the MLP, each on a residual, normalised before each
    (pre-norm) or after each residual sum (post-norm, ``config.family.norm_position``).

    ``attention_cls`` is any linen module built as ``attention_cls(attention)`` and called like ``Attention`` (the
    benchmark swaps in flax's own attention this way); the default is the zoo's ``Attention``, which takes every
    scheme; ``attention`` defaults to ``config.attention``.
    ``causal=False`` makes it an encoder block. ``config`` is a ModelConfig or anything with the same
    ``attention``, ``mlp_width``, ``dtype``, ``param_dtype`` and ``dropout_rate`` (the encoder's config). Returns
    ``(x, KV)`` with the K/V its attention used (another layer may read them), or ``(x, None)`` for an
    ``attention_cls`` that does not hand them back.

    The call's flags (``deterministic``, flax's ``decode``) are fields, not arguments: every argument of the call is
    an array or a pytree of arrays, so ``nn.remat(Block)`` needs no ``static_argnums`` tied to argument positions.
    """

    config: ModelConfig
    attention_cls: type = Attention
    causal: bool = True
    attention: AttentionConfig | None = None
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        x: Array,
        positions: Array | None = None,
        kv: KV | None = None,
        cache: KV | None = None,
        mask: Array | None = None,
    ):
        cfg, deterministic = self.config, self.deterministic
        pre, sandwich = cfg.family.norm_position != "post", cfg.family.norm_position == "sandwich"
        branch = (lambda name: _layer_norm(cfg, name)) if sandwich else (lambda name: lambda h: h)  # noqa: E731
        drop = nn.Dropout(cfg.dropout_rate)
        extra = {} if mask is None else {"mask": mask}  # attention_cls need not take these unless given them
        if self.decode:
            extra["decode"] = True
        att = self.attention or cfg.attention
        cls = self.attention_cls
        if cls is Attention:  # the zoo's module (a user's attention_cls need not take these)
            extra |= {"kv": kv, "cache": cache, "return_kv": True}
        ln_attention, ln_mlp = _layer_norm(cfg, "ln_attention"), _layer_norm(cfg, "ln_mlp")
        out = cls(att, name="attention")(
            ln_attention(x) if pre else x,
            **extra,
            causal=self.causal,
            positions=positions,
            deterministic=deterministic,
        )
        h, used = out if isinstance(out, tuple) else (out, None)
        x = x + drop(branch("ln_attention_out")(h), deterministic=deterministic)
        mlp = Mlp(cfg.family, cfg.mlp_width, cfg.dtype, cfg.param_dtype, name="mlp")
        if not pre:  # post-norm: x = Norm(x + Attn(x)); x = Norm(x + Mlp(x))
            x = ln_attention(x)
            return ln_mlp(x + drop(mlp(x), deterministic=deterministic)), used
        x = x + drop(branch("ln_mlp_out")(mlp(ln_mlp(x))), deterministic=deterministic)
        if cfg.family.layer_scale:  # Gemma 4 scales the whole stream after the block
            init = nn.with_logical_partitioning(nn.initializers.ones, (None,))
            scale = self.param("layer_scale", init, (1,), cfg.param_dtype).astype(x.dtype)
            x = x * scale.reshape((1,) * x.ndim)  # (1,) -> (1, 1, 1): rank-exact broadcasting
        return x, used


DECODE_MEMORY_FACTOR = 2  # decoding's memory per cache byte, the cache included (measured: 1.7)


@flax.struct.dataclass
class DecodeCache:
    """The decode state of a :class:`DecoderLM`, passed in and returned (a pytree; jit it, donate it).

    ``kv``: one dict per layer that produces keys and values (layers reading another layer's K/V have none), as
    :func:`qkvjax.attention.costs.cache_shapes` lays it out: each K/V group's (B, K, S, H) tensor (``"x"``: (B, S,
    D) for a bilinear key side; ``"latent"`` (B, S, R) and ``"k_rope"`` (B, S, H_r) for a latent scheme).
    ``lengths`` (B,) int32: the tokens each row holds; row b's next token goes to position ``lengths[b]``, so rows
    with prompts of different lengths decode together.
    ``rings`` (static): per entry, W > 0 where it is a ring of each row's last W tokens
    (:func:`qkvjax.attention.cache.ring_view`), else 0: a sliding-window layer whose window, and that of every
    layer reading its K/V, is at most W < the cache's length keeps W slots, so its memory stays W tokens however
    long a row runs.
    """

    kv: tuple[dict[str, Array], ...]
    lengths: Array
    rings: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, max_len: int | None = None) -> DecodeCache:
        """Zeros for ``batch`` rows of ``max_len`` (default the model's) positions, from the config alone; an
        entry whose readers (itself and the layers reading its K/V) all have a window, the widest W < ``max_len``,
        is a ring of W slots instead."""
        s = config.max_len if max_len is None else max_len
        for name, value in (("batch", batch), ("max_len", s)):
            checks.integer_value(f"DecodeCache.empty: {name}", value)
        layers = config.layer_attention
        entries, rings = [], []  # per entry {name: (shape of one row, dtype)}, and its ring's width (0: none)
        for i in producers(layers):
            att = layers[i].config
            windows = [r.config.sliding_window for j, r in enumerate(layers) if j == i or r.kv_from == i]
            ring = max(windows) if None not in windows and max(windows) < s else 0
            shapes = cache_shapes(att, config.d_model, ring or s)
            entries.append({name: (shape, jnp.dtype(att.dtype)) for name, shape in shapes.items()})
            rings.append(ring)
        row = sum(math.prod(shape) * dtype.itemsize for entry in entries for shape, dtype in entry.values())
        # refused here, not killed by the OS once touched: decoding holds the cache and about as much again (the
        # step's updated copy and per-row logits: 1.7x the cache was measured), in what is still available
        if DECODE_MEMORY_FACTOR * batch * row > (memory := checks.available_memory()):
            raise ValueError(
                f"a decode cache of {batch:,} rows x {s:,} positions needs {batch * row / 2**30:,.1f} GiB "
                f"({row:,} bytes a row) and decoding about {DECODE_MEMORY_FACTOR}x that; the device has "
                f"{memory / 2**30:,.1f} GiB available; allowed: fewer rows (at most "
                f"{memory // (DECODE_MEMORY_FACTOR * row):,}) or a shorter context"
            )
        kv = [{name: jnp.zeros((batch, *shape), dtype) for name, (shape, dtype) in entry.items()} for entry in entries]
        return cls(tuple(kv), jnp.zeros((batch,), jnp.int32), tuple(rings))

    def entries(self) -> list[KV]:
        """Each entry as the layer that produces it reads it: a cache at the rows' lengths, a ring where it is one."""
        rings = self.rings or (0,) * len(self.kv)
        return [KV(tensors, self.lengths, CACHED, ring) for tensors, ring in zip(self.kv, rings, strict=True)]

    def advanced(self, used: list[KV], valid: Array | int) -> DecodeCache:
        """After a call: what each layer's cache keeps of the K/V it read (:func:`qkvjax.attention.cache.settle`:
        a ring keeps each row's last W of the ``valid`` new positions), the lengths advanced by ``valid``."""
        valid = jnp.broadcast_to(jnp.asarray(valid, jnp.int32), self.lengths.shape)
        return DecodeCache(tuple(settle(kv, valid) for kv in used), self.lengths + valid, self.rings)

    def rewound(self, lengths) -> DecodeCache:
        """The cache of each row's first ``lengths[b]`` tokens only (at most what it holds): the later slots stay
        as they are, out of every later query's sight and overwritten by the next call (a slot is read only at a
        position the row holds). A ring has let its older positions go, so it cannot forget its newest: refused
        unless every row keeps all it holds."""
        lengths, now = np.asarray(lengths), np.asarray(self.lengths)  # refused as given: 3.5 is not cast to 3
        integers = lengths.shape == now.shape and np.issubdtype(lengths.dtype, np.integer)
        if not integers or (lengths < 0).any() or (lengths > now).any():
            raise ValueError(f"rewinding to lengths {lengths.tolist()}; allowed: {now.shape[0]} integer lengths, each "
                             f"between 0 and what the row holds, {now.tolist()}")  # fmt: skip
        lengths = lengths.astype(np.int32)
        if any(self.rings) and (lengths < now).any():
            raise ValueError(f"a ring of a sliding window's last {max(self.rings)} tokens cannot forget its newest; "
                             f"allowed: lengths {now.tolist()} (all a row holds), or a new cache")  # fmt: skip
        return self.replace(lengths=jnp.asarray(lengths))

    def select(self, rows) -> DecodeCache:
        """The cache of the given rows, in that order, a row as often as it is named: ``select([0] * n)`` copies a
        one-row cache (a prompt read once) to n rows that go on from it independently."""
        rows, n = np.asarray(rows), int(self.lengths.shape[0])
        indices = rows.ndim == 1 and rows.size > 0 and np.issubdtype(rows.dtype, np.integer)
        if not indices or rows.min() < 0 or rows.max() >= n:
            raise ValueError(f"selecting rows {rows.tolist()}; allowed: a non-empty list of row indices in [0, {n})")
        index = jnp.asarray(rows)
        return jax.tree.map(lambda x: x[index], self)  # every leaf's axis 0 is the row (B)

    @property
    def nbytes(self) -> int:
        """Bytes of the cached keys and values (the lengths excluded)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.kv))


def check_call(cfg: ModelConfig, tokens: Array, positions, cache: DecodeCache | None, num_valid) -> None:
    """:class:`DecoderLM`'s arguments, checked while tracing (before anything compiles); ``num_valid``'s values
    only when they are concrete (under jit the caller checks)."""
    checks.instance("DecoderLM's config", cfg, ModelConfig)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"DecoderLM takes integer tokens of shape (B, T); got {tokens.dtype} {tokens.shape}")
    (b, t), wanted = tokens.shape, len(producers(cfg.layer_attention))
    if t > cfg.max_len:
        raise ValueError(f"sequence length {t} exceeds the model's max_len={cfg.max_len}")
    if cache is None:
        if num_valid is not None:
            raise ValueError("num_valid= says how much of each row a cache keeps; it goes with cache= only")
        return
    if positions is not None or len(cache.kv) != wanted:
        raise ValueError(
            f"cache= needs positions=None and one entry per K/V-producing layer ({wanted}); got {len(cache.kv)} "
            "(build it with DecodeCache.empty)"
        )
    if cache.lengths.shape != (b,):
        raise ValueError(f"cache= holds {cache.lengths.shape[0]} rows; tokens {tokens.shape} have B={b} (build it "
                         "with DecodeCache.empty(config, B))")  # fmt: skip
    if num_valid is None:
        return
    if np.ndim(num_valid) > 1 or np.size(num_valid) not in (1, b):
        raise ValueError(f"num_valid has shape {np.shape(num_valid)}; allowed: a scalar or (B,) = ({b},)")
    valid = None if isinstance(num_valid, jax.core.Tracer) else np.asarray(num_valid)  # under jit: the caller's
    if valid is not None and not np.all((0 <= valid) & (valid <= t)):
        raise ValueError(f"num_valid={valid.tolist()}; allowed: 0 <= num_valid <= T={t} per row")


class DecoderLM(nn.Module):
    """tokens (B, T) int -> logits (B, T, V) in float32; with ``hidden=True`` the final hidden states (B, T, D) and
    the unembedding (D, V) instead, for a loss that makes the logits a chunk at a time (``train.loss_chunk``).

    With ``cache`` (a :class:`DecodeCache`), row b's tokens are written at positions ``lengths[b]`` onward and
    attend to everything the row holds; returns ``(logits, cache)`` with ``lengths`` advanced by ``num_valid``
    (B,) (the rest of each row is right padding, overwritten by the next call) or by T.

    ``decode=True`` is flax's convention instead (a ``cache`` collection made by ``init(..., decode=True)``,
    applied with ``mutable=["cache"]``, one position for the whole batch): kept for attention modules written
    against it (the benchmark's flax baseline) and for code that used it before the functional cache.
    """

    config: ModelConfig
    attention_cls: type = Attention

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        *,
        positions: Array | None = None,
        cache: DecodeCache | None = None,
        num_valid: Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
        hidden: bool = False,
    ):
        cfg, tokens = self.config, as_tokens(tokens)
        check_call(cfg, tokens, positions, cache, num_valid)
        embed = token_table(self, cfg)
        x = rows_of(embed, tokens, cfg.dtype)
        if cfg.learned_positions:
            pos_table = position_table(self, cfg, stddev=0.01)
            if decode:
                pos = self._decode_positions(tokens.shape)
            elif cache is not None:
                pos = jnp.minimum(cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None], cfg.max_len - 1)
            elif positions is None:
                pos = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
            else:
                pos = positions
            x = x + rows_of(pos_table, pos, cfg.dtype)
        if cfg.family.embed_scale:  # Gemma: the embeddings times sqrt(D)
            x = x * jnp.asarray(cfg.d_model**0.5, cfg.dtype)
        if cfg.family.embed_norm:
            x = _layer_norm(cfg, "ln_embed")(x)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)

        block = Block
        if cfg.remat != "none":
            policy = None if cfg.remat == "full" else jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
            block = nn.remat(Block, policy=policy)
        made: dict[int, KV] = {}
        entries = iter(cache.entries()) if cache is not None else None
        new_entries = []
        for i, layer in enumerate(cfg.layer_attention):
            own = None if cache is None or not layer.produces_kv else next(entries)
            flags = {  # a layer reading another's K/V reads them as the donor wrote them (no decode variables)
                "deterministic": deterministic,
                "decode": decode and layer.produces_kv,
            }
            x, used = block(cfg, self.attention_cls, attention=layer.config, **flags, name=f"block_{i}")(
                x, positions, kv=None if layer.produces_kv else made[layer.kv_from], cache=own
            )
            if layer.produces_kv:
                made[i] = used
                if cache is not None:
                    new_entries.append(used)
        if cfg.family.final_norm:
            x = _layer_norm(cfg, "ln_final")(x)
        if cfg.tie_embeddings:
            w_unembed = embed.T
        else:
            init = nn.with_logical_partitioning(_dense_init(0, 1), (axes.EMBED, axes.VOCAB))
            w_unembed = self.param("w_unembed", init, (cfg.d_model, cfg.vocab_size), cfg.param_dtype)
        if hidden:  # the final hidden states (B, T, D) and the unembedding (D, V): a chunked loss makes the logits
            return x, w_unembed
        logits = unembed(x, w_unembed, cfg)
        if cache is None:
            return logits
        return logits, cache.advanced(new_entries, tokens.shape[1] if num_valid is None else num_valid)

    def _decode_positions(self, shape) -> Array:
        """Absolute positions of the new tokens under ``decode=True``, counted in the model's own ``cache``."""
        initialized = self.has_variable("cache", "position")
        index = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
        start = index.value if initialized else jnp.array(0, jnp.int32)
        if initialized:
            index.value = start + shape[1]
        return jnp.broadcast_to(start + jnp.arange(shape[1])[None], shape)


def unembed(x: Array, w: Array, cfg: ModelConfig) -> Array:
    """Logits in float32 from the final hidden states and the (D, V) unembedding, soft-capped as the family says."""
    logits = core.dense(x, w.astype(cfg.dtype)).astype(jnp.float32)  # BTD,DV->BTV
    cap = cfg.family.logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def param_count(config: ModelConfig) -> int:
    """Parameters of the whole model, from the configuration alone."""
    d, v = config.d_model, config.vocab_size
    attention = sum(c.params for c in stack_cost(config.layer_attention, d, config.max_len))
    family = config.family
    total = attention + config.num_layers * family.block_params(d, config.mlp_width) + v * d + family.outer_params(d)
    total += config.max_len * d if config.learned_positions else 0
    total += 0 if config.tie_embeddings else d * v
    return total


def kv_cache_bytes_per_row(config: ModelConfig) -> int:
    """Bytes the decode cache holds per row at the model's ``max_len``, as :meth:`DecodeCache.empty` lays it out
    (a sliding-window layer's ring holds W tokens, not ``max_len``); shapes only, nothing allocated."""
    shapes = jax.eval_shape(lambda: DecodeCache.empty(config, 1))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes.kv))


def kv_cache_bytes_per_token(config: ModelConfig) -> int:
    """Bytes the decode cache holds per token (per row), over all layers."""
    return sum(c.kv_cache_bytes_per_token for c in stack_cost(config.layer_attention, config.d_model, 1))


def mfu_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token as nanoGPT's ``estimate_mfu`` and PaLM (Chowdhery et al. 2022, appendix B) count
    them, the count MFU is quoted with: 6 N + 6 sum over layers of N_heads (H_k + H_v) S, where N is every
    parameter but the position table (the token embedding counts once, as the tied output layer's) and S the keys
    a query attends to, all T of them (no halving for causality; a sliding window's width where it is smaller).
    For GPT-2's shape (H_k = H_v = Q) this is nanoGPT's 6 N + 12 L H Q T exactly."""
    t = config.max_len if seq_len is None else seq_len
    n = param_count(config) - (config.max_len * config.d_model if config.learned_positions else 0)
    attention = 0.0
    for layer in config.layer_attention:
        att = layer.config
        keys = min(t, att.sliding_window) if att.sliding_window else t
        attention += 6 * att.num_heads * (att.key_dim + att.value_dim) * keys
    return 6.0 * n + attention


def train_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward; no remat recompute counted).

    Attention scores are counted causally (each query sees on average (T + 1) / 2 keys, fewer in a sliding
    window), the MLP and the logits in full; embeddings and norms are ignored (as in PaLM's MFU, Chowdhery et al.
    2022, appendix B).
    """
    t = config.max_len if seq_len is None else seq_len
    d = config.d_model
    total = 2 * d * config.vocab_size
    for layer, att in zip(config.layer_attention, stack_cost(config.layer_attention, d, t), strict=True):
        per_key = att.score_flops / keys_seen(layer.config, t)  # the scores' FLOPs grow linearly in the keys
        causal_scores = per_key * causal_keys_seen(layer.config, t)
        total += att.projection_flops + causal_scores + att.output_flops + config.family.mlp_flops(d, config.mlp_width)
    return 3.0 * total
