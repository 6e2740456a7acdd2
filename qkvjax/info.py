"""What a workdir holds: checkpoints, config, parameters per component, the last metrics."""

from __future__ import annotations

import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from etils import epath

from qkvjax.attention import stack_cost
from qkvjax.config import to_dict
from qkvjax.evaluate import resolve_step
from qkvjax.models.encoder import EncoderConfig, model_of, parameter_count
from qkvjax.models.lm import kv_cache_bytes_per_row
from qkvjax.train import checkpoint
from qkvjax.workdir import (
    chat_template,
    checkpoint_steps,
    exported_steps,
    load_config,
    params_only,
    path,
    read_metrics,
    sampling_defaults,
    stop_ids,
)


def _size(folder: epath.Path) -> int:
    return sum(file.stat().length for _, file in checkpoint.files_under(folder))


def parameter_breakdown(params) -> dict[str, int]:
    """Parameters summed over layers by component: ``attention/w_qk``, ``mlp/w_in``, ``embed``, ..."""
    counts: dict[str, int] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(k, "key", k)) for k in key_path]
        if names[0].startswith("block_"):
            names = names[1:]
        key = "/".join(names)
        counts[key] = counts.get(key, 0) + int(leaf.size)
    return counts


def describe(workdir: str) -> dict:
    """A JSON-able summary of a training run's workdir."""
    if params_only(workdir):  # imported, not trained here yet
        config, folders = load_config(workdir), [path(workdir) / "params" / str(s) for s in exported_steps(workdir)]
    elif not checkpoint_steps(workdir):  # a run before its first save: its config, plan and progress exist already
        config, folders = load_config(workdir), []
    else:
        config, mngr, _ = resolve_step(workdir, None)
        folders = [epath.Path(mngr.directory) / str(step) for step in sorted(mngr.all_steps())]
    checkpoints = []
    for folder in folders:
        try:
            mtime, size = folder.stat().mtime, _size(folder)
        except FileNotFoundError:  # a live run's max_to_keep removed it after the listing: no longer a checkpoint
            continue
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))
        checkpoints.append({"step": int(folder.name), "time": stamp, "bytes": size})
    model = model_of(config.model)
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, config.seq_len), jnp.int32))
    breakdown = parameter_breakdown(nn.meta.unbox(abstract)["params"])
    train_records, eval_records = read_metrics(workdir)
    last_train = train_records[-1] if train_records else None
    last_eval = eval_records[-1] if eval_records else None
    m = config.model
    layers = [
        {"layer": i, "scheme": spec.config.scheme, "kv_heads": spec.config.kv_heads, "kv_from": spec.kv_from,
         "attention_params": c.params, "attention_flops_per_token": c.flops_per_token,
         "kv_cache_bytes_per_token": c.kv_cache_bytes_per_token}
        for i, (spec, c) in enumerate(zip(m.layer_attention, stack_cost(m.layer_attention, m.d_model, config.seq_len),
                                          strict=True))
    ]  # fmt: skip
    return {
        "workdir": os.fspath(path(workdir)),
        "model": "encoder" if isinstance(m, EncoderConfig) else "decoder",
        "scheme": m.attention.scheme,
        "layers": m.layers,
        "attention_by_layer": layers,
        "kv_cache_bytes_per_token": sum(x["kv_cache_bytes_per_token"] for x in layers),
        "kv_cache_bytes_per_row": None if isinstance(m, EncoderConfig) else kv_cache_bytes_per_row(m),
        "stop_ids": list(stop_ids(workdir)),  # an imported model's eos ids, where `sample` ends a row
        "chat_template": chat_template(workdir) is not None,  # an imported instruct model's (`sample --chat`)
        "sampling": sampling_defaults(workdir),  # an imported model's own settings, `sample`'s defaults for it
        "checkpoints": checkpoints,
        "parameters": {"total": parameter_count(config.model), "by_component": breakdown},
        "last_train_metrics": last_train,
        "last_eval_metrics": last_eval,
        "config": to_dict(config),
    }


def _metrics(m: dict | None) -> str:
    """One logged row for a person: 5 significant digits (``--json`` keeps every digit)."""
    if not m:
        return "none logged yet"
    return "  ".join(f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items() if k != "eval")


def format_description(info: dict) -> str:
    lines = [f"workdir {info['workdir']}  {info['model']}  scheme {info['scheme']}", "checkpoints:"]
    for c in info["checkpoints"]:
        lines.append(f"  step {c['step']:>8}  {c['time']}  {c['bytes'] / 2**20:10.2f} MiB")
    if not info["checkpoints"]:
        lines[-1] += " none yet (the first is saved at train.checkpoint_every, and when the run ends or is stopped)"
    pattern = f"  layers {info['layers']!r}" if info["layers"] else ""
    lines[0] += pattern
    row = info.get("kv_cache_bytes_per_row")
    at_max_len = "" if row is None else f", {row:,} per row at max_len (a windowed layer keeps its last W)"
    lines.append(f"KV cache: {info['kv_cache_bytes_per_token']:,} bytes per token in all{at_max_len}")
    lines.append("attention per layer (FLOPs forward per token at seq_len; KV bytes per token):")
    for x in info["attention_by_layer"]:
        reads = f"  K/V of layer {x['kv_from']}" if x["kv_from"] is not None else ""
        lines.append(
            f"  {x['layer']:>3} {x['scheme']:<12} K={x['kv_heads']:<3} params {x['attention_params']:>11,} "
            f"FLOPs {x['attention_flops_per_token']:>13,} KV B/tok {x['kv_cache_bytes_per_token']:>7,}{reads}"
        )
    if info["stop_ids"]:
        lines.append(f"sampling ends at eos ids {info['stop_ids']} (`sample --ignore-eos` goes on)")
    if info["chat_template"]:
        lines.append("chat template: `sample --chat` writes each prompt as a user turn in it")
    if info["sampling"]:
        from qkvjax.sample import describe_sampling

        own = describe_sampling(info["sampling"])
        lines.append(f"sampling: {own} (the model's own, from its generation_config.json: `sample`'s defaults)")
    lines.append(f"parameters: {info['parameters']['total']:,}")
    for name, n in info["parameters"]["by_component"].items():
        lines.append(f"  {name:<32} {n:>12,}")
    lines.append(f"last train metrics: {_metrics(info['last_train_metrics'])}")
    lines.append(f"last eval metrics:  {_metrics(info['last_eval_metrics'])}")
    lines.append("config: " + json.dumps(info["config"], indent=2))
    return "\n".join(lines)
