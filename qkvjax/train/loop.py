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
from qkvjax.attention import kernels
from qkvjax.config import Config, require_decoder, to_dict, to_json
from qkvjax.data.pipeline import check_corpus
from qkvjax.data.shards import repeated_fraction, window_count
from qkvjax.data.tokenizer import check_vocab, load_tokenizer, tokenize_splits
from qkvjax.models.lm import DecoderLM, mfu_flops_per_token, param_count, train_flops_per_token
from qkvjax.perf import datasheet_peak, measure_peak_flops
from qkvjax.train import checkpoint
from qkvjax.train.checks import check_fits, check_resume, check_splits, check_workdir, imported
from qkvjax.train.events import EventFile
from qkvjax.train.lock import WorkdirLock
from qkvjax.train.mesh import batch_sharding, data_parallel_size, make_mesh, shardings_for
from qkvjax.train.progress import TrainProgress
from qkvjax.train.state import abstract_state, create_state, learning_rate_schedule, make_optimizer
from qkvjax.train.step import make_eval_step, make_train_step, mean_loss
from qkvjax.workdir import (  # noqa: F401
    CONFIG_FILE,
    METRICS_FILE,
    check_data,
    drop_aside,
    export_params,
    exported_steps,
    framed_digest,
    is_remote,
    json_safe,
    load_config,
    metric_lines,
    replaced_runs,
    restore_exported,
    restore_hint,
    set_aside,
    splits_digest,
    write_text,
    writing,
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
        # One TensorBoard run per workdir: each (re)start writes its own events file, named by the step it starts
        # from, and a resume hides the steps after its checkpoint (they are about to be recomputed).
        self.tb_dir = self.workdir / "tensorboard"
        self.tb_local = tempfile.mkdtemp(prefix="qkvjax-tensorboard-") if self.remote else os.fspath(self.tb_dir)
        self.tb = EventFile(
            self.tb_local, 0 if resume_step is None else resume_step, None if resume_step is None else resume_step + 1
        )

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(json_safe(record), allow_nan=False) + "\n"
        if self.remote:
            self.lines.append(line)
        else:
            with writing(self.path, RESUME_ADVICE):
                with open(self.path, "a") as f:
                    f.write(line)
        if self.tb is not None:
            prefix = "eval/" if record.get("eval") else "train/"
            values = {prefix + k: v for k, v in record.items() if _scalar(v) and k != "step"}
            with writing(self.tb_local, RESUME_ADVICE):
                self.tb.scalars(values, record["step"])

    def flush(self) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            with writing(self.tb_local, RESUME_ADVICE):
                self.tb.flush()
        if not self.remote:
            return
        write_text(self.path, "".join(self.lines))
        if self.tb is None:
            return
        self.tb_dir.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(self.tb_local):
            epath.Path(self.tb_local, name).copy(self.tb_dir / name, overwrite=True)

    def close(self) -> None:
        if self.enabled:
            self.flush()
            if self.tb is not None:
                self.tb.close()
            if self.remote and self.tb is not None:
                shutil.rmtree(self.tb_local, ignore_errors=True)


def _scalar(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# What a failed write of the run's log adds to the file it names (a checkpoint's failure says it itself)
RESUME_ADVICE = (
    "; the checkpoints already saved are intact: fix the disk (or free space) and rerun the same command to resume "
    "from the last one"
)


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

    Process 0 holds the workdir's lock (:class:`qkvjax.train.lock.WorkdirLock`) for the whole run, so a second run on
    the same workdir refuses to start and names the holder. Raises :class:`Interrupted` when SIGTERM or SIGINT
    stopped the run (after its checkpoint is saved).
    """
    require_decoder(config, "train")
    workdir = workdir_path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--workdir={workdir} is a file; pass a folder (it is created if missing)")
    lock = WorkdirLock(workdir)
    created = not workdir.exists()
    try:
        if jax.process_index() == 0:
            try:
                workdir.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a read-only or missing mount, no permission: say which flag
                raise ValueError(f"--workdir={workdir} cannot be created: {e.strerror or e}") from e
            lock.acquire()
        return _train(config, workdir, overwrite, lock)
    finally:
        lock.release()
        # A start that failed before writing anything (bad data, a config the data cannot take, no room for the
        # lock) leaves no empty folder behind; a folder that held anything before, or now holds a checkpoint or a
        # log, stays.
        if created and jax.process_index() == 0 and workdir.is_dir() and not _holds_a_file(workdir):
            workdir.rmtree()  # empty, or only the empty checkpoints/ folder orbax made


def _holds_a_file(folder: epath.Path) -> bool:
    return any(not p.is_dir() or _holds_a_file(p) for p in folder.iterdir())


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


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare` checked and loaded before anything compiles: the model and optimizer, the layout
    (:class:`_Parallel`), the token ids of each split with its tokens per byte (bits per byte from a loss per
    token), the text's digest, and ``aside``: the runs ``--overwrite`` moved aside (now, or by an earlier attempt
    that stopped before its first checkpoint), until this run's first checkpoint is committed."""

    config: Config
    workdir: epath.Path
    model: DecoderLM
    tx: object  # optax.GradientTransformation
    par: _Parallel
    splits: dict
    tokens_per_byte: dict
    digest: tuple[str, ...]  # the text's sha256, then older digests of it that a data.json may hold
    aside: tuple[epath.Path, ...] = ()
    verification: object = None  # a prepared corpus' background sha256 check (qkvjax.data.shards)


def prepare(config: Config, workdir: epath.Path, overwrite: bool) -> Prepared:
    """Stage 1: everything that can be checked is checked (config, workdir, devices, data, tokenizer) before
    anything compiles; only then does ``--overwrite`` touch the old run, and only by moving it aside."""
    model = DecoderLM(config.model)
    tx = make_optimizer(config.train)
    abstract = abstract_state(model, config, tx)
    check_fits(config, abstract)  # before the mesh lays anything out
    par = _Parallel(config, abstract)
    check_workdir(workdir, config, overwrite)
    _sync("workdir checked")
    splits, tokens_per_byte, digest, verification = _load_data(config, workdir)
    if verification is None:
        check_splits(splits, config)
    aside = ()
    if jax.process_index() == 0:
        for left in replaced_runs(workdir):  # an earlier replacing attempt stopped before its first checkpoint
            _say(f"a run --overwrite replaced is still in {left} (the run replacing it stopped before its first "
                 f"checkpoint); it is deleted once this run commits one; {restore_hint(left)}")  # fmt: skip
            aside += (left,)
    if overwrite and jax.process_index() == 0 and (moved := set_aside(workdir, keep_imported=imported(workdir))):
        _say(f"--overwrite: the previous run is in {moved} until this run's first checkpoint is committed; "
             + restore_hint(moved))  # fmt: skip
        aside += (moved,)
    _sync("old run set aside")
    return Prepared(config, workdir, model, tx, par, splits, tokens_per_byte, digest, aside, verification)


def _load_data(config: Config, workdir: epath.Path) -> tuple[dict, dict, tuple[str, ...], object]:
    """The splits as token ids, their tokens per byte (1 for byte-level text), the text's digest and, for a prepared
    corpus, the background check of its shards' sha256 (else None)."""
    if config.data.prepared is not None:
        return _load_prepared(config, workdir)
    from qkvjax.data.builders import load_splits  # TFDS and grain load when a run reads data, not on import

    data_dir = os.path.expanduser(config.data.data_dir)
    if jax.process_count() > 1:  # process 0 prepares the dataset first: processes sharing a data_dir would race
        if jax.process_index() == 0:
            load_splits(config.data.dataset, config.data.source_path, data_dir)
        _sync("dataset prepared")
    text = load_splits(config.data.dataset, config.data.source_path, data_dir)
    tokenizer = load_tokenizer(config.data.tokenizer, workdir)
    if config.data.tokenizer is not None:  # byte-level text is checked against the vocabulary by check_splits
        check_vocab(tokenizer, config.model.vocab_size)
    tokens = tokenize_splits(text, tokenizer)
    per_byte = {k: len(tokens[k]) / max(1, len(text[k])) for k in text}
    return tokens, per_byte, (splits_digest(text), framed_digest(text)), None


def _load_prepared(config: Config, workdir: epath.Path):
    """A prepared corpus: its splits as memory-mapped sequences (nothing read yet), checked against the model and
    the run's tokenizer; its tokenizer copied into the workdir for ``sample`` and ``eval``; its shards' sha256
    checked in the background."""
    from qkvjax.data.shards import check_prepared, open_corpus

    corpus = open_corpus(config.data.prepared)
    check_prepared(corpus, config.model.vocab_size, config.data.tokenizer, workdir)
    splits = {s: corpus.split(s) for s in ("train", "validation")}
    check_corpus(splits["train"], config.seq_len, "train")
    per_byte = {s: corpus.tokens_per_byte(s) for s in splits}
    return splits, per_byte, (corpus.sha256,), corpus.verify()


def restore(prep: Prepared, mngr, batches, overwrite: bool):
    """Stage 2: ``(state, step)`` from the newest checkpoint that restores (the data iterator set to it), or a fresh
    state (from an imported model's params, if any) and None. Only evidence of damage moves a step aside (never
    deleted); any other failure (I/O, memory, a mesh the layout does not fit) stops here with the step and the
    cause, moving nothing."""
    config, workdir, par = prep.config, prep.workdir, prep.par
    latest, moved = mngr.latest_step(), []
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
        return state, latest
    if moved or checkpoint.damaged_steps(workdir):
        raise checkpoint.CheckpointError(
            f"workdir {workdir} has no checkpoint that restores: every one was damaged and is kept in "
            f"{checkpoint.DAMAGED_DIR}/ ({', '.join(checkpoint.damaged_steps(workdir))}); a run never starts "
            "afresh by itself: pass --overwrite to delete the run and start again"
        )
    state = create_state(prep.model, config, prep.tx, par.state_shardings)
    exported = exported_steps(workdir)
    if exported:  # an imported (or exported) model: start from its params, a fresh optimizer, step 0
        state = state.replace(params=restore_exported(workdir, exported[-1], par.target().params))
        _say(f"starting from the params in {workdir / 'params' / str(exported[-1])}")
    return state, None


def _record_provenance(prep: Prepared) -> None:
    """The config the run trains (config.json) and the digest of its text (data.json), on process 0."""
    if jax.process_index() == 0:
        write_text(prep.workdir / CONFIG_FILE, to_json(prep.config))
        data = prep.config.data
        source = data.source_path if data.prepared is None else str(epath.Path(data.prepared) / "manifest.json")
        changed = check_data(prep.workdir, prep.digest[0], source, record=True, also=prep.digest[1:])
        if data.prepared is not None:
            from qkvjax.data.shards import copy_tokenizer

            copy_tokenizer(data.prepared, prep.workdir)
        if changed:
            _say(changed)


def _compiled_steps(prep: Prepared):
    """The train and eval steps, jitted over the mesh (state donated) or pmapped over local devices; a GPU's
    default attention falls back to XLA's if cuDNN's fails to compile (:func:`kernels.falls_back_from_cudnn`)."""
    par, tc = prep.par, prep.config.train
    step_fn = make_train_step(prep.model, prep.tx, tc.grad_accum_steps, axis_name="data" if par.mesh is None else None,
                              loss_chunk=tc.loss_chunk)  # fmt: skip
    eval_fn = make_eval_step(prep.model)
    if par.mesh is None:
        eval_step = jax.pmap(eval_fn, axis_name="data")  # per-device sums; mean_loss adds them up
        train_step = jax.pmap(step_fn, axis_name="data", donate_argnums=0)
    else:
        shardings = dict(in_shardings=(par.state_shardings, par.batch), out_shardings=(par.state_shardings, None))
        train_step = jax.jit(step_fn, **shardings, donate_argnums=0)
        eval_step = jax.jit(eval_fn, in_shardings=(par.state_shardings.params, par.batch))
    return kernels.falls_back_from_cudnn(train_step, _say), kernels.falls_back_from_cudnn(eval_step, _say)


def _train(config: Config, workdir: epath.Path, overwrite: bool, lock: WorkdirLock) -> dict:
    from qkvjax.data.pipeline import train_batches

    prep = prepare(config, workdir, overwrite)
    mngr = checkpoint.manager(workdir, config.train.max_to_keep)
    batches = train_batches(
        prep.splits["train"], config.seq_len, config.train.batch_size, config.seed, jax.process_index(),
        jax.process_count(), config.data.window_sampling, config.data.workers, config.data.start_batch,
    )  # fmt: skip
    state, latest = restore(prep, mngr, batches, overwrite)
    _record_provenance(prep)
    return Loop(prep, mngr, batches, lock, state, latest).run()


@dataclasses.dataclass(frozen=True)
class Cadence:
    """Something the loop does every ``every`` (a ``train`` config field) steps and at the last step, after
    checking that the steps so far were finite; ``on_stop``: also when a signal stops the run."""

    name: str
    every: str
    action: str  # the Loop method
    on_stop: bool = False

    def due(self, step: int, tc, stopping: bool) -> bool:
        return step % getattr(tc, self.every) == 0 or step == tc.num_steps or (self.on_stop and stopping)


CADENCES = (
    Cadence("log", "log_every", "log"),
    Cadence("evaluation", "eval_every", "evaluate"),
    Cadence("checkpoint", "checkpoint_every", "save", on_stop=True),
)

# Seconds of timed matmuls for MFU's peak at a run's start (and again if a step beats it): milliseconds of calls on
# an accelerator; on a 2-core CPU all ten took 3.6-5.5 s, a third of a tiny run (2026-12-02).
PEAK_BUDGET_S = 1.0


class Loop:
    """Stage 3: the loop around the pure train step, with its cadences (:data:`CADENCES`): the log records, the
    evaluations and the checkpoints; the only place that writes metrics and checkpoints."""

    def __init__(self, prep: Prepared, mngr, batches, lock: WorkdirLock, state, latest: int | None):
        config, par = prep.config, prep.par
        self.prep, self.tc, self.mngr, self.batches, self.lock = prep, config.train, mngr, batches, lock
        self.train_step, self.eval_step = _compiled_steps(prep)
        self.state = par.replicate(state)
        self.step = int(par.unreplicate(self.state).step) if latest is not None else 0
        # MFU's numerator as nanoGPT and PaLM count it; the causal count (what the kernels do) logged beside it
        self.flops_per_token = mfu_flops_per_token(config.model, config.seq_len)
        self.causal_flops_per_token = train_flops_per_token(config.model, config.seq_len)
        self.sampling = config.data.window_sampling
        self.windows = window_count(len(prep.splits["train"]), config.seq_len, self.sampling)
        self.devices = 1 if jax.devices()[0].platform == "cpu" else jax.device_count()
        self.peak, self.peak_source = self._peak()
        self.schedule = jax.jit(learning_rate_schedule(self.tc))  # one program, not one per eager op it makes
        self.writer = MetricsWriter(prep.workdir, latest, self.tc.tensorboard)
        self._announce()
        self.progress = TrainProgress(self.step, self.tc.num_steps, enabled=jax.process_index() == 0)
        self.similarity = _similarity(prep, self.state, latest) if self.tc.log_weight_similarity else None
        # The first non-finite step and why (0: none), tracked on the device so the loop need not wait on each step.
        self.track = jax.jit(lambda seen, code, s: jnp.where((seen[0] == 0) & (code > 0), jnp.stack([s, code]), seen))
        self.nonfinite, self.skipped = jnp.zeros(2, jnp.int32), 0
        self.record: dict = {}
        self.compile_s = self.last_time = 0.0
        self.last_step, self.paused_s = self.step, 0.0

    def _peak(self) -> tuple[float, str]:
        """MFU's denominator and where it comes from: ``train.peak_flops``; else the devices' datasheet peak for
        the compute dtype (:data:`qkvjax.perf.DATASHEET`); else (a CPU) a matmul measured at start."""
        dtype = self.prep.config.model.attention.dtype
        if self.tc.peak_flops:
            return self.tc.peak_flops, "train.peak_flops"
        sheet = datasheet_peak(jax.devices()[0].device_kind, dtype)
        if sheet is not None:
            return sheet[0] * self.devices, f"{sheet[1]}, x{self.devices} devices"
        return self._measure_peak(), f"a {dtype} matmul measured at start"

    def _measure_peak(self) -> float:
        """The devices' matmul FLOP/s, within :data:`PEAK_BUDGET_S`: a CPU's MFU denominator, and beside a
        datasheet peak the practical ceiling."""
        return measure_peak_flops(self.prep.config.model.attention.dtype, budget_s=PEAK_BUDGET_S) * self.devices

    def _announce(self) -> None:
        config, tc, par = self.prep.config, self.tc, self.prep.par
        dtype = config.model.attention.dtype
        _say(
            f"qkvjax train: scheme={config.model.attention.scheme} params={param_count(config.model):,} "
            f"devices={jax.device_count()} {('mesh ' + str(dict(par.mesh.shape))) if par.mesh else 'pmap'} "
            f"step {self.step}/{tc.num_steps} workdir={self.prep.workdir}"
        )
        ceiling = ""
        if "datasheet" in self.peak_source:  # the practical ceiling beside the vendor's figure
            measured = self._measure_peak()
            ceiling = (
                f"; a {dtype} matmul measured now reaches {measured / 1e12:,.1f} TFLOP/s ({measured / self.peak:.0%})"
            )
        _say(
            f"MFU is model FLOPs (nanoGPT's and PaLM's count, {self.flops_per_token / 1e6:,.1f} MFLOP a token; "
            f"causal: {self.causal_flops_per_token / 1e6:,.1f}, logged as mfu_causal) over a peak of "
            f"{self.peak / 1e9:,.1f} GFLOP/s ({self.peak_source}){ceiling}"
        )
        if tc.warmup_steps >= tc.num_steps:
            _say(
                f"warning: train.warmup_steps={tc.warmup_steps} >= train.num_steps={tc.num_steps}: the learning rate "
                f"never reaches train.learning_rate={tc.learning_rate:g} (it ends at "
                f"{float(self.schedule(tc.num_steps - 1)):.3g}); pass a smaller --config.train.warmup_steps for a "
                "short (up)training run"
            )

    def run(self) -> dict:
        """Trains to ``num_steps`` (or until a signal); returns the last log record."""
        par, tc = self.prep.par, self.tc
        first_step, start_time = self.step, time.perf_counter()
        try:
            with _Preemption() as preemption:
                while self.step < tc.num_steps:
                    self.state, metrics = self.train_step(self.state, par.put_batch(next(self.batches)))
                    self.step += 1
                    self.nonfinite = self.track(self.nonfinite, jnp.max(metrics["nonfinite"]), jnp.int32(self.step))
                    self.progress.step(self.step, lambda m=metrics: jax.block_until_ready(m["loss"]))
                    if self.step == first_step + 1:  # the first call compiles: keep it out of the throughput
                        jax.block_until_ready(metrics)
                        self.compile_s = time.perf_counter() - start_time
                        self.last_time, self.last_step, self.paused_s = time.perf_counter(), self.step, 0.0
                        self.progress.message(f"compiled and ran the first step in {self.compile_s:.1f}s")
                    for cadence in CADENCES:
                        if cadence.due(self.step, tc, preemption.requested is not None):
                            self.check_finite()
                            getattr(self, cadence.action)(metrics)
                    if preemption.requested:
                        self.progress.message(f"{preemption.requested}: saved checkpoint step {self.step}; exiting")
                        break
        finally:  # also on an error: the checkpoint in flight completes, metrics are flushed
            self.progress.close()
            try:
                checkpoint.close(self.mngr)
            finally:
                self.writer.close()
        if preemption.requested:
            raise Interrupted(preemption.requested, self.step)
        if self.step >= tc.num_steps:
            export_params(self.prep.workdir, self.step, par.unreplicate(self.state).params)
        _say(f"done at step {self.step}; checkpoints in {self.prep.workdir / 'checkpoints'}")
        return self.record

    def check_finite(self) -> None:
        """Raises :class:`NonFiniteError` at the first non-finite step (or counts it, with ``skip_nonfinite``)."""
        bad_step, code = (int(x) for x in jax.device_get(self.nonfinite))
        if not bad_step:
            return
        what = "loss" if code == 1 else "gradient norm"
        if self.tc.skip_nonfinite:
            self.skipped += 1
            self.nonfinite = jnp.zeros(2, jnp.int32)
            self.progress.message(
                f"step {bad_step}: the {what} is not finite; the batch was skipped ({self.skipped} so far)"
            )
            return
        good = self.mngr.latest_step()
        raise NonFiniteError(
            f"step {bad_step}: the {what} is not finite, so training stopped there and saved nothing after it; "
            f"the last good checkpoint is {'step ' + str(good) if good is not None else 'none (no step finished)'}. "
            "Start again with a lower --config.train.learning_rate (a new --workdir, or --overwrite), or rerun with "
            "--config.train.skip_nonfinite=true to skip batches like this one"
        )

    def log(self, metrics) -> None:
        """A training record: loss, bits per byte, gradient norm, rate; throughput and MFU since the last one."""
        par, tc, step = self.prep.par, self.tc, self.step
        with writing(self.lock.path, RESUME_ADVICE):
            self.lock.refresh()
        metrics = jax.device_get(par.unreplicate(metrics) if par.mesh is None else metrics)
        now = time.perf_counter() - self.paused_s
        record = {
            "step": step,
            "loss": float(metrics["loss"]),
            "bits_per_byte": float(metrics["bits_per_byte"]) * self.prep.tokens_per_byte["train"],
            "grad_norm": float(metrics["grad_norm"]),
            "learning_rate": float(self.schedule(step - 1)),
        }
        # How much of the training text the run has seen: epochs of windows, and (disjoint windows, each target
        # once per epoch) the share of the targets trained on so far that it had trained on before.
        seen = (self.prep.config.data.start_batch + step) * tc.batch_size  # from the window order's start
        record["epochs"] = seen / self.windows
        if self.sampling == "disjoint":
            record["repeated"] = repeated_fraction(seen, self.windows)
        if self.skipped:
            record["skipped_steps"] = self.skipped
        if step - self.last_step:
            tokens_per_s = (step - self.last_step) * tc.batch_size * self.prep.config.seq_len / (now - self.last_time)
            achieved = tokens_per_s * self.flops_per_token
            if achieved > self.peak and "datasheet" not in self.peak_source:  # measured low (a loaded machine)
                self.peak = max(achieved, self._measure_peak())
                self.progress.message(
                    f"the model ran at {achieved / 1e9:,.1f} GFLOP/s, above the peak MFU was read against; "
                    f"MFU is now against {self.peak / 1e9:,.1f} GFLOP/s (measured again)"
                )
            record.update(tokens_per_s=tokens_per_s, mfu=achieved / self.peak,
                          mfu_causal=tokens_per_s * self.causal_flops_per_token / self.peak)  # fmt: skip
        else:
            record["compile_s"] = self.compile_s
        self.writer.write(record)
        self.progress.log(record)
        self.record = record
        self.last_time, self.last_step, self.paused_s = time.perf_counter(), step, 0.0

    def evaluate(self, metrics=None) -> None:
        """Validation loss and bits per byte (and weight statistics); its time pauses the throughput clock. The
        steps dispatched before it are training, so they finish first."""
        jax.block_until_ready(self.state)
        self.progress.doing("evaluating")
        start = time.perf_counter()
        ev = self.validation(self.state.params)
        self.writer.write({"step": self.step, "eval": True, **ev})
        self.progress.evaluated(self.step, ev)
        self.writer.flush()
        self.progress.doing("training")
        self.paused_s += time.perf_counter() - start

    def validation(self, params) -> dict:
        prep, tc, par = self.prep, self.tc, self.prep.par
        put = lambda b: par.put_batch(_local_rows(b))  # noqa: E731
        loss, count = mean_loss(
            self.eval_step, params, prep.splits["validation"], prep.config.seq_len, tc.batch_size, put,
            tc.eval_batches,
        )  # fmt: skip
        bpb = loss / math.log(2) * prep.tokens_per_byte["validation"]
        out = {"split": "validation", "loss": loss, "bits_per_byte": bpb, "tokens": count}
        if self.similarity is not None:
            stats = jax.device_get(self.similarity(params if par.mesh is not None else par.unreplicate(params)))
            out.update({k: float(v) for k, v in stats.items()})
        return out

    def save(self, metrics=None) -> None:
        """A checkpoint of the state and the data iterator; the first one deletes the run ``--overwrite`` replaced.
        Never after a prepared corpus' shard was found corrupted (the last one waits for the check to finish)."""
        if self.prep.verification is not None:
            if self.step >= self.tc.num_steps:
                self.prep.verification.wait()
            self.prep.verification.check()
        self.progress.doing("saving checkpoint")
        checkpoint.save(
            self.mngr, self.step, self.prep.par.unreplicate(self.state), self.batches.get_state(),
            to_dict(self.prep.config),
        )  # fmt: skip
        if self.prep.aside:  # the replaced runs go once this run has a checkpoint of its own
            checkpoint.finish(self.mngr)
            for aside in self.prep.aside:
                drop_aside(aside)
                _say(f"deleted the replaced run {aside} (checkpoint step {self.step} is committed)")
            self.prep.aside = ()
        self.writer.flush()
        self.progress.doing("training")


def _similarity(prep: Prepared, state, latest: int | None):
    """``params -> stats``: each attention kernel's similarities and its drift from W_0 (imported params, or the
    seed's initialisation, recomputed when resumed)."""
    config, par, workdir = prep.config, prep.par, prep.workdir
    if 0 in exported_steps(workdir):
        initial = restore_exported(workdir, 0, par.target().params)
    elif latest is None:
        initial = par.unreplicate(state).params
    else:
        initial = create_state(prep.model, config, prep.tx, par.state_shardings).params
    initial = jax.tree.map(lambda x: x.copy(), attention_kernels(initial))  # the step donates the state's buffers
    stats = jax.jit(lambda params, w0: weight_stats(params, config.model.layer_attention) | drift_stats(params, w0))
    return lambda params: stats(params, initial)


def _sync(what: str) -> None:
    """Every process reaches this point before any goes on (a no-op in one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"qkvjax: {what}")


def _local_rows(batch: dict) -> dict:
    """This process's share of a global batch (rows split evenly over processes)."""
    p, n = jax.process_index(), jax.process_count()
    return {k: v[p * len(v) // n : (p + 1) * len(v) // n] for k, v in batch.items()}
