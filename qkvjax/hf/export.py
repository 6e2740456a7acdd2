"""qkvjax models out to the Hugging Face GPT-2 or Llama layout (decoder LMs) or BERT's (encoders), where that
layout can express the model.

A tying scheme that is a plain partition of {q, k, v} computes ``q = x W^Q``, ``k = x W^K``, ``v = x W^V`` with
some of the three equal, so each role's kernel is written out (the shared one copied into every role it plays):
the exported model computes the same function, without the tie's savings. Schemes whose scores are not plain
``q . k`` of linear projections (a bilinear form, Reformer's unit keys and self-mask, a latent cache), QK-norm,
V-norm, relative biases and layers reading another layer's K/V (CLA) have no place in either layout and are
refused with one line. Missing biases (qkvjax's own models have none) are written as zeros; GPT-2 and BERT need
K = N. BERT is written as a ``BertModel`` with one token type (the import folded type 0 into the positions) and
without a pooler (never imported: transformers initialises it afresh; the hidden states do not use it).
"""

from __future__ import annotations

import numpy as np

from qkvjax.models.encoder import EncoderConfig
from qkvjax.models.lm import ModelConfig

FORMATS = ("gpt2", "llama", "bert")
GPT2_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _require(ok: bool, what: str, fmt: str) -> None:
    if not ok:
        raise ValueError(f"{what}: the Hugging Face {fmt} layout cannot express it; nothing was exported")


