"""Faults injected by hand: a second run on a workdir, non-finite training, bad data, a deleted config.json,
damaged checkpoints, leftovers of killed saves, and inputs that used to end in raw tracebacks."""

import contextlib
import errno
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from qkvjax.config import apply_overrides, load_config_file
from qkvjax.evaluate import evaluate
from qkvjax.train.lock import LOCK_FILE
from tests.helpers import TINY, exported_params, flat, metrics, run_in_process, train_args

STRICT_DTYPE_PROMOTION = False  # optax


def _strict_json_lines(path):
    def refuse(name):
        raise AssertionError(f"{path} holds the non-JSON constant {name}")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f if line.strip()]


def test_a_second_run_on_a_locked_workdir_refuses_and_a_stale_lock_is_taken_over(tmp_path, corpus, data_dir, capsys):
    w = tmp_path / "run"
    w.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (w / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "started": "then"}))
        assert run_in_process(train_args(w, corpus, data_dir, **{"train.num_steps": 2})) == 2
        err = capsys.readouterr().err
        assert f"in use by another training run (pid {holder.pid} on {socket.gethostname()}" in err
        assert not (w / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is stale and the next run takes it over, then releases it
    assert run_in_process(train_args(w, corpus, data_dir, **{"train.num_steps": 2})) == 0
    assert not (w / LOCK_FILE).exists()


def test_two_runs_that_both_found_the_lock_stale_cannot_both_hold_it(tmp_path):
    """A lock left by a dead run, and two runs that both read it before either took it over: the second acts on
    what it read (the dead holder) after the first holds the lock. Before the flock, it renamed the first run's
    fresh lock away as the stale one and created its own, and both trained into the workdir."""
    from qkvjax.train.lock import WorkdirLock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"host": socket.gethostname(), "pid": dead.pid, "started": "then"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))

    class ReadBeforeTheTakeover(WorkdirLock):
        def _holder(self):
            return dict(record)

    first, second = WorkdirLock(tmp_path), ReadBeforeTheTakeover(tmp_path)
    first.acquire()
    try:
        with pytest.raises(ValueError, match="in use by another training run"):
            second.acquire()
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == first.me["token"]
    finally:
        first.release()
        second.release()
    assert not (tmp_path / LOCK_FILE).exists()
    with WorkdirLock(tmp_path) as third:  # released: taken at once
        assert third.held


