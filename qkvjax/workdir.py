"""The run folder, as tools see it: where it is, its file names, the saved config, the metrics log, whole outputs.

Tools (eval, info, convert, analyze, the experiments) read a workdir through this module, never through the
training loop. Layout::

    WORKDIR/config.json            the run's Config (JSON of the frozen dataclasses)
    WORKDIR/metrics.jsonl          one JSON object per logged step; evaluation records carry "eval": true
    WORKDIR/checkpoints/<step>/    orbax: state, data iterator, config (see qkvjax.train.checkpoint)
    WORKDIR/params/<step>/         params only, written when a run finishes or by ``qkvjax import`` (step 0)
    WORKDIR/tokenizer.json         an imported model's tokenizer (``data.tokenizer``)
    WORKDIR/special_tokens.json    an imported model's bos/eos/pad ids (sampling stops at eos) and token strings
    WORKDIR/chat_template.jinja    an imported instruct model's chat template (``qkvjax sample --chat``)
    WORKDIR/tensorboard/           TensorBoard events, one file per (re)start
    WORKDIR/train.lock             the running trainer's host and pid (qkvjax.train.lock)

A workdir is a local folder or a URI that ``etils.epath`` opens (``gs://bucket/run`` with ``gcsfs`` installed,
``s3://``, ...). Object stores have no atomic rename and no append: there a file is written whole (an object
appears complete or not at all), orbax marks finished checkpoints with a commit file instead of renaming a temporary
folder, and the metrics log and TensorBoard events are rewritten whole when the loop flushes them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import socket
import stat
import sys
import tempfile
import time
import uuid

from etils import epath

from qkvjax.checks import is_disk_full  # noqa: F401  (its callers import it from here too)
from qkvjax.config import Config, from_dict

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
DAMAGED_DIR = "checkpoints_damaged"  # steps moved aside on evidence of damage (never deleted)
DATA_FILE = "data.json"  # the sha256 of the text a run trains on, to notice a corpus replaced under the same path
REPLACED_PREFIX = "replaced-"  # a run --overwrite replaces, kept until the new run's first checkpoint
TOKENIZER = "tokenizer.json"  # a run's (or an imported model's) tokenizer, in the Hugging Face format
SPECIAL_IDS_FILE = "special_tokens.json"  # an imported model's bos/eos/pad ids, written back by export
# the special-token names a chat template may refer to (read here and by qkvjax.chat)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # an imported model's chat template (qkvjax.chat), as transformers saves it
SAMPLING_FILE = "sampling.json"  # an imported model's own sampling settings (its generation_config.json asks for them)
IMPORTED_FILES = (TOKENIZER, SPECIAL_IDS_FILE, CHAT_TEMPLATE_FILE, SAMPLING_FILE)  # besides weights and config
IMPORTED_STEP = 0  # ``params/0``: an imported model (training exports params at steps >= 1 only)


REMOTE_SCHEMES = ("gs",)  # orbax writes checkpoints to local paths and Cloud Storage only (s3:// fails in it)


def path(workdir) -> epath.Path:
    """``workdir`` as an ``epath.Path``: a local path made absolute (``~`` expanded), a ``gs://`` URI as given.
    An empty text is refused: it would mean the current folder, and is more often an unset shell variable
    (``--workdir=$RUN``) than a wish to train into the folder a command was typed in. A local path that is not
    UTF-8 is refused too: TensorStore, which writes the checkpoints, takes no other, and failed at the first save,
    after the training before it (Python keeps such bytes as the surrogates U+DC80-U+DCFF)."""
    text = os.fsdecode(workdir)
    if not text.strip():
        raise ValueError(f"a run or model folder given as {text!r}; allowed: a folder's path (is a variable unset?)")
    if is_remote(text):
        scheme = text.split("://", 1)[0]
        if scheme not in REMOTE_SCHEMES:
            raise ValueError(
                f"workdir {text!r}: orbax's checkpoints cannot be written to {scheme}://; allowed: a local folder "
                "or gs://BUCKET/PATH"
            )
        return epath.Path(text)
    full = os.path.abspath(os.path.expanduser(text))
    try:
        full.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"a run or model folder given as {text!r}: {full!r} holds {full[e.start : e.end]!r}, bytes that are not "
            "UTF-8; allowed: a path in UTF-8 (TensorStore, which writes the checkpoints, takes no other)"
        ) from None
    return epath.Path(full)


def is_remote(workdir) -> bool:
    """True for ``scheme://...`` paths (object stores), False for local files."""
    return "://" in os.fspath(workdir)


