"""Checks made before a run trains: the workdir holds no other experiment, a checkpoint was trained with this
config, and the data suits the model. Each raises a ValueError that names the field or value and what to do."""

from __future__ import annotations

import dataclasses
import json

import jax

from qkvjax.config import Config, MeshConfig, TrainConfig, from_dict, to_dict
from qkvjax.data.pipeline import check_corpus
from qkvjax.train.state import learning_rate_schedule
from qkvjax.workdir import CONFIG_FILE, IMPORTED_STEP, exported_steps, params_only, path

# What may change between runs on one workdir: cadence, length and layout, not the experiment itself.
RESUMABLE_CHANGES = {
    "train.num_steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.max_to_keep",
    "train.peak_flops",
    "train.loss_chunk",  # the same loss, computed a chunk of positions at a time
    "train.log_weight_similarity",
    "train.skip_nonfinite",
    "train.tensorboard",
    "data.data_dir",
    "data.workers",
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "parallelism",
}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _as_now(saved: dict) -> dict:
    """A saved config as this version writes it: rebuilt through the dataclasses, so a field added since the run
    started takes its default (the value the run was trained with) instead of reading as a change."""
    try:
        return to_dict(from_dict(Config, saved))
    except (ValueError, TypeError):  # a field removed since, or no longer valid: compare what was written
        return saved


def check_workdir(workdir, config: Config, overwrite: bool) -> None:
    """Refuses a workdir that holds a run of another experiment, unless ``overwrite``; changes nothing (with
    ``overwrite`` the loop moves the old run aside once everything else is checked: :func:`qkvjax.workdir.set_aside`).

    An imported model's ``params/0`` survives ``overwrite`` (the new run starts from it), so a model config other
    than the one imported is refused either way."""
    workdir = path(workdir)
    folder = workdir / "checkpoints"
    foreign = sorted(p.name for p in folder.iterdir() if not (p.name.isdigit() or "orbax-checkpoint-tmp" in p.name)
                     ) if folder.is_dir() else []  # fmt: skip
    if not (workdir / CONFIG_FILE).exists() and foreign:
        # checkpoints/ holding what no qkvjax run writes (its steps are numbered folders) and no config.json beside
        # it: a user's own folder, which a run would write into and --overwrite would move aside and delete
        raise ValueError(
            f"workdir {workdir} holds a checkpoints/ folder but no run (no {CONFIG_FILE}; it holds {foreign[0]!r}): it "
            "is not a qkvjax run's, and neither resuming nor --overwrite may touch it; use another --workdir or move it"
        )
    old = {}
    if (workdir / CONFIG_FILE).exists():
        old = _flatten(_as_now(json.loads((workdir / CONFIG_FILE).read_text())))
    new = _flatten(to_dict(config))
    diff = sorted(k for k in set(old) | set(new) if k not in RESUMABLE_CHANGES and old.get(k) != new.get(k))
    if params_only(workdir):
        # imported (or exported) params and no run yet: any data and training settings, but the same model
        diff = [k for k in diff if k.startswith("model.")]
    model_diff = [k for k in diff if k.startswith("model.")]
    if old and model_diff and overwrite and imported(workdir):
        raise ValueError(
            f"workdir {workdir} holds an imported model (params/{IMPORTED_STEP}) of another model config "
            f"({_differences(model_diff, old, new)}); --overwrite restarts a run from the imported weights and keeps "
            "them, so the model must stay the same: use another --workdir for another model"
        )
    if old and diff and not overwrite:
        details = _differences(diff, old, new)
        raise ValueError(
            f"workdir {workdir} holds a run of another config ({details}); use another --workdir, or pass "
            "--overwrite to replace that run (it is kept aside until the new run's first checkpoint)"
        )


def imported(workdir) -> bool:
    """The workdir holds an imported model: ``params/0`` (training itself exports params at steps >= 1 only)."""
    return IMPORTED_STEP in exported_steps(workdir)


FIT_MARGIN = 1.5  # qkvjax.plan's total against XLA's own plan: 0.76-1.15x on GPUs, 0.38-0.87x on this CPU (test_plan)


