"""Hugging Face layouts, one :class:`~qkvjax.hf.layouts.base.Layout` entry per family: what import, export,
``qkvjax analyze --safetensors`` and the CLI know about it, in one place (the checklist for adding one is in
:class:`~qkvjax.hf.layouts.base.Layout`'s docstring).

An import either computes the same function as the original or does not happen (a field the model cannot
express is refused in one line naming it); an export is refused in one line naming the first part of the model
the layout cannot express.
"""

from __future__ import annotations

from qkvjax.hf.layouts import bert, deepseek, gemma, gpt2, llama
from qkvjax.hf.layouts.base import INERT, Layout, Projections

# in the order infer_format prefers them: the first that can express a model is its default export format
ORDER = (
    bert.LAYOUT,
    llama.LAYOUT,
    gpt2.LAYOUT,
    llama.QWEN3,
    deepseek.LAYOUT,
    gemma.LAYOUT,
    llama.MISTRAL,
    llama.QWEN2,
    deepseek.V3,
)
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in ORDER}
MODEL_TYPES: dict[str, str] = {t: layout.name for layout in LAYOUTS.values() for t in layout.model_types}


def layout_of(hf: dict) -> Layout:
    """The layout that imports a config.json, by its ``model_type``."""
    model_type = hf.get("model_type")
    if model_type is None and {"model", "data", "train"} <= set(hf):  # a qkvjax workdir's config.json
        raise ValueError(
            "config.json is a qkvjax run's, not a Hugging Face model's: eval, sample, convert and train read that "
            "workdir as it is (qkvjax export writes a Hugging Face folder from it)"
        )
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; allowed: {sorted(MODEL_TYPES)}")
    return LAYOUTS[MODEL_TYPES[model_type]]


def check_exportable(cfg, fmt: str) -> None:
    """Raises one line naming the first part of ``cfg`` that the ``fmt`` layout cannot express."""
    from qkvjax.models.encoder import EncoderConfig

    if not isinstance(fmt, str) or fmt not in LAYOUTS:
        raise ValueError(f"--format {fmt!r}; allowed: {list(LAYOUTS)}")
    encoder = isinstance(cfg, EncoderConfig)
    if encoder != LAYOUTS[fmt].encoder:
        what = "an encoder (EncoderConfig)" if encoder else "a decoder LM"
        allowed = ", ".join(name for name, layout in LAYOUTS.items() if layout.encoder == encoder)
        raise ValueError(f"--format {fmt!r} for {what}; allowed: {allowed}")
    LAYOUTS[fmt].exportable(cfg)


def infer_format(cfg) -> str:
    """The first layout (in ``LAYOUTS``' order) that can express ``cfg``; where none can, the first of its kind
    (encoder or decoder) whose positions (learned or rotary) match, so that its refusal names what is missing."""
    from qkvjax.models.encoder import EncoderConfig

    encoder = isinstance(cfg, EncoderConfig)
    kind = [name for name, layout in LAYOUTS.items() if layout.encoder == encoder]
    for name in kind:
        try:
            LAYOUTS[name].exportable(cfg)
        except ValueError:
            continue
        return name
    return next((name for name in kind if "rope=" not in _reason(name, cfg)), kind[0])


def _reason(name: str, cfg) -> str:
    try:
        LAYOUTS[name].exportable(cfg)
    except ValueError as e:
        return str(e)
    return ""


def export(cfg, params: dict, fmt: str) -> tuple[dict, dict]:
    """(config.json, tensors) of ``cfg`` in the ``fmt`` layout, after :func:`check_exportable`."""
    check_exportable(cfg, fmt)
    return LAYOUTS[fmt].write(cfg, params)


__all__ = ["INERT", "LAYOUTS", "MODEL_TYPES", "Layout", "Projections", "check_exportable", "export",
           "infer_format", "layout_of"]  # fmt: skip
