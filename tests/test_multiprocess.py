"""Two processes of four CPU devices each form one 8-device program (launch/local.sh) and train like one process."""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import REPO, metrics, run_in_process, train_args

STRICT_DTYPE_PROMOTION = False  # optax


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(tmp_path, small_text, data_dir):
    steps = {"train.num_steps": 3, "mesh.fsdp": 2}
    assert run_in_process(train_args(tmp_path / "one", small_text, data_dir, **steps)) == 0
    env = dict(os.environ, QKVJAX_PORT=str(_free_port()), PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "launch" / "local.sh"),
            "2",
            "4",
            *train_args(tmp_path / "two", small_text, data_dir, **steps)[1:],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "devices=8" in proc.stdout
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(tmp_path / "two")], [r["loss"] for r in metrics(tmp_path / "one")], rtol=2e-5
    )
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["3"]


def _process(i, port, args, timeout_s):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "qkvjax.cli", "train", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
           "--process-id", str(i), "--cpu-collectives", "--distributed-timeout", str(timeout_s), *args]  # fmt: skip
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # ~40 s: two processes, one killed, both resumed (out of CI for time: pytest -m slow)
def test_a_killed_peer_stops_the_other_process_within_the_timeout_and_both_resume(tmp_path, small_text, data_dir):
    timeout_s = 10
    w = tmp_path / "run"
    args = train_args(w, small_text, data_dir, **{"train.num_steps": 100000, "train.checkpoint_every": 4})[1:]
    port = _free_port()
    procs = [_process(i, port, args, timeout_s) for i in range(2)]
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (
            (w / "checkpoints" / "8").is_dir() or any(p.poll() is not None for p in procs)
        ):
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs), procs[0].stdout.read()[-3000:]
        procs[1].kill()  # the peer dies mid-run
        killed_at = time.time()
        try:
            out, _ = procs[0].communicate(timeout=timeout_s + 20)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process 0 still runs {timeout_s + 20}s after its peer died") from None
        waited = time.time() - killed_at
        assert procs[0].returncode != 0, out[-3000:]
        assert waited < timeout_s + 20, waited
    finally:
        for p in procs:
            p.kill()
            p.wait()
    saved = max(int(p.name) for p in (w / "checkpoints").iterdir() if p.name.isdigit())
    # Both rerun the same command (the step target changed, which resume allows) and continue from the checkpoint.
    env = dict(os.environ, QKVJAX_PORT=str(_free_port()), PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    again = train_args(w, small_text, data_dir, **{"train.num_steps": saved + 2, "train.checkpoint_every": 4})[1:]
    proc = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "2", "2", *again], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"resumed from checkpoint step {saved}" in proc.stdout
    assert metrics(w)[-1]["step"] == saved + 2


def test_a_peer_that_never_starts_is_said_in_one_line_and_nothing_is_written(tmp_path, small_text, data_dir):
    """Process 0 of 2 alone: before XLA's C++ abort at the timeout (exit 134, a stack trace, "another task died"),
    one line names the coordinator, the process count and id and what to check; exit 2; the workdir is not made."""
    w = tmp_path / "w"
    cmd = [sys.executable, "-m", "qkvjax.cli", "train", "--coordinator", f"127.0.0.1:{_free_port()}",
           "--num-processes", "2", "--process-id", "0", "--cpu-collectives", "--distributed-timeout", "6",
           *train_args(w, small_text, data_dir)[1:]]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "the 2 processes did not all join the coordinator 127.0.0.1:" in lines[0], lines
    assert "(this is process 0)" in lines[0] and "--distributed-timeout=6 s" in lines[0]
    assert not w.exists()
