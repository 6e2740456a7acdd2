"""GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm with biases, a GELU MLP, q/k/v fused in one Conv1D.

Conv1D stores ``[in, out]`` (``y = x W + b``): ``attn.c_attn.weight`` is (D, 3 D), the q, k and v features in
that order, each head-major. Scores scaled by 1 / layer index or without 1 / sqrt(H) are refused at import;
an export writes every role's kernel (ties written out) and zeros for the biases a qkvjax model lacks.
"""

from __future__ import annotations

import numpy as np

from qkvjax.attention import AttentionConfig
from qkvjax.hf.folder import Tensors
from qkvjax.hf.layouts.base import (
    COMMON_READ,
    Layout,
    Names,
    Projections,
    check_layers,
    fixed_table,
    heads,
    layer_norm,
    norm,
    plain_family,
    refuse,
    roles,
    unembed,
)
from qkvjax.models.family import Family
from qkvjax.models.lm import ModelConfig

ACTIVATIONS = Names({"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"})


def config(hf: dict, max_len: int | None = None) -> ModelConfig:
    refuse(hf, "scale_attn_by_inverse_layer_idx", (False,), "scores scaled by 1 / layer index are not modelled")
    refuse(hf, "scale_attn_weights", (True,), "scores without the 1 / sqrt(head width) scale are not modelled")
    refuse(hf, "activation_function", tuple(ACTIVATIONS.table), "an MLP activation qkvjax does not have")
    d, n = hf["n_embd"], hf["n_head"]
    fixed_table(max_len, hf["n_positions"], "GPT-2")
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
            mlp=ACTIVATIONS.ours(hf.get("activation_function", "gelu_new")),
            mlp_bias=True,
        ),
    )


def params(t: Tensors, cfg: ModelConfig) -> dict:
    n, d = cfg.attention.num_heads, cfg.d_model
    out = {"embed": t.take("wte.weight"), "pos_embed": t.take("wpe.weight"), "ln_final": layer_norm(t, "ln_f")}
    for i in range(cfg.num_layers):
        p = f"h.{i}."
        w_q, w_k, w_v = np.split(t.take(p + "attn.c_attn.weight", (d, 3 * d)), 3, axis=1)  # D(3D) -> 3 x DD
        b_q, b_k, b_v = np.split(t.take(p + "attn.c_attn.bias"), 3)
        attention = {"w_q": heads(w_q, n), "w_k": heads(w_k, n), "w_v": heads(w_v, n)}
        attention |= {"b_q": b_q.reshape(n, -1), "b_k": b_k.reshape(n, -1), "b_v": b_v.reshape(n, -1)}
        attention |= {"w_o": t.take(p + "attn.c_proj.weight").reshape(n, -1, d), "b_o": t.take(p + "attn.c_proj.bias")}
        mlp = {"w_in": t.take(p + "mlp.c_fc.weight"), "b_in": t.take(p + "mlp.c_fc.bias")}
        mlp |= {"w_out": t.take(p + "mlp.c_proj.weight"), "b_out": t.take(p + "mlp.c_proj.bias")}
        out[f"block_{i}"] = {
            "attention": attention,
            "ln_attention": layer_norm(t, p + "ln_1"),
            "ln_mlp": layer_norm(t, p + "ln_2"),
            "mlp": mlp,
        }
    return out | unembed(t, cfg, "wte.weight")


def check(cfg: ModelConfig, require) -> None:
    check_layers(cfg, require, "gpt2", learned_positions=True)
    fam = cfg.family
    require(fam.norm == "layernorm", f"norm={fam.norm!r}")
    require(fam.mlp in ACTIVATIONS.written, f"mlp={fam.mlp!r}")
    require(cfg.learned_positions, "learned_positions=False")
    plain_family(fam, require)


def write(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``GPT2LMHeadModel``."""
    d, f = cfg.d_model, cfg.mlp_width
    tensors = {"transformer.wte.weight": params["embed"], "transformer.wpe.weight": params["pos_embed"]}
    tensors["transformer.ln_f.weight"], tensors["transformer.ln_f.bias"] = norm(params["ln_final"], d)
    for i, layer in enumerate(cfg.layer_attention):
        block, p = params[f"block_{i}"], f"transformer.h.{i}."
        r = roles(block["attention"], layer.config)
        tensors[p + "attn.c_attn.weight"] = np.concatenate([r["w_" + x].reshape(d, -1) for x in "qkv"], axis=1)
        tensors[p + "attn.c_attn.bias"] = np.concatenate([r["b_" + x].reshape(-1) for x in "qkv"])
        tensors[p + "attn.c_proj.weight"] = np.asarray(block["attention"]["w_o"]).reshape(-1, d)
        tensors[p + "attn.c_proj.bias"] = r["b_o"]
        tensors[p + "ln_1.weight"], tensors[p + "ln_1.bias"] = norm(block["ln_attention"], d)
        tensors[p + "ln_2.weight"], tensors[p + "ln_2.bias"] = norm(block["ln_mlp"], d)
        mlp = block["mlp"]
        tensors[p + "mlp.c_fc.weight"], tensors[p + "mlp.c_proj.weight"] = mlp["w_in"], mlp["w_out"]
        tensors[p + "mlp.c_fc.bias"] = mlp.get("b_in", np.zeros(f))
        tensors[p + "mlp.c_proj.bias"] = mlp.get("b_out", np.zeros(d))
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = np.asarray(params["w_unembed"]).T
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_len,
        "n_embd": d,
        "n_layer": cfg.num_layers,
        "n_head": cfg.attention.num_heads,
        "n_inner": f,
        "activation_function": ACTIVATIONS.theirs(cfg.family.mlp),
        "layer_norm_epsilon": cfg.family.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    return config, tensors


READ = COMMON_READ | {
    "activation_function", "layer_norm_epsilon", "n_embd", "n_head", "n_inner", "n_layer", "n_positions",
    "vocab_size", "tie_word_embeddings", "scale_attn_by_inverse_layer_idx", "scale_attn_weights",
}  # fmt: skip
INERT = frozenset({
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj", "n_ctx",
    "reorder_and_upcast_attn",  # float32 scores and softmax in transformers; qkvjax takes the softmax in float32
})  # fmt: skip

LAYOUT = Layout(
    "gpt2", ("gpt2",), False, config, params, check, write,
    prefixes=("transformer.", ""),
    ignore=(".attn.bias", ".attn.masked_bias"),  # causal-mask buffers older checkpoints saved
    read=READ,
    inert=INERT,
    projections=Projections(r"^(?:transformer\.)?h\.(\d+)\.attn\.(c_attn)\.weight$", {"c_attn": "qkv"},
                            "h.0.attn.c_attn.weight", "n_head"),
)  # fmt: skip
