"""Gemma 4 text (``Gemma4ForCausalLM``, ``model_type: gemma4_text``), dense, without per-layer input embeddings.

Gemma 4 is the real model family whose attention differs most from layer to layer, and all of it is qkvjax data:

* ``layer_types``: "sliding_attention" layers (a window of ``sliding_window`` keys, their own rotary base) and
  "full_attention" layers (``per_layer_config``'s own head width and KV heads, "proportional" rotary: only the
  first ``partial_rotary_factor`` H / 2 pairs turn) -> one pattern entry per layer (``sliding_window``,
  ``head_dim``, ``kv``, ``rope_base``, ``rope_pairs``).
* ``attention_k_eq_v``: the full layers have no ``v_proj``; values are the raw keys, normalised without a scale,
  keys are normalised with ``k_norm`` and rotated -> the ``shared_kv`` scheme with ``qk_norm`` and ``v_norm``.
* Every layer normalises q and k per head (``q_norm``, ``k_norm``, learned scales) and v (no scale), with
  ``rms_norm_eps``; scores are not scaled (``scaling = 1``): qkvjax divides by sqrt(H), so the query norm's
  scale is stored times sqrt(H) (``q_norm_scale = sqrt(H) q_norm.weight``), the same function.
* ``num_kv_shared_layers``: the last layers project no K/V and read those of the last earlier layer of their
  type -> ``kv_from``. A reader of a K = V layer finishes the raw keys it reads with its donor's ``k_norm``
  scale, handed on with them (``KV.key_norm``: one parameter, so training moves both uses together).
* The block: four norms (``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``: ``norm_position="sandwich"``), a GeGLU MLP (tanh GELU), ``layer_scalar``
  multiplying the stream after the block (``layer_scale``); embeddings times sqrt(D) (``embed_scale``); logits
  soft-capped (``final_logit_softcapping`` -> ``logit_softcap``).

Refused in one line: mixture-of-experts blocks, per-layer input embeddings (``hidden_size_per_layer_input``),
bidirectional attention, double-wide MLPs in the K/V-sharing layers, attention biases, rotary scaling.
"""

from __future__ import annotations

import numpy as np

from qkvjax.attention import AttentionConfig
from qkvjax.hf.folder import Tensors
from qkvjax.hf.layouts.base import COMMON_READ, Layout, heads, linear, refuse, unembed
from qkvjax.hf.layouts.llama import mlp_params, mlp_tensors
from qkvjax.models.family import Family
from qkvjax.models.lm import ModelConfig

TYPES = ("sliding_attention", "full_attention")


def _rope(hf: dict, kind: str, head_dim: int) -> tuple[float, int | None]:
    """(base, rotated pairs or None for all) of one layer type."""
    rope = (hf.get("rope_parameters") or {}).get(kind) or {}
    name = rope.get("rope_type", "default")
    if name not in ("default", "proportional") or rope.get("factor", 1.0) != 1.0:
        raise ValueError(
            f"config.json rope_parameters[{kind!r}] rope_type={name!r}, factor={rope.get('factor', 1.0)}: "
            "rotary scaling is not modelled; allowed: 'default' or 'proportional' with factor 1"
        )
    base = float(rope.get("rope_theta", 10000.0))
    if name == "default":
        return base, None
    pairs = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
    return base, None if pairs == head_dim // 2 else pairs


def _layer_shapes(hf: dict) -> list[tuple[str, int, int]]:
    """(type, head width, KV heads) of every layer: the top-level values, overridden by ``per_layer_config``."""
    kinds, n = hf["layer_types"], hf["num_hidden_layers"]
    if len(kinds) != n or set(kinds) - set(TYPES):
        raise ValueError(f"config.json layer_types={kinds}: allowed: {n} of {list(TYPES)}")
    per = {int(k): v for k, v in (hf.get("per_layer_config") or {}).items()}
    unknown = sorted({key for v in per.values() for key in v} - {"head_dim", "num_key_value_heads"})
    if unknown:
        raise ValueError(f"config.json per_layer_config sets {unknown}; allowed: head_dim, num_key_value_heads")
    k = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    return [
        (kinds[i], per.get(i, {}).get("head_dim", hf["head_dim"]), per.get(i, {}).get("num_key_value_heads", k))
        for i in range(n)
    ]


