"""Hugging Face layouts <-> qkvjax configs and parameter trees: GPT-2, the Llama family, BERT.

Each layout translates a ``config.json`` into a qkvjax config (the model family as data: :class:`Family`,
``AttentionConfig`` biases and rotary conventions) and renames and reshapes the tensors. PyTorch's ``nn.Linear``
stores ``W: [out, in]`` (``y = x W^T + b``); GPT-2's ``Conv1D`` stores ``[in, out]`` (``y = x W + b``); qkvjax's
kernels are ``w_q: (D, N, H)``, ``w_o: (N, H, D)``, ``w_in: (D, F)``, ``embed: (V, D)``. Heads split the output
features head-major (feature ``n H + h`` is head n's h-th), in all three.

A field the model cannot express (a sliding window, rotary scaling, GPT-2's per-layer score scaling) is refused
with one line naming it: an import either computes the same function as the original or does not happen.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qkvjax.attention import AttentionConfig
from qkvjax.hf.folder import Tensors
from qkvjax.models.encoder import EncoderConfig
from qkvjax.models.family import Family
from qkvjax.models.lm import ModelConfig

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}
# the Llama layout's variants: which projections carry biases where the config does not say
LLAMA_BIASES = {"llama": None, "mistral": None, "qwen2": (True, False)}  # (q/k/v, o); None: attention_bias


def _refuse(hf: dict, field: str, allowed, why: str) -> None:
    value = hf.get(field, allowed[0])
    if value not in allowed:
        raise ValueError(f"config.json {field}={value!r}: {why}; allowed: {list(allowed)}")


def _fixed_table(max_len: int | None, rows: int, model: str) -> None:
    """A learned position table fixes the context: ``--max-len`` may only repeat it."""
    if max_len not in (None, rows):
        raise ValueError(f"--max-len {max_len}: {model}'s position table has {rows} rows; allowed: {rows}")


def _heads(w: np.ndarray, heads: int) -> np.ndarray:
    """(D, heads * H) -> (D, heads, H)."""
    return w.reshape(w.shape[0], heads, -1)


# ----------------------------------------------------------------------------------------------- GPT-2


def gpt2_config(hf: dict, max_len: int | None = None) -> ModelConfig:
    _refuse(hf, "scale_attn_by_inverse_layer_idx", (False,), "scores scaled by 1 / layer index are not modelled")
    _refuse(hf, "activation_function", tuple(GPT2_ACTIVATIONS), "an MLP activation qkvjax does not have")
    d, n = hf["n_embd"], hf["n_head"]
    _fixed_table(max_len, hf["n_positions"], "GPT-2")
    return ModelConfig(
        attention=AttentionConfig(num_heads=n, head_dim=d // n, use_bias=True),
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["n_layer"],
        mlp_dim=hf.get("n_inner") or 4 * d,
        max_len=hf["n_positions"],
        learned_positions=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        family=Family(
            norm="layernorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            norm_bias=True,
            mlp=GPT2_ACTIVATIONS[hf.get("activation_function", "gelu_new")],
            mlp_bias=True,
        ),
    )


def _layer_norm(t: Tensors, name: str) -> dict:
    return {"scale": t.take(name + ".weight"), "bias": t.take(name + ".bias")}


def gpt2_params(t: Tensors, cfg: ModelConfig) -> dict:
    n, d = cfg.attention.num_heads, cfg.d_model
    params = {"embed": t.take("wte.weight"), "pos_embed": t.take("wpe.weight"), "ln_final": _layer_norm(t, "ln_f")}
    for i in range(cfg.num_layers):
        p = f"h.{i}."
        w_q, w_k, w_v = np.split(t.take(p + "attn.c_attn.weight", (d, 3 * d)), 3, axis=1)  # D(3D) -> 3 x DD
        b_q, b_k, b_v = np.split(t.take(p + "attn.c_attn.bias"), 3)
        attention = {"w_q": _heads(w_q, n), "w_k": _heads(w_k, n), "w_v": _heads(w_v, n)}
        attention |= {"b_q": b_q.reshape(n, -1), "b_k": b_k.reshape(n, -1), "b_v": b_v.reshape(n, -1)}
        attention |= {"w_o": t.take(p + "attn.c_proj.weight").reshape(n, -1, d), "b_o": t.take(p + "attn.c_proj.bias")}
        mlp = {"w_in": t.take(p + "mlp.c_fc.weight"), "b_in": t.take(p + "mlp.c_fc.bias")}
        mlp |= {"w_out": t.take(p + "mlp.c_proj.weight"), "b_out": t.take(p + "mlp.c_proj.bias")}
        params[f"block_{i}"] = {
            "attention": attention,
            "ln_attention": _layer_norm(t, p + "ln_1"),
            "ln_mlp": _layer_norm(t, p + "ln_2"),
            "mlp": mlp,
        }
    return params | _unembed(t, cfg)


def _unembed(t: Tensors, cfg: ModelConfig) -> dict:
    """``w_unembed`` (D, V) from ``lm_head.weight`` (V, D), or nothing when tied (a saved copy must be the table)."""
    if not cfg.tie_embeddings:
        return {"w_unembed": t.take("lm_head.weight", (cfg.vocab_size, cfg.d_model), prefixed=False).T}
    if t.has("lm_head.weight", prefixed=False):
        copy = t.take("lm_head.weight", prefixed=False)
        if not np.array_equal(copy, t.take("embed_tokens.weight" if t.has("embed_tokens.weight") else "wte.weight")):
            raise ValueError("config.json tie_word_embeddings=true, but lm_head.weight differs from the embeddings")
    return {}


# ------------------------------------------------------------------------------------- Llama, Mistral, Qwen2


def _rope(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config.json rope_type={kind!r}: rotary scaling is not modelled; allowed: ['default']")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def llama_config(hf: dict, max_len: int | None = None) -> ModelConfig:
    model_type = hf.get("model_type", "llama")
    _refuse(hf, "hidden_act", ("silu",), "the Llama layout's MLP is SwiGLU")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise ValueError(
            f"config.json sliding_window={hf['sliding_window']}: qkvjax attends over the whole context; "
            "allowed: null (or use_sliding_window=false)"
        )
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    k = hf.get("num_key_value_heads") or n
    biases = LLAMA_BIASES[model_type] or (hf.get("attention_bias", False),) * 2
    attention = AttentionConfig(
        num_heads=n,
        head_dim=hf.get("head_dim") or d // n,
        num_kv_heads=None if k == n else k,
        rope=True,
        rope_base=_rope(hf),
        use_bias=biases[0],
        output_bias=biases[1],
    )
    return ModelConfig(
        attention=attention,
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


def _linear(t: Tensors, name: str) -> np.ndarray:
    """An ``nn.Linear`` weight as qkvjax's (in, out) kernel."""
    return t.take(name + ".weight").T


