"""A decoder-only language model whose attention is the zoo's ``Attention`` (GPT-2 layout, pre-norm).

``h_0 = E[x] (+ P)``, ``h_{l+1} = h_l + Attn(LN(h_l)) + MLP(LN(h_l + Attn(LN(h_l))))``, ``logits = LN(h_L) E^T``
(or a separate ``w_unembed``). Radford et al. 2019; the nanoGPT ``shakespeare_char`` and ``gpt2`` presets.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from qkvjax import axes
from qkvjax.attention import Attention, AttentionConfig, attention_cost

REMAT_POLICIES = ("none", "full", "dots")


class BlockShape:
    """What a ``Block`` reads from its model's config, and the checks every such config shares (mixed into the
    LM's and the encoder's frozen dataclasses)."""

    def _check_shape(self, positive_ints: tuple[str, ...]) -> None:
        name = type(self).__name__
        if isinstance(self.attention, dict):  # from JSON
            object.__setattr__(self, "attention", AttentionConfig(**self.attention))
        for field in positive_ints:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{field}={value!r}; allowed: an integer >= 1")
        if self.mlp_dim is not None and (not isinstance(self.mlp_dim, int) or self.mlp_dim < 1):
            raise ValueError(f"{name}.mlp_dim={self.mlp_dim!r}; allowed: None (= 4 d_model) or an integer >= 1")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"{name}.dropout_rate={self.dropout_rate!r}; allowed: 0 <= rate < 1")

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
      attention: the attention layer (its ``dtype``/``param_dtype`` are the model's).
      vocab_size: V; 256 for byte-level text.
      d_model: D.
      num_layers: blocks.
      mlp_dim: F; None means 4 D.
      max_len: the context length (learned position table size, decode cache length).
      learned_positions: add a learned absolute position embedding (use False with ``attention.rope``).
      tie_embeddings: logits use the token embedding transposed.
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

    def __post_init__(self):
        self._check_shape(("vocab_size", "d_model", "num_layers", "max_len"))
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; allowed: {list(REMAT_POLICIES)}")


def _dense_init(in_axis, out_axis):
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


class Mlp(nn.Module):
    """``gelu(x W_in) W_out`` with ``w_in: (D, F)``, ``w_out: (F, D)``."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        d, f = x.shape[-1], cfg.mlp_width
        w_in = self.param(
            "w_in", nn.with_logical_partitioning(_dense_init(0, 1), (axes.EMBED, axes.MLP)), (d, f), cfg.param_dtype
        )
        w_out = self.param(
            "w_out", nn.with_logical_partitioning(_dense_init(0, 1), (axes.MLP, axes.EMBED)), (f, d), cfg.param_dtype
        )
        h = nn.gelu(jnp.einsum("BTD,DF->BTF", x, w_in.astype(cfg.dtype)))
        return jnp.einsum("BTF,FD->BTD", h, w_out.astype(cfg.dtype))


def _layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        use_bias=False,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, (axes.EMBED,)),
        name=name,
    )


def token_table(module: nn.Module, cfg) -> Array:
    """``embed: (V, D)``, a parameter of ``module`` (``cfg`` has vocab_size, d_model, param_dtype)."""
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (axes.VOCAB, axes.EMBED))
    return module.param("embed", init, (cfg.vocab_size, cfg.d_model), cfg.param_dtype)


