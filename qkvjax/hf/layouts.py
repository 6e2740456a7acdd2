"""Hugging Face layouts <-> qkvjax configs and parameter trees: GPT-2, the Llama family, BERT.

Each layout translates a ``config.json`` into a qkvjax config (the model family as data: :class:`Family`,
``AttentionConfig`` biases and rotary conventions) and renames and reshapes the tensors. PyTorch's ``nn.Linear``
stores ``W: [out, in]`` (``y = x W^T + b``); GPT-2's ``Conv1D`` stores ``[in, out]`` (``y = x W + b``); qkvjax's
kernels are ``w_q: (D, N, H)``, ``w_o: (N, H, D)``, ``w_in: (D, F)``, ``embed: (V, D)``. Heads split the output
features head-major (feature ``n H + h`` is head n's h-th), in all three.

Sliding windows (Mistral's on every layer, or ``layer_types``' per layer) become ``AttentionConfig.sliding_window``.
A field the model cannot express (rotary scaling, GPT-2's per-layer score scaling) is refused
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
    _refuse(hf, "scale_attn_weights", (True,), "scores without the 1 / sqrt(head width) scale are not modelled")
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


def _windows(hf: dict) -> tuple[int | None, str]:
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


def llama_config(hf: dict, max_len: int | None = None) -> ModelConfig:
    model_type = hf.get("model_type", "llama")
    _refuse(hf, "hidden_act", ("silu",), "the Llama layout's MLP is SwiGLU")
    window, layers = _windows(hf)
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
    _refuse(hf, "is_decoder", (False,), "a causal BERT is not modelled (the encoder attends both ways)")
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


# ------------------------------------------------------------------------------------- the field audit
# Every config.json field is one of: read by the layout (honoured, or refused where its value cannot be
# expressed), or inert (it does not change the function the model computes at inference: dropout, ids, caching,
# bookkeeping, heads qkvjax does not import). Any other field is refused in one line: an import computes the
# function the original computes, or does not happen. tests/test_hf.py checks that every field transformers'
# config classes write is classified, and each honoured field against transformers with a non-default value.
INERT = frozenset({
    "_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "model_type",
    "id2label", "label2id", "problem_type", "return_dict", "output_attentions", "output_hidden_states",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "initializer_range", "chunk_size_feed_forward", "task_specific_params", "tokenizer_class", "prefix",
    "gradient_checkpointing", "_attn_implementation", "attn_implementation", "use_return_dict",
    "tie_encoder_decoder", "torchscript", "finetuning_task", "num_labels",
})  # fmt: skip
GPT2_READ = frozenset({
    "activation_function", "layer_norm_epsilon", "n_embd", "n_head", "n_inner", "n_layer", "n_positions",
    "vocab_size", "tie_word_embeddings", "scale_attn_by_inverse_layer_idx", "scale_attn_weights",
    "add_cross_attention", "is_encoder_decoder",
})  # fmt: skip
GPT2_INERT = frozenset({
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj", "n_ctx",
    "reorder_and_upcast_attn",  # float32 scores and softmax in transformers; qkvjax takes the softmax in float32
})  # fmt: skip
LLAMA_READ = frozenset({
    "attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
    "mlp_bias", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
    "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings", "vocab_size", "sliding_window",
    "use_sliding_window", "layer_types", "is_encoder_decoder", "max_window_layers",
})  # fmt: skip
LLAMA_INERT = frozenset({
    "attention_dropout",
    "pretraining_tp",  # splits the same products into slices in transformers 4; the same function
})  # fmt: skip
BERT_READ = frozenset({
    "hidden_act", "hidden_size", "intermediate_size", "layer_norm_eps", "max_position_embeddings",
    "num_attention_heads", "num_hidden_layers", "position_embedding_type", "type_vocab_size", "vocab_size",
    "is_decoder", "add_cross_attention", "is_encoder_decoder",
})  # fmt: skip
BERT_INERT = frozenset({
    "attention_probs_dropout_prob", "hidden_dropout_prob", "classifier_dropout",
    "tie_word_embeddings",  # ties the masked-LM head, which is not imported
})  # fmt: skip


def _checks_common(hf: dict) -> None:
    _refuse(hf, "is_encoder_decoder", (False,), "encoder-decoder models are not modelled")
    _refuse(hf, "add_cross_attention", (False,), "cross-attention to an encoder is not modelled")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One Hugging Face layout: its config and tensor translations, the name prefixes its checkpoints use,
    tensors it may carry that qkvjax does not need (BERT's pooler, GPT-2's causal-mask buffers), and the
    config.json fields it reads and those that do not change the function (:meth:`audit`)."""

    name: str
    translate: object
    params: object
    prefixes: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    read: frozenset = frozenset()
    inert: frozenset = frozenset()

    def audit(self, hf: dict) -> None:
        """Refuses, in one line, config.json fields this layout neither reads nor knows to be inert."""
        unknown = sorted(k for k in hf if k not in self.read and k not in self.inert and k not in INERT)
        if unknown:
            shown = ", ".join(f"{k}={hf[k]!r}" for k in unknown[:4]) + (" ..." if len(unknown) > 4 else "")
            raise ValueError(
                f"config.json has {len(unknown)} field(s) the {self.name} layout does not know ({shown}): each might "
                "change what the model computes, so nothing was imported; allowed: the fields listed in "
                "qkvjax/hf/layouts.py"
            )

    def config(self, hf: dict, max_len: int | None = None):
        """The qkvjax config of ``hf`` after the audit: every field honoured, or the import refused."""
        self.audit(hf)
        _checks_common(hf)
        return self.translate(hf, max_len)


LAYOUTS = {
    "gpt2": Layout("gpt2", gpt2_config, gpt2_params, ("transformer.", ""), (".attn.bias", ".attn.masked_bias"),
                   GPT2_READ, GPT2_INERT),
    "llama": Layout("llama", llama_config, llama_params, ("model.", ""), (), LLAMA_READ, LLAMA_INERT),
    "bert": Layout("bert", bert_config, bert_params, ("bert.", ""), ("pooler.", "position_ids", "cls."),
                   BERT_READ, BERT_INERT),
}  # fmt: skip
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "bert": "bert"}