def _donors(hf: dict) -> list[int | None]:
    """The producing layer each of the last ``num_kv_shared_layers`` layers reads (None: its own K/V)."""
    n, shared = hf["num_hidden_layers"], hf.get("num_kv_shared_layers", 0)
    first, kinds = n - shared, hf["layer_types"]
    donors: list[int | None] = [None] * n
    for i in range(first, n):
        earlier = [j for j in range(first) if kinds[j] == kinds[i]]
        if not earlier:
            raise ValueError(
                f"config.json num_kv_shared_layers={shared}: layer {i} ({kinds[i]}) has no earlier "
                "layer of its type to read; allowed: fewer shared layers"
            )
        donors[i] = earlier[-1]
    return donors


def config(hf: dict, max_len: int | None = None) -> ModelConfig:
    refuse(hf, "enable_moe_block", (False,), "mixture-of-experts blocks are not modelled")
    refuse(hf, "hidden_size_per_layer_input", (0, None), "per-layer input embeddings are not modelled")
    refuse(hf, "use_bidirectional_attention", (None, "vision"), "text attends causally here")
    refuse(hf, "attention_bias", (False,), "Gemma 4 has no attention biases; a folder with them is not modelled")
    refuse(hf, "hidden_activation", ("gelu_pytorch_tanh",), "the Gemma 4 layout's MLP is GeGLU with tanh GELU")
    if hf.get("use_double_wide_mlp") and hf.get("num_kv_shared_layers", 0):
        raise ValueError(
            "config.json use_double_wide_mlp=True: the K/V-sharing layers' MLPs are twice as wide, "
            "which one mlp_dim cannot say; allowed: false"
        )
    n, eps, window = hf["num_attention_heads"], hf.get("rms_norm_eps", 1e-6), hf.get("sliding_window")
    entries = []
    for (kind, h, k), donor in zip(_layer_shapes(hf), _donors(hf), strict=True):
        base, pairs = _rope(hf, kind, h)
        k_eq_v = hf.get("attention_k_eq_v", False) and kind == "full_attention"
        options = [f"head_dim={h}", f"kv={k}", f"rope_base={base!r}", f"rope_pairs={pairs}"]
        options += [f"sliding_window={window}"] if kind == "sliding_attention" else []
        options += [] if donor is None else [f"kv_from={donor}"]
        entries.append(("shared_kv" if k_eq_v else "separate") + "[" + ",".join(options) + "]")
    k = hf.get("num_key_value_heads") or n  # the base's; each layer's own is in its pattern entry
    attention = AttentionConfig(num_heads=n, head_dim=hf["head_dim"], num_kv_heads=None if k == n else k, rope=True,
                                qk_norm=True, v_norm=True, norm_eps=eps)  # fmt: skip
    return ModelConfig(
        attention=attention,
        layers=", ".join(entries),
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        mlp_dim=hf["intermediate_size"],
        max_len=max_len or hf["max_position_embeddings"],
        learned_positions=False,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        family=Family(
            norm="rmsnorm",
            norm_eps=eps,
            norm_position="sandwich",
            mlp="geglu",
            embed_scale=True,
            layer_scale=True,
            logit_softcap=hf.get("final_logit_softcapping"),
        ),
    )


