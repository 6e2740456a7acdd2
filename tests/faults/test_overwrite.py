"""--overwrite validates, then acts: everything that can be checked is checked before the old run is touched, the
old run is moved aside (renames in the workdir) and deleted only once the new run has committed a checkpoint, and
an imported model's weights survive it."""

import os
import shutil

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
    assert "deleted the replaced run" in out and "checkpoint step 2 is committed" in out
    assert [n for n in os.listdir(w) if n.startswith("replaced-")] == [aside.name]  # the failed attempt's stays
    assert sorted(os.listdir(w / "checkpoints")) == ["2", "4"] and '"d_model": 48' in (w / "config.json").read_text()


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