@contextlib.contextmanager
def writing(where, advice: str = ""):
    """An OSError raised inside names ``where`` (then ``advice``): a buffered write's error names no file, or a
    temporary one."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror or e} while writing {where}{advice}") from e


def pid_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (one of another user's runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def write_text(target, text: str) -> None:
    """Writes ``text`` so that readers see the old file or the new one, never a part: a local file through
    :func:`replace_file`, an object in one upload."""
    if is_remote(target):
        epath.Path(target).write_text(text)
        return
    replace_file(target, lambda tmp: epath.Path(tmp).write_text(text))


def replace_file(target: str, write) -> None:
    """Calls ``write(path)`` on a temporary sibling of ``target`` (same suffix, so a format read from the name
    holds), flushes it to disk and renames it over ``target``: a kill, a power loss, a full disk or an error while
    writing leaves the old file or none, never a part or an empty file (a command's ``--json``, ``--output``,
    ``--plot``; config.json, metrics.jsonl cut back at a resume, a checkpoint's inventory). A target that exists
    and is not a regular file (``/dev/null``, a pipe) or is named under ``/dev`` or ``/proc`` is written directly:
    a rename would replace it; one that is this process's own output redirected into a file is appended through
    its descriptor."""
    target = os.fspath(target)
    special = os.path.abspath(target).startswith(("/dev/", "/proc/"))
    if special and (fd := _own_output(target)) is not None:
        _append_to(fd, write, os.path.splitext(target)[1])
        return
    if special or (os.path.exists(target) and not os.path.isfile(target)):
        write(target)
        return
    target = os.path.realpath(target)  # through a link: its file is replaced, the link stays
    folder, name = os.path.split(os.path.abspath(target))
    stem, suffix = os.path.splitext(name)
    tmp = os.path.join(folder, f".{stem}.{uuid.uuid4().hex[:8]}.tmp{suffix}")
    try:
        with writing(target):
            write(tmp)
            _fsync(tmp)  # the bytes on disk before the name points at them: after a power loss, old or new
            os.replace(tmp, target)
            _fsync(folder, directory=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _own_output(target: str) -> int | None:
    """1 or 2 where ``target`` (``/dev/stdout``, ``/dev/fd/2``, ...) is this process's standard output or error
    and that is a regular file: opening it again would truncate the file a shell redirected it into."""
    try:
        named = os.stat(target)
    except OSError:
        return None
    for fd in (1, 2):
        try:
            own = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(own.st_mode) and (own.st_dev, own.st_ino) == (named.st_dev, named.st_ino):
            return fd
    return None


def _append_to(fd: int, write, suffix: str) -> None:
    """``write(path)`` into a temporary file, then its bytes through ``fd`` at its offset, after what Python's own
    streams hold (so ``--json /dev/stdout > out.txt`` keeps the table printed before the JSON)."""
    with tempfile.TemporaryDirectory() as folder:
        part = os.path.join(folder, "part" + suffix)
        write(part)
        with open(part, "rb") as f:
            data = memoryview(f.read())
    sys.stdout.flush()
    sys.stderr.flush()
    while data:
        data = data[os.write(fd, data) :]


def require_empty(target, holds: str = "files") -> None:
    """Refuses, in one line, a ``target`` that exists and is not an empty folder (checked before expensive work
    and again by :func:`whole_or_absent`)."""
    target = path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{target} already holds {holds}; choose a new or empty directory")


@contextlib.contextmanager
def whole_or_absent(target, holds: str):
    """Yields a temporary sibling folder of ``target`` to write a whole output into (a workdir, a model folder);
    when the block ends it is flushed to disk and renamed to ``target``, the last step; if the block fails, it is
    removed. So ``target`` is either whole or absent after a kill, a full disk or an error at any moment, and a
    rerun after any failure starts clean (the siblings of killed attempts on this host are removed first). Each
    attempt has its own sibling, so two writing the same ``target`` at once never mix their files: the first to
    finish publishes, the other is refused. ``target`` must not exist, or be an empty folder; otherwise one line
    says it already holds ``holds``."""
    target = path(target)
    require_empty(target, holds)
    prefix = f".{target.name}.partial"
    if target.parent.is_dir():
        for sibling in target.parent.iterdir():
            if sibling.is_dir() and _killed_attempt(sibling.name, prefix):  # never a finished output
                sibling.rmtree()
    staging = target.parent / f"{prefix}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)
    except OSError as e:  # a parent that is a file, a read-only or missing mount: one line naming the target
        raise ValueError(f"{target} cannot be created: {e.strerror or e}; choose a folder that can be written") from e
    try:
        yield staging
        if not is_remote(staging):
            _fsync_tree(os.fspath(staging))
        if target.exists():
            try:
                target.rmdir()  # empty when checked above
            except (OSError, ValueError) as e:  # epath says "Directory ... is not empty" as a ValueError
                raise ValueError(
                    f"{target} was written by another process while this one wrote it; that output stands, this "
                    "one was discarded"
                ) from e
        staging.rename(target)
        if not is_remote(target):
            _fsync(os.fspath(target.parent), directory=True)  # the rename that publishes it, on disk too
    except BaseException:
        with contextlib.suppress(OSError):
            staging.rmtree()
        raise


def _killed_attempt(name: str, prefix: str) -> bool:
    """Whether ``name`` is the staging folder of a :func:`whole_or_absent` whose process on this host is gone (or
    the one name all attempts shared before 2026-11-30)."""
    if name == prefix:
        return True
    host, pid, _ = (name.removeprefix(prefix + ".").rsplit(".", 2) + ["", ""])[:3]
    return name.startswith(prefix + ".") and host == socket.gethostname() and pid.isdigit() and pid_gone(int(pid))


def _fsync_tree(folder: str) -> None:
    """Every file and folder under ``folder`` flushed to disk, so the rename that publishes it publishes data."""
    for root, dirs, files in os.walk(folder):
        for name in files + dirs:
            _fsync(os.path.join(root, name))


def _fsync(path: str, directory: bool = False) -> None:
    """``path``'s data (a file's bytes, a folder's entries: a rename inside it) flushed to disk. An error of the
    disk (EIO, ENOSPC) is raised: the bytes may not be there; a file system that cannot sync (EINVAL, ENOTSUP; a
    folder: EBADF too) is written as it was before."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP) + ((errno.EBADF,) if directory else ()):
            raise
    finally:
        os.close(fd)


def load_config(workdir) -> Config:
    """The Config a run was started with; a clear error when ``workdir`` holds no run."""
    file = path(workdir) / CONFIG_FILE
    if not file.exists():
        raise ValueError(f"workdir {path(workdir)} holds no run (no {CONFIG_FILE})")
    try:
        data = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # empty, cut short or edited by hand: name the file
        raise ValueError(f"{file} is not JSON ({str(e).splitlines()[0]}); it is the run's config, written by "
                         "train, import and convert") from None  # fmt: skip
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}; allowed: a run's config (an object)")
    return from_dict(Config, data)


