"""The training loop: the only place that logs, evaluates and checkpoints around the pure ``train_step``.

Rerunning the same command on the same workdir resumes from the newest complete checkpoint (state, RNG, data
iterator), so the run continues exactly as if never stopped. SIGTERM (preemption) and SIGINT (Ctrl-C) checkpoint
and stop the run: ``train`` then raises :class:`Interrupted` (the CLI exits with 128 + the signal's number, as a
shell does), so no caller mistakes a stopped run for a finished one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from qkvjax.analyze import attention_kernels, drift_stats, weight_stats
from qkvjax.data.tokenizer import check_vocab, load_tokenizer, tokenize_splits
from qkvjax.models.lm import DecoderLM, param_count, train_flops_per_token
from qkvjax.perf import measure_peak_flops
from qkvjax.train import checkpoint
from qkvjax.train.checks import check_resume, check_splits, check_workdir, imported
from qkvjax.train.config import Config, require_decoder, to_dict, to_json
from qkvjax.train.mesh import batch_sharding, data_parallel_size, make_mesh, shardings_for
from qkvjax.train.progress import TrainProgress
from qkvjax.train.state import abstract_state, create_state, learning_rate_schedule, make_optimizer
from qkvjax.train.step import make_eval_step, make_train_step, mean_loss
from qkvjax.workdir import (  # noqa: F401
    CONFIG_FILE,
    METRICS_FILE,
    WorkdirLock,
    check_data,
    drop_aside,
    export_params,
    exported_steps,
    is_remote,
    json_safe,
    load_config,
    metric_lines,
    restore_exported,
    set_aside,
    splits_digest,
    write_text,
)
from qkvjax.workdir import path as workdir_path


class MetricsWriter:
    """metrics.jsonl (every record, full precision) and TensorBoard, on process 0 only.

    Locally each record is appended as it comes. On an object store (no append) the records are kept and the file
    is rewritten whole at each :meth:`flush` (the loop flushes at evaluations, checkpoints and the end), and the
    TensorBoard events are written to a local folder and uploaded at the same moments.
    """

    def __init__(self, workdir, resume_step: int | None, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.tb = None
        self.workdir = workdir_path(workdir)
        self.path = self.workdir / METRICS_FILE
        self.remote = is_remote(self.workdir)
        if not self.enabled:
            return
        self.lines = []
        if self.path.exists():
            # Records written after the checkpoint we resume from are about to be recomputed: drop them so the
            # curve continues without duplicates (and a fresh start drops a failed earlier attempt's records).
            self.lines = [
                line + "\n"
                for line, record in metric_lines(self.path)
                if resume_step is not None and record["step"] <= resume_step
            ]
            write_text(self.path, "".join(self.lines))
        if not tensorboard:
            return
        from tensorboardX import SummaryWriter  # only when events are wanted

        # One TensorBoard run per workdir: each (re)start writes its own events file, named by the step it starts
        # from, and a resume marks the steps after its checkpoint as purged (TensorBoard's SessionLog.START), so
        # the curves continue without the records that are about to be recomputed.
        start = 0 if resume_step is None else resume_step
        self.tb_dir = self.workdir / "tensorboard"
        self.tb_local = tempfile.mkdtemp(prefix="qkvjax-tensorboard-") if self.remote else os.fspath(self.tb_dir)
        self.tb = SummaryWriter(
            self.tb_local,
            purge_step=None if resume_step is None else resume_step + 1,
            filename_suffix=f".from_step_{start}",
        )

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(json_safe(record), allow_nan=False) + "\n"
        if self.remote:
            self.lines.append(line)
        else:
            with open(self.path, "a") as f:
                f.write(line)
        prefix = "eval/" if record.get("eval") else "train/"
        for k, v in record.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "step":
                if self.tb is not None:
                    self.tb.add_scalar(prefix + k, v, record["step"])

    def flush(self) -> None:
        if not (self.enabled and self.remote):
            return
        write_text(self.path, "".join(self.lines))
        if self.tb is None:
            return
        self.tb.flush()
        self.tb_dir.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(self.tb_local):
            epath.Path(self.tb_local, name).copy(self.tb_dir / name, overwrite=True)

    def close(self) -> None:
        if self.enabled:
            if self.tb is not None:
                self.tb.close()
            self.flush()
            if self.remote and self.tb is not None:
                shutil.rmtree(self.tb_local, ignore_errors=True)


class _Preemption:
    """Turns SIGTERM (preemption) and SIGINT (Ctrl-C) into a flag the loop checks after each step: it saves a
    checkpoint and exits. A second SIGINT interrupts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = None  # the signal's name once one arrived
        self.previous = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handler, no preemption support
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)


