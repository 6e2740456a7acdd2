"""Converting trained weights between schemes, where the maths allows it.

* ``to_bilinear`` (exact): ``W_QK[n] = W^Q_n (W^K_{kv(n)})^T``, so ``x_t^T W_QK[n] x_s = q_{t,n} . k_{s,kv(n)}``.
  Needs plain q.k logits: no rotary embedding, no key normalisation, no query/key biases.
* ``to_grouped`` (standard, not exact): multi-head to grouped-/multi-query attention by mean-pooling the key and
  value heads of each group (Ainslie et al. 2023, arXiv:2305.13245, section 2.1); meant to be uptrained.
* ``to_latent`` (exact at full rank): to MLA (:mod:`qkvjax.attention.latent`) by a truncated SVD of the stacked
  key and value kernels, ``[W^K, W^V] (D, K (H + Hv)) ~ U_R S_R V_R^T``: ``w_kv_down = U_R S_R^(1/2)`` and the
  up-projections split ``S_R^(1/2) V_R^T``, with no latent norm and no rotary part, so the converted layer computes
  ``separate``'s function up to the dropped singular values. The relative error ``|W - W_R|_F / |W|_F`` is reported
  per layer (Eckart-Young: the best rank-R approximation); the result is meant to be uptrained.

* ``to_shared_kv`` (least squares, exact when W^V's columns lie in W^K's span): one tensor per kv head plays
  key and value (K = V). Keys stay exactly as they were (``w_kv = W^K``) and the values become ``x W^K C`` with
  ``C = argmin_C |W^K C - W^V|_F`` (H x Hv per kv head, ``numpy.linalg.lstsq``), folded into the output projection,
  ``W^O_n <- C W^O_n``: queries, keys and scores are untouched and only the value-output maps ``W^V W^O_n`` change.
  The reported relative error is ``sqrt(sum_n |(W^K C - W^V) W^O_n|_F^2 / sum_n |W^V W^O_n|_F^2)``. A value bias
  ``b_v`` becomes ``b_k C`` plus a constant that attention weights (summing to 1) pass to the output bias.

All read the scheme's data (which group makes q, k, v), so they work for every scheme whose groups allow it.
"""

from __future__ import annotations

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qkvjax.attention import AttentionConfig, get_scheme
from qkvjax.models.lm import ModelConfig


def _attention_layers(params) -> list[str]:
    return sorted(k for k in params if k.startswith("block_"))


def bilinear_attention_params(att: dict, cfg: AttentionConfig) -> dict:
    """One attention layer's parameters as the ``bilinear`` scheme's, computing exactly the same function."""
    scheme = cfg.tying
    if scheme.bilinear:
        raise ValueError(f"scheme {cfg.scheme!r} is already bilinear")
    if cfg.rope or scheme.normalize_keys:
        raise ValueError(
            f"scheme {cfg.scheme!r} with rope={cfg.rope} has no fixed bilinear form (rotary embedding or key "
            "normalisation makes the score depend on more than x_t^T W x_s); only plain q.k schemes convert exactly"
        )
    if cfg.use_bias:
        raise ValueError("query/key biases have no place in the bilinear form; convert a model with use_bias=False")
    w_q, w_k = att["w_" + scheme.group_of("q")], att["w_" + scheme.group_of("k")]
    g = cfg.group_size
    w_k = jnp.repeat(w_k, g, axis=1) if w_k.shape[1] != w_q.shape[1] else w_k  # DKH -> DNH, head n uses kv n // G
    merged = jnp.einsum("DNH,ENH->NDE", w_q, w_k)
    return {"w_qk_merged": merged, "w_v": att["w_" + scheme.group_of("v")], "w_o": att["w_o"]}


def grouped_attention_params(att: dict, cfg: AttentionConfig, num_kv_heads: int) -> dict:
    """One layer's parameters with its key/value heads mean-pooled to ``num_kv_heads``."""
    scheme = cfg.tying
    target = dataclasses.replace(cfg, num_kv_heads=num_kv_heads)  # validates divisibility and the scheme
    if cfg.kv_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide the current {cfg.kv_heads} kv heads")
    ratio = cfg.kv_heads // num_kv_heads
    out = dict(att)
    for group in scheme.kv_groups:
        if "q" in group:
            continue
        for prefix, axis in (("w_", 1), ("b_", 0)):
            name = prefix + group
            if name in att:
                x = att[name]
                shape = x.shape[:axis] + (target.kv_heads, ratio) + x.shape[axis + 1 :]
                out[name] = x.reshape(shape).mean(axis=axis + 1)  # consecutive heads form a group
    return out