def special_tokens(workdir) -> dict:
    """An imported model's ``special_tokens.json``: its bos/eos/pad ids and token strings ({} for a run trained
    here, which has none)."""
    return _imported_json(workdir, SPECIAL_IDS_FILE)


def sampling_defaults(workdir) -> dict:
    """An imported model's own sampling settings, as :class:`~qkvjax.sample.Sampling` fields (``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``; a model imported before the penalty was read has no
    such key: none): what ``sample`` draws with where no flag says otherwise; only the penalty for a model whose
    folder asked for greedy decoding with one; {} for a run trained here and a model whose folder asked for
    neither."""
    return _imported_json(workdir, SAMPLING_FILE)


def _imported_json(workdir, name: str) -> dict:
    """One of an imported model's JSON files in the workdir ({} where the model brought none)."""
    file = path(workdir) / name
    return json.loads(file.read_text()) if file.exists() else {}


def stop_ids(workdir) -> tuple[int, ...]:
    """The token ids that end a sequence: an imported model's ``eos_token_id`` (one id or a list, as Hugging Face
    configs give it); none for a run trained here (its text is a stream with no end token)."""
    eos = special_tokens(workdir).get("eos_token_id")
    return tuple(int(i) for i in ([] if eos is None else eos if isinstance(eos, list) else [eos]))


