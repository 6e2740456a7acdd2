"""qkvjax: why three projections? Attention with every Q/K/V tying scheme, in Flax."""

from qkvjax.attention import (
    SCHEMES,
    Attention,
    AttentionConfig,
    AttentionCost,
    Scheme,
    attention_cost,
    get_scheme,
    register_scheme,
)

__version__ = "0.1.0"

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