def latent_attention_params(att: dict, cfg: AttentionConfig, rank: int) -> tuple[dict, float]:
    """One attention layer's parameters as the ``mla`` scheme's at latent rank ``rank``, and the relative error
    of the rank-``rank`` approximation of its stacked [W^K, W^V]."""
    scheme = cfg.tying
    if scheme.bilinear or scheme.latent or scheme.normalize_keys or scheme.mask_self:
        raise ValueError(f"scheme {cfg.scheme!r} has no plain W^K and W^V to factor; convert a plain q.k scheme")
    fixed = [f for f in ("rope", "use_bias", "qk_norm", "v_norm", "relative_bias") if getattr(cfg, f)]
    if fixed:
        raise ValueError(
            f"{fixed[0]}={getattr(cfg, fixed[0])!r}: a rank-R latent cannot carry it exactly (MLA rotates only a "
            "decoupled key part, and has no biases or K/V norms); convert a model without it"
        )
    d, k, h, hv = att["w_o"].shape[-1], cfg.kv_heads, cfg.head_dim, cfg.value_dim
    full = min(d, k * (h + hv))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full:
        raise ValueError(f"rank={rank!r}; allowed: 1 <= rank <= min(D, K (H + Hv)) = {full} (the full rank is exact)")
    w_k = np.asarray(att["w_" + scheme.group_of("k")], np.float64)
    w_v = np.asarray(att["w_" + scheme.group_of("v")], np.float64)
    stacked = np.concatenate([w_k.reshape(d, k * h), w_v.reshape(d, k * hv)], axis=1)  # DKH, DKH -> D(K(H+Hv))
    u, sv, vt = np.linalg.svd(stacked, full_matrices=False)
    root = np.sqrt(sv[:rank])
    down, up = u[:, :rank] * root, root[:, None] * vt[:rank]  # (D, R), (R, K (H + Hv))
    error = float(np.sqrt(np.sum(sv[rank:] ** 2) / np.sum(sv**2)))
    dtype = att["w_o"].dtype
    out = {
        "w_q": att["w_" + scheme.group_of("q")],
        "w_kv_down": jnp.asarray(down, dtype),
        "w_k_up": jnp.asarray(up[:, : k * h].reshape(rank, k, h), dtype),
        "w_v_up": jnp.asarray(up[:, k * h :].reshape(rank, k, hv), dtype),
        "w_o": att["w_o"],
    }
    return out, error


def shared_kv_attention_params(att: dict, cfg: AttentionConfig) -> tuple[dict, float]:
    """One layer's parameters as ``shared_kv``'s (keys kept, values least-squares through the keys) and the
    relative error of its value-output maps."""
    scheme = cfg.tying
    if scheme.group_of("k") != "k" or scheme.group_of("v") != "v" or scheme.normalize_keys or scheme.mask_self:
        raise ValueError(f"scheme {cfg.scheme!r} has no separate W^K and W^V to merge; convert a separate/GQA run")
    if cfg.v_norm or (cfg.use_bias and not cfg.has_output_bias):
        what = "v_norm=True" if cfg.v_norm else "value biases without an output bias"
        raise ValueError(f"{what}: the least-squares K = V cannot carry it exactly; convert a model without it")
    w_k = np.asarray(att["w_k"], np.float64)  # (D, K, H)
    w_v = np.asarray(att["w_v"], np.float64)  # (D, K, Hv)
    w_o = np.asarray(att["w_o"], np.float64)  # (N, Hv, D)
    k, g = cfg.kv_heads, cfg.group_size
    c = np.stack([np.linalg.lstsq(w_k[:, j], w_v[:, j], rcond=None)[0] for j in range(k)])  # (K, H, Hv)
    c_n = np.repeat(c, g, axis=0)  # KHV -> NHV: query head n reads kv head n // G
    residual = np.einsum("DKH,KHV->DKV", w_k, c) - w_v
    per_head = lambda w: np.repeat(w, g, axis=1)  # noqa: E731 (D, K, .) -> (D, N, .)
    error = np.sqrt(
        np.sum(np.einsum("DNV,NVE->NDE", per_head(residual), w_o) ** 2)
        / np.sum(np.einsum("DNV,NVE->NDE", per_head(w_v), w_o) ** 2)
    )
    dtype = att["w_o"].dtype
    out = {"w_q": att["w_q"], "w_kv": att["w_k"], "w_o": jnp.asarray(np.einsum("NHV,NVD->NHD", c_n, w_o), dtype)}
    if cfg.use_bias:
        b_k, b_v = np.asarray(att["b_k"], np.float64), np.asarray(att["b_v"], np.float64)  # (K, H), (K, Hv)
        shift = b_v - np.einsum("KH,KHV->KV", b_k, c)  # constant in every value: passes through the softmax
        out |= {"b_q": att["b_q"], "b_kv": att["b_k"]}
        out["b_o"] = jnp.asarray(np.asarray(att["b_o"]) + np.einsum("NV,NVD->D", np.repeat(shift, g, 0), w_o), dtype)
    return out, float(error)


def latent_config(cfg: AttentionConfig, rank: int) -> AttentionConfig:
    """The ``mla`` config that :func:`latent_attention_params` fills: rank ``rank``, no latent norm, no rotary."""
    return dataclasses.replace(cfg, scheme="mla", kv_rank=rank, latent_norm=False, q_rank=None, rope_head_dim=None)