def test_a_lock_holder_killed_with_sigkill_leaves_a_lock_the_next_run_takes_and_junk_is_no_holder(tmp_path):
    from qkvjax.train.lock import WorkdirLock

    code = (
        "import sys, time; from qkvjax.train.lock import WorkdirLock; lock = WorkdirLock(sys.argv[1]); lock.acquire(); "
        "print('held', flush=True); time.sleep(120)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"in use by another training run \\(pid {holder.pid} on "):
            WorkdirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # what the killed run left
    with WorkdirLock(tmp_path) as lock:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.me["token"]
    for junk in ("[]", '{"pid": "7", "host": "h"}', "{"):  # not a holder's record, and old: taken
        (tmp_path / LOCK_FILE).write_text(junk)
        os.utime(tmp_path / LOCK_FILE, (0, 0))
        with WorkdirLock(tmp_path) as lock:
            assert lock.held


def test_two_writers_of_one_output_folder_never_mix_their_files_and_a_killed_ones_folder_is_removed(tmp_path):
    """Two ``whole_or_absent`` blocks on one target, interleaved (two ``qkvjax import --workdir W`` at once): each
    writes its own sibling, the first to finish publishes its files alone, the other is refused. Before, both
    staged in ``.W.partial`` (the second removing the first's), so the target got the files of both."""
    from qkvjax.workdir import whole_or_absent

    target = tmp_path / "out"
    first_block, second_block = whole_or_absent(target, "files"), whole_or_absent(target, "files")
    first = first_block.__enter__()
    second = second_block.__enter__()
    (first / "from_first").write_text("1")
    (second / "from_second").write_text("2")
    second_block.__exit__(None, None, None)
    assert sorted(os.listdir(target)) == ["from_second"]  # published alone
    with pytest.raises(ValueError, match="written by another process while this one wrote it"):
        first_block.__exit__(None, None, None)
    assert sorted(os.listdir(target)) == ["from_second"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the refused attempt's sibling removed

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = tmp_path / f".again.partial.{socket.gethostname()}.{dead.pid}.0a1b2c3d"  # a killed attempt's
    legacy, elsewhere = tmp_path / ".again.partial", tmp_path / f".again.partial.otherhost.{dead.pid}.0a1b2c3d"
    for folder in (killed, legacy, elsewhere):
        folder.mkdir()
        (folder / "half").write_text("x")
    with whole_or_absent(tmp_path / "again", "files") as staging:
        (staging / "whole").write_text("y")
    assert sorted(os.listdir(tmp_path)) == [elsewhere.name, "again", "out"]  # another host's attempt may be alive
    assert os.listdir(tmp_path / "again") == ["whole"]


def test_a_diverging_run_stops_at_the_step_keeps_the_last_good_checkpoint_and_can_skip(
    tmp_path, corpus, data_dir, capsys
):
    common = {"train.num_steps": 12, "train.checkpoint_every": 2, "train.warmup_steps": 0}
    bad = tmp_path / "bad"  # a learning rate that makes the loss blow up within a few steps
    proc_args = train_args(bad, corpus, data_dir, **common, **{"train.learning_rate": 1e6})
    assert run_in_process(proc_args) == 2
    err = capsys.readouterr().err
    assert re.search(r"step \d+: the (loss|gradient norm) is not finite", err), err
    assert "skip_nonfinite=true" in err and "learning_rate" in err
    records = _strict_json_lines(bad / "metrics.jsonl")
    steps = sorted(int(p) for p in os.listdir(bad / "checkpoints")) if (bad / "checkpoints").exists() else []
    for step in steps:  # whatever was saved holds only finite numbers
        assert all(np.isfinite(v).all() for v in flat(_restore_params(bad, step)).values())
    assert all(r["loss"] is None or np.isfinite(r["loss"]) for r in records)
    # skip mode: the same run goes to the end, counting the skipped batches
    assert run_in_process(proc_args + ["--config.train.skip_nonfinite=true"]) == 0
    last = metrics(bad)[-1]
    assert last["step"] == 12 and last["skipped_steps"] >= 1
    assert all(np.isfinite(v).all() for v in flat(exported_params(bad, 12)).values())


def _restore_params(workdir, step):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(workdir, "checkpoints", str(step), "state"))["params"]


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_config_refuses_non_finite_numbers(value):
    with pytest.raises(ValueError, match=rf"train.learning_rate={value}.*finite"):
        apply_overrides(load_config_file(TINY), {"train.learning_rate": value})


def test_bad_data_is_refused_before_training(tmp_path, corpus, data_dir, capsys):
    assert run_in_process(train_args(tmp_path / "v", corpus, data_dir, **{"model.vocab_size": 100})) == 2
    assert "model.vocab_size=100 does not cover the data" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("twenty bytes of text")
    args = train_args(tmp_path / "s", str(short), data_dir, **{"data.seq_len": 8})
    assert run_in_process(args) == 2
    assert "the validation split has 1 bytes; evaluation needs at least 2" in capsys.readouterr().err
    assert not (tmp_path / "v").exists() and not (tmp_path / "s").exists()  # no half-made workdir left behind


@pytest.mark.parametrize("source", ["missing", "not_utf8", "folder"])
def test_a_data_error_leaves_no_workdir_behind(tmp_path, data_dir, capsys, source):
    path = {"missing": tmp_path / "nope.txt", "not_utf8": tmp_path / "latin1.txt", "folder": tmp_path}[source]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    args = train_args(tmp_path / "w", str(path), data_dir, **{"data.dataset": "text_file"})
    assert run_in_process(args) == 2
    assert "data.source_path" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert run_in_process(train_args(kept, str(path), data_dir, **{"data.dataset": "text_file"})) == 2
    assert (kept / "notes.txt").read_text() == "mine" and sorted(os.listdir(kept)) == ["notes.txt"]


def test_every_config_difference_is_named_or_counted(tmp_path, small_text, data_dir, capsys):
    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **{"train.num_steps": 2})) == 0
    changes = {"train.learning_rate": 0.01, "train.b1": 0.8, "train.b2": 0.9, "train.weight_decay": 0.2,
               "train.grad_clip": 0.5, "train.warmup_steps": 3, "train.min_lr_ratio": 0.2, "seed": 4,
               "train.batch_size": 16, "model.dropout_rate": 0.1}  # fmt: skip
    assert run_in_process(train_args(w, small_text, data_dir, **{"train.num_steps": 2, **changes})) == 2
    err = capsys.readouterr().err
    assert "and 2 more:" in err, err
    for key in changes:
        assert key in err, key


