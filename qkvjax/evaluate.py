"""Restoring checkpoints for use: ``load`` for Python callers, ``evaluate`` for a whole split."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec

from qkvjax import checks
from qkvjax.attention import kernels
from qkvjax.config import Config, MeshConfig, from_dict, require_decoder
from qkvjax.data import SPLITS
from qkvjax.data.pipeline import check_stride
from qkvjax.data.tokenizer import check_vocab, load_tokenizer, tokenize_splits
from qkvjax.models.encoder import model_of
from qkvjax.train import checkpoint
from qkvjax.train.mesh import batch_sharding, make_mesh
from qkvjax.train.state import abstract_state, make_optimizer
from qkvjax.train.step import make_eval_step, mean_loss
from qkvjax.workdir import (
    CONFIG_FILE,
    check_data,
    exported_steps,
    framed_digest,
    load_config,
    params_only,
    path,
    restore_exported,
    splits_digest,
)


def resolve_step(workdir: str, step: int | None) -> tuple[Config, object, int]:
    """(config, read-only checkpoint manager, step), with errors that say what the workdir holds. The config is
    the one saved in the checkpoint; without ``step``, a newest step whose config is damaged is skipped (with a
    warning) for the newest one whose config reads."""
    step = checks.integer_value("step", step, minimum=0, none="the newest")  # "20" or 20.0 would match no step
    workdir = path(workdir)
    has_checkpoints = (workdir / "checkpoints").is_dir()
    if not (workdir / CONFIG_FILE).exists() and not has_checkpoints:
        raise ValueError(f"workdir {workdir} holds no run (no {CONFIG_FILE}); pass the --workdir of a training run")
    if not has_checkpoints:
        raise ValueError(f"workdir {workdir} has no checkpoint yet (no checkpoints/ directory)")
    mngr = checkpoint.manager(workdir, read_only=True)
    steps = sorted(mngr.all_steps())
    if not steps:
        raise ValueError(f"workdir {workdir} has no complete checkpoint")
    if step is not None and step not in steps:
        raise ValueError(f"checkpoint step {step} does not exist in {workdir}; available steps: {steps}")
    candidates = [step] if step is not None else steps[::-1]
    for candidate in candidates:
        try:
            return checkpoint_config(mngr, candidate), mngr, candidate
        except checkpoint.CorruptCheckpointError as e:
            if candidate == candidates[-1]:
                raise
            print(f"warning: {e}; using the previous checkpoint", file=sys.stderr)
    raise AssertionError("unreachable")


def checkpoint_config(mngr, step: int) -> Config:
    return from_dict(Config, checkpoint.restore_config(mngr, step))


def restore_params(workdir: str, step: int | None = None, mesh=None):
    """(model, params, config, step): the params of a checkpoint, replicated over ``mesh`` (default: every
    device, data parallel). The whole train state is restored strictly, so a checkpoint of another model fails
    with the list of differences rather than loading part of it. Without ``step``, a damaged newest checkpoint
    is skipped (with a warning) for the newest one that restores; any other failure to read stops. A workdir
    without checkpoints but with params-only copies (``qkvjax import``) restores those."""
    return restore_with_data_state(workdir, step, mesh)[:4]


def restore_with_data_state(workdir: str, step: int | None = None, mesh=None):
    """(model, params, config, step, data_state): :func:`restore_params` and the data iterator's state saved in
    the same checkpoint (None for params-only copies), read together, so a step a running trainer rotates away
    cannot be read half (what ``qkvjax convert`` carries over to the converted run)."""
    mesh = mesh or make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
    if params_only(workdir):
        return (*_restore_exported(workdir, step, mesh), None)
    for attempt in range(3):  # a step a running trainer rotates away while it is read: list the steps again
        try:
            return _restore_checkpoint(workdir, step, mesh)
        except checkpoint.CheckpointVanishedError as e:
            if step is not None or attempt == 2:
                raise
            print(f"note: {e}; reading the newest checkpoint again", file=sys.stderr)
    raise AssertionError("unreachable")


def _restore_checkpoint(workdir: str, step: int | None, mesh):
    _, mngr, chosen = resolve_step(workdir, step)
    candidates = [chosen] if step is not None else sorted((s for s in mngr.all_steps() if s <= chosen), reverse=True)
    replicated = NamedSharding(mesh, PartitionSpec())
    for candidate in candidates:
        try:
            config = checkpoint_config(mngr, candidate)
            model = model_of(config.model)
            abstract = nn.meta.unbox(abstract_state(model, config, make_optimizer(config.train)))
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), abstract)
            state, data_state, _ = checkpoint.restore(mngr, candidate, target)
        except checkpoint.CorruptCheckpointError as e:
            if candidate == candidates[-1]:
                raise
            print(f"warning: {e}; using the previous checkpoint", file=sys.stderr)
            continue
        mngr.close()
        return model, state.params, config, candidate, data_state
    raise AssertionError("unreachable")


def _restore_exported(workdir: str, step: int | None, mesh):
    step = checks.integer_value("step", step, minimum=0, none="the newest")
    config = load_config(workdir)
    steps = exported_steps(workdir)
    if step is not None and step not in steps:
        raise ValueError(f"params step {step} does not exist in {path(workdir)}/params; available steps: {steps}")
    step = steps[-1] if step is None else step
    model = model_of(config.model)  # an imported BERT's workdir holds an encoder
    abstract = nn.meta.unbox(abstract_state(model, config, make_optimizer(config.train))).params
    replicated = NamedSharding(mesh, PartitionSpec())
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), abstract)
    return model, restore_exported(workdir, step, target), config, step


def load(workdir: str, step: int | None = None):
    """``(model, params, config)`` of a training run's checkpoint (the newest unless ``step`` is given), ready
    for ``model.apply({"params": params}, tokens)``."""
    model, params, config, _ = restore_params(workdir, step)
    return model, params, config


def evaluate(
    workdir: str,
    step: int | None = None,
    split: str = "validation",
    source_path: str | None = None,
    data_dir: str | None = None,
    stride: int | None = None,
    max_batches: int | None = None,
    batch_size: int | None = None,
) -> dict:
    """Loss, bits per byte and perplexity of a checkpoint over a whole split: every target once, in windows of the
    run's ``seq_len`` that do not overlap, or with ``stride`` S < seq_len in windows S apart that each score their
    last S targets (:func:`qkvjax.data.pipeline.eval_batches`: at least seq_len - S tokens of context each).

    ``batch_size``: windows per call (default: the run's training batch; rounded up to a multiple of the devices).
    Every target is scored once whatever it is (the last batch is padded and its padding weighs 0), so it changes
    only the speed and the order of the float sum; with ``max_batches`` it also sets how many windows are sampled."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: {list(SPLITS)}")
    saved = load_config(workdir)  # refusals before anything is restored or compiled
    require_decoder(saved, "eval")
    given = {k: v for k, v in (("source_path", source_path), ("data_dir", data_dir)) if v is not None}
    dataclasses.replace(saved.data, **given)  # DataConfig's own checks of the paths (UTF-8: TFDS fails on others)
    if stride is not None:
        check_stride(stride, saved.seq_len)
    if max_batches is not None:
        checks.integer_value("max_batches", max_batches, allowed="an integer >= 1 (batches of windows scored)")
    if batch_size is not None:
        checks.integer_value("batch_size", batch_size, allowed="an integer >= 1 (windows scored per call)")
        # refused here, not killed by the OS: a window holds its float32 logits about twice (logits, log-softmax)
        # and each layer's activations, about 8 D floats a position
        m = saved.model
        window = saved.seq_len * 4 * (2 * m.vocab_size + 8 * m.d_model * m.num_layers)
        if batch_size * window > (memory := checks.available_memory()):
            raise ValueError(f"batch_size={batch_size:,}: about {batch_size * window / 2**30:,.1f} GiB of logits and "
                             f"activations, {memory / 2**30:,.1f} GiB available; allowed: at most "
                             f"{memory // window:,} windows")  # fmt: skip
    if saved.data.prepared is not None:
        if source_path is not None or data_dir is not None:
            raise ValueError("--source-path and --data-dir name a byte corpus; this run read the prepared corpus "
                             f"{saved.data.prepared}")  # fmt: skip
        if split not in ("train", "validation"):
            raise ValueError(f"split={split!r}; a prepared corpus has train and validation")

    mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
    model, params, config, step = restore_params(workdir, step, mesh)
    if config.data.prepared is not None:
        tokens, tokens_per_byte = _prepared_split(workdir, config, split)
    else:
        tokens, tokens_per_byte = _byte_split(workdir, config, split, source_path, data_dir)
    n = jax.device_count()
    batch_size = -(-(batch_size or config.train.batch_size) // n) * n
    sharding = batch_sharding(mesh)
    eval_step = kernels.falls_back_from_cudnn(jax.jit(make_eval_step(model)), lambda line: print(line, file=sys.stderr))
    loss, count = mean_loss(
        eval_step,
        params,
        tokens,
        config.seq_len,
        batch_size,
        lambda b: {k: jax.make_array_from_process_local_data(sharding, v) for k, v in b.items()},
        max_batches,
        stride=stride,
    )
    return {
        "step": step,
        "scheme": config.model.attention.scheme,
        "split": split,
        "stride": stride or config.seq_len,  # seq_len: windows that do not overlap
        "max_batches": max_batches,  # None: the whole split
        "batch_size": batch_size,
        "tokens": count,
        "loss": loss,
        "bits_per_byte": loss / math.log(2) * tokens_per_byte,
        "perplexity": math.exp(loss),
    }


def _prepared_split(workdir, config, split: str):
    """A prepared corpus' split and its tokens per byte, after checking it is the corpus the run recorded."""
    from qkvjax.data.shards import check_prepared, open_corpus

    corpus = open_corpus(config.data.prepared)
    check_prepared(corpus, config.model.vocab_size, config.data.tokenizer, workdir)
    changed = check_data(workdir, corpus.sha256, f"{config.data.prepared}/manifest.json", record=False)
    if changed:
        print(changed, file=sys.stderr)
    return corpus.split(split), corpus.tokens_per_byte(split)


def _byte_split(workdir, config, split: str, source_path, data_dir):
    """A byte corpus' split as token ids and its tokens per byte."""
    from qkvjax.data.builders import load_splits

    splits = load_splits(
        config.data.dataset,
        source_path or config.data.source_path,
        os.path.expanduser(data_dir or config.data.data_dir),
    )
    changed = check_data(
        workdir, splits_digest(splits), source_path or config.data.source_path, record=False,
        also=(framed_digest(splits),),
    )  # fmt: skip
    if changed:
        print(changed, file=sys.stderr)
    tokenizer = load_tokenizer(config.data.tokenizer, workdir)
    if config.data.tokenizer is not None:
        check_vocab(tokenizer, config.model.vocab_size)
    byte_count = len(splits[split])
    tokens = tokenize_splits({split: splits[split]}, tokenizer)[split]
    return tokens, len(tokens) / max(1, byte_count)
