"""qkvjax: why three projections? Attention with every Q/K/V tying scheme, in Flax.

The public names load on first use (PEP 562): ``import qkvjax`` alone imports neither JAX nor Flax, so a tool that
needs neither (``qkvjax prepare``'s worker processes) starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_WHERE = {
    "KV": "qkvjax.attention",
    "SCHEMES": "qkvjax.attention",
    "Attention": "qkvjax.attention",
    "AttentionConfig": "qkvjax.attention",
    "AttentionCost": "qkvjax.attention",
    "LayerAttention": "qkvjax.attention",
    "Scheme": "qkvjax.attention",
    "attention_cost": "qkvjax.attention",
    "get_scheme": "qkvjax.attention",
    "register_scheme": "qkvjax.attention",
    "stack_cost": "qkvjax.attention",
    "DecodeCache": "qkvjax.models.lm",
    "DecoderLM": "qkvjax.models.lm",
    "ModelConfig": "qkvjax.models.lm",
}

if TYPE_CHECKING:  # what static tools and IDEs see
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


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'qkvjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


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