def test_lowering_num_steps_below_the_newest_checkpoint_changes_nothing(tmp_path, small_text, data_dir, capsys):
    w = tmp_path / "w"
    assert (
        run_in_process(train_args(w, small_text, data_dir, **{"train.num_steps": 4, "train.checkpoint_every": 2})) == 0
    )
    before = {p: p.read_bytes() for p in w.rglob("*") if p.is_file() and "tensorboard" not in p.parts}
    capsys.readouterr()
    assert run_in_process(train_args(w, small_text, data_dir, **{"train.num_steps": 3})) == 2
    err = capsys.readouterr().err
    assert "already at checkpoint step 4, past train.num_steps=3" in err and "nothing was changed" in err, err
    after = {p: p.read_bytes() for p in w.rglob("*") if p.is_file() and "tensorboard" not in p.parts}
    assert after == before  # config.json, metrics.jsonl and every checkpoint as they were


def test_a_split_cut_inside_a_multibyte_character_trains(tmp_path, data_dir):
    text = ("a" * 601 + "é" * 60 + "c" * 79).encode()  # 800 bytes: the 90% cut (720) falls inside an 'é'
    assert len(text) == 800 and text[720] & 0xC0 == 0x80  # a continuation byte
    path = tmp_path / "cut.txt"
    path.write_bytes(text)
    assert run_in_process(train_args(tmp_path / "w", str(path), data_dir, **{"train.num_steps": 1})) == 0


def test_config_provenance_is_the_checkpoints(tmp_path, corpus, data_dir, capsys):
    w = tmp_path / "w"
    assert run_in_process(train_args(w, corpus, data_dir, **{"train.num_steps": 2})) == 0
    before = evaluate(str(w))
    config = json.loads((w / "config.json").read_text())
    config["model"]["attention"]["rope"] = True  # a hand edit of config.json no longer changes the model
    (w / "config.json").write_text(json.dumps(config))
    assert evaluate(str(w)) == before
    os.remove(w / "config.json")  # and a deleted config.json does not let another config resume the checkpoint
    args = train_args(w, corpus, data_dir, **{"train.num_steps": 4, "train.learning_rate": 0.01, "seed": 3})
    assert run_in_process(args) == 2
    err = capsys.readouterr().err
    assert "checkpoint step 2 was trained with another config" in err and "train.learning_rate" in err and "seed" in err


