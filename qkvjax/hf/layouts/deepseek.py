"""DeepSeek-V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): Multi-head Latent Attention (qkvjax's
``mla`` scheme) with dense MLPs. V3's attention tensors are V2's; its ``rope_interleave`` says which rotary layout
the weights use (true: interleaved pairs, as V2; false: the half-split ``rotate_half`` one), and it writes no
``mlp_bias``. Its multi-token-prediction layers (``num_nextn_predict_layers``) are not part of the model
transformers runs and are not imported.

Per layer, in ``nn.Linear`` ``[out, in]`` weights (H = ``qk_nope_head_dim``, P = ``qk_rope_head_dim``,
U = ``v_head_dim``, R = ``kv_lora_rank``, Rq = ``q_lora_rank``)::

    q_proj (N (H + P), D)                   -> w_q (D, N, H), w_q_rope (D, N, P); each head's H then P features
    or q_a_proj (Rq, D), q_a_layernorm (Rq,), q_b_proj (N (H + P), Rq)
                                            -> w_q_down, q_norm_scale, w_q_up (Rq, N, H), w_q_rope_up (Rq, N, P)
    kv_a_proj_with_mqa (R + P, D)           -> w_kv_down (D, R) and the one rotary key w_k_rope (D, P)
    kv_a_layernorm (R,)                     -> kv_norm_scale
    kv_b_proj (N (H + U), R)                -> w_k_up (R, N, H), w_v_up (R, N, U); each head's H then U features
    o_proj (D, N U)                         -> w_o (N, U, D)

Rotary positions rotate feature pairs (2i, 2i + 1) of the P-wide parts (transformers' complex product):
``rope_layout="interleaved"``; a model with qkvjax's default ``"half"`` layout (pairs i, i + P/2, at the same
frequencies) is written with its rotary features reordered, the same function. Scores are scaled by
1 / sqrt(H + P), as qkvjax's latent attention scales them.
The two latent norms have epsilon 1e-6 whatever ``rms_norm_eps`` says (transformers builds them with the default);
the block norms use ``rms_norm_eps``. Layers from ``first_k_dense_replace`` on are mixture-of-experts layers: a
folder with any is refused in one line. Export writes a qkvjax ``mla`` model whose form this layout expresses; a
model with K < N key/value heads is written with each KV head's up-projections repeated for its query heads (the
same function); a rotary key per head (MHA2MLA's form) unless K = 1, biases or a latent without its norm are
refused.
"""

from __future__ import annotations

import numpy as np

from qkvjax.attention import AttentionConfig
from qkvjax.hf.folder import Tensors
from qkvjax.hf.layouts.base import COMMON_READ, Layout, linear, plain_family, refuse, unembed
from qkvjax.hf.layouts.llama import block_params, mlp_tensors, rope_base
from qkvjax.models.family import Family
from qkvjax.models.lm import ModelConfig

LATENT_EPS = 1e-6  # DeepseekV2RMSNorm's default, which kv_a_layernorm and q_a_layernorm are built with


