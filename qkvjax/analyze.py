"""How similar are a trained model's W^Q, W^K and W^V? Basis-invariant measures per head, with controls.

Head n's projections are (D, H) matrices P^Q_n, P^K_n, P^V_n with ``q_n = x P^Q_n`` (query head n reads KV head
n // G under GQA). Per head, with ``M_n = P^Q_n (P^K_n)^T`` (D x D, the bilinear form the scores use):

* ``qk_cos``, ``qv_cos``, ``kv_cos``: the mean cosine of the principal angles between two column spaces
  (orthonormal bases U_a, U_b; the singular values of U_a^T U_b; Bjorck & Golub 1973). A change of basis inside a
  head (P -> P A, A invertible) leaves them unchanged, unlike a plain cosine of the matrices.
* ``symmetry`` = ||(M + M^T)/2||_F^2 / ||M||_F^2: 1 when W^Q = W^K, about 1/2 for independent random matrices.
* ``trace_ratio`` = tr(M) / ||M||_*: 1 when M is positive semi-definite (shared QK), about 0 for random.
* ``effective_rank`` = exp(entropy of M's normalised singular values) (Roy & Vetterli 2007), at most H.
* ``kv_rank_err``: per layer, the relative error sqrt(sum_{i>R} s_i^2 / sum_i s_i^2) of the best rank-R
  approximation (Eckart-Young) of all its keys and values side by side, [W^K, W^V] (D, K (H + Hv)), at R = D/4:
  what a latent K/V cache of rank D/4 (MLA) loses. Gaussian matrices lose about 0.70 at R = D/4 of a (D, 2D)
  matrix; trained ones less as K and V come to share a subspace or to have low rank.

Everything is computed from H x H matrices (M = Q_q (R_q R_k^T) Q_k^T with P = Q R), so a layer of a 768-wide
model costs milliseconds. ``bilinear`` layers have M = W_QK[n] itself and no P^Q or P^K: only the last three
measures apply. Controls computed the same way: Gaussian matrices of the same shapes, and mismatched heads (head
n's Q against head n+1's K and V, K_n against V_{n+1}). The functions take numpy or jax arrays alike (the training
loop runs them jitted on sharded parameters).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from qkvjax import checks

MEASURES = ("qk_cos", "qv_cos", "kv_cos", "symmetry", "trace_ratio", "effective_rank", "kv_rank_err")


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One layer's projections, head-major: q (N, D, H); k, v (K, D, H); or qk_merged (N, D, D) for a merged form;
    ``form``: what ties the layer (its scheme, the layer whose K/V it reads, its window), shown beside its row."""

    v: object
    q: object = None
    k: object = None
    qk_merged: object = None
    form: str = ""

    def __post_init__(self):
        if self.qk_merged is None and (self.q is None or self.k is None):
            raise ValueError("LayerWeights needs q and k, or qk_merged")
        n = (self.q if self.q is not None else self.qk_merged).shape[0]
        if n % self.v.shape[0]:
            raise ValueError(f"{n} query heads cannot share {self.v.shape[0]} kv heads evenly")

    @property
    def num_heads(self) -> int:
        return (self.q if self.q is not None else self.qk_merged).shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.v.shape[0]


def _xp(*arrays):
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def principal_cosines(a, b):
    """(..., D, H) x (..., D, H) -> (...,) mean cosine of the principal angles between the column spaces."""
    xp = _xp(a, b)
    qa, _ = xp.linalg.qr(a)
    qb, _ = xp.linalg.qr(b)
    s = xp.linalg.svd(xp.swapaxes(qa, -1, -2) @ qb, compute_uv=False)
    return xp.clip(s, 0.0, 1.0).mean(-1)