def test_a_damaged_newest_checkpoint_is_moved_aside_and_training_falls_back(tmp_path, corpus, data_dir, capsys):
    w = tmp_path / "w"
    common = {"train.checkpoint_every": 2, "train.max_to_keep": 3}
    assert run_in_process(train_args(w, corpus, data_dir, **common, **{"train.num_steps": 4})) == 0
    (w / "checkpoints" / "9.orbax-checkpoint-tmp-1234").mkdir()  # left by a save killed half-way
    data = w / "checkpoints" / "4" / "state" / "ocdbt.process_0" / "d"
    victim = sorted(os.listdir(data))[0]
    with open(data / victim, "r+b") as f:  # same size, garbage content
        size = os.path.getsize(data / victim)
        f.write(b"\0" * size)
    shutil.copytree(w, tmp_path / "copy")
    assert evaluate(str(tmp_path / "copy"))["step"] == 2  # evaluation falls back by itself
    assert "checkpoint step 4" in capsys.readouterr().err
    assert run_in_process(train_args(w, corpus, data_dir, **common, **{"train.num_steps": 6})) == 0
    out = capsys.readouterr().out
    assert "checkpoint step 4" in out and "falling back" in out and "resumed from checkpoint step 2" in out
    assert len(os.listdir(w / "checkpoints_damaged")) == 1
    assert not list((w / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
    assert metrics(w)[-1]["step"] == 6


@pytest.mark.parametrize(
    "args, match",
    [
        (["train", f"--config={os.path.join(os.path.dirname(TINY), '..', '..', 'README.md')}", "--workdir={w}"],
         r"is not a Python file"),
        (["train", f"--config={TINY}", "--workdir={file}"], r"is a file; pass a folder"),
        (["train", f"--config={TINY}", "--workdir={file}/run"], r"--workdir=.*afile/run cannot be created: Not a dir"),
        (["schemes", "--num-heads", "0"], r"num_heads=0; allowed: an integer >= 1"),
        (["train", f"--config={TINY}", "--workdir=s3://bucket/run"], r"cannot be written to s3://; allowed: .*gs://"),
        (["info", "--workdir=s3://bucket/run"], r"cannot be written to s3://"),
        (["train", f"--config={TINY}", "--workdir={w}", "--config.train.max_to_keep=0"], r"train.max_to_keep=0"),
        # found by giving every option of every command odd values (2026-11-30): an empty --workdir (an unset
        # $RUN) trained into the folder the command was typed in; 2^40 layers or a batch of 10^12 rows filled the
        # memory before any check (the batch was being read, for good, with nothing printed)
        (["train", f"--config={TINY}", "--workdir="], r"a run or model folder given as ''; allowed: a folder's path"),
        (["eval", "--workdir="], r"given as ''; allowed: a folder's path"),
        (["info", "--workdir="], r"given as ''; allowed: a folder's path"),
        (["compare", ""], r"given as ''; allowed: a folder's path"),
        (["analyze", "--workdir="], r"given as ''; allowed: a folder's path"),
        # a path that is not UTF-8 trained, then failed at the first save inside TensorStore with a traceback
        (["train", f"--config={TINY}", "--workdir={w}\udcff"], r"holds '\\udcff', bytes that are not UTF-8; allowed"),
        (["info", "--workdir=w\udcff"], r"holds '\\udcff', bytes that are not UTF-8; allowed: a path in UTF-8"),
        (["train", f"--config={TINY}", "--workdir={w}", "--config.data.data_dir=td\udcff"],
         r"data.data_dir='td\\udcff'; allowed: UTF-8 text"),  # array_record's writer failed with a traceback
        (["train", f"--config={TINY}", "--workdir={w}", "--config.data.source_path=in\udcff.txt"],
         r"data.source_path='in\\udcff.txt'; allowed: None \(download Tiny Shakespeare\) or UTF-8 text"),
        (["schemes", "--num-layers", "1099511627776"], r"--num-layers=1099511627776; allowed: an integer in \[1, 6"),
        (["schemes", "--num-layers", "4", "--layers", "x=separate*1000000000000"],
         r"'\*1000000000000' makes 1000000000000 or more layers, more than num_layers=4"),
        (["train", f"--config={TINY}", "--workdir={w}", "--config.train.batch_size=1000000000000"],
         r"a training step needs about [\d,.]+ GiB per device \(params .*activations of [\d,]+ x 32 tokens"
         r" [\d,.]+\), over 1.5x the [\d,.]+ GiB a device has here; allowed: a smaller train.batch_size"),
    ],
)  # fmt: skip
def test_one_line_errors_instead_of_tracebacks(args, match, tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    args = [a.format(w=tmp_path / "w", file=tmp_path / "afile") for a in args]
    assert run_in_process(args) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not any((tmp_path / "cwd").iterdir()) and sorted(os.listdir(tmp_path)) == ["afile", "cwd"]  # nothing written


def test_decoding_past_the_cache_is_an_error():
    import jax
    import jax.numpy as jnp

    from qkvjax import Attention, AttentionConfig

    model = Attention(AttentionConfig(num_heads=3, head_dim=2))
    x = jnp.ones((1, 5, 7))
    variables = model.init(jax.random.key(0), x, decode=True)
    _, mutated = model.apply(variables, x, decode=True, mutable=["cache"])  # fills all 5 positions
    with pytest.raises(ValueError, match=r"decoding 1 more position\(s\) at cache index 5 overflows the cache of 5"):
        model.apply({"params": variables["params"], **mutated}, x[:, :1], decode=True, mutable=["cache"])


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs: room for a few checkpoints of the tiny model, not for twenty."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3000k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_disk_full_gives_one_clear_line_and_keeps_the_last_checkpoint(small_disk, corpus, data_dir, capsys):
    w = small_disk / "w"
    args = train_args(w, corpus, data_dir, **{"train.num_steps": 20, "train.checkpoint_every": 1,
                                               "train.max_to_keep": 20})  # fmt: skip
    assert run_in_process(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # orbax's thread tracebacks only with --verbose
    last = err[-1]
    match = re.search(
        r"disk full while writing a checkpoint to .* bytes free.*the last complete checkpoint is step (\d)", last
    )
    assert match, last
    assert evaluate(str(w))["step"] == int(match.group(1))  # that checkpoint restores
    left = [p for tmp in (w / "checkpoints").glob("*.orbax-checkpoint-tmp*") for p in tmp.rglob("*")]
    assert not left, left  # the partial save gave its space back


def test_disk_full_injected_without_a_mount(tmp_path, small_text, data_dir, monkeypatch, capsys):
    """The same handling where no tmpfs can be mounted (no root): orbax's save raises ENOSPC from the fourth
    checkpoint on, as it does when the disk fills while it writes."""
    import orbax.checkpoint as ocp

    real_save, saves = ocp.CheckpointManager.save, []

    def save(self, step, *args, **kwargs):
        saves.append(step)
        if len(saves) >= 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    w = tmp_path / "w"
    args = train_args(w, small_text, data_dir, **{"train.num_steps": 8, "train.checkpoint_every": 1,
                                                   "train.max_to_keep": 8})  # fmt: skip
    assert run_in_process(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.search(r"disk full while writing a checkpoint to .*the last complete checkpoint is step 3", err[0]), err
    monkeypatch.undo()
    assert evaluate(str(w))["step"] == 3  # that checkpoint restores


# The CLI with tensorboardX's record writer failing as a full disk does from its Nth record on (argv[1]).
FAILING_EVENTS = """
import errno, sys
from tensorboardX import record_writer
real, calls = record_writer.RecordWriter.write, [0]
def write(self, data):
    calls[0] += 1
    if calls[0] >= int(sys.argv[1]):
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, data)
record_writer.RecordWriter.write = write
from qkvjax.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _train_until_stopped(args, timeout=150, prefix=()):
    from tests.helpers import REPO, xla_flags

    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    command = [sys.executable, *prefix, *args] if prefix else [sys.executable, "-m", "qkvjax.cli", *args]
    try:
        return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the run hung instead of stopping ({timeout} s); its output: {e.stderr!r}") from None


def test_a_failing_tensorboard_write_stops_the_run_in_one_line_keeping_its_checkpoints(tmp_path, small_text, data_dir):
    """Before, tensorboardX's writer thread died on the error, its queue of 10 filled, and the loop blocked in
    ``add_scalar`` for ever (SIGTERM too): a run whose disk filled hung silently."""
    w = tmp_path / "w"
    args = train_args(w, small_text, data_dir, **{"train.num_steps": 60, "train.checkpoint_every": 10,
                                                   "train.eval_every": 1000})  # fmt: skip
    proc = _train_until_stopped(["25", *args], prefix=("-c", FAILING_EVENTS))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert re.search(r"No space left on device while writing .*tensorboard; the checkpoints already saved", err[0])
    assert evaluate(str(w))["step"] == 20  # the steps saved before the failure restore
    assert not (w / LOCK_FILE).exists()


def test_a_disk_that_fills_while_the_run_logs_stops_it_with_one_line(small_disk, small_text, data_dir):
    """A real full disk (the tmpfs above, a few kB left): metrics.jsonl or the events file fails first, and the run
    stops naming it instead of hanging."""
    filler = small_disk / "filler"
    free = shutil.disk_usage(small_disk).free
    with open(filler, "wb") as f:
        f.write(b"\0" * (free - 160 * 1024))
    w = small_disk / "w"
    args = train_args(w, small_text, data_dir, **{"train.num_steps": 100000, "train.checkpoint_every": 100000,
                                                   "train.eval_every": 100000})  # fmt: skip
    proc = _train_until_stopped(args, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert re.search(r"No space left on device while writing .*(metrics\.jsonl|tensorboard)", err[0]), err


def test_a_disk_that_fills_while_the_dataset_is_prepared_is_one_line_naming_data_dir(small_disk, small_text, capsys):
    """array_record's writer raised a RuntimeError with a traceback of 30 lines; TFDS removes its incomplete folder."""
    with open(small_disk / "filler", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - 64 * 1024))
    data_dir, w = small_disk / "tfds", small_disk / "w"
    assert run_in_process(train_args(w, small_text, str(data_dir), **{"train.num_steps": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"No space left on device while preparing the dataset in data_dir={data_dir}" in err[0]
    assert not list(data_dir.rglob("incomplete*")) and not w.exists()


def test_no_room_for_the_lock_is_one_line_naming_it_and_leaves_no_workdir(small_disk, small_text, data_dir, capsys):
    with open(small_disk / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):  # until the disk is full
            while True:
                f.write(b"\0" * 4096)
    w = small_disk / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **{"train.num_steps": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"No space left on device while writing the lock {w / LOCK_FILE}" in err[0], err
    assert not w.exists()  # before, an empty train.lock in the folder this run had made


def test_no_room_for_the_lock_injected_without_a_mount(tmp_path, small_text, data_dir, monkeypatch, capsys):
    """The same as the tmpfs test above where none can be mounted: the lock's write raises ENOSPC."""

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)  # the lock's record is the run's only pwrite before it fails
    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **{"train.num_steps": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"No space left on device while writing the lock {w / LOCK_FILE}" in err[0], err
    assert not w.exists()


def test_room_for_the_lock_but_not_the_config_is_one_line_naming_it_and_leaves_no_workdir(
    small_disk, small_text, data_dir, capsys
):
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):  # until the disk is full
            while True:
                f.write(b"\0" * 4096)
    os.truncate(filler, filler.stat().st_size - 4096)  # one page: the lock's
    w = small_disk / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **{"train.num_steps": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"No space left on device while writing {w / 'config.json'}" in err[0], err
    assert not w.exists()  # before, an unnamed error and the empty checkpoints/ folder orbax had made


def test_a_full_disk_reported_by_the_dataset_writer_is_one_line_without_a_mount(
    tmp_path, small_text, monkeypatch, capsys
):
    import tensorflow_datasets as tfds

    def full(self, **kwargs):  # array_record's own words when its chunk writer cannot write
        raise RuntimeError('Failed to finalize writing of split "test": write() failed: No space left on device')

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", full)
    data_dir = tmp_path / "tfds"
    assert run_in_process(train_args(tmp_path / "w", small_text, str(data_dir), **{"train.num_steps": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"No space left on device while preparing the dataset in data_dir={data_dir}" in err[0]


def test_a_relative_source_path_is_stored_absolute(tmp_path, small_text, data_dir, monkeypatch):
    monkeypatch.chdir(os.path.dirname(small_text))
    w = tmp_path / "w"
    assert run_in_process(train_args(w, os.path.basename(small_text), data_dir, **{"train.num_steps": 1})) == 0
    assert json.loads((w / "config.json").read_text())["data"]["source_path"] == small_text


def test_every_file_of_the_newest_checkpoint_damaged_falls_back_naming_it(tmp_path, small_text, data_dir):
    """Each kind of file of the newest step in turn deleted, truncated to half, and overwritten with same-size
    garbage: the restore refuses it naming the file (so training and evaluation fall back; the fallback itself is
    the test above), and the repaired step restores again."""
    from qkvjax.evaluate import restore_params
    from qkvjax.train import checkpoint

    w = tmp_path / "w"
    settings = {"train.num_steps": 4, "train.checkpoint_every": 2, "train.eval_every": 100}
    assert run_in_process(train_args(w, small_text, data_dir, **settings)) == 0
    step_dir = w / "checkpoints" / "4"
    # Every kind of file: each named file, and one of the content-addressed data chunks in each `d/` folder.
    kinds = {}
    for p in sorted(step_dir.rglob("*")):
        if p.is_file() and p.name != "inventory.json":
            kinds.setdefault(p.parent if p.parent.name == "d" else p, p)
    files = list(kinds.values())
    assert len(files) >= 8 and {p.relative_to(step_dir).parts[0] for p in files} >= {"state", "data", "config"}
    damages = {
        "deleted": lambda f, data: f.unlink(),
        "truncated": lambda f, data: f.write_bytes(data[: len(data) // 2]),
        "garbage": lambda f, data: f.write_bytes(bytes(255 - b for b in data)),
    }
    mngr = checkpoint.manager(str(w), read_only=True)
    checked = 0
    for file in files:
        original = file.read_bytes()
        for damage, apply in damages.items():
            if damage != "deleted" and not original:
                continue  # an empty file cannot be cut or garbled
            apply(file, original)
            rel = str(file.relative_to(step_dir))
            with pytest.raises(checkpoint.CorruptCheckpointError, match=r"checkpoint step 4 .*corrupted") as e:
                checkpoint.restore(mngr, 4, None)  # the damage is found before the state is read
            assert rel in str(e.value), (damage, rel, str(e.value))
            file.write_bytes(original)
            checked += 1
    mngr.close()
    assert checked >= 2 * len(files)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert restore_params(str(w))[3] == 4  # repaired: the newest restores again, with no warning
    assert "warning" not in err.getvalue()


def test_a_nan_entering_through_one_batch_is_caught_at_that_step_and_the_update_dropped():
    """A corrupted batch: one id outside the vocabulary, which the embedding lookup (``jnp.take``, fill mode)
    turns into a NaN row, so that step's loss is NaN. The update is dropped, the state stays as it was, and the
    next clean batch trains."""
    import jax

    from qkvjax.models.lm import DecoderLM
    from qkvjax.train.state import create_state, make_optimizer
    from qkvjax.train.step import make_train_step

    config = apply_overrides(load_config_file(TINY), {})
    model, tx = DecoderLM(config.model), make_optimizer(config.train)
    state = create_state(model, config, tx, None)
    step = jax.jit(make_train_step(model, tx))
    clean = np.tile(np.arange(10, 10 + config.seq_len, dtype=np.int32), (4, 1))
    poisoned = clean.copy()
    poisoned[2, 5] = config.model.vocab_size  # the corruption
    after, metrics = step(state, {"inputs": poisoned, "targets": clean})
    assert int(metrics["nonfinite"]) == 1 and not np.isfinite(float(metrics["loss"]))
    assert int(after.step) == 1
    for old, new in zip(jax.tree.leaves(state.params), jax.tree.leaves(after.params), strict=True):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))  # nothing non-finite reached the state
    for old, new in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(after.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
    after, metrics = step(after, {"inputs": clean, "targets": clean})
    assert int(metrics["nonfinite"]) == 0 and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize(("text", "message"), [
    ("", r"config.json is not JSON \(Expecting value: line 1 column 1 \(char 0\)\); it is the run's config"),
    ("[1]", r"config.json holds a JSON list; allowed: a run's config \(an object\)"),
])  # fmt: skip
def test_an_empty_or_damaged_run_config_is_named_in_one_line(tmp_path, capsys, text, message):
    """Issue 101: an empty config.json gave json's bare "Expecting value: line 1 column 1" with no file named."""
    (tmp_path / "config.json").write_text(text)
    for command in (["eval", f"--workdir={tmp_path}"], ["sample", f"--workdir={tmp_path}", "--prompt", "a"]):
        assert run_in_process(command) == 2
        err = capsys.readouterr().err
        assert re.search(message, err) and str(tmp_path) in err and len(err.strip().splitlines()) == 1, err
