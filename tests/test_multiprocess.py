"""Two processes of four CPU devices each form one 8-device program (launch/local.sh) and train like one process."""

import os
import re
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


def _train_process(i, n, port, args, timeout_s=60):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "qkvjax.cli", "train", "--coordinator", f"127.0.0.1:{port}",
           "--num-processes", str(n), "--process-id", str(i), "--cpu-collectives",
           "--distributed-timeout", str(timeout_s), *args]  # fmt: skip
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _refused_in_one_line(proc) -> str:
    """The one line a refused process printed (exit 2, nothing else on stderr)."""
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
    return lines[0]


def test_a_process_id_given_twice_is_refused_in_one_line_and_the_run_goes_on(tmp_path, small_text, data_dir):
    """Round 4's probe: two processes with the same --process-id ended every process of the run in XLA's C++ abort
    (exit 134, "another task died"), the coordinator's at once. Now, of 3 processes, a second process 1 is refused
    in one line by qkvjax's roll call (exit 2, nothing written), and the run goes on when process 2 comes; a process
    1 started again once the run trains is refused too, and the run finishes."""
    w = tmp_path / "w"
    steps = {"train.num_steps": 24, "train.checkpoint_every": 24, "train.batch_size": 9}  # 9: 3 processes' batch
    args = train_args(w, small_text, data_dir, **steps)[1:]
    port = _free_port()
    first = [_train_process(i, 3, port, args) for i in (0, 1)]
    try:
        time.sleep(2)
        line = _refused_in_one_line(_train_process(1, 3, port, args))
        assert "--process-id 1 has already checked in (from 127.0.0.1)" in line and "(this is process 1 of 3)" in line
        assert all(p.poll() is None for p in first)  # still waiting for process 2
        first.append(_train_process(2, 3, port, args))
        deadline = time.time() + 120
        while not (w / "config.json").exists() and time.time() < deadline:  # the run has started
            time.sleep(0.1)
        line = _refused_in_one_line(_train_process(1, 3, port, args))
        assert "does not hold a roll call: the run has likely started without this process" in line
        for p in first:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in first:
            p.kill()
    assert metrics(w)[-1]["step"] == 24


def test_the_roll_call_refuses_another_count_an_id_out_of_range_or_twice_and_lets_the_right_ones_go():
    """qkvjax.rollcall over loopback, without jax: each refusal names the bad value and what is allowed."""
    import threading

    from qkvjax.rollcall import RollCallError, host_roll_call, join_roll_call

    port, deadline = _free_port(), time.monotonic() + 30
    host = threading.Thread(target=host_roll_call, args=(port, 3, deadline))
    host.start()
    for count, i, message in [
        (4, 1, "--num-processes 4, but process 0 was started with --num-processes 3"),
        (3, 3, "--process-id 3; allowed: 1 to 2 (0 is the coordinator's)"),
        (3, 0, "--process-id 0; allowed: 1 to 2 (0 is the coordinator's)"),
    ]:
        with pytest.raises(RollCallError, match=re.escape(f"refused this process: {message}") + "$"):
            join_roll_call("127.0.0.1", port, count, i, deadline)
    results = {}

    def join(i):
        try:
            join_roll_call("127.0.0.1", port, 3, i, deadline)
            results[i] = "go"
        except RollCallError as e:
            results[i] = str(e)

    first = threading.Thread(target=join, args=(1,))
    first.start()
    time.sleep(0.5)
    with pytest.raises(RollCallError, match=r"--process-id 1 has already checked in \(from 127.0.0.1\)"):
        join_roll_call("127.0.0.1", port, 3, 1, deadline)  # the same id again, while the first waits for process 2
    join(2)
    first.join(10)
    host.join(10)
    assert results == {1: "go", 2: "go"} and not host.is_alive()
    with pytest.raises(RollCallError, match="cannot listen on the coordinator's port"):
        with socket.socket() as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("", port))
            taken.listen()
            host_roll_call(port, 2, time.monotonic() + 5)