def _singular_measures(s, xp):
    """trace-free measures of singular values s (..., r): nuclear norm and effective rank."""
    nuclear = s.sum(-1)
    p = s / xp.maximum(nuclear[..., None], 1e-30)
    entropy = -(xp.where(p > 0, p * xp.log(xp.where(p > 0, p, 1.0)), 0.0)).sum(-1)
    return nuclear, xp.exp(entropy)


def form_measures(pq, pk) -> dict:
    """symmetry, trace_ratio, effective_rank of M = P^Q (P^K)^T for (..., D, H) inputs, via H x H matrices."""
    xp = _xp(pq, pk)
    t = lambda x: xp.swapaxes(x, -1, -2)  # noqa: E731
    fro2 = (t(pq) @ pq * (t(pk) @ pk)).sum((-2, -1))  # tr(P_k^T P_k P_q^T P_q) = ||M||_F^2
    c = t(pk) @ pq
    tr_mm = (c * t(c)).sum((-2, -1))  # tr(M M)
    trace = (pq * pk).sum((-2, -1))
    _, rq = xp.linalg.qr(pq)
    _, rk = xp.linalg.qr(pk)
    nuclear, eff = _singular_measures(xp.linalg.svd(rq @ t(rk), compute_uv=False), xp)
    return {"symmetry": (fro2 + tr_mm) / (2 * fro2), "trace_ratio": trace / nuclear, "effective_rank": eff}


def merged_measures(m) -> dict:
    """The same three measures of full (..., D, D) forms."""
    xp = _xp(m)
    sym = (m + xp.swapaxes(m, -1, -2)) / 2
    nuclear, eff = _singular_measures(xp.linalg.svd(m, compute_uv=False), xp)
    return {
        "symmetry": (sym**2).sum((-2, -1)) / (m**2).sum((-2, -1)),
        "trace_ratio": xp.trace(m, axis1=-2, axis2=-1) / nuclear,
        "effective_rank": eff,
    }


