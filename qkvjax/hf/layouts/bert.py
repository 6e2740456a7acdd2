"""BERT (``BertModel``): an encoder with post-norm, an embedding LayerNorm, learned positions and token types.

Token type 0's embedding is folded into the position table at import (inputs are single segments), so an export
writes one all-zero token type. The masked-LM head and the pooler are not imported; an export writes no pooler
(transformers initialises one afresh; the hidden states do not use it).
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
    linear,
    norm,
    plain_family,
    refuse,
    roles,
)
from qkvjax.models.encoder import EncoderConfig
from qkvjax.models.family import Family

ACTIVATIONS = Names({"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"})


def config(hf: dict, max_len: int | None = None) -> EncoderConfig:
    refuse(hf, "position_embedding_type", ("absolute",), "relative position embeddings are not modelled")
    refuse(hf, "is_decoder", (False,), "a causal BERT is not modelled (the encoder attends both ways)")
    refuse(hf, "hidden_act", tuple(ACTIVATIONS.table), "an MLP activation qkvjax does not have")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    fixed_table(max_len, hf["max_position_embeddings"], "BERT")
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
            mlp=ACTIVATIONS.ours(hf.get("hidden_act", "gelu")),
            mlp_bias=True,
        ),
    )


def _norm(t: Tensors, name: str) -> dict:
    if t.has(name + ".gamma"):  # the original TF checkpoints' names
        return {"scale": t.take(name + ".gamma"), "bias": t.take(name + ".beta")}
    return layer_norm(t, name)


def params(t: Tensors, cfg: EncoderConfig) -> dict:
    n = cfg.attention.num_heads
    e = "embeddings."
    out = {
        "embed": t.take(e + "word_embeddings.weight"),
        "pos_embed": t.take(e + "position_embeddings.weight") + t.take(e + "token_type_embeddings.weight")[0],
        "ln_embed": _norm(t, e + "LayerNorm"),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        a = {}
        for role, name in (("q", "query"), ("k", "key"), ("v", "value")):
            a[f"w_{role}"] = heads(linear(t, f"{p}attention.self.{name}"), n)
            a[f"b_{role}"] = t.take(f"{p}attention.self.{name}.bias").reshape(n, -1)
        a["w_o"] = linear(t, p + "attention.output.dense").reshape(n, -1, cfg.d_model)
        a["b_o"] = t.take(p + "attention.output.dense.bias")
        mlp = {"w_in": linear(t, p + "intermediate.dense"), "b_in": t.take(p + "intermediate.dense.bias")}
        mlp |= {"w_out": linear(t, p + "output.dense"), "b_out": t.take(p + "output.dense.bias")}
        out[f"block_{i}"] = {
            "attention": a,
            "ln_attention": _norm(t, p + "attention.output.LayerNorm"),
            "ln_mlp": _norm(t, p + "output.LayerNorm"),
            "mlp": mlp,
        }
    return out


def check(cfg: EncoderConfig, require) -> None:
    check_layers(cfg, require, "bert", learned_positions=True)
    fam = cfg.family
    require(fam.norm == "layernorm", f"norm={fam.norm!r}")
    require(fam.mlp in ACTIVATIONS.written, f"mlp={fam.mlp!r}")
    require(cfg.learned_positions, "learned_positions=False")
    plain_family(fam, require, "post")
    require(cfg.num_classes == 0, f"num_classes={cfg.num_classes} (a token classifier head)")


def write(cfg: EncoderConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``BertModel`` (one token type, all zeros; no pooler)."""
    d, f, att = cfg.d_model, cfg.mlp_width, cfg.attention
    ln = lambda name, p: dict(zip((name + ".weight", name + ".bias"), norm(p, d), strict=True))  # noqa: E731
    tensors = {
        "embeddings.word_embeddings.weight": params["embed"],
        "embeddings.position_embeddings.weight": params["pos_embed"],
        "embeddings.token_type_embeddings.weight": np.zeros((1, d), np.float32),
        **ln("embeddings.LayerNorm", params["ln_embed"]),
    }
    for i, layer in enumerate(cfg.layer_attention):
        block, p = params[f"block_{i}"], f"encoder.layer.{i}."
        r = roles(block["attention"], layer.config)
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
        "hidden_act": ACTIVATIONS.theirs(cfg.family.mlp),
        "max_position_embeddings": cfg.max_len,
        "type_vocab_size": 1,
        "layer_norm_eps": cfg.family.norm_eps,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    return config, tensors


READ = COMMON_READ | {
    "hidden_act", "hidden_size", "intermediate_size", "layer_norm_eps", "max_position_embeddings",
    "num_attention_heads", "num_hidden_layers", "position_embedding_type", "type_vocab_size", "vocab_size",
    "is_decoder",
}  # fmt: skip
INERT = frozenset({
    "attention_probs_dropout_prob", "hidden_dropout_prob", "classifier_dropout",
    "tie_word_embeddings",  # ties the masked-LM head, which is not imported
})  # fmt: skip
PROJECTIONS = Projections(r"^(?:bert\.)?encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.weight$",
                          {"query": "q", "key": "k", "value": "v"}, "encoder.layer.0.attention.self.query.weight",
                          "num_attention_heads")  # fmt: skip

LAYOUT = Layout("bert", ("bert",), True, config, params, check, write,
                prefixes=("bert.", ""), ignore=("pooler.", "position_ids", "cls."),
                read=READ, inert=INERT, projections=PROJECTIONS)  # fmt: skip
