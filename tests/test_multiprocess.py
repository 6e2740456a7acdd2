"""Two processes of four CPU devices each form one 8-device program (launch/local.sh) and train like one process."""

import os
import socket
import subprocess
import sys

import numpy as np

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