def config(hf: dict, max_len: int | None = None) -> ModelConfig:
    n, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    dense = hf.get("first_k_dense_replace", 0)
    if dense < layers and (hf.get("n_routed_experts") or hf.get("model_type") == "deepseek_v3"):
        raise ValueError(
            f"config.json first_k_dense_replace={dense}: layers {dense}..{layers - 1} are mixture-of-experts layers, "
            f"which qkvjax does not model; allowed: first_k_dense_replace >= num_hidden_layers={layers} (dense MLPs)"
        )
    refuse(hf, "hidden_act", ("silu",), "the DeepSeek-V2 layout's MLP is SwiGLU")
    refuse(hf, "attention_bias", (False,), "biases on the latent down-projections are not modelled")
    interleaved = hf.get("rope_interleave", True)  # V2 has no such field: interleaved
    attention = AttentionConfig(
        num_heads=n,
        head_dim=hf["qk_nope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        scheme="mla",
        kv_rank=hf["kv_lora_rank"],
        q_rank=hf.get("q_lora_rank"),
        rope=True,
        rope_base=rope_base(hf),
        rope_layout="interleaved" if interleaved else "half",
        rope_head_dim=hf["qk_rope_head_dim"],
        norm_eps=LATENT_EPS,
    )
    return ModelConfig(
        attention=attention,
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=layers,
        mlp_dim=hf["intermediate_size"],
        max_len=max_len or hf["max_position_embeddings"],
        learned_positions=False,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        family=Family(
            norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", mlp_bias=hf.get("mlp_bias", False)
        ),
    )


def _split_heads(w: np.ndarray, n: int, widths: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(in, N (a + b)) -> (in, N, a), (in, N, b): each head's first a features, then its b."""
    per_head = w.reshape(w.shape[0], n, sum(widths))
    return per_head[..., : widths[0]], per_head[..., widths[0] :]


def params(t: Tensors, cfg: ModelConfig) -> dict:
    att = cfg.attention
    n, h, p, u, r = att.num_heads, att.head_dim, att.rope_dim, att.value_dim, att.latent_dim
    out = {"embed": t.take("embed_tokens.weight"), "ln_final": {"scale": t.take("norm.weight")}}
    for i in range(cfg.num_layers):
        pre = f"layers.{i}.self_attn."
        a = {}
        if att.q_rank is None:
            a["w_q"], a["w_q_rope"] = _split_heads(linear(t, pre + "q_proj"), n, (h, p))
        else:
            a["w_q_down"], a["q_norm_scale"] = linear(t, pre + "q_a_proj"), t.take(pre + "q_a_layernorm.weight")
            a["w_q_up"], a["w_q_rope_up"] = _split_heads(linear(t, pre + "q_b_proj"), n, (h, p))
        down = linear(t, pre + "kv_a_proj_with_mqa")  # (D, R + P): the latent, then the shared rotary key
        a["w_kv_down"], a["w_k_rope"] = down[:, :r], down[:, r:]
        a["kv_norm_scale"] = t.take(pre + "kv_a_layernorm.weight")
        a["w_k_up"], a["w_v_up"] = _split_heads(linear(t, pre + "kv_b_proj"), n, (h, u))
        a["w_o"] = linear(t, pre + "o_proj").reshape(n, u, cfg.d_model)
        out[f"block_{i}"] = block_params(t, f"layers.{i}.", a, cfg.family.mlp_bias)
    return out | unembed(t, cfg, "embed_tokens.weight")


def check(cfg: ModelConfig, require) -> None:
    first = cfg.layer_attention[0].config
    sizes = lambda a: (a.num_heads, a.head_dim, a.value_dim, a.latent_dim, a.q_rank, a.rope_dim, a.rope_base)  # noqa: E731
    for i, layer in enumerate(cfg.layer_attention):
        att, at = layer.config, f"layer {i}:"
        require(att.tying.latent, f"{at} scheme {att.scheme!r} (this layout's attention is mla)")
        require(layer.produces_kv, f"layer {i} reads layer {layer.kv_from}'s keys and values (CLA)")
        require(att.rope, f"{at} rope=False (DeepSeek-V2's keys always have a rotary part)")
        require(
            not att.rope_key_per_head or att.kv_heads == 1,  # fmt: skip
            f"{at} rope_key_per_head=True with {att.kv_heads} KV heads (a rotary key per head; DeepSeek-V2 "
            "shares one: convert to one KV head first, --num-kv-heads 1, whose one rotary key is shared)",
        )
        require(
            att.latent_norm,
            f"{at} latent_norm=False (DeepSeek-V2 normalises its latents: convert --to mla with --latent-norm, "
            "whose gains are the latent's expected RMS, then uptrain)",
        )
        require(att.norm_eps == LATENT_EPS, f"{at} norm_eps={att.norm_eps} (DeepSeek-V2's latent norms: 1e-6)")
        require(not att.use_bias and not att.has_output_bias, f"{at} use_bias=True")
        for field in ("relative_bias", "learned_temperature", "sliding_window"):
            require(not getattr(att, field), f"{at} {field}={getattr(att, field)!r}")
        require(sizes(att) == sizes(first), f"{at} its attention's sizes differ from layer 0's (one config for all)")
    fam = cfg.family
    require(fam.norm == "rmsnorm", f"norm={fam.norm!r}")
    require(fam.mlp == "swiglu", f"mlp={fam.mlp!r}")
    require(not cfg.learned_positions, "learned_positions=True")
    plain_family(fam, require)
    require(cfg.d_model % first.num_heads == 0, f"d_model={cfg.d_model} is not a multiple of num_heads="
            f"{first.num_heads} (transformers' DeepseekV2Config refuses it)")  # fmt: skip


def _per_query_head(w: np.ndarray, n: int) -> np.ndarray:
    """(R, K, X) -> (R, N, X): each KV head's up-projection repeated for the N / K query heads that read it."""
    return np.repeat(w, n // w.shape[1], axis=1)


def _interleaved(w: np.ndarray, layout: str) -> np.ndarray:
    """A rotary part's features (last axis) in the interleaved order: the half layout's pair (i, i + P/2) goes to
    (2i, 2i + 1), at the same frequency base^(-2i/P)."""
    p = w.shape[-1]
    return w if layout == "interleaved" else w[..., np.stack([np.arange(p // 2), np.arange(p // 2, p)], 1).reshape(-1)]


def _joined(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(in, N, a), (in, N, b) -> [N (a + b), in]: each head's a features, then its b (nn.Linear's layout)."""
    return np.concatenate([x, y], axis=-1).reshape(x.shape[0], -1).T


def write(cfg: ModelConfig, params: dict, v3: bool = False) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``DeepseekV2ForCausalLM`` with dense MLPs (``v3``: a ``DeepseekV3ForCausalLM``,
    whose ``rope_interleave`` takes the model's rotary layout as it is)."""
    att, d = cfg.attention, cfg.d_model
    n, rot = att.num_heads, (lambda w: w) if v3 else (lambda w: _interleaved(w, att.rope_layout))
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["ln_final"]["scale"]}
    for i in range(cfg.num_layers):
        block, pre = params[f"block_{i}"], f"model.layers.{i}."
        a, s = block["attention"], f"model.layers.{i}.self_attn."
        if att.q_rank is None:
            tensors[s + "q_proj.weight"] = _joined(a["w_q"], rot(a["w_q_rope"]))
        else:
            tensors[s + "q_a_proj.weight"], tensors[s + "q_a_layernorm.weight"] = a["w_q_down"].T, a["q_norm_scale"]
            tensors[s + "q_b_proj.weight"] = _joined(a["w_q_up"], rot(a["w_q_rope_up"]))
        k_rope = rot(a["w_k_rope"].reshape(d, -1))  # (D, P), or (D, 1, P): one KV head's rotary key
        tensors[s + "kv_a_proj_with_mqa.weight"] = np.concatenate([a["w_kv_down"], k_rope], axis=1).T
        tensors[s + "kv_a_layernorm.weight"] = a["kv_norm_scale"]
        tensors[s + "kv_b_proj.weight"] = _joined(_per_query_head(a["w_k_up"], n), _per_query_head(a["w_v_up"], n))
        tensors[s + "o_proj.weight"] = a["w_o"].reshape(-1, d).T
        tensors |= mlp_tensors(block["mlp"], pre, cfg.family.mlp_bias)
        tensors[pre + "input_layernorm.weight"] = block["ln_attention"]["scale"]
        tensors[pre + "post_attention_layernorm.weight"] = block["ln_mlp"]["scale"]
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = params["w_unembed"].T
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": d,
        "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.num_layers,
        "first_k_dense_replace": cfg.num_layers,  # every layer dense
        "num_attention_heads": n,
        "num_key_value_heads": n,
        "kv_lora_rank": att.latent_dim,
        "q_lora_rank": att.q_rank,
        "qk_nope_head_dim": att.head_dim,
        "qk_rope_head_dim": att.rope_dim,
        "v_head_dim": att.value_dim,
        "head_dim": att.rope_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.family.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": att.rope_base},
        "attention_bias": False,
        "mlp_bias": cfg.family.mlp_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if v3:
        config |= {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                   "rope_interleave": att.rope_layout == "interleaved"}  # fmt: skip
        del config["mlp_bias"]
    return config, tensors


def v3_check(cfg: ModelConfig, require) -> None:
    check(cfg, require)
    require(not cfg.family.mlp_bias, "mlp_bias=True (DeepSeek-V3's MLPs have no biases)")


def v3_write(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    return write(cfg, params, v3=True)


READ = COMMON_READ | {
    "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "n_routed_experts", "rope_interleave",
}  # fmt: skip
INERT = frozenset({
    "attention_dropout", "pretraining_tp",
    "head_dim", "qk_head_dim",  # qk_rope_head_dim and qk_nope + qk_rope, derived by the config class
    "num_key_value_heads",  # kv_b_proj makes keys and values for every query head whatever this says
    # the mixture-of-experts layers' settings: a folder with such layers is refused (first_k_dense_replace)
    "moe_intermediate_size", "n_group", "n_shared_experts", "norm_topk_prob", "num_experts_per_tok",
    "output_router_logits", "routed_scaling_factor", "topk_group", "topk_method",
    "num_nextn_predict_layers",  # V3's multi-token-prediction layers: not run by the model, not imported
})  # fmt: skip

LAYOUT = Layout("deepseek_v2", ("deepseek_v2",), False, config, params, check, write, prefixes=("model.", ""),
                read=READ, inert=INERT)  # fmt: skip
V3 = Layout("deepseek_v3", ("deepseek_v3",), False, config, params, v3_check, v3_write, prefixes=("model.", ""),
            read=READ, inert=INERT)  # fmt: skip
