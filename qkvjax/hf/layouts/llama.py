"""The Llama layout (``LlamaForCausalLM``) and the families that share its tensors: Mistral (a window on every
layer), Qwen2 (q/k/v biases, windows on the layers from ``max_window_layers``), and Qwen3, its own layout
(``Qwen3ForCausalLM``: QK-norm, an RMS norm over each head's H features with a learned (H,) scale on queries and
keys before rotary, ``self_attn.q_norm``/``k_norm``, with the model's ``rms_norm_eps``; one ``attention_bias`` for
q/k/v and o; no MLP biases).

RMSNorm, a SwiGLU MLP, rotary positions (half-split, one base; rotary scaling is refused), GQA through
``num_key_value_heads``, separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` ``nn.Linear`` weights. Sliding
windows (Mistral's on every layer, or ``layer_types``' per layer) become ``AttentionConfig.sliding_window``.
"""

from __future__ import annotations

import dataclasses

from qkvjax.attention import AttentionConfig
from qkvjax.hf.folder import Tensors
from qkvjax.hf.layouts.base import (
    COMMON_READ,
    Layout,
    Projections,
    check_layers,
    heads,
    linear,
    plain_family,
    refuse,
    roles,
    unembed,
)
from qkvjax.models.family import Family
from qkvjax.models.lm import ModelConfig

# which projections carry biases where the config does not say: (q/k/v, o); None: ``attention_bias``
BIASES = {"llama": None, "mistral": None, "qwen2": (True, False), "qwen3": None}


def rope_base(hf: dict) -> float:
    """The rotary base, after refusing any rotary scaling. Both ``rope_parameters`` and ``rope_scaling`` are read:
    transformers applies a ``rope_scaling`` entry written beside a default ``rope_parameters`` (the YaRN edit
    Qwen's model cards ask for), so taking the first alone imported another model, silently."""
    theta = hf.get("rope_theta", 10000.0)
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"config.json {key}={rope!r}; allowed: an object (or null)")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default" or rope.get("factor", 1.0) != 1.0:
            raise ValueError(
                f"config.json {key} rope_type={kind!r}, factor={rope.get('factor', 1.0)}: rotary scaling (linear, "
                "dynamic, YaRN, Llama 3) is not modelled, and importing without it would give another model; "
                "allowed: rope_type 'default' (remove the scaling entry to import the unscaled model)"
            )
        theta = rope.get("rope_theta", theta)
    return float(theta)


def windows(hf: dict) -> tuple[int | None, str]:
    """``(sliding_window, layers pattern)``: Mistral's window on every layer (``sliding_window`` with
    ``use_sliding_window`` unset or true), or ``layer_types``' per-layer choice of "sliding_attention" and
    "full_attention" (Qwen2 derives it from ``max_window_layers``) as a layer pattern."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    n = hf["num_hidden_layers"]
    kinds = list(hf.get("layer_types") or [])
    if not kinds and hf.get("use_sliding_window") and hf.get("max_window_layers") is not None:
        kinds = ["full_attention" if i < hf["max_window_layers"] else "sliding_attention" for i in range(n)]
    kinds = kinds or ["sliding_attention" if window is not None else "full_attention"] * n
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown or len(kinds) != n:
        raise ValueError(f"config.json layer_types={kinds}: allowed: {n} of 'sliding_attention' and 'full_attention'")
    if "sliding_attention" in kinds and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"config.json sliding_window={window!r} with sliding layers; allowed: an integer >= 1")
    if "full_attention" not in kinds:
        return window, ""
    if "sliding_attention" not in kinds:
        return None, ""
    return None, ", ".join(f"[sliding_window={window}]" if k == "sliding_attention" else "[]" for k in kinds)


def config(hf: dict, max_len: int | None = None) -> ModelConfig:
    model_type = hf.get("model_type", "llama")
    refuse(hf, "hidden_act", ("silu",), "the Llama layout's MLP is SwiGLU")
    window, layers = windows(hf)
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    k = hf.get("num_key_value_heads") or n
    biases = BIASES.get(model_type) or (hf.get("attention_bias", False),) * 2
    attention = AttentionConfig(
        num_heads=n,
        head_dim=hf.get("head_dim") or d // n,
        num_kv_heads=None if k == n else k,
        rope=True,
        rope_base=rope_base(hf),
        use_bias=biases[0],
        output_bias=biases[1],
        sliding_window=window,
    )
    return ModelConfig(
        attention=attention,
        layers=layers,
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        mlp_dim=hf["intermediate_size"],
        max_len=max_len or hf["max_position_embeddings"],
        learned_positions=False,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        family=Family(
            norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", mlp_bias=hf.get("mlp_bias", False)
        ),
    )


def qwen3_config(hf: dict, max_len: int | None = None) -> ModelConfig:
    cfg = config(hf, max_len)
    att = dataclasses.replace(cfg.attention, qk_norm=True, norm_eps=cfg.family.norm_eps)
    return dataclasses.replace(cfg, attention=att)


def mlp_params(t: Tensors, p: str, bias: bool) -> dict:
    """SwiGLU's ``gate_proj``, ``up_proj``, ``down_proj`` as ``w_gate``, ``w_in``, ``w_out``."""
    mlp = {"w_gate": linear(t, p + "mlp.gate_proj"), "w_in": linear(t, p + "mlp.up_proj")}
    mlp["w_out"] = linear(t, p + "mlp.down_proj")
    if bias:
        mlp |= {"b_gate": t.take(p + "mlp.gate_proj.bias"), "b_in": t.take(p + "mlp.up_proj.bias")}
        mlp["b_out"] = t.take(p + "mlp.down_proj.bias")
    return mlp


