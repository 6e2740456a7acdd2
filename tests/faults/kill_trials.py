"""SIGKILL at random moments, over seeded trials: every rerun resumes and ends bit for bit where a run that was
never interrupted ends.

    python tests/faults/kill_trials.py --trials 20 --seed 0 [--out results.json]

Each trial starts ``qkvjax train`` (the tiny preset, dropout on so the RNG must resume too), kills it with SIGKILL
at a moment drawn from the trial's seed: during a training step (a random delay after a random step's log line),
during an asynchronous checkpoint write (as soon as a step's folder or orbax's temporary folder appears) or during
an evaluation (right after an evaluation step's log line; evaluation reads many batches), then reruns the same
command to the end and compares the exported parameters with the uninterrupted run's, bit for bit. Prints one row
per trial and a summary; exits 1 if any trial differs. ``pytest -m slow tests/faults`` runs it with 10 trials.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository (or this folder) importable
    sys.path.insert(0, str(REPO))
# The trainers and this process (which reads their exported parameters) see the same 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.helpers import exported_params, flat, train_args, write_varied_text  # noqa: E402

MOMENTS = ("step", "checkpoint", "evaluation")
SETTINGS = {
    "train.num_steps": 40,
    "train.checkpoint_every": 5,
    "train.eval_every": 10,
    "train.eval_batches": 40,
    "model.dropout_rate": 0.1,
}


def _env() -> dict:
    return dict(os.environ)


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "qkvjax.cli", *args]


def _kill_at(args: list[str], workdir: Path, moment: str, rng: random.Random) -> str:
    """Starts training, kills it at ``moment``; returns what was happening (as far as the log tells)."""
    proc = subprocess.Popen(
        _cli(args), env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    target = rng.randrange(2, SETTINGS["train.num_steps"] - 2)  # the kill comes at or after this step
    last = "started"
    try:
        for line in proc.stdout:
            if not line.startswith("step "):
                continue
            last = line.split(" loss")[0].strip()
            step = int(line.split()[1].split("/")[0])
            if moment == "step" and step >= target:
                time.sleep(rng.uniform(0.0, 0.05))
                break
            if moment == "evaluation" and step >= target and step % SETTINGS["train.eval_every"] == 0:
                time.sleep(rng.uniform(0.0, 0.02))
                break
            if moment == "checkpoint" and step >= target and step % SETTINGS["train.checkpoint_every"] == 0:
                folder = workdir / "checkpoints"
                deadline = time.time() + 5
                while time.time() < deadline and not any(
                    p.name == str(step) or "tmp" in p.name for p in (folder.iterdir() if folder.exists() else [])
                ):
                    time.sleep(0.001)
                break
    finally:
        exited = proc.poll()  # None: still running, so the kill below lands mid-run
        proc.kill()
        tail = proc.stdout.read()[-300:]
        proc.wait()
    if exited is not None:  # ended by itself before the moment came: say so (the trial then tests nothing)
        return f"{moment}: NOT KILLED, exited rc={exited} after '{last}': {tail!r}"
    return f"{moment}: killed after '{last}'"


def run_trials(trials: int, seed: int, log=print) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="qkvjax-kill-") as tmp:
        tmp = Path(tmp)
        source = write_varied_text(tmp / "text.txt")
        data_dir = tmp / "tfds"
        reference = tmp / "reference"
        ref = subprocess.run(_cli(train_args(reference, source, data_dir, **SETTINGS)), env=_env(), cwd=REPO,
                             capture_output=True, text=True)  # fmt: skip
        if ref.returncode:
            raise RuntimeError(ref.stdout[-2000:] + ref.stderr[-2000:])
        want = flat(exported_params(reference, SETTINGS["train.num_steps"]))
        for trial in range(trials):
            rng = random.Random(seed * 1000 + trial)
            moment = MOMENTS[trial % len(MOMENTS)]
            workdir = tmp / f"trial{trial}"
            args = train_args(workdir, source, data_dir, **SETTINGS)
            start = time.perf_counter()
            what = _kill_at(args, workdir, moment, rng)
            done = subprocess.run(_cli(args), env=_env(), cwd=REPO, capture_output=True, text=True)
            resumed = next((ln for ln in done.stdout.splitlines() if ln.startswith("resumed from")), "from scratch")
            got = flat(exported_params(workdir, SETTINGS["train.num_steps"])) if done.returncode == 0 else {}
            equal = (
                done.returncode == 0
                and got.keys() == want.keys()
                and all(np.array_equal(got[k], want[k]) for k in want)
            )
            rows.append({"trial": trial, "moment": what, "rerun": resumed, "returncode": done.returncode,
                         "bit_exact": bool(equal), "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
            log(f"{trial:3d}  {'ok ' if equal else 'BAD'}  {what:60s}  {resumed}")
            if done.returncode:
                log(done.stdout[-1500:] + done.stderr[-1500:])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="number of kill-and-rerun trials")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = run_trials(args.trials, args.seed)
    exact = sum(r["bit_exact"] for r in rows)
    print(f"{exact}/{len(rows)} trials resumed bit-exactly")
    if args.out:
        meta = {"command": " ".join(["python", "tests/faults/kill_trials.py", *(argv or sys.argv[1:])]),
                "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
                "date": time.strftime("%Y-%m-%dT%H:%M")}  # fmt: skip
        Path(args.out).write_text(json.dumps({**meta, "trials": rows, "bit_exact": exact}, indent=2) + "\n")
    return 0 if exact == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
