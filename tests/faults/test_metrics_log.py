"""A damaged metrics.jsonl: a cut last line (a crash or a full disk mid-write) is skipped with a warning naming
the file and the line, and resume, info and compare go on; damage before the last line is refused in one line
naming both."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO, metrics, run_in_process, train_args, xla_flags

STRICT_DTYPE_PROMOTION = False  # optax

SETTINGS = {"train.num_steps": 4, "train.checkpoint_every": 2, "train.eval_every": 100}


def test_a_cut_last_line_is_skipped_and_damage_before_it_is_named(tmp_path, small_text, data_dir, capsys):
    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **{**SETTINGS, "train.num_steps": 2})) == 0
    log = w / "metrics.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines) + '\n{"step": 3, "loss": 2.5, "bits_per')  # cut mid-record
    where = f"{log} line {len(lines) + 1}"
    for command in (["info", "--workdir", str(w)], ["compare", str(w), str(w)]):
        assert run_in_process(command) == 0, command
        assert f"skipped a damaged last line in {where}" in capsys.readouterr().out
    assert run_in_process(train_args(w, small_text, data_dir, **SETTINGS)) == 0  # resumes from step 2
    out = capsys.readouterr().out
    assert "resumed from checkpoint step 2" in out and f"skipped a damaged last line in {where}" in out
    assert [r["step"] for r in metrics(w)] == [1, 2, 3, 4]  # the cut line is gone, steps 3-4 written anew

    damaged = tmp_path / "damaged"
    shutil.copytree(w, damaged)
    text = (damaged / "metrics.jsonl").read_text().splitlines()
    text[1] = text[1][:20]
    (damaged / "metrics.jsonl").write_text("\n".join(text) + "\n")
    assert run_in_process(["info", "--workdir", str(damaged)]) != 0
    err = capsys.readouterr().err
    assert f"{damaged / 'metrics.jsonl'} line 2 is damaged" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_corpus_replaced_under_the_same_path_is_said(tmp_path, data_dir, capsys):
    from tests.helpers import write_varied_text

    text = write_varied_text(tmp_path / "text.txt")
    w = tmp_path / "w"
    assert run_in_process(train_args(w, text, data_dir, **{**SETTINGS, "train.num_steps": 2})) == 0
    assert (w / "data.json").exists() and "changed" not in capsys.readouterr().out
    write_varied_text(tmp_path / "text.txt", lines=310)  # replaced under the same path
    assert run_in_process(["eval", "--workdir", str(w)]) == 0
    assert "is not the one this run recorded" in capsys.readouterr().err
    assert run_in_process(train_args(w, text, data_dir, **SETTINGS)) == 0  # resumes, and says so
    out = capsys.readouterr().out
    assert "resumed from checkpoint step 2" in out and "is not the one this run recorded" in out


def test_compare_reads_the_checkpoints_config_not_a_hand_edited_config_json(tmp_path, small_text, data_dir, capsys):
    import json

    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **{**SETTINGS, "train.num_steps": 2})) == 0
    config = json.loads((w / "config.json").read_text())
    config["model"]["attention"]["scheme"] = "shared_kv"  # edited by hand after the run
    (w / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert run_in_process(["compare", str(w), str(w)]) == 0
    out = capsys.readouterr().out
    assert "differs from the config saved with checkpoint step 2" in out
    assert "shared_kv" not in out.split("warning")[-1].split("\n", 1)[1]  # the table names the trained scheme
    assert "separate" in out


def test_info_describes_a_run_before_its_first_checkpoint(tmp_path, small_text, data_dir, capsys):
    """A run killed before its first save has its config, data record and metrics: info shows them (it said only
    "no checkpoint yet" before), with no checkpoint listed."""
    import shutil

    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **{**SETTINGS, "train.num_steps": 2})) == 0
    for saved in ("checkpoints", "params"):  # as if killed before the first save
        shutil.rmtree(w / saved, ignore_errors=True)
    capsys.readouterr()
    assert run_in_process(["info", "--workdir", str(w)]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: none yet" in out and "parameters:" in out and "last train metrics" in out.lower(), out


def test_export_reads_the_checkpoints_config_not_a_hand_edited_config_json(tmp_path, small_text, data_dir, capsys):
    """An exportable ``separate`` checkpoint whose config.json was edited to a scheme export refuses (``bilinear``)
    exports all the same, with the warning compare, info and sample give."""
    import json

    w = tmp_path / "w"
    assert run_in_process(train_args(w, small_text, data_dir, **{**SETTINGS, "train.num_steps": 2})) == 0
    config = json.loads((w / "config.json").read_text())
    config["model"]["attention"]["scheme"] = "bilinear"  # edited by hand after the run; not exportable
    (w / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert run_in_process(["export", "--workdir", str(w), str(tmp_path / "hf")]) == 0
    assert "differs from the config saved with checkpoint step 2" in capsys.readouterr().out
    assert (tmp_path / "hf" / "config.json").exists()


def test_mfu_never_reads_above_one_and_names_its_peak(tmp_path, small_text, data_dir, capsys):
    w = tmp_path / "w"
    low = {**SETTINGS, "train.num_steps": 4, "train.peak_flops": 1.0}  # a peak far below what any step achieves
    assert run_in_process(train_args(w, small_text, data_dir, **low)) == 0
    out = capsys.readouterr().out
    assert re.search(r"MFU is model FLOPs \(nanoGPT's and PaLM's count, [\d.]+ MFLOP a token; causal: [\d.]+, logged "
                     r"as mfu_causal\) over a peak of 0.0 GFLOP/s \(train.peak_flops\)", out), out  # fmt: skip
    assert out.count("above the peak MFU was read against") == 1  # measured again once, then it holds
    mfus = [r["mfu"] for r in metrics(w) if "mfu" in r]
    assert mfus and all(0 < m <= 1 for m in mfus), mfus


def test_a_run_shorter_than_its_warmup_says_so(tmp_path, small_text, data_dir, capsys):
    short = {**SETTINGS, "train.num_steps": 3, "train.warmup_steps": 10}
    assert run_in_process(train_args(tmp_path / "w", small_text, data_dir, **short)) == 0
    out = capsys.readouterr().out
    assert "train.warmup_steps=10 >= train.num_steps=3: the learning rate never reaches" in out


@pytest.mark.parametrize("tensorboard", [False, True])
def test_tensorboardx_is_imported_only_for_events_and_never_brings_torch(tmp_path, small_text, data_dir, tensorboard):
    # Without events tensorboardX is not imported at all; with them, its writer's `import torch` (2-3 s, and
    # PyTorch's CUDA libraries on a GPU machine) is kept out of the training process, where torch is installed.
    if tensorboard and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: nothing for tensorboardX to import (CI installs it, .[hf])")
    w = tmp_path / "w"
    settings = {**SETTINGS, "train.num_steps": 2, "train.tensorboard": str(tensorboard).lower()}
    code = (
        "import sys; from qkvjax.cli import main; rc = main(sys.argv[1:]); "
        "print('TBX', 'tensorboardX' in sys.modules, 'TORCH', 'torch' in sys.modules); "
        + ("import torch; print('TORCH_AFTER', torch.ones(1).item()); " if tensorboard else "")
        + "sys.exit(rc)"
    )
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}  # one device, as a user runs it; compiled as the suite compiles
    proc = subprocess.run([sys.executable, "-c", code, *train_args(w, small_text, data_dir, **settings)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"TBX {tensorboard} TORCH False" in proc.stdout
    assert [r["step"] for r in metrics(w)] == [1, 2]
    if tensorboard:  # the events are written, and the caller's own `import torch` afterwards still works
        assert "TORCH_AFTER 1.0" in proc.stdout
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(w / "tensorboard"))
    else:
        assert not (w / "tensorboard").exists()