def block_params(t: Tensors, p: str, attention: dict, mlp_bias: bool) -> dict:
    """A pre-norm block under ``p`` (``layers.{i}.``): the attention's parameters as given, its two RMSNorms and
    the SwiGLU MLP."""
    return {
        "attention": attention,
        "ln_attention": {"scale": t.take(p + "input_layernorm.weight")},
        "ln_mlp": {"scale": t.take(p + "post_attention_layernorm.weight")},
        "mlp": mlp_params(t, p, mlp_bias),
    }


def mlp_tensors(mlp: dict, p: str, bias: bool) -> dict:
    """:func:`mlp_params` inverted: ``w_gate``, ``w_in``, ``w_out`` (and biases) as ``nn.Linear`` weights."""
    out = {}
    for theirs, ours in (("gate_proj", "gate"), ("up_proj", "in"), ("down_proj", "out")):
        out[f"{p}mlp.{theirs}.weight"] = mlp["w_" + ours].T
        if bias:
            out[f"{p}mlp.{theirs}.bias"] = mlp["b_" + ours]
    return out


def params(t: Tensors, cfg: ModelConfig) -> dict:
    att = cfg.attention
    n, k = att.num_heads, att.kv_heads
    out = {"embed": t.take("embed_tokens.weight"), "ln_final": {"scale": t.take("norm.weight")}}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = {"w_q": heads(linear(t, p + "self_attn.q_proj"), n), "w_k": heads(linear(t, p + "self_attn.k_proj"), k)}
        a |= {"w_v": heads(linear(t, p + "self_attn.v_proj"), k)}
        a["w_o"] = linear(t, p + "self_attn.o_proj").reshape(n, att.value_dim, cfg.d_model)
        if att.use_bias:
            for role, count in (("q", n), ("k", k), ("v", k)):
                a[f"b_{role}"] = t.take(f"{p}self_attn.{role}_proj.bias").reshape(count, -1)
        if att.has_output_bias:
            a["b_o"] = t.take(p + "self_attn.o_proj.bias")
        if att.qk_norm:  # Qwen3, OLMo2-style per-head norms
            a |= {f"{r}_norm_scale": t.take(f"{p}self_attn.{r}_norm.weight") for r in "qk"}
        out[f"block_{i}"] = block_params(t, p, a, cfg.family.mlp_bias)
    return out | unembed(t, cfg, "embed_tokens.weight")


def check(cfg: ModelConfig, require, name: str = "llama", qk_norm: bool = False, windows: bool = False) -> None:
    check_layers(cfg, require, name, learned_positions=False, qk_norm=qk_norm, windows=windows)
    fam = cfg.family
    require(fam.norm == "rmsnorm", f"norm={fam.norm!r}")
    require(fam.mlp == "swiglu", f"mlp={fam.mlp!r}")
    require(not cfg.learned_positions, "learned_positions=True")
    plain_family(fam, require)


def write_tensors(cfg: ModelConfig, params: dict, qkv_bias: bool = False) -> tuple[dict, bool]:
    """The tensors of the Llama layout, and whether attention has biases (written when any layer has one; with
    ``qkv_bias`` (Qwen2) the q/k/v biases always, the output's never)."""
    d, layers = cfg.d_model, cfg.layer_attention
    attention_bias = qkv_bias or any(a.config.use_bias or a.config.has_output_bias for a in layers)
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["ln_final"]["scale"]}
    for i, layer in enumerate(layers):
        block, p = params[f"block_{i}"], f"model.layers.{i}."
        r = roles(block["attention"], layer.config)
        for x in "qkv":
            tensors[f"{p}self_attn.{x}_proj.weight"] = r["w_" + x].reshape(d, -1).T
            if attention_bias:
                tensors[f"{p}self_attn.{x}_proj.bias"] = r["b_" + x].reshape(-1)
        tensors[p + "self_attn.o_proj.weight"] = block["attention"]["w_o"].reshape(-1, d).T
        if attention_bias and not qkv_bias:
            tensors[p + "self_attn.o_proj.bias"] = r["b_o"]
        for role in ("q", "k") if layer.config.qk_norm else ():
            tensors[f"{p}self_attn.{role}_norm.weight"] = block["attention"][f"{role}_norm_scale"]
        tensors |= mlp_tensors(block["mlp"], p, cfg.family.mlp_bias)
        tensors[p + "input_layernorm.weight"] = block["ln_attention"]["scale"]
        tensors[p + "post_attention_layernorm.weight"] = block["ln_mlp"]["scale"]
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = params["w_unembed"].T
    return tensors, attention_bias