def params(t: Tensors, cfg: ModelConfig) -> dict:
    out = {"embed": t.take("embed_tokens.weight"), "ln_final": {"scale": t.take("norm.weight")}}
    layers = cfg.layer_attention
    for i, layer in enumerate(layers):
        att, p = layer.config, f"layers.{i}."
        n, k, h = att.num_heads, att.kv_heads, att.head_dim
        a = {"w_q": heads(linear(t, p + "self_attn.q_proj"), n)}
        a["q_norm_scale"] = t.take(p + "self_attn.q_norm.weight") * np.float32(np.sqrt(h))  # scores unscaled
        a["w_o"] = linear(t, p + "self_attn.o_proj").reshape(n, h, cfg.d_model)
        if layer.produces_kv:
            a["k_norm_scale"] = t.take(p + "self_attn.k_norm.weight")
            if att.tying.group_of("k") == att.tying.group_of("v"):  # attention_k_eq_v: one projection
                a["w_kv"] = heads(linear(t, p + "self_attn.k_proj"), k)
            else:
                a["w_k"], a["w_v"] = (
                    heads(linear(t, p + "self_attn.k_proj"), k),
                    heads(linear(t, p + "self_attn.v_proj"), k),
                )
        out[f"block_{i}"] = {
            "attention": a,
            "ln_attention": {"scale": t.take(p + "input_layernorm.weight")},
            "ln_attention_out": {"scale": t.take(p + "post_attention_layernorm.weight")},
            "ln_mlp": {"scale": t.take(p + "pre_feedforward_layernorm.weight")},
            "ln_mlp_out": {"scale": t.take(p + "post_feedforward_layernorm.weight")},
            "layer_scale": t.take(p + "layer_scalar"),
            "mlp": mlp_params(t, p, False),
        }
    return out | unembed(t, cfg, "embed_tokens.weight")


READ = COMMON_READ | {
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_activation",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    "hidden_size_per_layer_input",
    "attention_k_eq_v",
    "num_kv_shared_layers",
    "enable_moe_block",
    "use_double_wide_mlp",
    "per_layer_config",
    "vocab_size",
}
INERT = frozenset({
    "attention_dropout",
    "vocab_size_per_layer_input",  # the per-layer input embeddings' table, refused when present
    "num_experts", "top_k_experts", "moe_intermediate_size",  # the MoE blocks' settings, refused when enabled
})  # fmt: skip


def _kind(layer) -> str:
    return "sliding_attention" if layer.config.sliding_window else "full_attention"


def _shape(att) -> tuple:
    """What one layer type shares in Gemma 4's config: head width, KV heads, rotary base and pairs, window."""
    return att.head_dim, att.kv_heads, att.rope_base, att.rope_pairs, att.sliding_window


def _k_eq_v(att) -> bool:
    return att.tying.group_of("k") == att.tying.group_of("v")


def check(cfg: ModelConfig, require) -> None:
    fam, layers = cfg.family, cfg.layer_attention
    require(
        fam.norm == "rmsnorm" and fam.norm_position == "sandwich",
        f"norm={fam.norm!r}, norm_position="
        f"{fam.norm_position!r} (Gemma 4: RMSNorm before and after each sublayer, 'sandwich')",
    )
    require(fam.mlp == "geglu" and not fam.mlp_bias, f"mlp={fam.mlp!r}, mlp_bias={fam.mlp_bias} (Gemma 4: GeGLU)")
    require(fam.embed_scale and fam.layer_scale, "embed_scale or layer_scale off (Gemma 4 has both)")
    require(not fam.embed_norm and not cfg.learned_positions, "an embedding norm or learned positions")
    kinds = [_kind(layer) for layer in layers]
    require(kinds[-1] == "full_attention", "the last layer has a sliding window (Gemma 4's last layer is full)")
    first_reader = next((i for i, layer in enumerate(layers) if not layer.produces_kv), len(layers))
    shapes: dict[str, tuple] = {}
    for i, layer in enumerate(layers):
        att, scheme, at = layer.config, layer.config.tying, f"layer {i}:"
        require(att.rope and att.rope_layout == "half", f"{at} rope={att.rope}, rope_layout={att.rope_layout!r}")
        require(
            att.qk_norm and att.v_norm,
            f"{at} qk_norm={att.qk_norm}, v_norm={att.v_norm} (Gemma 4 normalises q, k and v in every layer)",
        )
        require(att.norm_eps == fam.norm_eps, f"{at} norm_eps={att.norm_eps} differs from the model's {fam.norm_eps}")
        require(att.num_heads == cfg.attention.num_heads, f"{at} num_heads={att.num_heads} varies")
        require(
            not (att.use_bias or att.has_output_bias or att.relative_bias or att.learned_temperature),
            f"{at} biases, a relative bias or a learned temperature",
        )
        plain = not (scheme.bilinear or scheme.latent or scheme.normalize_keys or scheme.mask_self)
        require(plain and scheme.group_of("q") == "q", f"{at} scheme {att.scheme!r} (Gemma 4 has separate queries)")
        require(att.value_dim == att.head_dim, f"{at} v_head_dim={att.v_head_dim}")
        require(
            not _k_eq_v(att) or kinds[i] == "full_attention",
            f"{at} K = V on a sliding layer (Gemma 4 ties keys and values on its full-attention layers only)",
        )
        same = shapes.setdefault(kinds[i], _shape(att) + (_k_eq_v(att),))
        require(
            _shape(att) + (_k_eq_v(att),) == same,
            f"{at} its head width, KV heads, rotary, window or K = V "
            f"differ from the other {kinds[i]} layers' (Gemma 4 sets them per layer type)",
        )
        if i >= first_reader:
            producers = [j for j in range(first_reader) if kinds[j] == kinds[i]]
            require(
                not layer.produces_kv and layer.kv_from == (producers or [None])[-1],
                f"{at} reads {layer.kv_from} (Gemma 4's last layers each read the last earlier layer of their type)",
            )


