"""Training end to end on 8 CPU devices: the CLI, exact resume, mesh and pmap agreement, checkpoints, errors."""

import logging
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from qkvjax.config import apply_overrides, load_config_file
from qkvjax.train import checkpoint
from qkvjax.train.loop import train
from tests.helpers import (
    REPO,
    TINY,
    exported_params,
    flat,
    metrics,
    run_in_new_process,
    run_in_process,
    train_args,
    xla_flags,
)

STRICT_DTYPE_PROMOTION = False  # optax


def test_cli_two_steps_writes_metrics_and_checkpoint(tmp_path, corpus, data_dir):
    w = tmp_path / "run"
    assert run_in_process(train_args(w, corpus, data_dir, **{"train.num_steps": 2})) == 0
    records = metrics(w)
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    assert records[0]["loss"] != records[1]["loss"]
    (ev,) = metrics(w, evals=True)
    assert ev["step"] == 2 and ev["split"] == "validation" and ev["tokens"] > 0
    assert sorted(os.listdir(w / "checkpoints")) == ["2"]
    assert (w / "config.json").exists() and (w / "params" / "2").is_dir()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(w / "tensorboard"))


def test_resume_in_a_new_process_is_bitwise_exact(tmp_path, corpus, data_dir):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = {"train.checkpoint_every": 3, "model.dropout_rate": 0.1}  # dropout: the RNG must resume too
    assert run_in_process(train_args(straight, corpus, data_dir, **common, **{"train.num_steps": 6})) == 0
    assert run_in_process(train_args(resumed, corpus, data_dir, **common, **{"train.num_steps": 3})) == 0
    proc = run_in_new_process(train_args(resumed, corpus, data_dir, **common, **{"train.num_steps": 6}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from checkpoint step 3" in proc.stdout
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout  # piped: plain lines, no progress bar
    assert re.search(r"^step 6/6 loss \d\.\d{4} .* tok/s .* eta 0:00$", proc.stdout, re.M), proc.stdout
    assert "train.num_steps 3 -> 6: the warmup-cosine schedule is recomputed" in proc.stdout
    a, b = flat(exported_params(straight, 6)), flat(exported_params(resumed, 6))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert [r["loss"] for r in metrics(straight)] == [r["loss"] for r in metrics(resumed)]
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3, 4, 5, 6]

    # Lose the last checkpoint after steps 4-6 were logged: the rerun redoes them, and TensorBoard shows each step
    # once (the resume's events file purges the old records after step 3), in two files named by their start.
    shutil.rmtree(straight / "checkpoints" / "6")
    assert run_in_process(train_args(straight, corpus, data_dir, **common, **{"train.num_steps": 6})) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(os.listdir(straight / "tensorboard"))
    assert [e.rsplit(".", 1)[-1] for e in events] == ["from_step_0", "from_step_3"], events
    acc = EventAccumulator(str(straight / "tensorboard"))
    acc.Reload()
    losses = acc.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([e.value for e in losses], [r["loss"] for r in metrics(straight)], rtol=1e-6)


def test_sharded_mesh_and_pmap_match_one_device(tmp_path, corpus, data_dir):
    steps = {"train.num_steps": 3, "model.attention.causal_block": 8}  # T = 32: the causal blocks, sharded too
    one = run_in_new_process(train_args(tmp_path / "one", corpus, data_dir, **steps), devices=1)
    assert one.returncode == 0, one.stderr[-3000:]
    mesh = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
    assert run_in_process(train_args(tmp_path / "mesh", corpus, data_dir, **steps, **mesh)) == 0
    assert run_in_process(train_args(tmp_path / "pmap", corpus, data_dir, **steps, parallelism="pmap")) == 0
    reference = [r["loss"] for r in metrics(tmp_path / "one")]
    for run in ("mesh", "pmap"):
        np.testing.assert_allclose([r["loss"] for r in metrics(tmp_path / run)], reference, rtol=2e-5, err_msg=run)
    p1, p8 = flat(exported_params(tmp_path / "one", 3)), flat(exported_params(tmp_path / "mesh", 3))
    for k in p1:
        np.testing.assert_allclose(p8[k], p1[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_checkpoint_moves_from_8_devices_to_1_then_4(tmp_path, corpus, data_dir):
    w, ref = tmp_path / "moving", tmp_path / "reference"
    assert run_in_process(train_args(ref, corpus, data_dir, **{"train.num_steps": 5})) == 0
    assert run_in_process(train_args(w, corpus, data_dir, **{"train.num_steps": 3, "mesh.fsdp": 2})) == 0
    one = run_in_new_process(train_args(w, corpus, data_dir, **{"train.num_steps": 4}), devices=1)
    assert one.returncode == 0 and "resumed from checkpoint step 3" in one.stdout, one.stderr[-3000:]
    four = run_in_new_process(train_args(w, corpus, data_dir, **{"train.num_steps": 5, "mesh.tensor": 2}), devices=4)
    assert four.returncode == 0 and "resumed from checkpoint step 4" in four.stdout, four.stderr[-3000:]
    np.testing.assert_allclose([r["loss"] for r in metrics(w)], [r["loss"] for r in metrics(ref)], rtol=2e-5)


def _tiny(source, data_dir, **overrides):
    base = {
        "data.source_path": source,
        "data.data_dir": data_dir,
        "train.peak_flops": "1e11",
        "train.num_steps": 2,
        "train.log_every": 1,
    }
    base.update(overrides)
    return apply_overrides(load_config_file(TINY), {k: str(v) for k, v in base.items()})


def test_restore_of_another_scheme_lists_missing_and_unexpected(tmp_path, small_text, data_dir):
    from qkvjax.models.lm import DecoderLM
    from qkvjax.train.loop import _Parallel
    from qkvjax.train.state import abstract_state, make_optimizer

    train(_tiny(small_text, data_dir), str(tmp_path))
    other = _tiny(small_text, data_dir, **{"model.attention.scheme": "shared_kv"})
    abstract = abstract_state(DecoderLM(other.model), other, make_optimizer(other.train))
    mngr = checkpoint.manager(str(tmp_path), read_only=True)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.restore(mngr, 2, _Parallel(other, abstract).target())
    message = str(e.value)
    assert "checkpoint step 2" in message
    assert "missing" in message and "w_kv" in message
    assert "unexpected" in message and "w_k" in message and "w_v" in message
    # Through the CLI the workdir's config already disagrees, and the error names the field.
    with pytest.raises(ValueError, match=r"another config.*model.attention.scheme: 'separate' -> 'shared_kv'"):
        train(other, str(tmp_path))


def test_half_written_checkpoint_is_skipped(tmp_path, small_text, data_dir):
    cfg = _tiny(small_text, data_dir, **{"train.checkpoint_every": 1})
    train(cfg, str(tmp_path))
    # What a kill during an async save leaves behind: orbax's temporary directory for step 3.
    shutil.copytree(tmp_path / "checkpoints" / "2", tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp")
    assert checkpoint.manager(str(tmp_path), read_only=True).latest_step() == 2
    train(apply_overrides(cfg, {"train.num_steps": "3"}), str(tmp_path))
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_save_and_exit_cleanly(tmp_path, small_text, data_dir, sig):
    args = train_args(tmp_path, small_text, data_dir, **{"train.num_steps": 100000, "train.checkpoint_every": 100000})
    env = dict(os.environ, XLA_FLAGS=xla_flags(2), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkvjax.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:  # wait until training really runs
        seen.append(line)
        if line.startswith("step 3/"):
            proc.send_signal(sig)
            break
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=120) == 128 + sig, out[-3000:]  # stopped, not finished: 143 or 130, as a shell says
    assert f"{sig.name}: saved checkpoint step" in out and "rerun the same command to resume" in out
    saved = checkpoint.manager(str(tmp_path), read_only=True).latest_step()
    assert saved is not None and saved >= 3
    assert metrics(tmp_path)[-1]["step"] >= saved


# Bad input: a clear ValueError before the train step is compiled.


@pytest.fixture
def no_train_step_compiled(caplog):
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        yield
    compiled = [r.getMessage() for r in caplog.records if "train_step" in r.getMessage()]
    assert not compiled, compiled


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", r"source_path='.*nope.txt' does not exist"),
        ("empty", r"source_path='.*empty.txt' is empty"),
        ("short", r"train split has \d+ tokens, shorter than one window of seq_len \+ 1 = 33"),
        ("mesh", r"mesh \(data, fsdp, tensor\) = \(3, 1, 1\) multiplies to 3, but there are 8 devices"),
        ("mesh_fill", r"fixed sizes multiply to 3, which does not divide the 8 devices"),
        ("batch", r"train.batch_size=12 is not divisible by the data-parallel size 8"),
        ("micro", r"train.micro-batch=4 is not divisible by the data-parallel size 8"),
    ],
)
def test_bad_input_fails_before_compiling(case, match, tmp_path, small_text, data_dir, no_train_step_compiled):
    source, overrides = small_text, {}
    if case == "missing":
        source = str(tmp_path / "nope.txt")
    elif case in ("empty", "short"):
        source = str(tmp_path / f"{case}.txt")
        with open(source, "w") as f:
            f.write("" if case == "empty" else "x" * 20)
    elif case == "mesh":
        overrides = {"mesh.data": 3}
    elif case == "mesh_fill":
        overrides = {"mesh.fsdp": 3}
    elif case == "batch":
        overrides = {"train.batch_size": 12}
    elif case == "micro":
        overrides = {"train.batch_size": 8, "train.grad_accum_steps": 2}
    with pytest.raises(ValueError, match=match):
        train(_tiny(source, data_dir, **overrides), str(tmp_path / "w"))
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_grad_accumulation_matches_one_big_batch(tmp_path, small_text, data_dir):
    one = train(_tiny(small_text, data_dir), str(tmp_path / "one"))
    acc = train(
        _tiny(
            small_text,
            data_dir,
            **{"train.grad_accum_steps": 2, "train.batch_size": 16, "mesh.data": 4, "mesh.fsdp": 2},
        ),
        str(tmp_path / "acc"),
    )
    big = train(_tiny(small_text, data_dir, **{"train.batch_size": 16}), str(tmp_path / "big"))
    np.testing.assert_allclose(acc["loss"], big["loss"], rtol=1e-5)
    assert one["loss"] != big["loss"]


def test_readme_entry_point_refuses_unknown_overrides(tmp_path, small_text, data_dir):
    with pytest.raises(ValueError, match=r"TrainConfig has no field 'num_step'.*num_steps"):
        _tiny(small_text, data_dir, **{"train.num_step": 3})
    with pytest.raises(ValueError, match=r"--config.train.batch_size='eight'; allowed: an integer$"):
        _tiny(small_text, data_dir, **{"train.batch_size": "eight"})
    bools = r"true, yes, 1, false, no, 0"
    with pytest.raises(ValueError, match=rf"--config.model.attention.rope='maybe'; allowed: {bools}$"):
        _tiny(small_text, data_dir, **{"model.attention.rope": "maybe"})
    with pytest.raises(ValueError, match=r"--config.train.peak_flops='fast'; allowed: a number or None$"):
        _tiny(small_text, data_dir, **{"train.peak_flops": "fast"})
    with pytest.raises(ValueError, match=r"data.seq_len=100001 exceeds model.max_len=\d+; allowed: at most \d+ \("):
        _tiny(small_text, data_dir, **{"data.seq_len": 100001})
    with pytest.raises(ValueError, match=r"scheme 'shared_qk' uses one projection.*num_kv_heads == num_heads"):
        _tiny(small_text, data_dir, **{"model.attention.scheme": "shared_qk", "model.attention.num_kv_heads": 2})
    cfg = _tiny(small_text, data_dir, **{"model.attention.scheme": "shared_kv", "model.attention.num_kv_heads": 2})
    assert cfg.model.attention.scheme == "shared_kv" and cfg.model.attention.kv_heads == 2


def test_a_run_written_before_a_config_field_existed_still_resumes(tmp_path):
    """config.json of an older version lacks fields added since (here the model family and the tokenizer): they
    read as their defaults, which the run was trained with; a real change of such a field is still refused."""
    import json

    from qkvjax.config import to_dict
    from qkvjax.train.checks import check_resume, check_workdir

    config = load_config_file(TINY)
    old = to_dict(config)
    del old["model"]["family"], old["data"]["tokenizer"], old["model"]["attention"]["learned_temperature"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    check_workdir(tmp_path, config, overwrite=False)
    check_resume(old, config, 0, overwrite=False)
    changed = apply_overrides(config, {"model.family.norm": "rmsnorm"})
    with pytest.raises(ValueError, match=r"model\.family\.norm: 'layernorm' -> 'rmsnorm'"):
        check_workdir(tmp_path, changed, overwrite=False)
    with pytest.raises(ValueError, match=r"model\.family\.norm"):
        check_resume(old, changed, 0, overwrite=False)


def test_evaluations_between_logged_steps_keep_their_place_on_the_curve_and_out_of_the_throughput(
    tmp_path, corpus, data_dir
):
    """eval_every need not divide by log_every: every evaluation is on the curve, at a training time between its
    neighbours' (it used to be dropped, and the clock restarted after it, so the next interval's tokens/s
    counted steps it had not timed)."""
    from qkvjax.workdir import learning_curve, read_metrics

    w = tmp_path / "run"
    overrides = {"train.num_steps": 9, "train.log_every": 3, "train.eval_every": 2, "train.eval_batches": 2}
    assert run_in_process(train_args(w, corpus, data_dir, **overrides)) == 0
    train_records, eval_records = read_metrics(str(w))
    assert [r["step"] for r in train_records] == [3, 6, 9]
    assert [r["step"] for r in eval_records] == [2, 4, 6, 8, 9]
    points = learning_curve(train_records, eval_records, tokens_per_step=7)
    assert [p["step"] for p in points] == [2, 3, 4, 6, 8, 9]
    assert [p["step"] for p in points if p["val_loss"] is not None] == [2, 4, 6, 8, 9]
    assert [p["step"] for p in points if p["train_loss"] is not None] == [3, 6, 9]
    walls = [p["wall_s"] for p in points]
    assert walls == sorted(walls) and walls[-1] > walls[2] > 0  # steps 1-3 compile: their clock starts at 0


def test_learning_curve_places_an_evaluation_at_its_interval_s_rate():
    from qkvjax.workdir import learning_curve

    train_records = [
        {"step": 5, "loss": 3.0},  # the compiling interval: no rate, so no time
        {"step": 10, "loss": 2.5, "tokens_per_s": 50.0},
        {"step": 15, "loss": 2.0, "tokens_per_s": 25.0},
    ]
    evals = [{"step": 7, "loss": 2.9}, {"step": 13, "loss": 2.1}, {"step": 15, "loss": 1.9}]
    points = learning_curve(train_records, evals, tokens_per_step=10)
    assert [(p["step"], p["wall_s"], p["train_loss"], p["val_loss"]) for p in points] == [
        (5, 0.0, 3.0, None),
        (7, 0.4, None, 2.9),  # 2 steps x 10 tokens at 50 tok/s
        (10, 1.0, 2.5, None),
        (13, 2.2, None, 2.1),  # + 3 x 10 at 25 tok/s
        (15, 3.0, 2.0, 1.9),
    ]


def test_one_process_writes_replicated_arrays_whole_compiling_nothing_and_orbax_reads_them(tmp_path, caplog):
    """orbax's replica-parallel writing (each of R replicas writes 1/R of a replicated array) slices every array on
    every device, one compiled program each; one process writes each array whole, in the standard layout."""
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    from qkvjax.workdir import export_params

    everywhere = NamedSharding(jax.make_mesh((8,), ("data",)), PartitionSpec())
    # orbax splits an axis the replicas divide: D = 16 here, odd sizes elsewhere
    tree = {"w_q": np.arange(16 * 3 * 5, dtype=np.float32).reshape(16, 3, 5), "scale": np.arange(24, dtype=np.float32)}
    tree = jax.device_put(tree, everywhere)
    caplog.set_level(logging.WARNING)
    jax.config.update("jax_log_compiles", True)  # the context manager is thread-local; orbax writes on its threads
    try:
        mngr = checkpoint.manager(str(tmp_path / "run"))
        checkpoint.save(mngr, 3, tree, {"epoch": 0}, {"seed": 0})
        checkpoint.close(mngr)
        copy = export_params(tmp_path / "run", 3, tree)
    finally:
        jax.config.update("jax_log_compiles", False)
    assert not [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    with ocp.StandardCheckpointer() as plain:  # any orbax reader: the files and typestr are orbax's own
        for where in (copy, tmp_path / "run" / "checkpoints" / "3" / "state"):
            back = plain.restore(where, target)
            for k in tree:
                np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]), err_msg=f"{where} {k}")


def test_the_threefry_gpu_kernel_is_chosen_only_for_a_gpu_and_arrays_whole_on_each_device():
    """``create_state`` lowers the init's random draws to jax's ThreeFry kernel only on a GPU and only when no
    output is split over devices (the kernel is one custom call the SPMD partitioner cannot split)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from qkvjax.train import state

    mesh = jax.make_mesh((8,), ("data",))
    whole, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    assert state.whole_on_a_gpu(None, "gpu") and state.whole_on_a_gpu({"w_q": whole, "scale": whole}, "gpu")
    assert not state.whole_on_a_gpu({"w_q": whole, "scale": split}, "gpu")
    assert not state.whole_on_a_gpu(None, "cpu") and not state.whole_on_a_gpu(None, "tpu")
    assert not state.uses_threefry_kernel(None)  # this machine's backend is the CPU
    # the probe itself runs here: the CPU ignores the flag, so both compiles give the same bits
    assert state._kernel_agrees()