def llama_params(t: Tensors, cfg: ModelConfig) -> dict:
    att = cfg.attention
    n, k = att.num_heads, att.kv_heads
    params = {"embed": t.take("embed_tokens.weight"), "ln_final": {"scale": t.take("norm.weight")}}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = {"w_q": _heads(_linear(t, p + "self_attn.q_proj"), n), "w_k": _heads(_linear(t, p + "self_attn.k_proj"), k)}
        a |= {"w_v": _heads(_linear(t, p + "self_attn.v_proj"), k)}
        a["w_o"] = _linear(t, p + "self_attn.o_proj").reshape(n, att.value_dim, cfg.d_model)
        if att.use_bias:
            for role, heads in (("q", n), ("k", k), ("v", k)):
                a[f"b_{role}"] = t.take(f"{p}self_attn.{role}_proj.bias").reshape(heads, -1)
        if att.has_output_bias:
            a["b_o"] = t.take(p + "self_attn.o_proj.bias")
        mlp = {"w_gate": _linear(t, p + "mlp.gate_proj"), "w_in": _linear(t, p + "mlp.up_proj")}
        mlp["w_out"] = _linear(t, p + "mlp.down_proj")
        if cfg.family.mlp_bias:
            mlp |= {"b_gate": t.take(p + "mlp.gate_proj.bias"), "b_in": t.take(p + "mlp.up_proj.bias")}
            mlp["b_out"] = t.take(p + "mlp.down_proj.bias")
        params[f"block_{i}"] = {
            "attention": a,
            "ln_attention": {"scale": t.take(p + "input_layernorm.weight")},
            "ln_mlp": {"scale": t.take(p + "post_attention_layernorm.weight")},
            "mlp": mlp,
        }
    return params | _unembed(t, cfg)


