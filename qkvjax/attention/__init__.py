"""The attention zoo: every Q/K/V tying scheme as one Flax module, per layer or as a pattern over a stack."""

from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.costs import AttentionCost, attention_cost, stack_cost
from qkvjax.attention.latent import LatentAttention
from qkvjax.attention.layers import LayerAttention
from qkvjax.attention.module import KV, Attention
from qkvjax.attention.schemes import SCHEMES, Scheme, get_scheme, register_scheme


def attention_module(config: AttentionConfig) -> type:
    """The module class that implements ``config``'s scheme: :class:`LatentAttention` for a latent scheme, else
    :class:`Attention` (both are built as ``cls(config)`` and called alike)."""
    return LatentAttention if config.tying.latent else Attention


__all__ = [
    "KV",
    "SCHEMES",
    "Attention",
    "AttentionConfig",
    "AttentionCost",
    "LatentAttention",
    "LayerAttention",
    "Scheme",
    "attention_cost",
    "attention_module",
    "get_scheme",
    "register_scheme",
    "stack_cost",
]