def convert(
    model: ModelConfig,
    params,
    to: str | None = None,
    num_kv_heads: int | None = None,
    rank: int | None = None,
    errors: list | None = None,
):
    """(new config, new params) with the scheme ``to`` and/or ``num_kv_heads`` changed; ``rank`` is the latent
    rank of ``to="mla"``, whose relative approximation error per layer is appended to ``errors`` if given."""
    att_cfg = model.attention
    if att_cfg.tying.latent:
        raise ValueError(f"this run's scheme {att_cfg.scheme!r} is latent (MLA); convert starts from a plain scheme "
                         "(separate, GQA, shared_kv, ...)")  # fmt: skip
    if (rank is not None) != (to is not None and get_scheme(to).latent):
        raise ValueError(f"rank={rank!r} goes with a latent target scheme and only there: --to mla --rank R")
    if getattr(model, "layers", ""):  # an EncoderConfig (an imported BERT) has one attention config
        raise ValueError(
            f"convert works on runs with one attention config for every layer; this run has the layer pattern "
            f"{model.layers!r} (convert its layers by hand, or train the pattern you want)"
        )
    params = nn.meta.unbox(params)
    new = {k: v for k, v in params.items()}
    if num_kv_heads is not None and num_kv_heads != att_cfg.kv_heads:
        for layer in _attention_layers(params):
            block = dict(new[layer])
            block["attention"] = grouped_attention_params(block["attention"], att_cfg, num_kv_heads)
            new[layer] = block
        att_cfg = dataclasses.replace(att_cfg, num_kv_heads=num_kv_heads)
    if to is not None and to != att_cfg.scheme:
        target = get_scheme(to)
        ties_kv = target.groups == ("q", "kv") and not target.latent  # the partition {q}{k,v}: K = V
        if not (target.bilinear or target.latent or ties_kv):
            raise ValueError(
                f"no conversion from {att_cfg.scheme!r} to {to!r}: tying cannot be undone or imposed exactly; "
                "supported: --to bilinear (exact), --to shared_kv (least squares), --to mla --rank R (truncated "
                "SVD) and --num-kv-heads K (mean-pooled kv heads)"
            )
        for layer in _attention_layers(params):
            block = dict(new[layer])
            error = None
            if target.latent:
                block["attention"], error = latent_attention_params(block["attention"], att_cfg, rank)
            elif target.bilinear:
                block["attention"] = bilinear_attention_params(block["attention"], att_cfg)
            else:
                block["attention"], error = shared_kv_attention_params(block["attention"], att_cfg)
            if errors is not None and error is not None:
                errors.append(error)
            new[layer] = block
        att_cfg = latent_config(att_cfg, rank) if target.latent else dataclasses.replace(att_cfg, scheme=to)
    return dataclasses.replace(model, attention=att_cfg), new


def convert_workdir(
    workdir: str,
    out: str,
    to: str | None,
    num_kv_heads: int | None,
    step: int | None = None,
    rank: int | None = None,
    errors: list | None = None,
) -> str:
    """Writes a new workdir whose checkpoint holds the converted params (fresh optimizer state, same step and
    data position), so ``qkvjax eval`` / ``sample`` / ``train`` (to uptrain) all work on it. ``errors``: as in
    :func:`convert`."""
    from qkvjax.evaluate import restore_params
    from qkvjax.hf.folder import TOKENIZER
    from qkvjax.train import checkpoint
    from qkvjax.train.config import to_dict, to_json
    from qkvjax.train.state import TrainState, make_optimizer
    from qkvjax.workdir import CONFIG_FILE, export_params, path, write_text

    if to is None and num_kv_heads is None:
        raise ValueError("nothing to convert: pass --to SCHEME and/or --num-kv-heads K")
    out = os.fspath(path(out))
    if (path(out) / CONFIG_FILE).exists():
        raise ValueError(f"--out {out} already holds a run; choose an empty directory")
    _, params, config, step = restore_params(workdir, step)
    model_cfg, new_params = convert(config.model, params, to, num_kv_heads, rank, errors)
    config = dataclasses.replace(config, model=model_cfg)
    path(out).mkdir(parents=True, exist_ok=True)
    tokenizer = path(workdir) / TOKENIZER
    if tokenizer.exists():  # an imported model's: data.tokenizer names it relative to the workdir
        (path(out) / TOKENIZER).write_bytes(tokenizer.read_bytes())
    if not (path(workdir) / "checkpoints").is_dir():  # params only (an imported model): the same out
        export_params(out, step, new_params)
        write_text(path(out) / CONFIG_FILE, to_json(config))
        return out
    tx = make_optimizer(config.train)
    mngr_in = checkpoint.manager(workdir, read_only=True)
    data_state = checkpoint.restore_data_state(mngr_in, step)
    mngr_in.close()
    state = TrainState(
        step=jnp.array(step, jnp.int32),
        params=new_params,
        opt_state=tx.init(new_params),
        rng=jax.random.PRNGKey(config.seed),
    )
    mngr = checkpoint.manager(out)
    checkpoint.save(mngr, step, state, data_state, to_dict(config))
    checkpoint.close(mngr)
    write_text(path(out) / CONFIG_FILE, to_json(config))
    return out
