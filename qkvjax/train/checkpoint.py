"""Orbax checkpoints: the train state (sharded, async), the data iterator's state and the config, per step.

Layout: ``WORKDIR/checkpoints/<step>/{state,data,config}`` plus ``WORKDIR/params/<step>`` (params only, for
evaluation). A save still in flight (killed mid-write) is a ``*.orbax-checkpoint-tmp`` directory that orbax never
lists, so the newest *complete* step is always the one restored. Restores are strict: the checkpoint's tree must
equal the expected one, key for key and shape for shape, or the error lists what is missing, unexpected or
reshaped. Restoring onto another mesh or device count only needs the target shardings. The files are orbax's
standard ones; one process writes each replicated array whole (:func:`qkvjax.workdir.state_handler`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import zlib

import jax
import orbax.checkpoint as ocp
from etils import epath

from qkvjax.train import tensorstore_leak
from qkvjax.workdir import DAMAGED_DIR, is_disk_full, is_remote, state_handler, write_text
from qkvjax.workdir import path as workdir_path

ITEMS = ("state", "data", "config")


# TensorStore's bindings leak every dict key and value they return as JSON, which orbax's throughput probe hits on
# every save; while qkvjax's own saves and restores are in flight the probe is skipped (see tensorstore_leak.py).
tensorstore_leak.install()


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored as asked; the message says which step and why."""


class CorruptCheckpointError(CheckpointError):
    """Evidence that a step's bytes are damaged: a file missing, resized or rewritten against the step's inventory,
    or (for a step written without one) bytes that do not decode. Only this error moves a step aside."""


class CheckpointReadError(CheckpointError):
    """A step that could not be read for a reason that is not evidence of damage (an I/O or object-store error, too
    little memory, a layout the target mesh cannot take): nothing is moved or deleted; the message names the step
    and the cause, and rerunning once the cause is gone restores it."""


class CheckpointVanishedError(CheckpointReadError):
    """The step's folder went away while it was being read: a training run rotated it out (``max_to_keep``) or
    replaced the run. No evidence of damage; a reader picks the newest step again."""


def _vanished(where: epath.Path, step: int) -> CheckpointVanishedError | None:
    if (where / str(step)).exists():
        return None
    return CheckpointVanishedError(
        f"checkpoint step {step} in {where} went away while it was read (a training run rotates old steps out); "
        "it was not damaged"
    )


def quarantine(mngr: ocp.CheckpointManager, step: int) -> str:
    """Moves a damaged step out of the checkpoints folder (never deletes it) and returns where it went."""
    where = epath.Path(mngr.directory)
    target = where.parent / DAMAGED_DIR / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        (where / str(step)).rename(target)  # an object store copies, then deletes
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"qkvjax: quarantined {step}")
    mngr.reload()
    return os.fspath(target)


def damaged_steps(workdir) -> list[str]:
    """The names of the steps moved to ``checkpoints_damaged/`` (``<step>-<time>``), oldest first."""
    folder = workdir_path(workdir) / DAMAGED_DIR
    if not folder.is_dir():
        return []
    return sorted((p.name for p in folder.iterdir()), key=lambda name: name.split("-")[0].zfill(12))