def chat_template(workdir) -> tuple[str, dict[str, str]] | None:
    """An imported model's chat template and the special-token strings it refers to (``bos_token``, ...); None
    when the model came without one (a base model, or a run trained here)."""

    file = path(workdir) / CHAT_TEMPLATE_FILE
    if not file.exists():
        return None
    strings = {k: v for k, v in special_tokens(workdir).items() if k in SPECIAL_TOKENS and isinstance(v, str)}
    return file.read_text(encoding="utf-8"), strings


def run_config(workdir) -> Config:
    """The Config the run's newest committed checkpoint was saved with (what ``info``, ``eval`` and ``sample``
    restore), read from its JSON without restoring anything; ``config.json`` where there is no checkpoint. A
    ``config.json`` edited by hand so that it disagrees is named in a warning and not used."""
    folder = path(workdir) / "checkpoints"
    for step in reversed(checkpoint_steps(workdir)):
        saved = folder / str(step) / "config" / "metadata"  # orbax's JsonSave of the config, committed with the step
        try:
            config = from_dict(Config, json.loads(saved.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue  # damaged or in flight: the step before it
        file = path(workdir) / CONFIG_FILE
        if file.exists():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                if from_dict(Config, json.loads(file.read_text())) != config:
                    print(
                        f"warning: {file} differs from the config saved with checkpoint step {step}; using the "
                        "checkpoint's, as info, eval and sample do"
                    )
        return config
    return load_config(workdir)


def read_metrics(workdir) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) from ``metrics.jsonl``, in the order written; ([], []) if absent."""
    train, evals = [], []
    for _, record in metric_lines(path(workdir) / METRICS_FILE):
        (evals if record.get("eval") else train).append(record)
    return train, evals


def metric_lines(file: epath.Path) -> list[tuple[str, dict]]:
    """``(line, record)`` of every record in a metrics log. A damaged last line is what a crash or a full disk
    leaves mid-write: it is skipped with a warning naming the file and the line. Damage anywhere else is not, and
    raises a ValueError naming both."""
    if not file.exists():
        return []
    lines = file.read_bytes().decode("utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with an integer step")
        except ValueError as e:
            where = f"{file} line {i + 1}"
            if i == last:
                print(f"warning: skipped a damaged last line in {where} (a run stopped while writing it): {e}")
                continue
            raise ValueError(
                f"{where} is damaged ({e}) and is not the last line; move the file aside or cut the line to go on"
            ) from None
        out.append((line, record))
    return out


def export_params(workdir, step: int, params) -> str:
    """A params-only orbax copy for evaluation and other code: ``WORKDIR/params/<step>``; returns its path.

    The copy is written beside the target, into ``.<step>.exporting`` (orbax writes its own temporary folder and
    renames it when whole), and put in place by renames: an earlier export of the step (a finished run started
    again) is moved aside to ``.<step>.replaced`` first and removed last. So a kill or a full disk at any moment
    leaves a whole copy, in place or aside; the next export puts an aside copy back before it starts and removes
    what killed attempts left. Until 2026-12-01 the earlier copy was removed before the new one was written, and a
    kill during that removal left a ``params/<step>`` that did not restore. One writer at a time: training holds the
    workdir's lock, import and convert write into folders of their own. Every process saves its shards; process 0
    renames. (An object store has no rename: there each is a copy and a delete, and a kill during one can leave the
    step without a whole export; the step's checkpoint still holds its params.)"""
    import jax
    import orbax.checkpoint as ocp

    folder = path(workdir) / "params"
    target, staging, aside = (folder / name for name in (str(step), f".{step}.exporting", f".{step}.replaced"))
    primary = jax.process_index() == 0
    if primary and folder.is_dir():
        if aside.exists() and not target.exists():
            aside.rename(target)  # a killed export's earlier copy, back in place
        for leftover in folder.iterdir():
            if leftover.name.startswith((staging.name, aside.name)):  # orbax's temporary folder included
                leftover.rmtree()
    with ocp.AsyncCheckpointer(state_handler()) as ckptr:
        ckptr.save(staging, args=ocp.args.StandardSave(params))
    if primary:
        if target.exists():
            target.rename(aside)
        try:
            staging.rename(target)
        except BaseException:
            if aside.exists():
                aside.rename(target)  # the earlier copy back in place
            raise
        if aside.exists():
            aside.rmtree()
    return os.fspath(target)


def state_handler():
    """orbax's ``StandardCheckpointHandler`` (the same files and typestr: any orbax reader restores them) whose
    arrays are each written whole by one replica when one process holds every replica. orbax's default off GPUs is
    replica-parallel writing: each of R replicas writes 1/R of a replicated array, so that R hosts share the work;
    in one process the same process writes every part, and each part is a slice XLA compiles per array shape and
    device (a two-step run of experiments/configs/tiny.py on 8 CPU devices: 56 of its 78 compiled programs, seconds
    at the first save). With several processes orbax's default stands."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata import array_metadata_store

    handler = ocp.StandardCheckpointHandler()
    if jax.process_count() == 1:
        whole = ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
        )
        default = ocp.type_handlers.get_type_handler
        types = ocp.type_handlers.supported_types()
        registry = ocp.type_handlers.create_type_handler_registry(
            *((t, whole if t is jax.Array else default(t)) for t in types)
        )
        # StandardCheckpointHandler is this PyTree handler with the global registry (no constructor argument takes
        # another): the instance keeps its class, so StandardSave / StandardRestore still find it
        handler._impl = ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=96, restore_concurrent_gb=96, type_handler_registry=registry
        )
    return handler


def exported_steps(workdir) -> list[int]:
    """Steps under ``WORKDIR/params/``, ascending ([] if none)."""
    return _numbered(path(workdir) / "params")


def checkpoint_steps(workdir) -> list[int]:
    """Step folders under ``WORKDIR/checkpoints/``, ascending ([] if none), from the listing alone (committed or
    not: :func:`run_config` and the checkpoint manager tell those apart)."""
    return _numbered(path(workdir) / "checkpoints")


def _numbered(folder) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def params_only(workdir) -> bool:
    """A workdir holding params-only copies and no checkpoint: an imported model not trained here yet."""
    return not (path(workdir) / "checkpoints").is_dir() and bool(exported_steps(workdir))


def restore_exported(workdir, step: int, target):
    """The params-only copy of ``step``, laid out as ``target`` (a tree of ``jax.ShapeDtypeStruct`` with shardings):
    strict, so params of another model fail rather than load in part."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path(workdir) / "params" / str(step), target)


def json_safe(value):
    """``value`` with every non-finite float replaced by None, so the JSON written is strict (RFC 8259)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def training_clock(train_records: list[dict], tokens_per_step: int) -> list[float]:
    """Cumulative training seconds at each training record: steps x tokens / the measured tokens/s of each
    interval. The compiling first interval and evaluations are left out, so curves of resumed runs continue."""
    clock, wall, prev = [], 0.0, 0
    for r in train_records:
        if r.get("tokens_per_s"):
            wall += (r["step"] - prev) * tokens_per_step / r["tokens_per_s"]
        prev = r["step"]
        clock.append(wall)
    return clock


def learning_curve(train_records: list[dict], eval_records: list[dict], tokens_per_step: int) -> list[dict]:
    """One point per step that was logged or evaluated, in step order: ``step``, ``wall_s`` (training seconds so
    far, :func:`training_clock`), ``train_loss`` and ``val_loss`` (None where that step had no such record).

    Evaluations need not fall on logged steps (``eval_every`` need not be a multiple of ``log_every``): an
    evaluation between two training records is placed on the clock at the rate of the interval that holds it."""
    clock = training_clock(train_records, tokens_per_step)
    points = {r["step"]: {"step": r["step"], "wall_s": w, "train_loss": r.get("loss"), "val_loss": None}
              for r, w in zip(train_records, clock, strict=True)}  # fmt: skip
    logged = sorted(points)
    for r in eval_records:
        if r.get("loss") is None:
            continue
        step = r["step"]
        if step not in points:
            before = [s for s in logged if s < step]
            after = next((t for t in train_records if t["step"] > step), None)
            wall = points[before[-1]]["wall_s"] if before else 0.0
            if after is not None and after.get("tokens_per_s"):
                wall += (step - (before[-1] if before else 0)) * tokens_per_step / after["tokens_per_s"]
            points[step] = {"step": step, "wall_s": wall, "train_loss": None, "val_loss": None}
        points[step]["val_loss"] = r["loss"]
    return [points[s] for s in sorted(points)]


def set_aside(workdir, keep_imported: bool) -> epath.Path | None:
    """Moves the run in ``workdir`` (checkpoints, damaged steps, params, TensorBoard events, metrics, config) into
    ``workdir/replaced-<UTC time>/`` by renames inside the workdir: nothing is copied or deleted, and a kill at any
    moment leaves every file in one of the two places. With ``keep_imported``, an imported model's ``params/0``
    stays where it is (the new run starts from it). Returns the folder, or None when there was nothing to move.
    The caller deletes it once the new run has committed its first checkpoint (:func:`drop_aside`)."""
    workdir = path(workdir)
    names = ("checkpoints", DAMAGED_DIR, "tensorboard", METRICS_FILE, CONFIG_FILE, DATA_FILE)
    moving = [workdir / n for n in names if (workdir / n).exists()]
    params = workdir / "params"
    kept = {str(IMPORTED_STEP)} if keep_imported else set()
    moving += [params / str(s) for s in exported_steps(workdir) if str(s) not in kept]
    if not moving:
        return None
    stamp = REPLACED_PREFIX + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    names = [stamp] + [f"{stamp}-{i}" for i in range(1, 1000)]  # two replacements within one second
    aside = next(workdir / n for n in names if not (workdir / n).exists())
    for source in moving:
        target = aside / source.relative_to(workdir)
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
    return aside


def replaced_runs(workdir) -> list[epath.Path]:
    """The runs ``--overwrite`` moved aside that are still here (:func:`set_aside`), oldest first: a replacing run
    stopped before its first checkpoint leaves one."""
    workdir = path(workdir)
    if not workdir.is_dir():
        return []
    return sorted(p for p in workdir.iterdir() if p.name.startswith(REPLACED_PREFIX) and p.is_dir())


def restore_hint(aside) -> str:
    """How to keep a replaced run: its folder is a whole workdir of its own (config, checkpoints, metrics)."""
    return f"to keep it, stop this run and move that folder out: it is a workdir itself (mv {aside} runs/old)"


def drop_aside(aside: epath.Path) -> None:
    """Deletes a replaced run (:func:`set_aside`) once the run replacing it has a committed checkpoint."""
    if aside.exists():
        aside.rmtree()


def splits_digest(splits: dict) -> str:
    """sha256 of a dataset's text: its train, validation and test bytes in that order. A byte corpus' splits are
    consecutive cuts of one file, so this is the file's own sha256 (``sha256sum FILE`` confirms data.json)."""
    h = hashlib.sha256()
    for name in ("train", "validation", "test"):
        h.update(memoryview(splits[name]))
    return h.hexdigest()


def framed_digest(splits: dict) -> str:
    """The digest data.json held before 2026-12-07 (each split framed by its name and length): still accepted."""
    h = hashlib.sha256()
    for name in ("train", "validation", "test"):
        data = bytes(memoryview(splits[name]))
        h.update(f"{name}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def _data_record(workdir) -> dict | None:
    """``data.json``: the text a run recorded at its start (``source``, ``sha256``), or None where it has none."""
    file = path(workdir) / DATA_FILE
    return json.loads(file.read_text()) if file.exists() else None


def recorded_text(workdir) -> str | None:
    """The sha256 of the text a run recorded at its start, or None where it recorded none (an imported model, a run
    from before the record)."""
    try:
        return (_data_record(workdir) or {}).get("sha256")
    except (ValueError, AttributeError):  # a damaged record says nothing here; check_data raises on it
        return None


def check_data(workdir, digest: str, source: str | None, record: bool, also: tuple[str, ...] = ()) -> str | None:
    """Compares the text's ``digest`` with the one the run recorded in ``data.json``; returns a warning naming
    both when the corpus changed (the caller says it), else None. ``record`` writes it where none is recorded
    (a training start); evaluation only compares. ``also``: other digests of the same text that an older record
    may hold (:func:`framed_digest`)."""
    old = _data_record(workdir)
    if old is not None:
        if old.get("sha256") not in (digest, *also):
            return (
                f"warning: the text at {source or old.get('source')} is not the one this run recorded "
                f"(sha256 {str(old.get('sha256'))[:16]}... then, {digest[:16]}... now): it was replaced or "
                "edited; the numbers below are on the new text"
            )
    elif record:
        write_text(path(workdir) / DATA_FILE, json.dumps({"source": source, "sha256": digest}, indent=2) + "\n")
    return None