def _say(line: str) -> None:
    """A message before the progress display starts (process 0 only)."""
    if jax.process_index() == 0:
        print(line, flush=True)


@dataclasses.dataclass
class _Parallel:
    """How arrays are laid out: a jit mesh or pmap over local devices."""

    config: Config
    abstract: object  # boxed abstract state

    def __post_init__(self):
        cfg = self.config
        if cfg.parallelism == "jit":
            self.mesh = make_mesh(cfg.mesh)
            self.dp = data_parallel_size(self.mesh)
            self.state_shardings = nn.meta.unbox(shardings_for(self.abstract, self.mesh))
            self.batch = batch_sharding(self.mesh)
        else:
            self.mesh = None
            self.dp = jax.device_count()
            single = NamedSharding(jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("d",)), PartitionSpec())
            self.state_shardings = jax.tree.map(lambda _: single, nn.meta.unbox(self.abstract))
        for name, value in (
            ("batch_size", cfg.train.batch_size),
            ("micro-batch", cfg.train.batch_size // cfg.train.grad_accum_steps),
        ):
            if value % self.dp:
                raise ValueError(
                    f"train.{name}={value} is not divisible by the data-parallel size {self.dp} "
                    f"({'data x fsdp of mesh ' + str(dict(self.mesh.shape)) if self.mesh else 'pmap devices'})"
                )

    def target(self):
        """Abstract state with shardings: what a restore lays the checkpoint out as."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            nn.meta.unbox(self.abstract),
            self.state_shardings,
        )

    def put_batch(self, local: dict) -> dict:
        if self.mesh is not None:
            return {k: jax.make_array_from_process_local_data(self.batch, v) for k, v in local.items()}
        n = jax.local_device_count()
        return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in local.items()}

    def replicate(self, state):
        if self.mesh is not None:
            return state
        n = jax.local_device_count()
        return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *x.shape)), state)

    def unreplicate(self, state):
        return state if self.mesh is not None else jax.tree.map(lambda x: x[0], state)


def train(config: Config, workdir: str, *, overwrite: bool = False) -> dict:
    """Trains (or resumes) ``config`` in ``workdir``; returns the last logged training record.

    Process 0 holds the workdir's lock (:class:`qkvjax.workdir.WorkdirLock`) for the whole run, so a second run on
    the same workdir refuses to start and names the holder. Raises :class:`Interrupted` when SIGTERM or SIGINT
    stopped the run (after its checkpoint is saved).
    """
    require_decoder(config, "train")
    workdir = workdir_path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--workdir={workdir} is a file; pass a folder (it is created if missing)")
    lock = WorkdirLock(workdir)
    created = not workdir.exists()
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    try:
        return _train(config, workdir, overwrite, lock)
    finally:
        lock.release()
        # A start that failed before writing anything (bad data, a config the data cannot take) leaves no empty
        # folder behind; a folder that held anything before, or now holds a checkpoint or a log, stays.
        if created and jax.process_index() == 0 and workdir.is_dir() and not any(workdir.iterdir()):
            workdir.rmdir()


class Interrupted(Exception):
    """The run was stopped by a signal after saving a checkpoint at ``step``; rerunning resumes it."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(f"{signal_name}: saved checkpoint step {step}; rerun the same command to resume")
        self.signal_name, self.step = signal_name, step

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (130 for SIGINT, 143 for SIGTERM), what a shell reports for it."""
        return 128 + int(getattr(signal, self.signal_name))


class NonFiniteError(ValueError):
    """The loss or gradient norm stopped being finite; nothing non-finite was saved."""


def _train(config: Config, workdir: epath.Path, overwrite: bool, lock: WorkdirLock) -> dict:
    from qkvjax.data.builders import load_splits  # TFDS and grain load when a run reads data, not on import
    from qkvjax.data.pipeline import train_batches

    tc = config.train
    # Everything that can be checked is checked before anything compiles.
    model = DecoderLM(config.model)
    tx = make_optimizer(tc)
    abstract = abstract_state(model, config, tx)
    par = _Parallel(config, abstract)
    check_workdir(workdir, config, overwrite)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("qkvjax: workdir checked")
    data_dir = os.path.expanduser(config.data.data_dir)
    if jax.process_count() > 1:  # process 0 prepares the dataset first: processes sharing a data_dir would race
        if jax.process_index() == 0:
            load_splits(config.data.dataset, config.data.source_path, data_dir)
        multihost_utils.sync_global_devices("qkvjax: dataset prepared")
    splits = load_splits(config.data.dataset, config.data.source_path, data_dir)
    digest = splits_digest(splits)
    tokenizer = load_tokenizer(config.data.tokenizer, workdir)
    if config.data.tokenizer is not None:  # byte-level text is checked against the vocabulary by check_splits
        check_vocab(tokenizer, config.model.vocab_size)
    # bits per byte from a loss per token: x tokens / bytes of the split (1 for byte-level text)
    tokens = tokenize_splits(splits, tokenizer)
    tokens_per_byte = {k: len(tokens[k]) / max(1, len(splits[k])) for k in splits}
    splits = tokens
    check_splits(splits, config)
    # Checked: config, workdir, data, tokenizer, devices. Only now does --overwrite touch the old run, and only by
    # moving it aside; it is deleted once this run's first checkpoint is committed (save below).
    aside = None
    if overwrite and jax.process_index() == 0:
        aside = set_aside(workdir, keep_imported=imported(workdir))
        if aside is not None:
            _say(f"--overwrite: the previous run is in {aside} until this run's first checkpoint is committed")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("qkvjax: old run set aside")

    mngr = checkpoint.manager(workdir, tc.max_to_keep)
    latest = mngr.latest_step()
    batches = train_batches(
        splits["train"], config.seq_len, tc.batch_size, config.seed, jax.process_index(), jax.process_count()
    )
    # The newest checkpoint that restores. Only evidence of damage moves a step aside (never deleted); any other
    # failure (I/O, memory, a mesh the layout does not fit) stops here with the step and the cause, moving nothing.
    moved = []
    while latest is not None:
        try:
            check_resume(checkpoint.restore_config(mngr, latest), config, latest, overwrite)
            state, data_state, _ = checkpoint.restore(mngr, latest, par.target())
        except checkpoint.CorruptCheckpointError as e:
            moved.append(checkpoint.quarantine(mngr, latest))
            _say(f"warning: {e}; moved it to {moved[-1]} and falling back to the previous checkpoint")
            latest = mngr.latest_step()
            continue
        batches.set_state(data_state)
        _say(f"resumed from checkpoint step {latest} in {mngr.directory}")
        break
    if latest is None and (moved or checkpoint.damaged_steps(workdir)):
        raise checkpoint.CheckpointError(
            f"workdir {workdir} has no checkpoint that restores: every one was damaged and is kept in "
            f"{checkpoint.DAMAGED_DIR}/ ({', '.join(checkpoint.damaged_steps(workdir))}); a run never starts "
            "afresh by itself: pass --overwrite to delete the run and start again"
        )
    if latest is None:
        state = create_state(model, config, tx, par.state_shardings)
        exported = exported_steps(workdir)
        if exported:  # an imported (or exported) model: start from its params, a fresh optimizer, step 0
            state = state.replace(params=restore_exported(workdir, exported[-1], par.target().params))
            _say(f"starting from the params in {workdir / 'params' / str(exported[-1])}")
    if jax.process_index() == 0:
        write_text(workdir / CONFIG_FILE, to_json(config))
        changed = check_data(workdir, digest, config.data.source_path, record=True)
        if changed:
            _say(changed)

    step_fn = make_train_step(model, tx, tc.grad_accum_steps, axis_name="data" if par.mesh is None else None)
    eval_fn = make_eval_step(model)
    if par.mesh is not None:
        train_step = jax.jit(
            step_fn,
            in_shardings=(par.state_shardings, par.batch),
            out_shardings=(par.state_shardings, None),
            donate_argnums=0,
        )
        eval_step = jax.jit(eval_fn, in_shardings=(par.state_shardings.params, par.batch))
    else:
        train_step = jax.pmap(step_fn, axis_name="data", donate_argnums=0)
        eval_step = jax.pmap(eval_fn, axis_name="data")  # per-device sums; mean_loss adds them up
    state = par.replicate(state)

    flops_per_token = train_flops_per_token(config.model, config.seq_len)
    devices = 1 if jax.devices()[0].platform == "cpu" else jax.device_count()
    peak = tc.peak_flops or measure_peak_flops(config.model.attention.dtype) * devices
    peak_source = "train.peak_flops" if tc.peak_flops else f"a {config.model.attention.dtype} matmul measured at start"
    schedule = learning_rate_schedule(tc)
    writer = MetricsWriter(workdir, latest, tc.tensorboard)
    step = int(par.unreplicate(state).step) if latest is not None else 0
    _say(
        f"qkvjax train: scheme={config.model.attention.scheme} params={param_count(config.model):,} "
        f"devices={jax.device_count()} {('mesh ' + str(dict(par.mesh.shape))) if par.mesh else 'pmap'} "
        f"step {step}/{tc.num_steps} workdir={workdir}"
    )
    _say(f"MFU is model FLOPs over a peak of {peak / 1e9:,.1f} GFLOP/s ({peak_source})")
    if tc.warmup_steps >= tc.num_steps:
        _say(
            f"warning: train.warmup_steps={tc.warmup_steps} >= train.num_steps={tc.num_steps}: the learning rate never "
            f"reaches train.learning_rate={tc.learning_rate:g} (it ends at {float(schedule(tc.num_steps - 1)):.3g}); "
            f"pass a smaller --config.train.warmup_steps for a short (up)training run"
        )
    progress = TrainProgress(step, tc.num_steps, enabled=jax.process_index() == 0)

    if tc.log_weight_similarity:  # and each attention kernel's drift from W_0 (imported params, or the seed's init)
        if 0 in exported_steps(workdir):
            initial = restore_exported(workdir, 0, par.target().params)
        elif latest is None:
            initial = par.unreplicate(state).params
        else:  # resumed: the seed's initialisation, recomputed
            initial = create_state(model, config, tx, par.state_shardings).params
        initial = jax.tree.map(lambda x: x.copy(), attention_kernels(initial))  # the step donates the state's buffers
        similarity = jax.jit(
            lambda params, w0: weight_stats(params, config.model.layer_attention) | drift_stats(params, w0)
        )

    def evaluate(params) -> dict:
        put = lambda b: par.put_batch(_local_rows(b))  # noqa: E731
        loss, count = mean_loss(
            eval_step, params, splits["validation"], config.seq_len, tc.batch_size, put, tc.eval_batches
        )
        bpb = loss / math.log(2) * tokens_per_byte["validation"]
        out = {"split": "validation", "loss": loss, "bits_per_byte": bpb, "tokens": count}
        if tc.log_weight_similarity:
            stats = jax.device_get(similarity(params if par.mesh is not None else par.unreplicate(params), initial))
            out.update({k: float(v) for k, v in stats.items()})
        return out

    def save(state, step):
        nonlocal aside
        host_state = par.unreplicate(state)
        checkpoint.save(mngr, step, host_state, batches.get_state(), to_dict(config))
        if aside is not None:  # the replaced run goes once this run has a checkpoint of its own
            checkpoint.finish(mngr)
            drop_aside(aside)
            _say(f"deleted the replaced run {aside} (checkpoint step {step} is committed)")
            aside = None

    # The first non-finite step and why (0: none), tracked on the device so the loop need not wait on every step.
    track = jax.jit(lambda seen, code, step: jnp.where((seen[0] == 0) & (code > 0), jnp.stack([step, code]), seen))
    nonfinite = jnp.zeros(2, jnp.int32)
    skipped = 0

    def check_finite() -> None:
        nonlocal nonfinite, skipped
        bad_step, code = (int(x) for x in jax.device_get(nonfinite))
        if not bad_step:
            return
        what = "loss" if code == 1 else "gradient norm"
        if tc.skip_nonfinite:
            skipped += 1
            nonfinite = jnp.zeros(2, jnp.int32)
            progress.message(f"step {bad_step}: the {what} is not finite; the batch was skipped ({skipped} so far)")
            return
        good = mngr.latest_step()
        raise NonFiniteError(
            f"step {bad_step}: the {what} is not finite, so training stopped there and saved nothing after it; "
            f"the last good checkpoint is {'step ' + str(good) if good is not None else 'none (no step finished)'}. "
            "Start again with a lower --config.train.learning_rate (a new --workdir, or --overwrite), or rerun with "
            "--config.train.skip_nonfinite=true to skip batches like this one"
        )

    record: dict = {}
    first_step, start_time, paused_s = step, time.perf_counter(), 0.0
    try:
        with _Preemption() as preemption:
            while step < tc.num_steps:
                state, metrics = train_step(state, par.put_batch(next(batches)))
                step += 1
                nonfinite = track(nonfinite, jnp.max(metrics["nonfinite"]), jnp.int32(step))
                progress.step(step, lambda m=metrics: jax.block_until_ready(m["loss"]))
                if step == first_step + 1:  # the first call compiles: keep it out of the throughput
                    jax.block_until_ready(metrics)
                    compile_s = time.perf_counter() - start_time
                    last_time, last_step, paused_s = time.perf_counter(), step, 0.0
                    progress.message(f"compiled and ran the first step in {compile_s:.1f}s")
                if step % tc.log_every == 0 or step == tc.num_steps:
                    check_finite()
                    lock.refresh()
                    metrics = jax.device_get(par.unreplicate(metrics) if par.mesh is None else metrics)
                    now = time.perf_counter() - paused_s
                    steps_timed = step - last_step
                    record = {
                        "step": step,
                        "loss": float(metrics["loss"]),
                        "bits_per_byte": float(metrics["bits_per_byte"]) * tokens_per_byte["train"],
                        "grad_norm": float(metrics["grad_norm"]),
                        "learning_rate": float(schedule(step - 1)),
                    }
                    if skipped:
                        record["skipped_steps"] = skipped
                    if steps_timed:
                        tokens_per_s = steps_timed * tc.batch_size * config.seq_len / (now - last_time)
                        achieved = tokens_per_s * flops_per_token
                        if achieved > peak:  # the peak was measured low (a loaded machine): it cannot be under this
                            peak = max(achieved, measure_peak_flops(config.model.attention.dtype) * devices)
                            progress.message(
                                f"the model ran at {achieved / 1e9:,.1f} GFLOP/s, above the peak MFU was read against; "
                                f"MFU is now against {peak / 1e9:,.1f} GFLOP/s (measured again)"
                            )
                        record.update(tokens_per_s=tokens_per_s, mfu=achieved / peak)
                    else:
                        record["compile_s"] = compile_s
                    writer.write(record)
                    progress.log(record)
                    last_time, last_step, paused_s = time.perf_counter(), step, 0.0
                if step % tc.eval_every == 0 or step == tc.num_steps:
                    check_finite()
                    # Evaluation time is not training throughput; the steps dispatched before it still are, so
                    # they finish first. An evaluation between two log records pauses the clock, not resets it.
                    jax.block_until_ready(state)
                    progress.doing("evaluating")
                    eval_start = time.perf_counter()
                    ev = evaluate(state.params)
                    writer.write({"step": step, "eval": True, **ev})
                    progress.evaluated(step, ev)
                    writer.flush()
                    progress.doing("training")
                    paused_s += time.perf_counter() - eval_start
                if step % tc.checkpoint_every == 0 or step == tc.num_steps or preemption.requested:
                    check_finite()
                    progress.doing("saving checkpoint")
                    save(state, step)
                    writer.flush()
                    progress.doing("training")
                if preemption.requested:
                    progress.message(f"{preemption.requested}: saved checkpoint step {step}; exiting")
                    break
    finally:  # also on an error: the checkpoint in flight completes, metrics are flushed
        progress.close()
        try:
            checkpoint.close(mngr)
        finally:
            writer.close()
    if preemption.requested:
        raise Interrupted(preemption.requested, step)
    if step >= tc.num_steps:
        export_params(workdir, step, par.unreplicate(state).params)
    _say(f"done at step {step}; checkpoints in {workdir / 'checkpoints'}")
    return record


def _local_rows(batch: dict) -> dict:
    """This process's share of a global batch (rows split evenly over processes)."""
    p, n = jax.process_index(), jax.process_count()
    return {k: v[p * len(v) // n : (p + 1) * len(v) // n] for k, v in batch.items()}