def write(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of a ``Gemma4ForCausalLM`` (text only: no per-layer inputs, no MoE)."""
    layers, d = cfg.layer_attention, cfg.d_model
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["ln_final"]["scale"]}
    for i, layer in enumerate(layers):
        att, block, p = layer.config, params[f"block_{i}"], f"model.layers.{i}."
        a = block["attention"]
        tensors[p + "self_attn.q_proj.weight"] = a["w_q"].reshape(d, -1).T
        tensors[p + "self_attn.q_norm.weight"] = a["q_norm_scale"] / np.float32(np.sqrt(att.head_dim))
        tensors[p + "self_attn.o_proj.weight"] = a["w_o"].reshape(-1, d).T
        if layer.produces_kv:
            tensors[p + "self_attn.k_norm.weight"] = a["k_norm_scale"]
            for role in "k" if _k_eq_v(att) else "kv":  # K = V: k_proj only
                tensors[f"{p}self_attn.{role}_proj.weight"] = a["w_" + att.tying.group_of(role)].reshape(d, -1).T
        for theirs, ours in (
            ("input_layernorm", "ln_attention"),
            ("post_attention_layernorm", "ln_attention_out"),
            ("pre_feedforward_layernorm", "ln_mlp"),
            ("post_feedforward_layernorm", "ln_mlp_out"),
        ):
            tensors[f"{p}{theirs}.weight"] = block[ours]["scale"]
        tensors[p + "layer_scalar"] = block["layer_scale"]
        tensors |= mlp_tensors(block["mlp"], p, False)
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = params["w_unembed"].T
    return _config(cfg), tensors


def _config(cfg: ModelConfig) -> dict:
    layers = cfg.layer_attention
    kinds = [_kind(layer) for layer in layers]
    by_kind = {kind: layers[kinds.index(kind)].config for kind in TYPES if kind in kinds}
    top = by_kind.get("sliding_attention", by_kind["full_attention"])
    rope = {}
    for kind in TYPES:
        att = by_kind.get(kind, top)
        pairs = att.rope_pairs
        rope[kind] = (
            {"rope_type": "default", "rope_theta": att.rope_base}
            if pairs is None
            else {
                "rope_type": "proportional",
                "rope_theta": att.rope_base,
                "partial_rotary_factor": 2 * pairs / att.head_dim,
            }
        )
    per_layer = {str(i): {"head_dim": layer.config.head_dim, "num_key_value_heads": layer.config.kv_heads}
                 for i, layer in enumerate(layers) if kinds[i] == "full_attention"}  # fmt: skip
    full = by_kind["full_attention"]
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": top.num_heads,
        "num_key_value_heads": top.kv_heads,
        "head_dim": top.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.family.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope,
        "attention_bias": False,
        "sliding_window": top.sliding_window or cfg.max_len,
        "layer_types": kinds,
        "final_logit_softcapping": cfg.family.logit_softcap,
        "use_bidirectional_attention": None,
        "hidden_size_per_layer_input": 0,
        "attention_k_eq_v": _k_eq_v(full),
        "num_kv_shared_layers": sum(not layer.produces_kv for layer in layers),
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "per_layer_config": per_layer,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


LAYOUT = Layout("gemma4", ("gemma4_text",), False, config, params, check, write, prefixes=("model.", ""),
                read=READ, inert=INERT)  # fmt: skip
