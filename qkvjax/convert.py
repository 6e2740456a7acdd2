"""Converting trained weights between schemes, where the maths allows it.

* ``to_bilinear`` (exact): ``W_QK[n] = W^Q_n (W^K_{kv(n)})^T``, so ``x_t^T W_QK[n] x_s = q_{t,n} . k_{s,kv(n)}``.
  Needs plain q.k logits: no rotary embedding, no key normalisation, no query/key biases.
* ``to_grouped`` (standard, not exact): multi-head to grouped-/multi-query attention by mean-pooling the key and
  value heads of each group (Ainslie et al. 2023, arXiv:2305.13245, section 2.1); meant to be uptrained.
* ``to_latent`` (exact at full rank): to MLA (:mod:`qkvjax.attention.latent`) by a truncated SVD of the stacked
  key and value kernels, ``[W^K, W^V] (D, K (H + Hv)) ~ U_R S_R V_R^T``: ``w_kv_down = U_R S_R^(1/2)`` and the
  up-projections split ``S_R^(1/2) V_R^T``, with no latent norm and no rotary part, so the converted layer computes
  ``separate``'s function up to the dropped singular values. The relative error ``|W - W_R|_F / |W|_F`` is reported
  per layer (Eckart-Young: the best rank-R approximation); the result is meant to be uptrained. Biases carry over
  exactly: the query bias stays, a key bias adds q . b_k to every score of a query alike (the softmax drops it),
  and a value bias reaches the output as sum_n b_v W^O_n (added to the output bias). A rotary model's latent keys
  cannot be rotated, so it takes ``rope_dim`` (MHA2MLA's partial RoPE, Ji et al. 2025): the highest-frequency pairs
  of every head stay rotated as a rotary key per KV head, the others lose their rotation and go into the latent.
  ``latent_norm`` adds DeepSeek-V2's RMS norm on the latent (its layout always has one; not exact at any rank):
  ``norm(c) g`` with every gain ``g = s``, the latent's RMS ``s`` expected when the layer's input is its input
  norm's output on isotropic unit-RMS features, ``s^2 = (|diag(gamma) W_down|_F^2 + |beta W_down|^2) / R``
  (gamma, beta: the input norm's scale and bias). A token whose latent has RMS ``s`` is computed as before; others
  have their latent keys and values rescaled by ``s / rms(c)``: uptrain.

* ``to_shared_kv`` (least squares, exact when W^V's columns lie in W^K's span): one tensor per kv head plays
  key and value (K = V). Keys stay exactly as they were (``w_kv = W^K``) and the values become ``x W^K C`` with
  ``C = argmin_C |W^K C - W^V|_F`` (H x Hv per kv head, ``numpy.linalg.lstsq``), folded into the output projection,
  ``W^O_n <- C W^O_n``: queries, keys and scores are untouched and only the value-output maps ``W^V W^O_n`` change.
  The reported relative error is ``sqrt(sum_n |(W^K C - W^V) W^O_n|_F^2 / sum_n |W^V W^O_n|_F^2)``. A value bias
  ``b_v`` becomes ``b_k C`` plus a constant that attention weights (summing to 1) pass to the output bias.

* ``to_shared_qk`` (least squares, exact when every head's score matrix is symmetric positive semi-definite): one
  tensor per head plays query and key (W^Q = W^K). Head n's scores are ``x_t^T A_n x_s`` with ``A_n = W^Q_n
  (W^K_n)^T`` (D x D, rank <= H); a shared head can only give ``W_n W_n^T``, symmetric PSD of rank <= H. The nearest
  such matrix in Frobenius norm is the symmetric part ``S_n = (A_n + A_n^T) / 2`` (the antisymmetric part is
  orthogonal to every symmetric matrix) truncated to its H largest positive eigenvalues: ``W_n = V_H Λ_H^(1/2)``.
  ``S_n`` has rank <= 2H, so it is taken in the span of ``[W^Q_n, W^K_n]`` (a QR of that (D, 2H) block and a 2H x 2H
  eigenproblem, not a D x D one). Values and the output projection are kept. The reported relative error is
  ``sqrt(sum_n |A_n - W_n W_n^T|_F^2 / sum_n |A_n|_F^2)``. Plain q.k scores only: rotary positions, key or query
  norms, biases, a relative bias or grouped heads are refused.

* ``cross_layer`` (least squares, under the assumption that adjacent layers see similar inputs): Cross-Layer
  Attention (Brandon et al. 2024) in groups of G layers, the first of each group keeping its K/V and the others
  reading them. A reader's keys become ``k_d B`` with ``B = argmin |W^K_d B - W^K_i|_F`` (per kv head), absorbed
  into its queries (``W^Q_i <- W^Q_i B^T``), and its values ``v_d C`` with ``C = argmin |W^V_d C - W^V_i|_F``,
  absorbed into ``W^O``. A key bias's mismatch adds a constant per query to every score (softmax ignores it); a
  value bias's goes to the output bias. The reported errors are of the weights alone (keys; value-output maps as
  for K = V): the reader now attends over its donor's *input*, a lower layer's residual stream, which no weight
  error measures -- the loss does. With rotary positions the donor's keys arrive rotated, so ``B`` must commute
  with every rotation: per frequency pair of features it is a complex number (a scale and a turn), fitted by
  complex least squares, ``b = <z_d, z_i> / <z_d, z_d>`` with z the pair's two columns as one complex column;
  then ``q^T R_(s-t) (B k_d) = (B^T q)^T R_(s-t) k_d`` holds at every offset. (A key bias would be rotated too and
  no longer a constant per query: rotary models with biases are refused.)

All read the scheme's data (which group makes q, k, v), so they work for every scheme whose groups allow it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qkvjax.attention import AttentionConfig, get_scheme
from qkvjax.models.lm import ModelConfig


class LayerError(NamedTuple):
    """How far a converted layer's weights are from the original's: ``|W - W_R|_F / |W|_F`` of ``[W^K, W^V]`` for
    MLA at rank R, the relative error of the value-output maps for K = V (module docstring)."""

    layer: int
    error: float


class CrossLayerError(NamedTuple):
    """A layer that now reads an earlier layer's K/V (CLA): the relative errors of its keys and of its value-output
    maps, of the weights alone (it attends over the donor's input, which no weight error measures)."""

    reader: int
    donor: int
    key_error: float
    value_error: float


def _attention_layers(params) -> list[str]:
    """The blocks' names in layer order (block_2 before block_10)."""
    return sorted((k for k in params if k.startswith("block_")), key=lambda k: int(k.removeprefix("block_")))


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


def rotary_split(h: int, rope_dim: int, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """(kept, freed) feature indices of a rotary head of width ``h``: its ``rope_dim / 2`` highest-frequency
    pairs keep their rotation, laid out as a rotary part of width ``rope_dim`` in the same layout (MHA2MLA's
    S_high choice); the other features lose it."""
    r = rope_dim // 2
    kept = np.arange(2 * r) if interleaved else np.concatenate([np.arange(r), h // 2 + np.arange(r)])
    return kept, np.setdiff1d(np.arange(h), kept)


def latent_attention_params(att: dict, cfg: AttentionConfig, rank: int, rope_dim: int | None = None,
                            norm_input: dict | None = None) -> tuple[dict, float]:  # fmt: skip
    """One attention layer's parameters as the ``mla`` scheme's at latent rank ``rank`` (config:
    :func:`latent_config`), and the relative error of the rank-``rank`` approximation of its stacked [W^K, W^V].

    A rotary model needs ``rope_dim`` (MHA2MLA's partial RoPE, Ji et al. 2025, arXiv:2502.14837): the
    ``rope_dim / 2`` highest-frequency pairs of every query and key head stay rotated, as a decoupled rotary part
    with a key per KV head at their own frequencies; the other features lose their rotation and only their key
    part joins W^V in the latent. That is the one change to the function besides the truncation (the error
    reported is the truncation's): measure it with ``qkvjax eval`` and uptrain.

    ``norm_input``: the parameters of the norm that feeds the layer ({"scale": (D,), "bias": (D,)}, either may be
    absent; {} for a norm without parameters) asks for a latent norm (``latent_norm=True``), whose gains are the
    latent's expected RMS (the module docstring): DeepSeek-V2's form."""
    scheme = cfg.tying
    if scheme.bilinear or scheme.latent or scheme.normalize_keys or scheme.mask_self:
        raise ValueError(f"scheme {cfg.scheme!r} has no plain W^K and W^V to factor; convert a plain q.k scheme")
    fixed = [f for f in ("qk_norm", "v_norm", "relative_bias") if getattr(cfg, f)]
    if fixed or (cfg.use_bias and not cfg.has_output_bias) or (cfg.rope and cfg.use_bias):
        what = (f"{fixed[0]}={getattr(cfg, fixed[0])!r}" if fixed else "value biases without an output bias"
                if not cfg.rope else "rope=True with biases")  # fmt: skip
        raise ValueError(
            f"{what}: a rank-R latent cannot carry it exactly (MLA has no K/V norms, its value biases go to the "
            "output bias, and its rotary part has none); convert a model without it"
        )
    d, k, h, hv = att["w_o"].shape[-1], cfg.kv_heads, cfg.head_dim, cfg.value_dim
    if cfg.rope != (rope_dim is not None):
        raise ValueError(
            "rope=True: a rank-R latent cannot carry rotated keys whole; keep rope_dim (--rope-dim) features of "
            f"every head rotated (MHA2MLA's partial RoPE): an even number from 2 to H - 2 = {h - 2}"
            if cfg.rope else f"rope_dim={rope_dim!r} is for rotary models; this one has rope=False: leave it out"
        )  # fmt: skip
    if rope_dim is not None and (isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim % 2
                                 or not 2 <= rope_dim <= h - 2):  # fmt: skip
        raise ValueError(f"rope_dim={rope_dim!r}; allowed: an even number from 2 to H - 2 = {h - 2}")
    w_q = np.asarray(att["w_" + scheme.group_of("q")], np.float64)
    w_k = np.asarray(att["w_" + scheme.group_of("k")], np.float64)
    w_v = np.asarray(att["w_" + scheme.group_of("v")], np.float64)
    rotary = {}
    if rope_dim:  # DNH -> DN(H - H_r) into the latent's side, DNH_r (and DKH_r) stay rotated
        kept, freed = rotary_split(h, rope_dim, cfg.rope_interleaved)
        rotary = {"w_q_rope": w_q[..., kept], "w_k_rope": w_k[..., kept]}
        w_q, w_k, h = w_q[..., freed], w_k[..., freed], h - rope_dim
    full = min(d, k * (h + hv))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full:
        raise ValueError(f"rank={rank!r}; allowed: 1 <= rank <= min(D, K (H + Hv)) = {full} (the full rank is exact)")
    stacked = np.concatenate([w_k.reshape(d, k * h), w_v.reshape(d, k * hv)], axis=1)  # DKH, DKH -> D(K(H+Hv))
    u, sv, vt = np.linalg.svd(stacked, full_matrices=False)
    root = np.sqrt(sv[:rank])
    down, up = u[:, :rank] * root, root[:, None] * vt[:rank]  # (D, R), (R, K (H + Hv))
    error = float(np.sqrt(np.sum(sv[rank:] ** 2) / np.sum(sv**2)))
    dtype = att["w_o"].dtype
    out = {
        "w_q": jnp.asarray(w_q, dtype),
        "w_kv_down": jnp.asarray(down, dtype),
        "w_k_up": jnp.asarray(up[:, : k * h].reshape(rank, k, h), dtype),
        "w_v_up": jnp.asarray(up[:, k * h :].reshape(rank, k, hv), dtype),
        "w_o": att["w_o"],
    } | {name: jnp.asarray(w, dtype) for name, w in rotary.items()}
    if norm_input is not None:  # BSD -> BSR: E|c|^2 over x = gamma u + beta with E[u u^T] = I
        gamma = np.asarray(norm_input.get("scale", np.ones(d)), np.float64)
        beta = np.asarray(norm_input.get("bias", np.zeros(d)), np.float64)
        rms = np.sqrt((np.sum((gamma[:, None] * down) ** 2) + np.sum((beta @ down) ** 2)) / rank)
        out["kv_norm_scale"] = jnp.full((rank,), rms, dtype)
    if cfg.use_bias:  # b_k: q . b_k is the same for every key, so the softmax drops it; b_v passes to the output
        out["b_q"] = att["b_" + scheme.group_of("q")]
        b_v = np.repeat(np.asarray(att["b_" + scheme.group_of("v")], np.float64), cfg.group_size, axis=0)  # KU -> NU
        shift = np.einsum("NU,NUD->D", b_v, np.asarray(att["w_o"], np.float64))
        out["b_o"] = jnp.asarray(np.asarray(att["b_o"], np.float64) + shift, dtype)
    elif "b_o" in att:
        out["b_o"] = att["b_o"]
    return out, error


def _lstsq_heads(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per head j, ``argmin_X |a[:, j] X - b[:, j]|_F``: (D, K, H), (D, K, H') -> (K, H, H')."""
    return np.stack([np.linalg.lstsq(a[:, j], b[:, j], rcond=None)[0] for j in range(a.shape[1])])


def _lstsq_rotary(a: np.ndarray, b: np.ndarray, interleaved: bool) -> np.ndarray:
    """Per head j, the best ``a[:, j] X ~ b[:, j]`` over maps X that commute with rotary embeddings: on each
    frequency pair of features (i, i + H/2), or (2i, 2i + 1) when ``interleaved``, X multiplies by one complex
    number. (D, K, H), (D, K, H) -> (K, H, H)."""
    k, h = a.shape[1], a.shape[2]
    first = np.arange(0, h, 2) if interleaved else np.arange(h // 2)
    second = first + 1 if interleaved else first + h // 2
    za, zb = a[..., first] + 1j * a[..., second], b[..., first] + 1j * b[..., second]  # (D, K, H/2)
    c = np.sum(np.conj(za) * zb, axis=0) / np.sum(np.abs(za) ** 2, axis=0)  # (K, H/2): argmin |za c - zb|
    x = np.zeros((k, h, h))
    for j in range(k):  # z -> c z on each pair, for row vectors: (u, w) -> (Re c u - Im c w, Im c u + Re c w)
        x[j, first, first], x[j, second, second] = c[j].real, c[j].real
        x[j, second, first], x[j, first, second] = -c[j].imag, c[j].imag
    return x


def _value_output_error(approx_v: np.ndarray, w_v: np.ndarray, w_o: np.ndarray, g: int) -> float:
    """``sqrt(sum_n |(V' - W^V) W^O_n|_F^2 / sum_n |W^V W^O_n|_F^2)`` over query heads n (kv head n // G);
    ``approx_v``, ``w_v``: (D, K, Hv), ``w_o``: (N, Hv, D)."""
    per_head = lambda w: np.repeat(w, g, axis=1)  # noqa: E731 (D, K, .) -> (D, N, .)
    ov = lambda w: np.einsum("DNU,NUE->NDE", per_head(w), w_o)  # noqa: E731
    return float(np.sqrt(np.sum(ov(approx_v - w_v) ** 2) / np.sum(ov(w_v) ** 2)))


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
    g = cfg.group_size
    c = _lstsq_heads(w_k, w_v)  # (K, H, Hv)
    c_n = np.repeat(c, g, axis=0)  # KHU -> NHU: query head n reads kv head n // G
    error = _value_output_error(np.einsum("DKH,KHU->DKU", w_k, c), w_v, w_o, g)
    dtype = att["w_o"].dtype
    out = {"w_q": att["w_q"], "w_kv": att["w_k"], "w_o": jnp.asarray(np.einsum("NHU,NUD->NHD", c_n, w_o), dtype)}
    if cfg.use_bias:
        b_k, b_v = np.asarray(att["b_k"], np.float64), np.asarray(att["b_v"], np.float64)  # (K, H), (K, Hv)
        shift = b_v - np.einsum("KH,KHU->KU", b_k, c)  # constant in every value: passes through the softmax
        out |= {"b_q": att["b_q"], "b_kv": att["b_k"]}
        out["b_o"] = jnp.asarray(np.asarray(att["b_o"]) + np.einsum("NU,NUD->D", np.repeat(shift, g, 0), w_o), dtype)
    return out, float(error)


def cross_layer_attention_params(att: dict, donor: dict, cfg: AttentionConfig) -> tuple[dict, float, float]:
    """A layer's parameters when it reads ``donor``'s keys and values instead of its own (least squares, see the
    module docstring), and the relative errors of its keys and of its value-output maps."""
    scheme = cfg.tying
    if scheme.group_of("k") != "k" or scheme.group_of("v") != "v" or scheme.normalize_keys or scheme.mask_self:
        raise ValueError(f"scheme {cfg.scheme!r} has no separate W^K and W^V to share across layers")
    fixed = [f for f in ("qk_norm", "v_norm") if getattr(cfg, f)]
    if fixed or (cfg.use_bias and not cfg.has_output_bias) or (cfg.rope and cfg.use_bias):
        what = (f"{fixed[0]}=True" if fixed else "value biases without an output bias" if not cfg.rope
                else "query/key biases under rotary positions")  # fmt: skip
        raise ValueError(f"{what}: the least-squares cross-layer map cannot carry it; convert a model without it")
    f64 = lambda name, tree=att: np.asarray(tree[name], np.float64)  # noqa: E731
    g = cfg.group_size
    fit = functools.partial(_lstsq_rotary, interleaved=cfg.rope_interleaved) if cfg.rope else _lstsq_heads
    b = np.repeat(fit(f64("w_k", donor), f64("w_k")), g, axis=0)  # (N, H, H): k_i ~ k_d B
    c = np.repeat(_lstsq_heads(f64("w_v", donor), f64("w_v")), g, axis=0)  # (N, Hv, Hv): v_i ~ v_d C
    w_o = f64("w_o")
    key_error = np.linalg.norm(np.einsum("DKJ,KJH->DKH", f64("w_k", donor), b[::g]) - f64("w_k")) / np.linalg.norm(
        f64("w_k")
    )
    value_error = _value_output_error(np.einsum("DKJ,KJU->DKU", f64("w_v", donor), c[::g]), f64("w_v"), w_o, g)
    dtype = att["w_o"].dtype
    out = {
        "w_q": jnp.asarray(np.einsum("DNH,NJH->DNJ", f64("w_q"), b), dtype),  # q . (k_d B) = (B q) . k_d
        "w_o": jnp.asarray(np.einsum("NJU,NUD->NJD", c, w_o), dtype),
    }
    if cfg.use_bias:
        out["b_q"] = jnp.asarray(np.einsum("NH,NJH->NJ", f64("b_q"), b), dtype)
        shift = f64("b_v") - np.einsum("KJ,KJU->KU", f64("b_v", donor), c[::g])  # passes through the softmax
        out["b_o"] = jnp.asarray(f64("b_o") + np.einsum("NU,NUD->D", np.repeat(shift, g, 0), w_o), dtype)
    elif "b_o" in att:
        out["b_o"] = att["b_o"]
    return out, float(key_error), float(value_error)


def cross_layer_pattern(scheme: str, group: int) -> str:
    """The layer pattern of CLA in groups of ``group``: ``(S, [kv_from=-1], ..., [kv_from=-(G-1)])*``."""
    return "(" + ", ".join([scheme] + [f"[kv_from=-{j}]" for j in range(1, group)]) + ")*"


def latent_config(cfg: AttentionConfig, rank: int, rope_dim: int | None = None, latent_norm: bool = False
                  ) -> AttentionConfig:  # fmt: skip
    """The ``mla`` config that :func:`latent_attention_params` fills: rank ``rank``, a latent norm or none, and for a
    rotary model a rotary part of ``rope_dim`` per KV head whose base puts its pairs at the frequencies they had
    (pair i of H_r at base'^(-i / (H_r/2)) = base^(-i / (H/2)): base' = base^(H_r / H))."""
    rotary = {} if rope_dim is None else dict(
        head_dim=cfg.head_dim - rope_dim, v_head_dim=cfg.value_dim, rope_key_per_head=True,
        rope_base=cfg.rope_base ** (rope_dim / cfg.head_dim),
    )  # fmt: skip
    return dataclasses.replace(
        cfg, scheme="mla", kv_rank=rank, latent_norm=latent_norm, q_rank=None, rope_head_dim=rope_dim, **rotary
    )


def shared_qk_attention_params(att: dict, cfg: AttentionConfig) -> tuple[dict, float]:
    """One layer's parameters as ``shared_qk``'s (per head the nearest PSD rank-H form of its score matrix, module
    docstring) and the relative error of the score matrices."""
    scheme = cfg.tying
    if scheme.group_of("q") != "q" or scheme.group_of("k") != "k" or scheme.bilinear:
        raise ValueError(f"scheme {cfg.scheme!r} has no separate W^Q and W^K to tie; convert a separate run")
    refused = {"rope=True": cfg.rope, "qk_norm=True": cfg.qk_norm, "use_bias=True": cfg.use_bias,
               f"relative_bias={cfg.relative_bias}": cfg.relative_bias, "learned_temperature=True":
               cfg.learned_temperature, f"num_kv_heads={cfg.kv_heads} < num_heads={cfg.num_heads}":
               cfg.kv_heads != cfg.num_heads}  # fmt: skip
    if reason := next((k for k, v in refused.items() if v), None):
        raise ValueError(f"{reason}: --to shared_qk ties plain q.k scores of one query head per key head; allowed: "
                         "a separate run without rotary positions, norms, biases, a relative bias or grouped "
                         "heads")  # fmt: skip
    w_q = np.asarray(att["w_q"], np.float64)  # (D, N, H)
    w_k = np.asarray(att["w_k"], np.float64)  # (D, N, H): K = N here
    h = w_q.shape[2]
    shared, residual, total = np.zeros_like(w_q), 0.0, 0.0
    for n in range(w_q.shape[1]):
        q, k = w_q[:, n], w_k[:, n]  # (D, H)
        basis, r = np.linalg.qr(np.concatenate([q, k], axis=1))  # (D, 2H), (2H, 2H): [q, k] = basis r
        rq, rk = r[:, :h], r[:, h:]
        small = (rq @ rk.T + rk @ rq.T) / 2  # S_n in the basis: S_n = basis small basis^T
        values, vectors = np.linalg.eigh(small)  # ascending
        keep = np.clip(values[::-1][:h], 0, None)  # the H largest, negative ones dropped (PSD)
        w = basis @ vectors[:, ::-1][:, :h] * np.sqrt(keep)  # (D, H): W_n = V_H Λ_H^(1/2)
        shared[:, n] = w
        a = q @ k.T
        residual += float(np.sum((a - w @ w.T) ** 2))
        total += float(np.sum(a**2))
    out = {"w_qk": jnp.asarray(shared, att["w_q"].dtype), "w_v": att["w_v"], "w_o": att["w_o"]}
    if "b_o" in att:
        out["b_o"] = att["b_o"]
    return out, float(np.sqrt(residual / total))


def convertible(scheme) -> bool:
    """Whether a plain scheme's weights can be converted to ``scheme``: a bilinear form (exact), a latent scheme
    (truncated SVD), the partition {q}{k,v} (K = V by least squares) or plain {q,k}{v} (shared QK, the nearest
    PSD form). Read off the scheme's data."""
    plain_qk = scheme.groups == ("qk", "v") and not (scheme.normalize_keys or scheme.mask_self)
    return scheme.bilinear or scheme.latent or scheme.groups == ("q", "kv") or plain_qk


def __getattr__(name: str):
    if name == "TARGETS":  # the registry's schemes that --to accepts (registered schemes included)
        from qkvjax.attention.schemes import SCHEMES

        return tuple(k for k, v in SCHEMES.items() if convertible(v))
    raise AttributeError(name)


def convert(
    model: ModelConfig,
    params,
    to: str | None = None,
    num_kv_heads: int | None = None,
    rank: int | None = None,
    errors: list[LayerError | CrossLayerError] | None = None,
    cross_layer: int | None = None,
    rope_dim: int | None = None,
    latent_norm: bool = False,
):
    """(new config, new params) with the scheme ``to`` and/or ``num_kv_heads`` changed; ``rank`` is the latent
    rank of ``to="mla"``, ``rope_dim`` its rotary features per head for a rotary model and ``latent_norm`` whether
    its latent is normalised, as DeepSeek-V2's always is (:func:`latent_attention_params`). ``cross_layer`` G: CLA
    in groups of G layers (last). ``errors``, if given, receives a :class:`LayerError` per layer converted to MLA or
    K = V, in layer order, then a :class:`CrossLayerError` per layer reading another's K/V."""
    att_cfg = model.attention
    if att_cfg.tying.latent:
        raise ValueError(f"this run's scheme {att_cfg.scheme!r} is latent (MLA); convert starts from a plain scheme "
                         "(separate, GQA, shared_kv, ...)")  # fmt: skip
    if (rank is not None) != (to is not None and get_scheme(to).latent):
        raise ValueError(f"rank={rank!r} goes with a latent target scheme and only there: --to mla --rank R")
    if rope_dim is not None and rank is None:
        raise ValueError(f"rope_dim={rope_dim!r} goes with --to mla --rank R (a rotary model's rotated part)")
    if latent_norm and rank is None:
        raise ValueError("latent_norm=True goes with --to mla --rank R (a norm on MLA's latent)")
    if cross_layer is not None and "layers" not in {f.name for f in dataclasses.fields(model)}:
        raise ValueError(f"--cla {cross_layer!r}: an encoder (EncoderConfig) has no layer patterns; allowed: decoders")
    if model.layers:  # an EncoderConfig (an imported BERT) has none
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
        if not convertible(target):
            raise ValueError(
                f"no conversion from {att_cfg.scheme!r} to {to!r}: tying cannot be undone or imposed exactly; "
                "supported: --to bilinear (exact), --to shared_kv and --to shared_qk (least squares), --to mla "
                "--rank R (truncated SVD) and --num-kv-heads K (mean-pooled kv heads)"
            )
        for layer in _attention_layers(params):
            block = dict(new[layer])
            error = None
            if target.latent:
                feeding = block.get("ln_attention", {}) if latent_norm else None  # the block's pre-norm, if any
                block["attention"], error = latent_attention_params(
                    block["attention"], att_cfg, rank, rope_dim, feeding
                )
            elif target.bilinear:
                block["attention"] = bilinear_attention_params(block["attention"], att_cfg)
            elif target.groups == ("qk", "v"):
                block["attention"], error = shared_qk_attention_params(block["attention"], att_cfg)
            else:
                block["attention"], error = shared_kv_attention_params(block["attention"], att_cfg)
            if errors is not None and error is not None:
                errors.append(LayerError(int(layer.removeprefix("block_")), error))
            new[layer] = block
        att_cfg = (latent_config(att_cfg, rank, rope_dim, latent_norm) if target.latent
                   else dataclasses.replace(att_cfg, scheme=to))  # fmt: skip
    out = dataclasses.replace(model, attention=att_cfg)
    if cross_layer is not None:
        out, new = _cross_layer(out, new, cross_layer, errors)
    return out, new


def _cross_layer(model, params: dict, group: int, errors: list | None):
    layers = _attention_layers(params)
    if isinstance(group, bool) or not isinstance(group, int) or group < 2 or len(layers) % group:
        raise ValueError(f"--cla {group!r}; allowed: an integer >= 2 dividing the {len(layers)} layers")
    new = dict(params)
    for i in range(len(layers)):
        donor = i - i % group
        if donor == i:
            continue
        block = dict(new[f"block_{i}"])
        block["attention"], key_error, value_error = cross_layer_attention_params(
            params[f"block_{i}"]["attention"], params[f"block_{donor}"]["attention"], model.attention
        )
        new[f"block_{i}"] = block
        if errors is not None:
            errors.append(CrossLayerError(i, donor, key_error, value_error))
    return dataclasses.replace(model, layers=cross_layer_pattern(model.attention.scheme, group)), new


def convert_workdir(
    workdir: str,
    out: str,
    to: str | None,
    num_kv_heads: int | None,
    step: int | None = None,
    rank: int | None = None,
    errors: list[LayerError | CrossLayerError] | None = None,
    cross_layer: int | None = None,
    rope_dim: int | None = None,
    latent_norm: bool = False,
) -> str:
    """Writes a new workdir whose checkpoint holds the converted params (fresh optimizer state, same step and
    data position), so ``qkvjax eval`` / ``sample`` / ``train`` (to uptrain) all work on it. ``errors``: as in
    :func:`convert`."""
    from qkvjax.config import to_dict, to_json
    from qkvjax.evaluate import restore_with_data_state
    from qkvjax.train import checkpoint
    from qkvjax.train.state import TrainState, make_optimizer
    from qkvjax.workdir import (
        CONFIG_FILE,
        IMPORTED_FILES,
        export_params,
        path,
        require_empty,
        whole_or_absent,
        write_text,
    )

    if to is None and num_kv_heads is None and cross_layer is None:
        raise ValueError("nothing to convert: pass --to SCHEME, --num-kv-heads K and/or --cla G")
    out = os.fspath(path(out))
    require_empty(out)
    _, params, config, step, data_state = restore_with_data_state(workdir, step)  # None: an imported model
    model_cfg, new_params = convert(
        config.model, params, to, num_kv_heads, rank, errors, cross_layer, rope_dim, latent_norm
    )
    config = dataclasses.replace(config, model=model_cfg)
    # Written whole into a sibling and renamed into place last: a kill leaves --out absent, never half-written.
    with whole_or_absent(out, "files") as staging:
        for name in IMPORTED_FILES:  # an imported model's tokenizer, special tokens and chat template
            if (path(workdir) / name).exists():
                (staging / name).write_bytes((path(workdir) / name).read_bytes())
        if data_state is None:  # an imported model: params only out too
            export_params(staging, step, new_params)
        else:
            tx = make_optimizer(config.train)
            state = TrainState(
                step=jnp.array(step, jnp.int32),
                params=new_params,
                opt_state=tx.init(new_params),
                rng=jax.random.PRNGKey(config.seed),
            )
            mngr = checkpoint.manager(staging)
            checkpoint.save(mngr, step, state, data_state, to_dict(config))
            checkpoint.close(mngr)
        write_text(staging / CONFIG_FILE, to_json(config))
    return out