def restore_config(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The config saved with ``step``. A config that cannot be read is an error (never a skipped provenance check):
    CorruptCheckpointError on evidence of damage, CheckpointReadError otherwise."""
    where = epath.Path(mngr.directory)
    check_intact(where, step)
    try:
        with tensorstore_leak.window(mngr):
            return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    except Exception as e:
        raise _read_failure(e, where, step, "its saved config") from e


class _ReadOnlyNotice(logging.Filter):
    """Drops orbax's warning that a read-only manager's directory is read only: the reader asked for that."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


# Where a run's max_to_keep moves the steps it drops, inside checkpoints/, removed at the next save (finish):
# orbax deletes a step file by file and then its folder, so a tool reading a live run (info, convert, eval) saw a
# step with some of its items gone ('Item "config" was not found'); one rename takes it away whole. Object stores
# have no rename; there orbax deletes in place and a reader says the step went away.
ROTATED_DIR = ".rotated"


def manager(workdir: str, max_to_keep: int = 3, read_only: bool = False) -> ocp.CheckpointManager:
    # A reader's options are the ones orbax would otherwise reset, each with a warning (eval, sample, qkvjax.load)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep, save_interval_steps=0 if read_only else 1,
        create=not read_only, read_only=read_only, enable_async_checkpointing=True,
        todelete_subdir=None if read_only else ROTATED_DIR,
    )  # fmt: skip
    handlers = {
        "state": ocp.StandardCheckpointHandler() if read_only else state_handler(),
        "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }
    # orbax picks how a save becomes visible: an atomic rename of a temporary folder on local disks, a commit
    # file written last on object stores (gs://), which have no rename.
    notice, absl_logger = _ReadOnlyNotice(), logging.getLogger("absl")
    absl_logger.addFilter(notice)
    try:
        for attempt in range(5):
            try:
                return ocp.CheckpointManager(
                    workdir_path(workdir) / "checkpoints", options=options, item_handlers=handlers
                )
            except (FileNotFoundError, NotADirectoryError):
                # orbax lists the steps, then reads each one's time: a live run's max_to_keep can remove a step
                # in between (tests/faults/test_restore_faults.py, a trainer saving every step); list them again
                if not read_only or attempt == 4:
                    raise
        raise AssertionError("unreachable")
    finally:
        absl_logger.removeFilter(notice)


INVENTORY = "inventory.json"


def _crc32(path: epath.Path) -> tuple[int, int]:
    """(size, crc32) of a file, read once."""
    crc, size = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def files_under(folder: epath.Path, prefix: str = ""):
    """(relative path, path) of every file below ``folder``, listing folder by folder (epath refuses recursive
    globs on object stores, and its ``walk`` drops the URI scheme)."""
    for child in folder.iterdir():
        if child.is_dir():
            yield from files_under(child, f"{prefix}{child.name}/")
        else:
            yield prefix + child.name, child


def _inventory(step_dir: epath.Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of a step's files (crc32 catches same-size garbage)."""
    out = {}
    for rel, file in files_under(step_dir):
        if not rel.startswith(INVENTORY):
            out[rel] = list(_crc32(file))
    return out


class DiskFullError(CheckpointError):
    """No space left while writing a checkpoint; the earlier checkpoints are intact."""


def _disk_full(mngr: ocp.CheckpointManager, e: BaseException) -> DiskFullError | None:
    """A DiskFullError saying where and how much is free, if ``e`` (or its cause) is ENOSPC; else None."""
    if not is_disk_full(e):
        return None
    where = epath.Path(mngr.directory)
    _remove_leftovers(mngr, patience_s=10.0)  # give the space back, once orbax's writer threads have stopped
    free = "unknown" if is_remote(where) else f"{shutil.disk_usage(where).free:,}"
    good = [s for s in mngr.all_steps() if (where / str(s)).is_dir()]
    return DiskFullError(
        f"disk full while writing a checkpoint to {where} ({free} bytes free after removing the partial save); "
        f"the last complete checkpoint is {'step ' + str(max(good)) if good else 'none'}. Free space (or lower "
        "--config.train.max_to_keep) and rerun the same command to resume"
    )


def finish(mngr: ocp.CheckpointManager) -> None:
    """Waits for the save in flight, then records each finished step's files and sizes (``inventory.json``), so a
    later restore can name a file that went missing or changed."""
    try:
        mngr.wait_until_finished()
    except Exception as e:
        raise (_disk_full(mngr, e) or e) from e
    finally:
        tensorstore_leak.close_windows(mngr)
    if jax.process_index() != 0:
        return
    _remove_leftovers(mngr)
    for step in mngr.all_steps():
        step_dir = epath.Path(mngr.directory) / str(step)
        target = step_dir / INVENTORY
        if step_dir.is_dir() and not target.exists():
            write_text(target, json.dumps(_inventory(step_dir)))


def close(mngr: ocp.CheckpointManager) -> None:
    """``finish`` then closes the manager; after a failed save, once orbax's threads are joined, removes what they
    were still writing (a partial save can reappear after the first removal)."""
    try:
        finish(mngr)
    finally:
        mngr.close()
        if jax.process_index() == 0:
            _remove_leftovers(mngr, patience_s=10.0)


def _remove_leftovers(mngr: ocp.CheckpointManager, patience_s: float = 0.0) -> None:
    """Removes the folders of saves killed half-way, and the steps max_to_keep moved to ``ROTATED_DIR``: nothing
    else writes here (the workdir is locked) and no save is in flight. Locally the former are orbax's
    ``*.orbax-checkpoint-tmp*`` folders; on an object store, step folders without the commit file, which orbax
    does not list."""
    where = epath.Path(mngr.directory)
    if not where.exists():
        return
    finished = {str(s) for s in mngr.all_steps()}
    for leftover in where.iterdir():
        name = leftover.name
        if (
            name == ROTATED_DIR
            or ".orbax-checkpoint-tmp" in name
            or (is_remote(where) and name.isdigit() and name not in finished)
        ):
            _remove(leftover, patience_s)


def _remove(path: epath.Path, patience_s: float) -> None:
    """Removes ``path``; with ``patience_s``, until it stays gone for half a second (at most that long). After a
    failed save TensorStore's writer threads can still be finishing files inside it: rmtree then fails with
    ENOTEMPTY, or a late write recreates the folder. Best effort after that; the next run removes what is left."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            path.rmtree(missing_ok=True) if path.is_dir() else path.unlink(missing_ok=True)
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return
        if not path.exists():
            time.sleep(0.5)
            if not path.exists():
                return
        time.sleep(0.1)


def damaged_files(step_dir) -> list[str]:
    """Files of a finished step that are missing, resized or rewritten since it was written (empty: none known)."""
    step_dir = epath.Path(step_dir)
    if not (step_dir / INVENTORY).exists():
        return []
    try:
        expected = json.loads((step_dir / INVENTORY).read_text())
    except (OSError, ValueError):  # the inventory itself is damaged: nothing known; orbax's own checks remain
        return []
    now = _inventory(step_dir)
    out = []
    for rel, want in sorted(expected.items()):
        size, crc = (want, None) if isinstance(want, int) else want  # inventories before checksums: sizes only
        if rel not in now:
            out.append(f"{rel} (missing)")
        elif now[rel][0] != size:
            out.append(f"{rel} ({now[rel][0]} bytes, written as {size})")
        elif crc is not None and now[rel][1] != crc:
            out.append(f"{rel} (same size, different content)")
    return out


def save(mngr: ocp.CheckpointManager, step: int, state, data_state: dict, config_dict: dict) -> None:
    """Starts an async save of the step (returns once the arrays are copied off the devices)."""
    finish(mngr)  # orbax would wait for the previous save here anyway
    tensorstore_leak.open_window(mngr)  # until finish(): the async save runs on orbax's threads
    try:
        _save(mngr, step, state, data_state, config_dict)
    except Exception as e:
        raise (_disk_full(mngr, e) or e) from e


def _save(mngr: ocp.CheckpointManager, step: int, state, data_state: dict, config_dict: dict) -> None:
    mngr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config_dict),
        ),
        force=True,
    )


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _paths(tree) -> dict[str, tuple]:
    """'opt_state/1/0/mu/block_0/...' -> shape; the same spelling for live trees and orbax's metadata dicts."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_name(k) for k in path): tuple(getattr(leaf, "shape", ())) for path, leaf in flat}


def check_structure(saved, expected, step: int, where: str) -> None:
    """Raises CheckpointError listing missing, unexpected and reshaped entries (never a partial restore)."""
    have, want = _paths(saved), _paths(expected)
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    reshaped = sorted(f"{k}: saved {have[k]}, expected {want[k]}" for k in set(have) & set(want) if have[k] != want[k])
    if missing or unexpected or reshaped:
        lines = [f"checkpoint step {step} in {where} does not match this model"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("reshaped", reshaped)):
            if items:
                lines.append(
                    f"  {title} ({len(items)}): " + ", ".join(items[:12]) + (" ..." if len(items) > 12 else "")
                )
        raise CheckpointError("\n".join(lines))


def check_intact(where: epath.Path, step: int) -> None:
    """Raises CorruptCheckpointError if the step's files differ from its inventory, CheckpointReadError if they
    cannot even be listed or read (a transient error is no evidence of damage)."""
    try:
        damaged = damaged_files(where / str(step))
    except (OSError, MemoryError) as e:
        gone = _vanished(where, step)
        if gone is not None:
            raise gone from e
        raise CheckpointReadError(
            f"checkpoint step {step} in {where} could not be checked ({_short(e)}); nothing was moved: rerun once "
            "the cause is fixed"
        ) from e
    if damaged:
        gone = _vanished(where, step)
        if gone is not None:
            raise gone
        raise CorruptCheckpointError(
            f"checkpoint step {step} in {where} is corrupted: "
            + "; ".join(damaged[:8])
            + (f" and {len(damaged) - 8} more" if len(damaged) > 8 else "")
            + " (training and evaluation fall back to an earlier step by themselves)"
        )


# What only damaged bytes produce when a step has no inventory to compare against: a file that is not there, or
# bytes that do not decode. TensorStore reports these with absl status codes in its message.
_DAMAGE_TYPES = (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, EOFError)
_DAMAGE_WORDS = ("DATA_LOSS", "NOT_FOUND", "Error decoding", "Failed to decode", "corrupt", "checksum mismatch")


def is_damage(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is evidence of damaged bytes rather than trouble reading good ones."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (MemoryError, PermissionError)):
            return False
        if isinstance(e, _DAMAGE_TYPES) or any(word in str(e) for word in _DAMAGE_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


def _read_failure(e: BaseException, where: epath.Path, step: int, what: str) -> CheckpointError:
    """The error to raise for a failed read of ``what``: damage only when the step has no inventory vouching for
    its bytes and the failure itself shows damage; anything else moves nothing."""
    gone = _vanished(where, step)
    if gone is not None:  # a missing file is damage only while its step is still there
        return gone
    vouched = (where / str(step) / INVENTORY).exists()  # check_intact passed: every byte is as written
    if not vouched and is_damage(e):
        return CorruptCheckpointError(
            f"checkpoint step {step} in {where} is corrupted: cannot read {what} ({_short(e)}); training and "
            "evaluation fall back to an earlier step by themselves"
        )
    return CheckpointReadError(
        f"checkpoint step {step} in {where}: reading {what} failed ({_short(e)}); this is not evidence of damage, "
        "so nothing was moved or deleted: rerun once the cause is fixed"
    )


def restore(mngr: ocp.CheckpointManager, step: int, target_state):
    """(state, data_state, config_dict) of ``step``, the state laid out as ``target_state`` (abstract arrays with
    shardings) says. Raises CorruptCheckpointError on evidence of damage (the callers then fall back),
    CheckpointReadError when the read failed for another reason, CheckpointError when the step holds another
    model; each names the step and the file or cause."""
    where = epath.Path(mngr.directory)
    step_dir = where / str(step)
    check_intact(where, step)
    try:
        metadata = mngr.item_metadata(step)["state"]
    except Exception as e:
        raise _read_failure(e, where, step, "its metadata") from e
    if metadata is None or not (step_dir / "state" / "_METADATA").exists():
        gone = _vanished(where, step)
        if gone is not None:
            raise gone
        raise CorruptCheckpointError(
            f"checkpoint step {step} in {where} is corrupted: the state's metadata file state/_METADATA is missing"
        )
    tree = getattr(metadata, "tree", metadata)
    check_structure(tree, target_state, step, where)
    try:
        with tensorstore_leak.window(mngr):
            restored = mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target_state),
                    data=ocp.args.JsonRestore(),
                    config=ocp.args.JsonRestore(),
                ),
            )
    except Exception as e:
        raise _read_failure(e, where, step, "its state") from e
    return restored["state"], restored["data"], restored["config"]


def _short(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 400 else text[:400] + " ..."
