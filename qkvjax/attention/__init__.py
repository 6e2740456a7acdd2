"""The attention zoo: every Q/K/V tying scheme as one Flax module, per layer or as a pattern over a stack."""

from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.costs import AttentionCost, attention_cost, stack_cost
from qkvjax.attention.layers import LayerAttention
from qkvjax.attention.module import KV, Attention
from qkvjax.attention.schemes import SCHEMES, Scheme, get_scheme, register_scheme

__all__ = [
    "KV",
    "SCHEMES",
    "Attention",
    "AttentionConfig",
    "AttentionCost",
    "LayerAttention",
    "Scheme",
    "attention_cost",
    "get_scheme",
    "register_scheme",
    "stack_cost",
]