# ----------------------------------------------------------------------------------------------- BERT


def bert_config(hf: dict, max_len: int | None = None) -> EncoderConfig:
    _refuse(hf, "position_embedding_type", ("absolute",), "relative position embeddings are not modelled")
    _refuse(hf, "hidden_act", tuple(BERT_ACTIVATIONS), "an MLP activation qkvjax does not have")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    _fixed_table(max_len, hf["max_position_embeddings"], "BERT")
    return EncoderConfig(
        attention=AttentionConfig(num_heads=n, head_dim=d // n, use_bias=True),
        vocab_size=hf["vocab_size"],
        num_classes=0,
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        mlp_dim=hf["intermediate_size"],
        max_len=hf["max_position_embeddings"],
        learned_positions=True,
        family=Family(
            norm="layernorm",
            norm_eps=hf.get("layer_norm_eps", 1e-12),
            norm_bias=True,
            norm_position="post",
            embed_norm=True,
            mlp=BERT_ACTIVATIONS[hf.get("hidden_act", "gelu")],
            mlp_bias=True,
        ),
    )


def _bert_norm(t: Tensors, name: str) -> dict:
    if t.has(name + ".gamma"):  # the original TF checkpoints' names
        return {"scale": t.take(name + ".gamma"), "bias": t.take(name + ".beta")}
    return _layer_norm(t, name)


def bert_params(t: Tensors, cfg: EncoderConfig) -> dict:
    """Token type 0's embedding is folded into the position table: inputs are single segments (type ids 0)."""
    n = cfg.attention.num_heads
    e = "embeddings."
    params = {
        "embed": t.take(e + "word_embeddings.weight"),
        "pos_embed": t.take(e + "position_embeddings.weight") + t.take(e + "token_type_embeddings.weight")[0],
        "ln_embed": _bert_norm(t, e + "LayerNorm"),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        a = {}
        for role, name in (("q", "query"), ("k", "key"), ("v", "value")):
            a[f"w_{role}"] = _heads(_linear(t, f"{p}attention.self.{name}"), n)
            a[f"b_{role}"] = t.take(f"{p}attention.self.{name}.bias").reshape(n, -1)
        a["w_o"] = _linear(t, p + "attention.output.dense").reshape(n, -1, cfg.d_model)
        a["b_o"] = t.take(p + "attention.output.dense.bias")
        mlp = {"w_in": _linear(t, p + "intermediate.dense"), "b_in": t.take(p + "intermediate.dense.bias")}
        mlp |= {"w_out": _linear(t, p + "output.dense"), "b_out": t.take(p + "output.dense.bias")}
        params[f"block_{i}"] = {
            "attention": a,
            "ln_attention": _bert_norm(t, p + "attention.output.LayerNorm"),
            "ln_mlp": _bert_norm(t, p + "output.LayerNorm"),
            "mlp": mlp,
        }
    return params


@dataclasses.dataclass(frozen=True)
class Layout:
    """One Hugging Face layout: its config and tensor translations, the name prefixes its checkpoints use, and
    tensors it may carry that qkvjax does not need (BERT's pooler, GPT-2's causal-mask buffers)."""

    name: str
    config: object
    params: object
    prefixes: tuple[str, ...]
    ignore: tuple[str, ...] = ()


LAYOUTS = {
    "gpt2": Layout("gpt2", gpt2_config, gpt2_params, ("transformer.", ""), (".attn.bias", ".attn.masked_bias")),
    "llama": Layout("llama", llama_config, llama_params, ("model.", "")),
    "bert": Layout("bert", bert_config, bert_params, ("bert.", ""), ("pooler.", "position_ids", "cls.")),
}
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "bert": "bert"}