def check_exportable(cfg: ModelConfig | EncoderConfig, fmt: str) -> None:
    """Raises one line naming the first part of ``cfg`` that the ``fmt`` layout cannot express."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}; allowed: {list(FORMATS)}")
    encoder = isinstance(cfg, EncoderConfig)
    if encoder != (fmt == "bert"):
        what = "an encoder (EncoderConfig)" if encoder else "a decoder LM"
        raise ValueError(f"--format {fmt!r} for {what}; allowed: {'bert' if encoder else 'gpt2, llama'}")
    fam = cfg.family
    for i, layer in enumerate(cfg.layer_attention):
        att, scheme = layer.config, layer.config.tying
        where = f"layer {i}: scheme {att.scheme!r}"
        _require(layer.produces_kv, f"layer {i} reads layer {layer.kv_from}'s keys and values (CLA)", fmt)
        _require(not (scheme.bilinear or scheme.latent or scheme.normalize_keys or scheme.mask_self), where, fmt)
        for name in ("qk_norm", "v_norm", "relative_bias"):
            _require(not getattr(att, name), f"layer {i}: {name}={getattr(att, name)!r}", fmt)
        _require(att.value_dim == att.head_dim, f"layer {i}: v_head_dim={att.v_head_dim}", fmt)
        _require(att.sliding_window is None, f"layer {i}: sliding_window={att.sliding_window} (not written yet)", fmt)
        _require(att.kv_heads == cfg.attention.kv_heads, f"layer {i}: num_kv_heads={att.num_kv_heads} varies", fmt)
        if fmt in ("gpt2", "bert"):
            _require(not att.rope, f"layer {i}: rope=True ({fmt} has learned positions)", fmt)
            _require(att.kv_heads == att.num_heads, f"layer {i}: num_kv_heads={att.num_kv_heads} (GQA)", fmt)
            _require(att.num_heads * att.head_dim == cfg.d_model, f"layer {i}: N H != D", fmt)
        else:
            _require(att.rope, f"layer {i}: rope=False (the llama layout has rotary positions only)", fmt)
            _require(att.rope_layout == "half", f"layer {i}: rope_layout={att.rope_layout!r}", fmt)
            _require(att.rope_base == cfg.attention.rope_base, f"layer {i}: rope_base varies", fmt)
    if fmt == "bert":
        _require(fam.norm == "layernorm", f"norm={fam.norm!r}", fmt)
        _require(fam.mlp in BERT_ACTIVATIONS, f"mlp={fam.mlp!r}", fmt)
        _require(cfg.learned_positions, "learned_positions=False", fmt)
        _require(fam.norm_position == "post" and fam.embed_norm, "pre-norm or no embedding norm", fmt)
        _require(cfg.num_classes == 0, f"num_classes={cfg.num_classes} (a token classifier head)", fmt)
        return
    if fmt == "gpt2":
        _require(fam.norm == "layernorm", f"norm={fam.norm!r}", fmt)
        _require(fam.mlp in GPT2_ACTIVATIONS, f"mlp={fam.mlp!r}", fmt)
        _require(cfg.learned_positions, "learned_positions=False", fmt)
    else:
        _require(fam.norm == "rmsnorm", f"norm={fam.norm!r}", fmt)
        _require(fam.mlp == "swiglu", f"mlp={fam.mlp!r}", fmt)
        _require(not cfg.learned_positions, "learned_positions=True", fmt)
    _require(fam.norm_position == "pre" and not fam.embed_norm, "post-norm or an embedding norm", fmt)


def _roles(att_params: dict, att) -> dict[str, np.ndarray]:
    """Each role's (D, heads, H) kernel and (heads, H) bias (zeros where there is none), from the scheme's groups."""
    out = {}
    for role in "qkv":
        group = att.tying.group_of(role)
        w = np.asarray(att_params["w_" + group])
        out["w_" + role] = w
        out["b_" + role] = np.asarray(att_params["b_" + group]) if "b_" + group in att_params else np.zeros(w.shape[1:])
    d = att_params["w_o"].shape[-1]
    out["b_o"] = np.asarray(att_params["b_o"]) if "b_o" in att_params else np.zeros(d)
    return out


def _norm(p: dict, d: int) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(p["scale"]), np.asarray(p["bias"]) if "bias" in p else np.zeros(d)


def to_gpt2(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``GPT2LMHeadModel``."""
    d, f = cfg.d_model, cfg.mlp_width
    tensors = {"transformer.wte.weight": params["embed"], "transformer.wpe.weight": params["pos_embed"]}
    tensors["transformer.ln_f.weight"], tensors["transformer.ln_f.bias"] = _norm(params["ln_final"], d)
    for i, layer in enumerate(cfg.layer_attention):
        block, p = params[f"block_{i}"], f"transformer.h.{i}."
        r = _roles(block["attention"], layer.config)
        tensors[p + "attn.c_attn.weight"] = np.concatenate([r["w_" + x].reshape(d, -1) for x in "qkv"], axis=1)
        tensors[p + "attn.c_attn.bias"] = np.concatenate([r["b_" + x].reshape(-1) for x in "qkv"])
        tensors[p + "attn.c_proj.weight"] = np.asarray(block["attention"]["w_o"]).reshape(-1, d)
        tensors[p + "attn.c_proj.bias"] = r["b_o"]
        tensors[p + "ln_1.weight"], tensors[p + "ln_1.bias"] = _norm(block["ln_attention"], d)
        tensors[p + "ln_2.weight"], tensors[p + "ln_2.bias"] = _norm(block["ln_mlp"], d)
        mlp = block["mlp"]
        tensors[p + "mlp.c_fc.weight"], tensors[p + "mlp.c_proj.weight"] = mlp["w_in"], mlp["w_out"]
        tensors[p + "mlp.c_fc.bias"] = mlp.get("b_in", np.zeros(f))
        tensors[p + "mlp.c_proj.bias"] = mlp.get("b_out", np.zeros(d))
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = np.asarray(params["w_unembed"]).T
    att = cfg.attention
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_len,
        "n_embd": d,
        "n_layer": cfg.num_layers,
        "n_head": att.num_heads,
        "n_inner": f,
        "activation_function": GPT2_ACTIVATIONS[cfg.family.mlp],
        "layer_norm_epsilon": cfg.family.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    return config, tensors


