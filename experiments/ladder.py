"""The scaling study's ladder of models: the sizes, the attention variants and the one function that turns a size,
a variant and a budget into a run's config. ``experiments/scaling.py`` sweeps it; the benchmarks time the same
models (``benchmarks/scaling_speed.py``, ``vs_torch.py``, the lever studies), so it lives apart from the sweep and
imports only qkvjax."""

from __future__ import annotations

import dataclasses
import math

from qkvjax.attention import attention_cost
from qkvjax.config import AttentionConfig, Config, DataConfig, ModelConfig, TrainConfig

NUM_HEADS, NUM_LAYERS, CONTEXT, BATCH = 4, 4, 128, 16
POSITIONS = ("learned", "rope")  # a learned absolute table, or rotary positions in every score (no table)
DEFAULT_SIZES = (48, 96, 160)
SHARED_LR = 2e-3  # the one rate the 0.8-epoch comparison used for every scheme: the ranking is also read at it
# Each variant: the attention config's fields (num_kv_heads as a fraction of N; ``kv_rank_fraction``: a latent's cache
# per token and layer, R + H_r, as a fraction of D, so a rotary part H_r comes out of the rank and the cache stays
# the same under either positions; ``params_of``: the MLP narrowed or widened to that variant's parameter count, as
# compare_schemes.py's ``params`` matching does).
# A name is a label, never a branch.
VARIANTS = {
    "separate": {"scheme": "separate"},
    "shared_kv": {"scheme": "shared_kv"},
    "gqa": {"scheme": "separate", "kv_heads_fraction": 0.5},
    "shared_qk": {"scheme": "shared_qk"},
    "shared_qkv": {"scheme": "shared_qkv"},
    "reformer_qk": {"scheme": "reformer_qk"},
    "bilinear": {"scheme": "bilinear"},
    # W_QK's extra (N - 2) D^2 per layer (N = 4 heads) taken from the MLP: F = 3 D instead of 4 D, so the merged form
    # is compared with the factored pair per parameter, not only at equal width
    "bilinear_params": {"scheme": "bilinear", "params_of": "separate"},
    # DeepSeek-V2's latent K/V at its default rank R = 4 H = D: gqa's cache bytes (D per token and layer), with
    # 5 D^2 attention weights per layer against separate's 4 D^2 and gqa's 3 D^2; latent norm on, no rotary part
    # (with learned positions; under rotary ones R = D - H / 2 beside DeepSeek-V2's decoupled rotary key of H / 2)
    "mla": {"scheme": "mla", "kv_rank_fraction": 1.0},
    # W^Q = W^V: shared_qk's parameters (3 D^2 attention weights per layer) at separate's cache (K and V distinct)
    "shared_qv": {"scheme": "shared_qv"},
    # Below GQA's cache, where DeepSeek-V2 put the latent: MQA (one K/V head, 2 H = D / 2 per token and layer) and a
    # rank R = D / 2 latent at the same cache, 2.5 D^2 and 3.5 D^2 attention weights per layer (no rotary part with
    # learned positions; under rotary ones R = 3 D / 8 beside a rotary key of H / 2 = D / 8)
    "mqa": {"scheme": "separate", "kv_heads_fraction": 0.25},
    "mla_half": {"scheme": "mla", "kv_rank_fraction": 0.5},
}


def params_matched_mlp_dim(model: ModelConfig, reference: AttentionConfig) -> int:
    """The MLP width F at which ``model`` has the parameters it would have with ``reference``'s attention: the
    attention parameters ``model.attention`` saves (or adds) per layer go to (or come from) the MLP's 2 D F weights.
    Exact up to F's bias and the rounding of F (under 0.1% at the ladder's sizes)."""
    d, t = model.d_model, model.max_len
    saved = attention_cost(reference, d, t).params - attention_cost(model.attention, d, t).params
    return model.mlp_width + round(saved / (2 * d))


def size_config(d_model: int, variant: str, learning_rate: float, seed: int, tokens: int, data: DataConfig,
                layers: int = NUM_LAYERS, context: int = CONTEXT, positions: str = "learned",
                heads: int = NUM_HEADS) -> Config:  # fmt: skip
    """The model and training of one run: width ``d_model``, ``tokens`` training tokens, ``positions`` one of
    POSITIONS (rotary: ``attention.rope`` on every layer and no position table), ``heads`` query heads N of width
    H = D / N (a variant's K/V heads are its fraction of N: ``mqa``'s quarter is one of 4 heads, two of 8)."""
    if positions not in POSITIONS:
        raise ValueError(f"positions={positions!r}; allowed: {', '.join(POSITIONS)}")
    spec = dict(VARIANTS[variant])
    fraction, params_of = spec.pop("kv_heads_fraction", None), spec.pop("params_of", None)
    cache_fraction = spec.pop("kv_rank_fraction", None)
    kv_heads = None if fraction is None else max(1, round(heads * fraction))
    attention = AttentionConfig(num_heads=heads, head_dim=d_model // heads, num_kv_heads=kv_heads,
                                rope=positions == "rope", **spec)  # fmt: skip
    if cache_fraction is not None:  # the latent's cached width R + H_r is the fraction of D
        kv_rank = max(1, round(d_model * cache_fraction) - attention.rope_dim)
        attention = dataclasses.replace(attention, kv_rank=kv_rank)
    model = ModelConfig(attention=attention, d_model=d_model, num_layers=layers, max_len=context,
                        learned_positions=positions == "learned")  # fmt: skip
    if params_of is not None:
        reference = size_config(d_model, params_of, learning_rate, seed, tokens, data, layers, context, positions,
                                heads).model  # fmt: skip
        model = dataclasses.replace(model, mlp_dim=params_matched_mlp_dim(model, reference.attention))
    steps = max(1, math.ceil(tokens / (BATCH * context)))
    every = max(1, steps // 10)
    return Config(
        model=model,
        data=data,
        train=TrainConfig(
            batch_size=BATCH,
            num_steps=steps,
            learning_rate=learning_rate,
            min_lr_ratio=0.1,
            warmup_steps=max(1, steps // 20),
            weight_decay=0.1,
            b2=0.99,
            log_every=max(1, steps // 50),
            eval_every=every,
            eval_batches=8,
            checkpoint_every=every,
            max_to_keep=1,
        ),  # fmt: skip
        seed=seed,
    )
