"""benchmarks/gpu_check.py --smoke: the GPU visit's script, run end to end on the CPU at toy shapes, so that it
cannot rot between visits (the figures it prints here are not measurements of anything). Marked ``slow`` (out of
CI for time): the GPU recipe runs it first, ``.venv/bin/python -m pytest -m slow tests/test_gpu_check.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

STRICT_DTYPE_PROMOTION = False  # optax, in the speed section run in this process


@pytest.mark.parametrize("flag", ["--rows", "--variants", "--sections", "--sample-rows"])
def test_an_unknown_row_variant_or_section_is_refused_before_any_section_runs(tmp_path, flag):
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path), flag, "mla,mla_rope"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert f"{flag} ['mla_rope']" in proc.stderr or f"{flag} ['mla', 'mla_rope']" in proc.stderr
    assert "allowed:" in proc.stderr
    assert not (tmp_path / "gpu_check.log").exists() or "=====" not in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.parametrize(
    "args, message",
    [(["--schemes", "separate,bogus"], "--schemes: unknown 'bogus'; allowed: separate, "),
     (["--batch-size", "0"], "--batch-size=0; allowed: an integer >= 1"),
     (["--set", "model.num_layers=0"], "ModelConfig.num_layers=0; allowed: an integer >= 1")],
)  # fmt: skip
def test_bench_refuses_bad_arguments_in_one_line_before_the_baseline(args, message):
    proc = subprocess.run([sys.executable, "benchmarks/bench.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]  # argparse's usage lines, then the error
    assert proc.returncode == 2 and last.startswith("bench.py: error: ") and message in last, proc.stderr
    assert not proc.stdout  # nothing measured: not even the device line


def test_gpu_check_smoke_runs_the_measuring_sections_in_ci(tmp_path):
    # The sections whose code a visit most needs, in CI (~38 s): the ceilings, MLA with rotary against float64 (its
    # cuDNN padding and absorbed decode), a train step, sampling. The rest is the slow test below.
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path), "--sections",
         "machine,correctness,speed,sample", "--variants", "mla+rope", "--rows", "separate,separate/auto"],
        cwd=REPO, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + (tmp_path / "gpu_check.log").read_text()[-3000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(s["rc"] == 0 for s in out["status"].values()) and len(out["status"]) == 4
    assert out["machine"]["matmul"]["flops_per_s"] > 0 and out["machine"]["copy"]["bytes_per_s"] > 0
    row = out["correctness"]["cases"]["mla+rope"]
    assert list(out["correctness"]["cases"]) == ["mla+rope"]
    assert row["float32"]["out"] < 1e-5 and row["bfloat16"]["grads"] < 1e-2 and row["decode"] < 1e-5
    init = out["correctness"]["init"]  # create_state against the inlined lowering: on the CPU, no kernel, the same
    assert init["kernel_used"] is False and init["leaves"] > 10 and init["leaves_differing"] == 0
    assert "ThreeFry GPU kernel False, 0 of" in proc.stdout  # the table printed last
    speed = out["speed"]["rows"]["separate"]
    assert speed["tokens_per_s"] > 0 and speed["init_s"] > 0 and speed["warmup_s"] > 0 and speed["mfu"] > 0
    assert speed["init_threefry_kernel"] is False
    auto = out["speed"]["rows"]["separate/auto"]  # the implementation unset, as a user runs it; no cuDNN here
    assert auto["implementation"] is None and auto["cudnn_attention_calls"] == speed["cudnn_attention_calls"] == 0
    rows = out["sample"]["rows"]
    assert set(rows) == {"1", "8", "8+eos"} and all(0 < r["fraction_of_floor"] for r in rows.values())
    # a stop id no row draws: the while loop runs the whole length and makes the scan's tokens
    assert rows["8+eos"]["same_tokens"] and rows["8+eos"]["decode_steps"] == rows["8"]["decode_steps"] == 16
    assert rows["8+eos"]["x_scan"] > 0


def test_a_speed_row_that_fails_is_recorded_and_the_rows_after_it_still_run(tmp_path, monkeypatch):
    """A visit's speed section: the row whose step raises (on a GPU, cuDNN's kernel failing to compile under
    the default is one thing a visit checks) gets its error; the rows after it still run and are saved."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    monkeypatch.setattr(sys, "path", sys.path)
    import bench

    from benchmarks import gpu_check

    real, calls = bench.prepare_train, []

    def prepare_train(model, cfg):
        calls.append(cfg)
        if len(calls) == 1:  # the first row, 'separate/auto'
            raise RuntimeError("INTERNAL: No valid engine configs for Matmul_MUL_Reduction (cuda_dnn.cc)\nmore")
        return real(model, cfg)

    monkeypatch.setattr(bench, "prepare_train", prepare_train)
    monkeypatch.chdir(REPO)
    argv = ["--smoke", "--out", str(tmp_path), "--section", "speed", "--work", str(tmp_path), "--steps", "2"]
    assert gpu_check.main([*argv, "--rows", "separate/auto,separate"]) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    error = "RuntimeError: INTERNAL: No valid engine configs for Matmul_MUL_Reduction (cuda_dnn.cc)"
    assert rows["separate/auto"]["error"] == error
    assert rows["separate"]["tokens_per_s"] > 0
    assert re.search(
        r"\nseparate/auto +ERROR " + re.escape(error), gpu_check.table({"speed": {"rows": rows}, "status": {}})
    )