def write_config(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
    att = cfg.attention
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": att.num_heads,
        "num_key_value_heads": att.kv_heads,
        "head_dim": att.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.family.norm_eps,
        "rope_theta": att.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": att.rope_base},
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def write(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``LlamaForCausalLM`` (biases written when the model has any)."""
    tensors, attention_bias = write_tensors(cfg, params)
    config = write_config(cfg, "llama", "LlamaForCausalLM")
    return config | {"attention_bias": attention_bias, "mlp_bias": cfg.family.mlp_bias}, tensors


def qwen3_check(cfg: ModelConfig, require) -> None:
    check(cfg, require, "qwen3", qk_norm=True, windows=True)
    require(not cfg.family.mlp_bias, "mlp_bias=True")


def _window(cfg: ModelConfig) -> int | None:
    return next((layer.config.sliding_window for layer in cfg.layer_attention if layer.config.sliding_window), None)


def layer_windows(cfg: ModelConfig) -> dict:
    """Qwen2's and Qwen3's window fields: ``layer_types`` per layer, the one width, the switch."""
    kinds = ["sliding_attention" if layer.config.sliding_window else "full_attention" for layer in cfg.layer_attention]
    window = _window(cfg)
    return {"use_sliding_window": window is not None, "sliding_window": window, "layer_types": kinds,
            "max_window_layers": cfg.num_layers}  # fmt: skip


def qwen3_write(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``Qwen3ForCausalLM``."""
    tensors, attention_bias = write_tensors(cfg, params)
    config = write_config(cfg, "qwen3", "Qwen3ForCausalLM") | {"attention_bias": attention_bias}
    return config | layer_windows(cfg), tensors


def mistral_check(cfg: ModelConfig, require) -> None:
    """Mistral: the Llama layout with one window on every layer (or none), no biases."""
    check(cfg, require, "mistral", windows=True)
    windows = {layer.config.sliding_window for layer in cfg.layer_attention}
    require(len(windows) == 1, "a window on some layers only (Mistral has one for all; qwen2 has per-layer ones)")
    require(not any(a.config.use_bias or a.config.has_output_bias for a in cfg.layer_attention), "use_bias=True")
    require(not cfg.family.mlp_bias, "mlp_bias=True")


def mistral_write(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``MistralForCausalLM``."""
    tensors, _ = write_tensors(cfg, params)
    return write_config(cfg, "mistral", "MistralForCausalLM") | {"sliding_window": _window(cfg)}, tensors


def qwen2_check(cfg: ModelConfig, require) -> None:
    """Qwen2: the Llama layout with q/k/v biases (zeros where the model has none), no output bias, windows per
    layer."""
    check(cfg, require, "qwen2", windows=True)
    require(not any(a.config.has_output_bias for a in cfg.layer_attention), "an output bias (Qwen2 has none)")
    require(not cfg.family.mlp_bias, "mlp_bias=True")


def qwen2_write(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``Qwen2ForCausalLM``: its q/k/v biases always written."""
    tensors, _ = write_tensors(cfg, params, qkv_bias=True)
    return write_config(cfg, "qwen2", "Qwen2ForCausalLM") | layer_windows(cfg), tensors


READ = COMMON_READ | {
    "attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
    "mlp_bias", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
    "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings", "vocab_size", "sliding_window",
    "use_sliding_window", "layer_types", "max_window_layers",
}  # fmt: skip
INERT = frozenset({
    "attention_dropout",
    "pretraining_tp",  # splits the same products into slices in transformers 4; the same function
})  # fmt: skip
PROJECTIONS = Projections(
    r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight$", {"q": "q", "k": "k", "v": "v"},
    "model.layers.0.self_attn.q_proj.weight", "num_attention_heads", "num_key_value_heads",
)  # fmt: skip

LAYOUT = Layout("llama", ("llama",), False, config, params, check, write,
                prefixes=("model.", ""), read=READ, inert=INERT, projections=PROJECTIONS)  # fmt: skip
MISTRAL = Layout("mistral", ("mistral",), False, config, params, mistral_check, mistral_write,
                 prefixes=("model.", ""), read=READ, inert=INERT, projections=PROJECTIONS)  # fmt: skip
QWEN2 = Layout("qwen2", ("qwen2",), False, config, params, qwen2_check, qwen2_write,
               prefixes=("model.", ""), read=READ, inert=INERT, projections=PROJECTIONS)  # fmt: skip
QWEN3 = Layout("qwen3", ("qwen3",), False, qwen3_config, params, qwen3_check, qwen3_write,
               prefixes=("model.", ""), read=READ, inert=INERT, projections=PROJECTIONS)  # fmt: skip