def position_table(module: nn.Module, cfg, stddev: float) -> Array:
    """``pos_embed: (max_len, D)``, learned absolute positions, a parameter of ``module``."""
    init = nn.with_logical_partitioning(nn.initializers.normal(stddev), (None, axes.EMBED))
    return module.param("pos_embed", init, (cfg.max_len, cfg.d_model), cfg.param_dtype)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then the MLP, each on a residual.

    ``attention_cls`` is any linen module built as ``attention_cls(config.attention)`` and called like
    ``Attention`` (the benchmark swaps in flax's own attention this way). ``causal=False`` makes it an encoder
    block. ``config`` is a ModelConfig or anything with the same ``attention``, ``mlp_width``, ``dtype``,
    ``param_dtype`` and ``dropout_rate`` (the encoder's config).
    """

    config: ModelConfig
    attention_cls: type = Attention
    causal: bool = True

    @nn.compact
    def __call__(
        self, x: Array, positions: Array | None, decode: bool, deterministic: bool, mask: Array | None = None
    ) -> Array:
        cfg = self.config
        drop = nn.Dropout(cfg.dropout_rate)
        extra = {} if mask is None else {"mask": mask}  # attention_cls need not take a mask unless given one
        h = self.attention_cls(cfg.attention, name="attention")(
            _layer_norm(cfg, "ln_attention")(x),
            **extra,
            causal=self.causal,
            positions=positions,
            decode=decode,
            deterministic=deterministic,
        )
        x = x + drop(h, deterministic=deterministic)
        h = Mlp(cfg, name="mlp")(_layer_norm(cfg, "ln_mlp")(x))
        return x + drop(h, deterministic=deterministic)


class DecoderLM(nn.Module):
    """tokens (B, T) int -> logits (B, T, V) in float32."""

    config: ModelConfig
    attention_cls: type = Attention

    @nn.compact
    def __call__(
        self, tokens: Array, *, positions: Array | None = None, decode: bool = False, deterministic: bool = True
    ) -> Array:
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"DecoderLM takes tokens of shape (B, T); got {tokens.shape}")
        if tokens.shape[1] > cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_len={cfg.max_len}")
        embed = token_table(self, cfg)
        x = jnp.take(embed, tokens, axis=0).astype(cfg.dtype)
        if cfg.learned_positions:
            pos_table = position_table(self, cfg, stddev=0.01)
            if decode:
                pos = self._decode_positions(tokens.shape)
            elif positions is None:
                pos = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
            else:
                pos = positions
            x = x + jnp.take(pos_table, pos, axis=0).astype(cfg.dtype)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)

        block = Block
        if cfg.remat != "none":
            policy = None if cfg.remat == "full" else jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
            block = nn.remat(Block, policy=policy, static_argnums=(3, 4))  # (self, x, positions, decode, deterministic)
        for i in range(cfg.num_layers):
            x = block(cfg, self.attention_cls, name=f"block_{i}")(x, positions, decode, deterministic)
        x = _layer_norm(cfg, "ln_final")(x)
        if cfg.tie_embeddings:
            return jnp.einsum("BTD,VD->BTV", x, embed.astype(cfg.dtype)).astype(jnp.float32)
        w_unembed = self.param(
            "w_unembed",
            nn.with_logical_partitioning(_dense_init(0, 1), (axes.EMBED, axes.VOCAB)),
            (cfg.d_model, cfg.vocab_size),
            cfg.param_dtype,
        )
        return jnp.einsum("BTD,DV->BTV", x, w_unembed.astype(cfg.dtype)).astype(jnp.float32)

    def _decode_positions(self, shape) -> Array:
        """Absolute positions of the new tokens, counted in the model's own cache (the attention caches agree)."""
        initialized = self.has_variable("cache", "position")
        index = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
        start = index.value if initialized else jnp.array(0, jnp.int32)
        if initialized:
            index.value = start + shape[1]
        return jnp.broadcast_to(start + jnp.arange(shape[1])[None], shape)


def param_count(config: ModelConfig) -> int:
    """Parameters of the whole model, from the configuration alone."""
    d, v = config.d_model, config.vocab_size
    per_layer = attention_cost(config.attention, d, config.max_len).params + 2 * d * config.mlp_width + 2 * d
    total = config.num_layers * per_layer + v * d + d  # + final norm
    total += config.max_len * d if config.learned_positions else 0
    total += 0 if config.tie_embeddings else d * v
    return total


def train_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward; no remat recompute counted).

    Attention scores are counted causally (each query sees on average (T + 1) / 2 keys), the MLP and the logits
    in full; embeddings and norms are ignored (as in PaLM's MFU, Chowdhery et al. 2022, appendix B).
    """
    t = config.max_len if seq_len is None else seq_len
    d = config.d_model
    att = attention_cost(config.attention, d, t)
    causal_scores = att.score_flops * (t + 1) / (2 * t)
    per_layer = att.projection_flops + causal_scores + att.output_flops + 2 * 2 * d * config.mlp_width
    return 3.0 * (config.num_layers * per_layer + 2 * d * config.vocab_size)