@pytest.mark.slow  # 130-250 s (seven sections, each in its own interpreter): run before a GPU visit, pytest -m slow
def test_gpu_check_smoke_runs_every_section(tmp_path):
    pytest.importorskip("torch", reason="the torch section needs the optional bench extra (CI installs it)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + (tmp_path / "gpu_check.log").read_text()[-3000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(out["status"]) == {
        "machine",
        "correctness",
        "speed",
        "torch",
        "train",
        "sample",
        "levers",
        "decode_levers",
    }
    assert all(s["rc"] == 0 for s in out["status"].values())
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "gpu_check.log"]  # section files merged, removed
    # float32 on the CPU against the float64 host reference: far under the bound, and bf16 under its own
    for name, row in out["correctness"]["cases"].items():
        assert row["float32"]["out"] < 1e-5 and row["float32"]["grads"] < 1e-5, name
        assert row["bfloat16"]["out"] < 1e-2 and row["bfloat16"]["grads"] < 1e-2, name
        assert row["decode"] < 1e-5, name
    assert {"separate", "mla+rope", "cla2", "window"} <= set(out["correctness"]["cases"])
    assert out["speed"]["rows"]["separate"]["tokens_per_s"] > 0 and out["torch"]["tokens_per_s"] > 0
    # GPT-2 124M's rows on the toy shapes: a vocabulary of 1,024, the loss chunked and whole, and torch beside them
    chunked, whole = out["speed"]["rows"]["124m:separate"], out["speed"]["rows"]["124m:separate/nochunk"]
    assert (chunked["vocab_size"], chunked["loss_chunk"], whole["loss_chunk"]) == (1024, 8, None)
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-4)  # the same loss, a chunk at a time
    assert out["torch"]["real_vocab"]["vocab_size"] == 1024 and out["torch"]["real_vocab"]["tokens_per_s"] > 0
    assert "124m:torch eager" in proc.stdout
    # the decode floor counts the bytes decoding reads (the weights cast once to the compute dtype)
    assert out["sample"]["param_bytes"] <= out["sample"]["param_bytes_float32"]
    train = out["train"]
    assert train["killed_while_running"] and train["checkpoints_left_at_kill"]
    assert train["losses_identical"] and train["params_identical"]  # the CPU is deterministic: bit for bit
    sample = out["sample"]["rows"]
    assert set(sample) == {"1", "8", "8+eos"}  # the smoke run's default rows
    assert sample["8+eos"]["same_tokens"] and sample["8+eos"]["x_scan"] > 0  # a stop id no row draws: the same tokens
    decode = out["decode_levers"]["rows"]
    assert set(decode) == {"baseline", "graphs_while_cond", "unroll_8"}  # a GPU flag XLA parses on the CPU too
    for name, row in decode.items():
        assert set(row["batches"]) == ({"1"} if name == "unroll_8" else {"1", "8"}), name
        assert all(r["tokens_per_s"] > 0 and r["same_tokens"] for r in row["batches"].values()), name
        assert all(r["tokens_sha256"] == sample[b]["tokens_sha256"] for b, r in row["batches"].items()), name
    profile = out["decode_levers"]["baseline_profile"]  # batch 1 traced: the host's plane at least, on a CPU
    assert profile["decode_steps"] == 15 and profile["planes"]["/host:CPU"]["top_events"], profile.keys()
    levers = out["levers"]["rows"]
    assert set(levers) == {"baseline", "batch_4"} and levers["baseline"]["x_baseline"] == 1.0
    assert levers["batch_4"]["batch"] == 4 and levers["batch_4"]["tokens_per_s"] > 0
    assert "status: machine 0" in proc.stdout  # the table, printed last


