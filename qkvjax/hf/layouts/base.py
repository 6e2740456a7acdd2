"""What a Hugging Face layout is (:class:`Layout`, one entry of ``qkvjax.hf.layouts.LAYOUTS``) and the pieces the
layouts share: reading a config field or refusing it, splitting heads, the ``nn.Linear`` convention, the audit of
``config.json`` fields, and the checks an export runs on every attention layer.

PyTorch's ``nn.Linear`` stores ``W: [out, in]`` (``y = x W^T + b``); GPT-2's ``Conv1D`` stores ``[in, out]``
(``y = x W + b``); qkvjax's kernels are ``w_q: (D, N, H)``, ``w_o: (N, H, D)``, ``w_in: (D, F)``, ``embed: (V, D)``.
Heads split the output features head-major (feature ``n H + h`` is head n's h-th) in every layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np

from qkvjax import checks
from qkvjax.hf.folder import Tensors

# ------------------------------------------------------------------------------------------------- the entry


@dataclasses.dataclass(frozen=True)
class Projections:
    """Where ``qkvjax analyze --safetensors FILE --format NAME`` finds each layer's q/k/v projections: a regular
    expression over tensor names whose groups are (layer, role name), the role each name plays (``"qkv"``: the
    three fused along the output features in that order, stored ``[in, out]`` as GPT-2's Conv1D), an example
    name for the error, and the config.json keys giving N and K (K's key None: K = N)."""

    pattern: str
    roles: Mapping[str, str]
    example: str
    heads_key: str
    kv_heads_key: str | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """One Hugging Face layout, everything qkvjax knows about it in one place.

    * ``name`` is the ``--format`` value; ``model_types`` the config.json ``model_type`` values it imports;
      ``encoder`` whether its qkvjax model is an ``EncoderConfig`` (else a decoder ``ModelConfig``).
    * Import: ``config(hf, max_len)`` translates config.json (after :meth:`audit`: every field is in ``read``, in
      ``inert`` or in the shared :data:`INERT`); ``params(tensors, cfg)`` renames and reshapes the tensors, found
      under the first of ``prefixes`` the checkpoint uses; tensors containing one of ``ignore`` may stay unread.
    * Export: ``check(cfg, require)`` calls ``require(ok, what)`` for each part of a qkvjax model the layout must
      express (the first failure is the one-line refusal); ``write(cfg, params)`` gives ``(config.json, tensors)``.
    * ``projections``: where ``qkvjax analyze`` finds q/k/v in a bare safetensors file (None: analyze the
      imported workdir instead).

    Adding a layout (the checklist):

    1. A module beside this one with ``config``, ``params``, ``check`` and ``write`` and its ``read``/``inert``
       field sets; activations as one :class:`Names` table, read both ways.
    2. Its ``Layout`` in ``LAYOUTS`` (``qkvjax/hf/layouts/__init__.py``), placed where ``infer_format`` should
       prefer it (the first layout that can express a model is its default export format).
    3. A tiny random model of the family in ``tests/test_hf.py``'s ``_models`` (import, cached decoding, export
       back) and its config class in ``CONFIG_CLASSES`` (the field audit); a refusal test for each ``require``.
    4. The README's Hugging Face section names it. The CLI's ``--format`` choices and ``import``'s help come from
       this registry.
    """

    name: str
    model_types: tuple[str, ...]
    encoder: bool
    translate: Callable
    params: Callable
    check: Callable
    write: Callable
    prefixes: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    read: frozenset = frozenset()
    inert: frozenset = frozenset()
    projections: Projections | None = None

    def audit(self, hf: dict) -> None:
        """Refuses, in one line, config.json fields this layout neither reads nor knows to be inert."""
        unknown = sorted(k for k in hf if k not in self.read and k not in self.inert and k not in INERT)
        if unknown:
            shown = ", ".join(f"{k}={hf[k]!r}" for k in unknown[:4]) + (" ..." if len(unknown) > 4 else "")
            raise ValueError(
                f"config.json has {len(unknown)} field(s) the {self.name} layout does not know ({shown}): each might "
                f"change what the model computes, so nothing was imported; allowed: the fields listed in "
                f"qkvjax/hf/layouts/"
            )

    def config(self, hf: dict, max_len: int | None = None):
        """The qkvjax config of ``hf`` after the audit: every field honoured, or the import refused."""
        self.audit(hf)
        check_kinds(hf)
        refuse(hf, "is_encoder_decoder", (False,), "encoder-decoder models are not modelled")
        refuse(hf, "add_cross_attention", (False,), "cross-attention to an encoder is not modelled")
        return self.translate(hf, max_len)

    def exportable(self, cfg) -> None:
        """Raises one line naming the first part of ``cfg`` that this layout cannot express."""

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"{what}: the Hugging Face {self.name} layout cannot express it; nothing was exported")

        self.check(cfg, require)


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
COMMON_READ = frozenset({"is_encoder_decoder", "add_cross_attention"})

# The kind of each number and switch the layouts read, checked before any arithmetic: an untrusted config.json's
# "12" for a width, 0 heads or "false" for a switch (a string is true in Python) would otherwise be a TypeError, a
# ZeroDivisionError or a silent misreading. Each entry: (allowed, test); None passes wherever the key is listed
# in NULLABLE (transformers writes null for "the default" there).
SIZES = frozenset({
    "n_embd", "n_head", "n_layer", "n_positions", "n_inner", "hidden_size", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim",
    "vocab_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "type_vocab_size",
})  # fmt: skip
COUNTS = frozenset({
    "sliding_window", "n_routed_experts", "first_k_dense_replace", "max_window_layers", "num_kv_shared_layers",
    "hidden_size_per_layer_input",
})  # fmt: skip
EPSILONS = frozenset({"layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps", "rope_theta", "final_logit_softcapping"})
SWITCHES = frozenset({
    "attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window", "attention_k_eq_v", "enable_moe_block",
    "is_decoder", "rope_interleave", "use_bidirectional_attention", "use_double_wide_mlp", "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx", "is_encoder_decoder", "add_cross_attention",
})  # fmt: skip
OBJECTS = frozenset({"rope_parameters", "rope_scaling", "per_layer_config"})  # their entries: the layouts check
NULLABLE = frozenset({
    "n_inner", "num_key_value_heads", "head_dim", "q_lora_rank", "sliding_window", "n_routed_experts",
    "final_logit_softcapping", "max_window_layers", "num_kv_shared_layers", "hidden_size_per_layer_input",
    "rope_parameters", "rope_scaling", "per_layer_config", "layer_types",
}) | SWITCHES  # fmt: skip


INT32_MAX = 2**31 - 1


def _kind(key: str) -> tuple[str, Callable] | None:
    """(what is allowed, its test) for a config.json field, or None where a layout checks it itself."""
    if key in SIZES:  # bounded: a size or window past int32 overflows the first jitted computation that reads it
        return f"an integer in [1, {INT32_MAX}]", lambda v: checks.is_integer(v) and 1 <= v <= INT32_MAX
    if key in COUNTS:
        return f"an integer in [0, {INT32_MAX}]", lambda v: checks.is_integer(v) and 0 <= v <= INT32_MAX
    if key in EPSILONS:
        return (
            "a finite number > 0",
            lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf,
        )
    if key in SWITCHES:
        return "true or false", lambda v: isinstance(v, bool)
    if key in OBJECTS:
        return "an object", lambda v: isinstance(v, dict)
    if key == "layer_types":
        return "a list of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)
    return None


def check_kinds(hf: dict) -> None:
    """Refuses, in one line, the first field of ``hf`` whose value is not of its kind (see :data:`SIZES`)."""
    for key, value in hf.items():
        kind = _kind(key)
        if kind is None or (value is None and key in NULLABLE):
            continue
        allowed, test = kind
        if not test(value):
            allowed = f"null or {allowed}" if key in NULLABLE else allowed
            raise ValueError(f"config.json {key}={value!r}; allowed: {allowed}")


# ------------------------------------------------------------------------------------------- import pieces


@dataclasses.dataclass(frozen=True)
class Names:
    """A name table read both ways: Hugging Face's names -> qkvjax's (several may map to one), and back (the
    first Hugging Face name listed for each qkvjax name is the one written)."""

    table: Mapping[str, str]

    def __contains__(self, theirs: str) -> bool:
        return theirs in self.table

    def ours(self, theirs: str) -> str:
        return self.table[theirs]

    def theirs(self, ours: str) -> str:
        return next(k for k, v in self.table.items() if v == ours)

    @property
    def written(self) -> frozenset[str]:
        """The qkvjax names an export can write."""
        return frozenset(self.table.values())


def refuse(hf: dict, field: str, allowed, why: str) -> None:
    value = hf.get(field, allowed[0])
    if value not in allowed:
        raise ValueError(f"config.json {field}={value!r}: {why}; allowed: {list(allowed)}")


def fixed_table(max_len: int | None, rows: int, model: str) -> None:
    """A learned position table fixes the context: ``--max-len`` may only repeat it."""
    if max_len not in (None, rows):
        raise ValueError(f"--max-len {max_len}: {model}'s position table has {rows} rows; allowed: {rows}")


def heads(w: np.ndarray, count: int) -> np.ndarray:
    """(D, count * H) -> (D, count, H)."""
    return w.reshape(w.shape[0], count, -1)


def linear(t: Tensors, name: str) -> np.ndarray:
    """An ``nn.Linear`` weight as qkvjax's (in, out) kernel."""
    return t.take(name + ".weight").T


def layer_norm(t: Tensors, name: str) -> dict:
    return {"scale": t.take(name + ".weight"), "bias": t.take(name + ".bias")}


def unembed(t: Tensors, cfg, table: str) -> dict:
    """``w_unembed`` (D, V) from ``lm_head.weight`` (V, D), or nothing when tied (a saved copy must equal the
    embedding ``table``)."""
    if not cfg.tie_embeddings:
        return {"w_unembed": t.take("lm_head.weight", (cfg.vocab_size, cfg.d_model), prefixed=False).T}
    if t.has("lm_head.weight", prefixed=False):
        if not np.array_equal(t.take("lm_head.weight", prefixed=False), t.take(table)):
            raise ValueError("config.json tie_word_embeddings=true, but lm_head.weight differs from the embeddings")
    return {}


# ------------------------------------------------------------------------------------------- export pieces


def check_layers(
    cfg, require, name: str, *, learned_positions: bool, qk_norm: bool = False, windows: bool = False
) -> None:
    """What these layouts need of each attention layer: a plain partition scheme (each role ``x W``), no layer
    reading another's K/V, no V-norm or relative bias, QK-norm on every layer (with the model's norm epsilon) or
    on none as ``qk_norm`` says, values as wide as keys, no window (unless ``windows``: then one width, on the
    layers that have one), one K for all layers; learned positions (no rotary, K = N, N H = D) or rotary ones
    (half-split, one base)."""
    widths = {layer.config.sliding_window for layer in cfg.layer_attention} - {None}
    require(len(widths) <= 1, f"sliding windows of {len(widths)} widths {sorted(widths)} (one per model)")
    for i, layer in enumerate(cfg.layer_attention):
        att, scheme = layer.config, layer.config.tying
        if learned_positions:  # positions first: infer_format tells a position mismatch by its "rope=" refusal
            require(not att.rope, f"layer {i}: rope=True ({name} has learned positions)")
            require(att.kv_heads == att.num_heads, f"layer {i}: num_kv_heads={att.num_kv_heads} (GQA)")
            require(att.num_heads * att.head_dim == cfg.d_model, f"layer {i}: N H != D")
        else:
            require(att.rope, f"layer {i}: rope=False (the {name} layout has rotary positions only)")
            require(att.rope_layout == "half", f"layer {i}: rope_layout={att.rope_layout!r}")
            require(att.rope_base == cfg.attention.rope_base, f"layer {i}: rope_base varies")
        require(layer.produces_kv, f"layer {i} reads layer {layer.kv_from}'s keys and values (CLA)")
        plain = not (scheme.bilinear or scheme.latent or scheme.normalize_keys or scheme.mask_self)
        require(plain, f"layer {i}: scheme {att.scheme!r}")
        for field in ("v_norm", "relative_bias"):
            require(not getattr(att, field), f"layer {i}: {field}={getattr(att, field)!r}")
        require(att.qk_norm == qk_norm, f"layer {i}: qk_norm={att.qk_norm!r}")
        if qk_norm:
            eps = cfg.family.norm_eps
            require(att.norm_eps == eps, f"layer {i}: norm_eps={att.norm_eps} differs from the model's {eps}")
        require(att.value_dim == att.head_dim, f"layer {i}: v_head_dim={att.v_head_dim}")
        require(windows or att.sliding_window is None, f"layer {i}: sliding_window={att.sliding_window} (this "
                "layout has no window; mistral, qwen2, qwen3 and gemma4 have)")  # fmt: skip
        require(att.kv_heads == cfg.attention.kv_heads, f"layer {i}: num_kv_heads={att.num_kv_heads} varies")


def plain_family(fam, require, norm_position: str = "pre") -> None:
    """No part of Gemma's block in a layout that has none: ``norm_position`` as given, no embedding norm (unless
    post-norm BERT's), no embedding scale, layer scale or logit soft-cap."""
    require(fam.norm_position == norm_position, f"norm_position={fam.norm_position!r}")
    require(fam.embed_norm == (norm_position == "post"), f"embed_norm={fam.embed_norm!r}")
    for field in ("embed_scale", "layer_scale", "logit_softcap"):
        require(not getattr(fam, field), f"{field}={getattr(fam, field)!r}")


def roles(att_params: dict, att) -> dict[str, np.ndarray]:
    """Each role's (D, heads, H) kernel and (heads, H) bias (zeros where there is none), from the scheme's
    groups: a tie is written out, the shared kernel copied into every role it plays."""
    out = {}
    for role in "qkv":
        group = att.tying.group_of(role)
        w = np.asarray(att_params["w_" + group])
        out["w_" + role] = w
        out["b_" + role] = np.asarray(att_params["b_" + group]) if "b_" + group in att_params else np.zeros(w.shape[1:])
    d = att_params["w_o"].shape[-1]
    out["b_o"] = np.asarray(att_params["b_o"]) if "b_o" in att_params else np.zeros(d)
    return out


def norm(p: dict, d: int) -> tuple[np.ndarray, np.ndarray]:
    """A norm's (scale, bias), zeros for a missing bias."""
    return np.asarray(p["scale"]), np.asarray(p["bias"]) if "bias" in p else np.zeros(d)
