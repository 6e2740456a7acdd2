"""The attention zoo: every Q/K/V tying scheme as one Flax module."""

from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.module import Attention
from qkvjax.attention.schemes import SCHEMES, AttentionCost, Scheme, attention_cost, get_scheme, register_scheme

__all__ = [
    "SCHEMES",
    "Attention",
    "AttentionConfig",
    "AttentionCost",
    "Scheme",
    "attention_cost",
    "get_scheme",
    "register_scheme",
]
