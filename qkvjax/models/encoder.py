"""A bidirectional encoder with a per-token classification head (the synthetic probes) or none (BERT's hidden
states, ``num_classes=0``).

``h_0 = E[x] (+ P)``, then the LM's blocks without a causal mask, ``logits = LN(h_L) W_cls`` (Devlin et al.
2019's encoder, token-level head; the norms where :mod:`qkvjax.models.family` puts them). Any tying scheme and
head sharing; positions are learned absolute embeddings, rotary (``attention.rope``, Su et al. 2021), both, or
none (the model is then permutation-equivariant: permuting the tokens permutes the outputs).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from qkvjax import axes, checks
from qkvjax.attention import AttentionConfig, attention_cost
from qkvjax.attention.layers import LayerAttention, expand
from qkvjax.models.family import Family
from qkvjax.models.lm import (
    Block,
    BlockShape,
    DecoderLM,
    ModelConfig,
    _dense_init,
    _layer_norm,
    as_tokens,
    param_count,
    position_table,
    rows_of,
    token_table,
)


@dataclasses.dataclass(frozen=True)
class EncoderConfig(BlockShape):
    """A token classifier.

    Attributes:
      attention: the attention layer (``rope`` gives rotary positions; ``dtype``/``param_dtype`` are the model's).
      vocab_size: input symbols.
      num_classes: C, output classes per token; 0: no head, the call returns the hidden states (B, T, D).
      d_model: D.
      num_layers: blocks.
      mlp_dim: F; None means 4 D.
      max_len: the longest sequence (size of the learned position table).
      learned_positions: add a learned absolute position embedding.
      dropout_rate: residual and embedding dropout.
      family: the norms and the MLP (BERT: post-norm with an embedding norm).
    """

    attention: AttentionConfig
    vocab_size: int
    num_classes: int
    d_model: int = 64
    num_layers: int = 2
    mlp_dim: int | None = None
    max_len: int = 64
    learned_positions: bool = True
    dropout_rate: float = 0.0
    family: Family = Family()

    def __post_init__(self):
        self._check_shape()
        checks.integer(self, "num_classes", minimum=0, allowed="0 (no head) or an integer >= 1")

    # The decoder's per-layer view, so tools that read a workdir (info, analyze, convert) read an encoder's too:
    # every layer has ``attention`` and its own K/V (no layer pattern, no cross-layer sharing).
    @property
    def layers(self) -> str:
        return ""

    @property
    def layer_attention(self) -> tuple[LayerAttention, ...]:
        return expand("", self.attention, self.num_layers)


class Encoder(nn.Module):
    """tokens (B, T) int, optional padding ``mask`` (B, T) bool -> logits (B, T, C) in float32 (the hidden states
    (B, T, D) when ``num_classes`` is 0)."""

    config: EncoderConfig

    @nn.compact
    def __call__(self, tokens: Array, *, mask: Array | None = None, deterministic: bool = True) -> Array:
        cfg, tokens = self.config, as_tokens(tokens)
        if tokens.ndim != 2 or tokens.shape[1] > cfg.max_len or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"Encoder takes integer tokens (B, T) with T <= max_len={cfg.max_len}; got {tokens.dtype} "
                             f"{tokens.shape}")  # fmt: skip
        if mask is not None and mask.shape != tokens.shape:
            raise ValueError(f"mask is the tokens' padding, (B, T) = {tokens.shape} (1: a token); got {mask.shape}")
        x = rows_of(token_table(self, cfg), tokens, cfg.dtype)
        if cfg.learned_positions:
            x = x + position_table(self, cfg, stddev=0.02)[None, : tokens.shape[1]].astype(cfg.dtype)
        if cfg.family.embed_scale:
            x = x * jnp.asarray(cfg.d_model**0.5, cfg.dtype)
        if cfg.family.embed_norm:
            x = _layer_norm(cfg, "ln_embed")(x)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        if mask is not None:  # padding: (B, S) keys -> (B, 1, 1, S)
            mask = mask.astype(jnp.bool_)[:, None, None, :]
        for i in range(cfg.num_layers):
            x, _ = Block(cfg, causal=False, deterministic=deterministic, name=f"block_{i}")(x, mask=mask)
        if cfg.family.final_norm:
            x = _layer_norm(cfg, "ln_final")(x)
        if not cfg.num_classes:
            return x.astype(jnp.float32)
        w_cls = self.param(
            "w_cls",
            nn.with_logical_partitioning(_dense_init(0, 1), (axes.EMBED, None)),
            (cfg.d_model, cfg.num_classes),
            cfg.param_dtype,
        )
        logits = jnp.einsum("BTD,DC->BTC", x, w_cls.astype(cfg.dtype)).astype(jnp.float32)
        cap = cfg.family.logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def encoder_param_count(config: EncoderConfig) -> int:
    """Parameters of the whole encoder, from the configuration alone."""
    d = config.d_model
    family = config.family
    per_layer = attention_cost(config.attention, d, config.max_len).params + family.block_params(d, config.mlp_width)
    total = config.num_layers * per_layer + config.vocab_size * d + family.outer_params(d) + d * config.num_classes
    return total + (config.max_len * d if config.learned_positions else 0)


def model_of(config: ModelConfig | EncoderConfig) -> nn.Module:
    """The module a config describes: ``Encoder`` or ``DecoderLM``."""
    return Encoder(config) if isinstance(config, EncoderConfig) else DecoderLM(config)


def parameter_count(config: ModelConfig | EncoderConfig) -> int:
    """Parameters of either model, from the configuration alone."""
    return encoder_param_count(config) if isinstance(config, EncoderConfig) else param_count(config)