def check_fits(config: Config, abstract) -> None:
    """Refuses a run whose step cannot fit in its devices' memory, before any data is read or anything compiles:
    :mod:`qkvjax.plan`'s estimate over ``FIT_MARGIN`` times what a device holds (a CPU's devices share the
    machine's memory). Only what surely cannot fit is refused (the estimate was at most 1.15x XLA's own plan where
    measured): on a CPU such a run is killed by the operating system, with no message, once its memory is touched;
    on a GPU it fails after compiling. ``abstract``: the run's boxed abstract train state."""
    from qkvjax import checks
    from qkvjax.plan import GIB, plan

    if config.parallelism == "pmap":  # data parallel on every device, whatever the (unused) mesh says
        config = dataclasses.replace(config, mesh=MeshConfig())
    p = plan(config, jax.device_count(), abstract=abstract)
    local = jax.local_devices()
    have = checks.device_memory(local[0]) // (len(local) if local[0].platform == "cpu" else 1)
    if p.total > FIT_MARGIN * have:
        parts = ", ".join(f"{name} {getattr(p, name) / GIB:,.2f}" for name in ("params", "optimizer", "gradients"))
        raise ValueError(
            f"a training step needs about {p.total / GIB:,.1f} GiB per device ({parts}, activations of "
            f"{p.micro_batch:,} x {config.seq_len:,} tokens {p.activations / GIB:,.1f}), over {FIT_MARGIN}x the "
            f"{have / GIB:,.1f} GiB a device has here; allowed: a smaller train.batch_size, more "
            "train.grad_accum_steps, model.remat=full or more devices (`qkvjax plan` shows the sums)"
        )


def check_splits(splits: dict, config: Config) -> None:
    """Every split the run touches is usable, and the model's vocabulary covers the bytes in it."""
    check_corpus(splits["train"], config.seq_len, "train")
    if len(splits["validation"]) < 2:
        raise ValueError(
            f"the validation split has {len(splits['validation'])} bytes; evaluation needs at least 2 (the split is "
            "the 5% of the text after the training 90%): use a longer text"
        )
    top = max(int(s.max()) for s in splits.values() if len(s))
    if top >= config.model.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} does not cover the data: byte value {top} occurs in it; "
            "use vocab_size >= 256 for byte-level text"
        )


def check_resume(saved: dict | None, config: Config, step: int, overwrite: bool) -> None:
    """The checkpoint's own config against the requested one: only resumable fields may differ."""
    if saved is None:
        return
    old, new = _flatten(_as_now(saved)), _flatten(to_dict(config))
    diff = sorted(k for k in set(old) | set(new) if k not in RESUMABLE_CHANGES and k in old and old[k] != new.get(k))
    if diff and not overwrite:
        raise ValueError(
            f"checkpoint step {step} was trained with another config ({_differences(diff, old, new)}); use another "
            "--workdir, or pass --overwrite to delete that run and start again"
        )
    if step > config.train.num_steps and not overwrite:
        raise ValueError(
            f"the run is already at checkpoint step {step}, past train.num_steps={config.train.num_steps}: nothing "
            f"to train, and nothing was changed; pass a train.num_steps above {step} to train further, or "
            "--overwrite to start again"
        )
    if old.get("train.num_steps") != config.train.num_steps:
        before = learning_rate_schedule(from_dict(TrainConfig, saved["train"]))(step)
        after = learning_rate_schedule(config.train)(step)
        _say(
            f"train.num_steps {old.get('train.num_steps')} -> {config.train.num_steps}: the warmup-cosine schedule "
            f"is recomputed for the new length, so the learning rate at step {step} moves from {float(before):.3g} "
            f"to {float(after):.3g}"
        )


def _differences(keys: list[str], old: dict, new: dict, shown: int = 8) -> str:
    """``a: x -> y`` for the first ``shown`` keys, then how many more (every one is in the two config.json files)."""
    text = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:shown])
    return text + (f", and {len(keys) - shown} more: {', '.join(keys[shown:])}" if len(keys) > shown else "")


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(line, flush=True)