def head_measures(layer: LayerWeights, shift: int = 0) -> dict:
    """Every measure per query head, (N,) each (NaN where it does not apply). ``shift`` = 1 pairs head n's Q with
    the K and V of the next KV group, and K_n with V_{n+1} (the mismatched control)."""
    xp = _xp(layer.v, layer.q, layer.k, layer.qk_merged)
    n, g = layer.num_heads, layer.num_heads // layer.num_kv_heads
    kv_index = (np.arange(n) // g + shift) % layer.num_kv_heads
    v = layer.v[kv_index]
    nan = xp.full((n,), xp.nan)
    if layer.qk_merged is not None:
        out = merged_measures(layer.qk_merged) if shift == 0 else {k: nan for k in MEASURES[3:6]}
        return {"qk_cos": nan, "qv_cos": nan, "kv_cos": nan, **out, "kv_rank_err": nan}
    k = layer.k[kv_index]
    own_k = layer.k[np.arange(n) // g]
    return {
        "qk_cos": principal_cosines(layer.q, k),
        "qv_cos": principal_cosines(layer.q, v),
        "kv_cos": principal_cosines(own_k, v),
        **form_measures(layer.q, k),
        "kv_rank_err": nan if shift else xp.full((n,), kv_rank_error(layer.k, layer.v, xp)),
    }


def kv_rank_error(k, v, xp, fraction: int = 4):
    """Relative error of the best rank-(D / ``fraction``) approximation of [W^K, W^V]; k (K, D, H), v (K, D, Hv)."""
    d = k.shape[1]
    side_by_side = xp.concatenate([xp.moveaxis(w, 0, 1).reshape(d, -1) for w in (k, v)], axis=1)  # KDH -> D(KH)
    s = xp.linalg.svd(side_by_side, compute_uv=False)
    return xp.sqrt(xp.sum(s[max(1, d // fraction) :] ** 2) / xp.sum(s**2))


def _summary(per_head: dict) -> dict:
    """Means over heads (NaN-free keys only) and their spreads under ``<measure>_std``."""
    out = {}
    for name in MEASURES:
        values = np.asarray(per_head[name], np.float64)
        ok = np.isfinite(values)
        out[name] = float(values[ok].mean()) if ok.any() else None
        out[name + "_std"] = float(values[ok].std()) if ok.any() else None
    return out


def _pooled(per_heads: list[dict]) -> dict:
    return _summary({k: np.concatenate([np.asarray(p[k]) for p in per_heads]) for k in MEASURES})


def random_layer(like: LayerWeights, rng: np.random.Generator) -> LayerWeights:
    """Gaussian matrices of ``like``'s shapes."""
    draw = lambda x: None if x is None else rng.standard_normal(np.shape(x))  # noqa: E731
    return LayerWeights(v=draw(like.v), q=draw(like.q), k=draw(like.k), qk_merged=draw(like.qk_merged))


def _float64(lw: LayerWeights) -> LayerWeights:
    arrays = {f.name: None if (x := getattr(lw, f.name)) is None else np.asarray(x, np.float64)
              for f in dataclasses.fields(lw) if f.name != "form"}  # fmt: skip
    return LayerWeights(**arrays, form=lw.form)


# draws of the random control: each a layer's measures, 0.23 s at d_model 768 and 12 heads on this project's 2-core
# CPU (2026-11-30), so 1000 take four minutes; a typo's 10^12 ran for good
MAX_RANDOM_SEEDS = 1000


def analyze_layers(
    layers: list[LayerWeights],
    source: str,
    seed: int = 0,
    random_seeds: int = 3,
    initial: list[LayerWeights] | None = None,
    drift: list[dict] | None = None,
    decay_only: dict | None = None,
) -> dict:
    """The report: per-layer means over heads (with spreads), the random and the mismatched-heads controls, and
    with ``initial`` the same measures of the run's own initialisation W_0 (a trained run is compared with where
    it started, not only with fresh random matrices), ``drift`` (``|W - W_0| / |W_0|`` per kernel and layer) and
    ``decay_only``, its control: the drift weight decay alone gives over as many steps
    (:func:`qkvjax.sources.decay_only_drift`)."""
    if not layers:
        raise ValueError(f"{source}: no attention layers found")
    if not checks.is_integer(random_seeds) or not 1 <= random_seeds <= MAX_RANDOM_SEEDS:
        raise ValueError(f"--random-seeds={random_seeds!r}; allowed: an integer in [1, {MAX_RANDOM_SEEDS}]")
    layers = [_float64(lw) for lw in layers]
    per_layer = [head_measures(lw) for lw in layers]
    rng = np.random.default_rng(checks.seed("seed", seed))
    random = [head_measures(random_layer(layers[0], rng)) for _ in range(random_seeds)]
    report = {
        "source": source,
        "num_heads": layers[0].num_heads,
        "num_kv_heads": layers[0].num_kv_heads,
        # the largest possible effective rank: H for factored heads, D for a merged (D, D) form
        "max_rank": int(layers[0].v.shape[-1] if layers[0].qk_merged is None else layers[0].qk_merged.shape[-1]),
        "layers": [
            {"layer": i, **_summary(m)} | ({"form": lw.form} if lw.form else {})
            for i, (lw, m) in enumerate(zip(layers, per_layer, strict=True))
        ],
        "mean": _pooled(per_layer),
        "random": {"seeds": random_seeds, **_pooled(random)},
    }
    if initial is not None:
        report["initial"] = _pooled([head_measures(_float64(lw)) for lw in initial])
    if drift is not None:
        report["drift"] = drift
    if decay_only is not None:
        report["drift_decay_only"] = decay_only
    if layers[0].num_kv_heads > 1:
        report["mismatched"] = _pooled([head_measures(lw, shift=1) for lw in layers])
    else:  # one KV head: every query head reads the same K and V, so no head is mismatched
        report["mismatched"] = {name: None for name in MEASURES}
    return report


def _fmt(value, std) -> str:
    return f"{'n/a':>15}" if value is None else f"{value:>8.3f} ±{std:5.3f}"


def format_report(report: dict) -> str:
    lines = [
        f"{report['source']}: N={report['num_heads']} query heads, K={report['num_kv_heads']} kv heads; "
        "mean ± std over heads",
        f"{'layer':<11}" + "".join(f"{m:>16}" for m in MEASURES),
    ]
    rows = [(str(r["layer"]), r) for r in report["layers"]]
    rows += [("all layers", report["mean"]), ("random", report["random"]), ("mismatched", report["mismatched"])]
    rows += [("initial", report["initial"])] if "initial" in report else []
    for label, r in rows:
        form = f"  {r['form']}" if r.get("form") else ""  # an imported Gemma 4's K = V and K/V-reading layers
        lines.append(f"{label:<11}" + "".join(f"{_fmt(r.get(m), r.get(m + '_std')):>16}" for m in MEASURES) + form)
    lines.append(f"(random: Gaussian matrices of the same shapes, {report['random']['seeds']} draws; mismatched: "
                 "head n's Q against head n+1's K and V" + ("; initial: this run's own W_0" if "initial" in report
                                                           else "") + ")")  # fmt: skip
    if report.get("drift"):
        names = list(dict.fromkeys(k for r in report["drift"] for k in r if k != "layer"))  # every layer's kernels
        lines.append("relative drift |W - W_0|_F / |W_0|_F:")
        lines.append(f"{'layer':<11}" + "".join(f"{n:>12}" for n in names))
        for r in report["drift"]:  # a kernel a layer does not have (a CLA reader's w_k, w_v) is "-"
            lines.append(f"{r['layer']:<11}" + "".join(f"{r[n]:>12.3f}" if n in r else f"{'-':>12}" for n in names))
        if report.get("drift_decay_only"):
            d = report["drift_decay_only"]
            note = f"  (the run's optimizer, every gradient zero, {d['steps']} steps: weight decay alone)"
            lines.append(f"{'decay only':<11}" + "".join(f"{d['drift']:>12.3f}" for _ in names) + note)
    return "\n".join(lines)


def plot_report(report: dict, path: str) -> None:
    """A heat map: layers (then the controls) x measures; effective rank is coloured as a fraction of H."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qkvjax.workdir import replace_file

    rows = [(f"layer {r['layer']}", r) for r in report["layers"]]
    rows += [("random", report["random"]), ("mismatched", report["mismatched"])]
    rows += [("initial W_0", report["initial"])] if "initial" in report else []
    max_rank = report.get("max_rank") or 1
    values = np.full((len(rows), len(MEASURES)), np.nan)
    for i, (_, r) in enumerate(rows):
        for j, m in enumerate(MEASURES):
            if r.get(m) is not None:
                values[i, j] = r[m] / (max_rank if m == "effective_rank" else 1)
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.55 * len(rows)))
    im = ax.imshow(values, cmap="viridis", vmin=-0.2 if np.nanmin(values) < 0 else 0, vmax=1, aspect="auto")
    for i, (_, r) in enumerate(rows):
        for j, m in enumerate(MEASURES):
            # each cell shows the number its colour encodes (effective rank as its fraction of the maximum)
            text = "n/a" if r.get(m) is None else f"{values[i, j]:.2f}"
            shade = values[i, j]  # a missing value leaves its cell blank (white): its "n/a" is written in black
            ax.text(j, i, text, ha="center", va="center", fontsize=10,
                    color="white" if math.isfinite(shade) and shade < 0.6 else "black")  # fmt: skip
    ax.axhline(len(report["layers"]) - 0.5, color="white", lw=3)
    labels = [m if m != "effective_rank" else f"eff. rank / {max_rank:g}" for m in MEASURES]
    ax.set_xticks(range(len(MEASURES)), labels, fontsize=9)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    n, k = report.get("num_heads"), report.get("num_kv_heads")
    heads = f", {n} query heads on {k} K/V heads" if n and k and k < n else ""
    ax.set_title(f"W^Q, W^K, W^V similarity: {report['source']}{heads}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    replace_file(path, lambda target: fig.savefig(target, dpi=120))  # the old plot or the new, never a part
    plt.close(fig)


def weight_stats(params: dict, layers) -> dict:
    """Head-averaged ``symmetry`` and ``qk_cos`` of every block of a qkvjax LM (jit-able; for training logs).
    ``layers``: the model's ``layer_attention`` (a layer reading another's K/V is measured with its donor's)."""
    out = {}
    for i, layer in enumerate(layers):
        layer = layer_from_params(block_attention(params, layers, i), layer.config.tying)
        m = head_measures(layer)
        out[f"symmetry/layer_{i}"] = m["symmetry"].mean()
        if layer.q is not None:
            out[f"qk_cos/layer_{i}"] = m["qk_cos"].mean()
    return out


def attention_kernels(params: dict) -> dict:
    """``{"block_i": {"w_q": ..., ...}}``: the attention kernels of a qkvjax LM's params (no biases, no norms)."""
    return {
        name: {k: v for k, v in block["attention"].items() if k.startswith("w_")}
        for name, block in params.items()
        if name.startswith("block_")
    }


def drift_stats(params: dict, initial: dict) -> dict:
    """``drift/<kernel>/layer_i`` = |W - W_0|_F / |W_0|_F for every kernel in ``initial`` (as
    :func:`attention_kernels` gives it); numpy or jax arrays alike (jit-able, for training logs)."""
    out = {}
    for name, kernels in initial.items():
        for k, w0 in kernels.items():
            w = params[name]["attention"][k]
            xp = _xp(w0, w)
            relative = xp.linalg.norm((w - w0).ravel()) / xp.linalg.norm(w0.ravel())
            out[f"drift/{k}/layer_{name.removeprefix('block_')}"] = relative
    return out


def block_attention(params: dict, layers, i: int) -> dict:
    """Block i's attention params; for a layer reading another layer's K/V, with its donor's K/V kernels."""
    own = dict(params[f"block_{i}"]["attention"])
    if layers[i].kv_from is not None:
        donor = params[f"block_{layers[i].kv_from}"]["attention"]
        own |= {k: v for k, v in donor.items() if k.startswith(("w_", "b_")) and k not in own}
    return own


def layer_from_params(attention: dict, scheme) -> LayerWeights:
    """A qkvjax Attention's params -> LayerWeights: each role reads its group's kernel ``w_<group>`` (D, heads, H).

    A latent (MLA) layer's roles are the products of its factors, e.g. ``W^K_j = W^DKV diag(s) W^UK_j`` with the
    latent norm's scale s (the norm's per-token 1 / rms scales K and V of a token alike and leaves column spaces
    as they are); the decoupled rotary part is left out (it is shared by all heads and carries positions)."""
    if scheme.latent:
        xp = _xp(*attention.values())

        def product(down: str, scale: str, up: str):
            w = attention[down] * (attention[scale][None] if scale in attention else 1.0)
            return xp.einsum("DR,RNH->NDH", w, attention[up])  # N: the up-projection's heads (N or K)

        q = attention["w_q"].transpose(1, 0, 2) if "w_q" in attention else product("w_q_down", "q_norm_scale", "w_q_up")
        return LayerWeights(
            v=product("w_kv_down", "kv_norm_scale", "w_v_up"), q=q, k=product("w_kv_down", "kv_norm_scale", "w_k_up")
        )
    role = lambda r: None if scheme.group_of(r) is None else attention[f"w_{scheme.group_of(r)}"].transpose(1, 0, 2)  # noqa: E731
    merged = attention.get("w_qk_merged") if scheme.bilinear else None
    return LayerWeights(v=role("v"), q=role("q"), k=role("k"), qk_merged=merged)
