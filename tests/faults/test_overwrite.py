"""--overwrite validates, then acts: everything that can be checked is checked before the old run is touched, the
old run is moved aside (renames in the workdir) and deleted only once the new run has committed a checkpoint, and
an imported model's weights survive it."""

import os
import shutil

import pytest

from tests.faults.test_restore_faults import snapshot
from tests.helpers import metrics, run_in_process, train_args

STRICT_DTYPE_PROMOTION = False  # optax

SETTINGS = {"train.num_steps": 4, "train.checkpoint_every": 2, "train.eval_every": 100}


def test_overwrite_with_a_missing_corpus_changes_nothing(tmp_path, small_text, data_dir, capsys):
    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **SETTINGS)) == 0
    before = snapshot(w)
    missing = tmp_path / "nowhere.txt"
    args = train_args(w, str(missing), data_dir, **SETTINGS, **{"model.d_model": 48}) + ["--overwrite"]
    assert run_in_process(args) != 0
    assert str(missing) in capsys.readouterr().err
    assert snapshot(w) == before  # every checkpoint, the config and the log, byte for byte
    assert not [n for n in os.listdir(w) if n.startswith("replaced-")]


def test_overwrite_keeps_the_old_run_aside_until_the_first_new_checkpoint(tmp_path, small_text, data_dir, capsys):
    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **SETTINGS)) == 0
    old_config = (w / "config.json").read_text()
    # a new run that fails at its first step (a non-finite loss) has no checkpoint: the old run stays aside, whole
    nan = {**SETTINGS, "train.learning_rate": 1e30, "model.d_model": 48}
    assert run_in_process(train_args(w, small_text, data_dir, **nan) + ["--overwrite"]) != 0
    (aside,) = [w / n for n in os.listdir(w) if n.startswith("replaced-")]
    assert (aside / "config.json").read_text() == old_config
    assert sorted(os.listdir(aside / "checkpoints")) == ["2", "4"] and (aside / "params" / "4").is_dir()
    assert "until this run's first checkpoint" in capsys.readouterr().out
    # a new run that commits a checkpoint deletes what it replaced, and only then
    new = {**SETTINGS, "model.d_model": 48}
    assert run_in_process(train_args(w, small_text, data_dir, **new) + ["--overwrite"]) == 0
    out = capsys.readouterr().out
    # the start names the run the failed attempt left aside, and how to keep it (its folder is a workdir itself)
    assert f"a run --overwrite replaced is still in {aside}" in out and f"mv {aside} runs/old" in out
    assert "deleted the replaced run" in out and "checkpoint step 2 is committed" in out
    assert out.count("deleted the replaced run") == 2  # the failed attempt's aside and this start's, both announced
    assert not [n for n in os.listdir(w) if n.startswith("replaced-")]
    assert sorted(os.listdir(w / "checkpoints")) == ["2", "4"] and '"d_model": 48' in (w / "config.json").read_text()


@pytest.mark.slow  # a real SIGKILL mid-run, 20-40 s (pytest -m slow tests/faults/test_overwrite.py); the failed
# attempt in the test above covers the same naming and clean-up in CI
def test_a_replaced_run_left_by_a_killed_attempt_is_named_at_the_next_start(tmp_path, small_text, data_dir, capsys):
    """A replacing run killed (SIGKILL) before its first checkpoint leaves the replaced run whole; the same command
    again says where it is and how to keep it, and deletes it once the new run has a checkpoint."""
    import signal
    import subprocess
    import sys
    import time

    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **SETTINGS)) == 0
    long = {**SETTINGS, "train.num_steps": 10**6, "train.checkpoint_every": 10**6, "train.log_every": 1}
    args = train_args(w, small_text, data_dir, **long, **{"model.d_model": 48}) + ["--overwrite"]
    proc = subprocess.Popen([sys.executable, "-m", "qkvjax.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 300

        def training():  # the old run is aside and the new one has logged a step: no new checkpoint yet
            aside = [n for n in os.listdir(w) if n.startswith("replaced-")]
            return aside and (w / "metrics.jsonl").exists() and (w / "metrics.jsonl").stat().st_size

        while not training() and time.time() < deadline:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (aside,) = [w / n for n in os.listdir(w) if n.startswith("replaced-")]
    assert sorted(os.listdir(aside / "checkpoints")) == ["2", "4"]
    capsys.readouterr()
    again = {**long, "train.num_steps": 2, "train.checkpoint_every": 2}  # the same run, told to stop sooner
    assert run_in_process(train_args(w, small_text, data_dir, **again, **{"model.d_model": 48}) + ["--overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"a run --overwrite replaced is still in {aside}" in out and f"mv {aside} runs/old" in out
    assert f"deleted the replaced run {aside}" in out and not aside.exists()
    assert not [n for n in os.listdir(w) if n.startswith("replaced-")]


def test_a_users_own_checkpoints_folder_is_never_touched(tmp_path, small_text, data_dir, capsys):
    """A folder holding no run (no config.json) but a checkpoints/ folder of the user's own: refused with and
    without --overwrite (--overwrite moved it aside and deleted it), the folder kept byte for byte."""
    w = tmp_path / "w"
    (w / "checkpoints").mkdir(parents=True)
    (w / "checkpoints" / "mine.pt").write_bytes(b"a user's weights")
    for extra in ([], ["--overwrite"]):
        assert run_in_process(train_args(w, small_text, data_dir, **SETTINGS) + extra) != 0
        err = capsys.readouterr().err
        assert "holds a checkpoints/ folder but no run" in err and err.count("\n") == 1, err
        assert (w / "checkpoints" / "mine.pt").read_bytes() == b"a user's weights"
        assert sorted(os.listdir(w)) == ["checkpoints"]


def test_overwrite_of_an_imported_model_starts_from_its_weights(tmp_path, small_text, data_dir, capsys):
    src, w = tmp_path / "src", tmp_path / "w"
    assert run_in_process(train_args(src, small_text, data_dir, **SETTINGS)) == 0
    # what `qkvjax import` leaves: config.json and params/0, no checkpoints
    w.mkdir()
    shutil.copy(src / "config.json", w / "config.json")
    shutil.copytree(src / "params" / "4", w / "params" / "0")
    imported = snapshot(w / "params" / "0")
    # a first run from it that went wrong (as the non-finite error advises: --overwrite with a lower rate)
    assert run_in_process(train_args(w, small_text, data_dir, **SETTINGS)) == 0
    capsys.readouterr()
    again = {**SETTINGS, "train.learning_rate": 1e-4}
    assert run_in_process(train_args(w, small_text, data_dir, **again) + ["--overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"starting from the params in {w / 'params' / '0'}" in out
    assert snapshot(w / "params" / "0") == imported
    assert metrics(w)[0]["step"] == 1 and len(metrics(w)) == 4
    # another model cannot start from those weights: refused before anything moves
    before = snapshot(w)
    assert run_in_process(train_args(w, small_text, data_dir, **again, **{"model.d_model": 48}) + ["--overwrite"])
    assert "imported model (params/0) of another model config" in capsys.readouterr().err
    assert snapshot(w) == before
