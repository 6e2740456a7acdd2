"""README.md's user path runs as written: the fresh-machine run command, then every line of the "first hour" block
(with the tiny preset in place of shakespeare_char, as the README says), then its TensorBoard command."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks.first_hour import apply, fresh_clone, readme_blocks, run_commands
from tests.helpers import docs_text, xla_flags

pytestmark = pytest.mark.xdist_group("readme")  # one worker builds the module's fixture once

README = docs_text()  # README.md, then the docs pages
TINY = [("experiments/configs/shakespeare_char.py", "experiments/configs/tiny.py --config.model.max_len=128")]


@pytest.fixture(scope="module")
def clone(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("fresh")
    clone = fresh_clone(root, Path(sys.prefix), Path(corpus).parents[2])
    blocks = readme_blocks(README)
    assert "shakespeare_char.py" in blocks["run"][0] and len(blocks["first_hour"]) >= 8
    commands = [apply(c, TINY) for c in blocks["run"] + blocks["first_hour"]]
    # One CPU device, as on a user's machine (the other tests simulate 8).
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    rows = run_commands(commands, clone, env=env)
    failed = [r for r in rows if r["returncode"]]
    assert not failed, f"{failed[0]['command']}\n{failed[0]['stdout'][-2000:]}\n{failed[0]['stderr'][-2000:]}"
    assert len(rows) == len(commands)
    return clone, {r["command"]: r for r in rows}


def _out(rows, starts):
    (row,) = [r for c, r in rows.items() if c.startswith(starts)]
    return row["stdout"]


def test_first_hour_commands_run_as_written(clone):
    clone, rows = clone
    assert "separate" in _out(rows, "qkvjax info")
    for line in _out(rows, "tail -n 2").splitlines():
        assert json.loads(line)["step"] == 120
    result = json.loads(_out(rows, "qkvjax eval"))
    assert result["split"] == "test" and result["loss"] > 0
    assert _out(rows, 'qkvjax sample --workdir runs/shakespeare_char --prompt "ROMEO:"').startswith("ROMEO:")
    for run in ("shakespeare_char", "shared_kv"):  # the compare plot's validation curves have a shape, not 2 points
        evals = [json.loads(line) for line in (clone / "runs" / run / "metrics.jsonl").read_text().splitlines()]
        assert sum(1 for r in evals if r.get("eval")) >= 5
    table = _out(rows, "qkvjax compare")
    assert "shakespeare_char" in table and "shared_kv" in table
    assert (clone / "runs" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((clone / "runs" / "my_text" / "config.json").read_text())
    assert config["data"]["dataset"] == "text_file" and config["data"]["source_path"] == str(clone / "README.md")
    assert (clone / "runs" / "my_text" / "params" / "60").is_dir()
    assert _out(rows, "qkvjax sample --workdir runs/my_text").startswith("The ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensorboard_command_serves_every_run(clone):
    clone, _ = clone
    (command,) = readme_blocks(README)["tensorboard"]
    port = _free_port()
    venv_bin = Path(sys.prefix) / "bin"
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command} --port {port} --host 127.0.0.1"],
        cwd=clone,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline, tags = time.time() + 60, None
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                    tags = json.load(r)
                if len(tags) >= 3:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert tags is not None, proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no answer"
        runs = {run.split("/")[0] for run in tags}
        assert runs == {"shakespeare_char", "shared_kv", "my_text"}, tags
        assert "train/loss" in tags["shakespeare_char/tensorboard"] and "eval/loss" in tags["shared_kv/tensorboard"]
    finally:
        proc.kill()
        proc.wait()
