"""qkvjax: why three projections? Attention with every Q/K/V tying scheme, in Flax."""

from qkvjax.attention import (
    KV,
    SCHEMES,
    Attention,
    AttentionConfig,
    AttentionCost,
    LayerAttention,
    Scheme,
    attention_cost,
    get_scheme,
    register_scheme,
    stack_cost,
)
from qkvjax.models.lm import DecodeCache, DecoderLM, ModelConfig

__version__ = "0.1.0"


def load(workdir: str, step: int | None = None):
    """``(model, params, config)`` from a training run's checkpoint; see :func:`qkvjax.evaluate.load`."""
    from qkvjax.evaluate import load as _load  # orbax and TFDS load only when asked for

    return _load(workdir, step)


__all__ = [
    "KV",
    "SCHEMES",
    "Attention",
    "AttentionConfig",
    "AttentionCost",
    "DecodeCache",
    "DecoderLM",
    "LayerAttention",
    "ModelConfig",
    "Scheme",
    "attention_cost",
    "get_scheme",
    "load",
    "register_scheme",
    "stack_cost",
]
