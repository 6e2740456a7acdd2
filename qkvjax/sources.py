"""Where ``qkvjax analyze`` finds attention projections: a qkvjax run, or a safetensors file of a PyTorch model.

safetensors weights follow ``nn.Linear``: ``W`` is ``[out, in]`` and ``y = x @ W.T + b``; heads split the output
dimension contiguously, so head n's (D, H) projection is ``W[n H:(n + 1) H].T``. Where each layout keeps q, k and
v is its :class:`~qkvjax.hf.layouts.Projections` entry (``bert``: ``query``/``key``/``value``, each [D, D];
``gpt2``: one fused [D, 3 D] Conv1D weight, stored ``[in, out]``; ``llama``: q [N H, D], k and v [K H, D]).
Hugging Face permutes rows inside each q/k head for its rotary layout; the measures are invariant to that.

Read with numpy and ``safetensors`` only (no torch, no transformers).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np

from qkvjax.analyze import LayerWeights, block_attention, layer_from_params
from qkvjax.config import TrainConfig
from qkvjax.hf.layouts import LAYOUTS, Projections

FORMATS: dict[str, Projections] = {name: lay.projections for name, lay in LAYOUTS.items() if lay.projections}


def heads_from_config(path: str, fmt: str) -> tuple[int | None, int | None]:
    """(N, K) from a Hugging Face ``config.json`` beside the weights, or (None, None) if there is none."""
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
    if not os.path.exists(cfg_path):
        return None, None
    with open(cfg_path) as f:
        cfg = json.load(f)
    where = FORMATS[fmt]
    return cfg.get(where.heads_key), cfg.get(where.kv_heads_key) if where.kv_heads_key else None


def _split(w: np.ndarray, heads: int, name: str, expected: str) -> np.ndarray:
    """[heads H, D] (nn.Linear) -> (heads, D, H)."""
    if w.ndim != 2 or w.shape[0] % heads:
        raise ValueError(f"tensor {name} has shape {tuple(w.shape)}; expected {expected} with {heads} heads")
    h = w.shape[0] // heads
    return w.reshape(heads, h, w.shape[1]).transpose(0, 2, 1)  # (heads H, D) -> (heads, H, D) -> (heads, D, H)


def _fused(name: str, w: np.ndarray, n: int) -> LayerWeights:
    """q, k, v from one Conv1D [D, 3 D] weight (``[in, out]``: the transpose of nn.Linear's)."""
    if w.ndim != 2 or w.shape[1] != 3 * w.shape[0]:
        raise ValueError(f"tensor {name} has shape {tuple(w.shape)}; expected a fused Conv1D [D, 3 D]")
    d = w.shape[0]
    q, k, v = (_split(w[:, j * d : (j + 1) * d].T, n, name, f"[D, 3 D] = [{d}, {3 * d}]") for j in range(3))
    return LayerWeights(q=q, k=k, v=v)


def _separate(roles: dict[str, tuple[str, np.ndarray]], n: int, k: int) -> LayerWeights:
    """q [N H, D], k and v [K H, D] (nn.Linear), each checked against q's head width and D."""
    d = roles["q"][1].shape[-1]
    q = _split(roles["q"][1], n, roles["q"][0], f"[N H, D] = [{n} x H, D]")
    kk = _split(roles["k"][1], k, roles["k"][0], f"[K H, D] = [{k} x H, D]")
    v = _split(roles["v"][1], k, roles["v"][0], f"[K H, D] = [{k} x H, D]")
    for role, arr, heads in (("q", q, n), ("k", kk, k), ("v", v, k)):
        name = roles[role][0]
        if arr.shape[1:] != (d, q.shape[2]):
            raise ValueError(
                f"tensor {name} has shape {tuple(roles[role][1].shape)}; expected [{heads * q.shape[2]}, {d}] "
                f"({heads} heads of width {q.shape[2]}, model width {d})"
            )
    return LayerWeights(q=q, k=kk, v=v)


def load_safetensors(path: str, fmt: str, num_heads: int | None = None, num_kv_heads: int | None = None):
    """LayerWeights of every layer, in order."""
    from safetensors.numpy import load_file

    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"--format={fmt!r}; allowed: {sorted(FORMATS)}")
    if not os.path.isfile(path):
        raise ValueError(f"--safetensors={path!r} is not a file")
    where = FORMATS[fmt]
    cfg_n, cfg_k = heads_from_config(path, fmt)
    n = num_heads or cfg_n
    k = num_kv_heads or cfg_k or n
    if not n:
        raise ValueError(f"{path}: no config.json beside it gives the number of heads; pass --num-heads")
    if n < 1 or k < 1 or n % k:
        raise ValueError(f"num_heads={n}, num_kv_heads={k}; allowed: integers >= 1 with K dividing N")
    try:
        tensors = load_file(path)
    except Exception as e:  # safetensors' own error types: a header that does not parse, offsets past the end
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--safetensors={path!r} is not a readable safetensors file: {first}") from None
    found: dict[int, dict[str, tuple[str, np.ndarray]]] = {}
    for name, value in tensors.items():
        if match := re.match(where.pattern, name):
            role = where.roles[match.group(2)]
            found.setdefault(int(match.group(1)), {})[role] = (name, np.asarray(value, np.float64))
    if not found:
        sample = ", ".join(sorted(tensors)[:4])
        example = where.example
        raise ValueError(f"{path} is not in the {fmt} layout: no tensor like {example!r} (the file has {sample}, ...)")
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"{path}: {fmt} layers {sorted(found)} are not numbered 0..{len(found) - 1}")
    layers = []
    for i in range(len(found)):
        roles = found[i]
        if "qkv" in roles:
            layers.append(_fused(*roles["qkv"], n))
            continue
        missing = sorted({"q", "k", "v"} - set(roles))
        if missing:
            want = where.example.replace(".0.", f".{i}.")
            raise ValueError(f"{path}: layer {i} has no {', '.join(missing)} projection (like {want})")
        layers.append(_separate(roles, n, k))
    return layers


