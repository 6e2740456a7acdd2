"""The attention zoo: every Q/K/V tying scheme as one Flax module, per layer or as a pattern over a stack."""

from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.costs import AttentionCost, attention_cost, stack_cost
from qkvjax.attention.latent import LatentAttention
from qkvjax.attention.layers import LayerAttention
from qkvjax.attention.module import KV, Attention
from qkvjax.attention.schemes import SCHEMES, Scheme, get_scheme, register_scheme


def attention_module(config: AttentionConfig) -> type:
    """The module class that implements ``config``'s scheme: :class:`Attention`, which takes every scheme (kept for
    code written when a latent scheme had a module of its own, :class:`LatentAttention`)."""
    del config  # every scheme's module is the same one
    return Attention


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