def test_the_next_visits_commands_in_the_benchmarks_readme_name_only_what_the_script_takes():
    """The recipe a GPU session pastes under a 15-minute clock: every flag of its gpu_check.py lines is one the
    script parses, and every section, speed row and correctness variant is one it knows (a rename here fails)."""
    import re
    import shlex

    from benchmarks import gpu_check

    text = (REPO / "benchmarks/README.md").read_text()
    block = text[text.index("The next visit (prepared since") :]
    block = block[block.index("```bash") + 7 : block.index("```", block.index("```bash") + 7)]
    commands = [shlex.split(c, comments=True) for c in re.sub(r"\\\n", " ", block).splitlines()]
    commands = [c for c in commands if c and c[:2] == ["python3", "benchmarks/gpu_check.py"]]
    assert len(commands) >= 2, block
    allowed = {"--sections": gpu_check.SECTIONS, "--rows": gpu_check.SPEED_ROWS,
               "--variants": gpu_check.CORRECTNESS_VARIANTS, "--sample-rows": gpu_check.SAMPLE_ROWS}  # fmt: skip
    takes = {"--out", "--corpus", "--batch-size", "--budget-s", "--steps", *allowed}
    for cmd in commands:
        flags = dict(zip(cmd[2::2], cmd[3::2], strict=True))
        assert set(flags) <= takes, cmd
        for flag, names in allowed.items():
            assert set(flags.get(flag, "").split(",")) - {""} <= set(names), (flag, flags.get(flag))


def test_a_sections_timeout_kills_everything_it_started(tmp_path, monkeypatch):
    """Issue 98: a section's timeout killed only its own process; a training run it had started kept the GPU busy
    while later sections timed themselves. Now its whole process group goes, grandchildren included."""
    import time

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from gpu_check import run_group

    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $! > {pids}; bash -c 'sleep 300 & echo $! >> {pids}; wait' & wait"
    start = time.perf_counter()
    assert run_group(["bash", "-c", script], 2.0) == "timeout"
    assert time.perf_counter() - start < 30
    time.sleep(0.5)

    def running(pid: int) -> bool:  # a killed process not yet reaped by init is a zombie: not running
        try:
            state = open(f"/proc/{pid}/status").read().split("State:")[1].split()[0]
        except (FileNotFoundError, IndexError):
            return False
        return state != "Z"

    alive = [pid for pid in map(int, pids.read_text().split()) if running(pid)]
    assert len(pids.read_text().split()) == 2 and alive == [], f"still running: {alive}"
    assert run_group(["bash", "-c", "exit 3"], 10.0) == 3