def to_llama(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``LlamaForCausalLM`` (biases written when the model has any)."""
    d, f, att = cfg.d_model, cfg.mlp_width, cfg.attention
    layers = cfg.layer_attention
    attention_bias = any(a.config.use_bias or a.config.has_output_bias for a in layers)
    mlp_bias = cfg.family.mlp_bias
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["ln_final"]["scale"]}
    for i, layer in enumerate(layers):
        block, p = params[f"block_{i}"], f"model.layers.{i}."
        r = _roles(block["attention"], layer.config)
        for x in "qkv":
            tensors[f"{p}self_attn.{x}_proj.weight"] = r["w_" + x].reshape(d, -1).T
            if attention_bias:
                tensors[f"{p}self_attn.{x}_proj.bias"] = r["b_" + x].reshape(-1)
        tensors[p + "self_attn.o_proj.weight"] = np.asarray(block["attention"]["w_o"]).reshape(-1, d).T
        if attention_bias:
            tensors[p + "self_attn.o_proj.bias"] = r["b_o"]
        mlp = block["mlp"]
        for hf_name, name in (("gate_proj", "gate"), ("up_proj", "in"), ("down_proj", "out")):
            tensors[f"{p}mlp.{hf_name}.weight"] = np.asarray(mlp["w_" + name]).T
            if mlp_bias:
                tensors[f"{p}mlp.{hf_name}.bias"] = mlp["b_" + name]
        tensors[p + "input_layernorm.weight"] = block["ln_attention"]["scale"]
        tensors[p + "post_attention_layernorm.weight"] = block["ln_mlp"]["scale"]
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = np.asarray(params["w_unembed"]).T
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": att.num_heads,
        "num_key_value_heads": att.kv_heads,
        "head_dim": att.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.family.norm_eps,
        "rope_theta": att.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": att.rope_base},
        "attention_bias": attention_bias,
        "mlp_bias": mlp_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    return config, tensors


def to_bert(cfg: EncoderConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``BertModel`` (one token type, all zeros; no pooler)."""
    d, f, att = cfg.d_model, cfg.mlp_width, cfg.attention
    ln = lambda name, p: dict(zip((name + ".weight", name + ".bias"), _norm(p, d), strict=True))  # noqa: E731
    tensors = {
        "embeddings.word_embeddings.weight": params["embed"],
        "embeddings.position_embeddings.weight": params["pos_embed"],
        "embeddings.token_type_embeddings.weight": np.zeros((1, d), np.float32),
        **ln("embeddings.LayerNorm", params["ln_embed"]),
    }
    for i, layer in enumerate(cfg.layer_attention):
        block, p = params[f"block_{i}"], f"encoder.layer.{i}."
        r = _roles(block["attention"], layer.config)
        for x, name in (("q", "query"), ("k", "key"), ("v", "value")):
            tensors[f"{p}attention.self.{name}.weight"] = r["w_" + x].reshape(d, -1).T
            tensors[f"{p}attention.self.{name}.bias"] = r["b_" + x].reshape(-1)
        tensors[p + "attention.output.dense.weight"] = np.asarray(block["attention"]["w_o"]).reshape(-1, d).T
        tensors[p + "attention.output.dense.bias"] = r["b_o"]
        tensors |= ln(p + "attention.output.LayerNorm", block["ln_attention"])
        mlp = block["mlp"]
        tensors[p + "intermediate.dense.weight"] = np.asarray(mlp["w_in"]).T
        tensors[p + "intermediate.dense.bias"] = mlp.get("b_in", np.zeros(f))
        tensors[p + "output.dense.weight"] = np.asarray(mlp["w_out"]).T
        tensors[p + "output.dense.bias"] = mlp.get("b_out", np.zeros(d))
        tensors |= ln(p + "output.LayerNorm", block["ln_mlp"])
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": d,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": att.num_heads,
        "intermediate_size": f,
        "hidden_act": BERT_ACTIVATIONS[cfg.family.mlp],
        "max_position_embeddings": cfg.max_len,
        "type_vocab_size": 1,
        "layer_norm_eps": cfg.family.norm_eps,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    return config, tensors


EXPORTERS = {"gpt2": to_gpt2, "llama": to_llama, "bert": to_bert}


def infer_format(cfg: ModelConfig | EncoderConfig) -> str:
    """'bert' for an encoder, 'llama' for a rotary decoder, else 'gpt2'."""
    return "bert" if isinstance(cfg, EncoderConfig) else "llama" if cfg.attention.rope else "gpt2"