def _attention_only(params) -> dict:
    return {k: {"attention": {kk: np.asarray(vv, np.float64) for kk, vv in v["attention"].items()}}
            for k, v in params.items() if k.startswith("block_")}  # fmt: skip


def _layers(params: dict, spec) -> list:
    return [dataclasses.replace(layer_from_params(block_attention(params, spec, i), spec[i].config.tying),
                                form=_form(spec[i])) for i in range(len(spec))]  # fmt: skip


def _form(layer) -> str:
    """What ties a layer, in words: its scheme (K = V, ...), the layer whose K/V it reads, its window."""
    att, tying = layer.config, layer.config.tying
    parts = [att.scheme + (" (K = V)" if tying.group_of("k") == tying.group_of("v") else "")]
    parts = parts if att.scheme != "separate" else []
    parts += [] if layer.produces_kv else [f"reads layer {layer.kv_from}'s K/V"]
    parts += [f"window {att.sliding_window}"] if att.sliding_window else []
    return ", ".join(parts)


def load_workdir(workdir: str, step: int | None = None, with_initial: bool = False):
    """(LayerWeights of every block, label) of a qkvjax run's checkpoint; with ``with_initial``, also the run's
    initialisation W_0 as LayerWeights, the relative drift of every attention kernel (:func:`drift`) and what
    weight decay alone would have moved it (:func:`decay_only_drift`)."""
    from qkvjax.evaluate import restore_params

    _, params, config, step = restore_params(workdir, step)
    spec = config.model.layer_attention
    params = _attention_only(params)
    label = config.model.attention.scheme + (f", layers {config.model.layers!r}" if config.model.layers else "")
    out = _layers(params, spec), f"{os.path.basename(os.path.abspath(workdir))} step {step} ({label})"
    if not with_initial:
        return out
    initial = _attention_only(initial_params(workdir, config))
    return (*out, _layers(initial, spec), drift(params, initial), decay_only_drift(config.train, step))


def decay_only_drift(train: TrainConfig, steps: int) -> dict:
    """The control drift is read against: ``|W - W_0|_F / |W_0|_F`` after ``steps`` updates of the run's own
    optimizer and schedule with every gradient zero. AdamW's moments then stay 0, so each step only shrinks a
    decayed kernel, W <- (1 - lr_t wd) W (Loshchilov & Hutter 2019): the drift is 1 - prod_t (1 - lr_t wd), the
    same for every kernel of two dimensions or more and independent of W_0, so one (2, 2) kernel measures it."""
    import jax
    import jax.numpy as jnp
    import optax

    from qkvjax.train.state import make_optimizer

    tx = make_optimizer(train)
    w0 = {"w": jnp.ones((2, 2), jnp.float32)}
    zeros = jax.tree.map(jnp.zeros_like, w0)

    def body(_, carry):
        w, state = carry
        updates, state = tx.update(zeros, state, w)
        return optax.apply_updates(w, updates), state

    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction raises a float to its int32 count
        w, _ = jax.jit(lambda w: jax.lax.fori_loop(0, steps, body, (w, tx.init(w))))(w0)
    return {"steps": int(steps), "drift": float(jnp.linalg.norm(w["w"] - w0["w"]) / jnp.linalg.norm(w0["w"]))}


def initial_params(workdir: str, config):
    """W_0 of a run: its params-only copy of step 0 (an imported model, trained since or not), else the
    initialisation recomputed from the run's seed (``create_state`` draws it from ``PRNGKey(config.seed)``)."""
    from qkvjax.models.encoder import model_of
    from qkvjax.train.state import create_state, make_optimizer
    from qkvjax.workdir import exported_steps

    if 0 in exported_steps(workdir):  # imported at step 0 (trained since or not)
        from qkvjax.config import MeshConfig
        from qkvjax.evaluate import _restore_exported
        from qkvjax.train.mesh import make_mesh

        return _restore_exported(workdir, 0, make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1)))[1]
    return create_state(model_of(config.model), config, make_optimizer(config.train), None).params


def drift(params: dict, initial: dict) -> list[dict]:
    """Per layer, ``|W - W_0|_F / |W_0|_F`` of every attention kernel (``w_*``) the layer owns."""
    from qkvjax.analyze import attention_kernels, drift_stats

    stats = drift_stats(params, attention_kernels(initial))
    rows = []
    for name in sorted(attention_kernels(initial), key=lambda n: int(n.removeprefix("block_"))):
        i = name.removeprefix("block_")
        row = {"layer": int(i)}
        for key, value in stats.items():
            kernel, layer = key.split("/")[1:]
            if layer == f"layer_{i}":
                row[kernel] = float(value)
        rows.append(row)
    return rows
