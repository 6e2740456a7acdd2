"""A soak run: the tiny model trains for a fixed time with a checkpoint every 10 steps (``--checkpoint-every``)
and ``max_to_keep=3``; memory (RSS), the workdir's size and the step time must stay flat.

    python tests/faults/soak.py --minutes 20 [--out soak.json]

Samples the trainer's resident memory (``/proc/PID/status``), the checkpoints folder's and the workdir's bytes
every ``--every`` seconds, stops the run with SIGTERM (which saves and exits), and prints the first and last
samples and the median tokens/s of the first and last quarter of the logged steps. Exits 1 when RSS grew by more
than ``--max-rss-growth`` (default 20%), the checkpoints folder by more than 50%, or the throughput fell by more
than 25%. metrics.jsonl and the TensorBoard events grow with the steps by design; the workdir's total is reported
beside.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers import metrics, train_args, write_varied_text  # noqa: E402


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):  # files come and go while orbax saves: skip the ones that vanished
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def rss_slope(samples: list[dict]) -> float:
    """MiB per minute of RSS over the second half of the run (least squares): 0 when memory has settled."""
    half = [x for x in samples if x["t_s"] >= samples[-1]["t_s"] / 2]
    t = np.array([x["t_s"] / 60 for x in half])
    r = np.array([x["rss"] / 2**20 for x in half])
    return float(np.polyfit(t, r, 1)[0]) if len(half) >= 3 else 0.0


def soak(minutes: float, every: float, log=print, checkpoint_every: int = 10, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="qkvjax-soak-") as tmp:
        tmp = Path(tmp)
        source = write_varied_text(tmp / "text.txt", lines=3000)
        workdir = tmp / "run"
        settings = {"train.num_steps": 10**9, "train.checkpoint_every": checkpoint_every, "train.max_to_keep": 3,
                    "train.log_every": 10, "train.eval_every": 500, "train.eval_batches": 4}  # fmt: skip
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu", **(env or {}))
        proc = subprocess.Popen(
            [sys.executable, "-m", "qkvjax.cli", *train_args(workdir, source, tmp / "tfds", **settings)],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        samples, start = [], time.time()
        while time.time() - start < minutes * 60 and proc.poll() is None:
            time.sleep(every)
            if (workdir / "metrics.jsonl").exists():
                try:
                    records = metrics(workdir)
                except ValueError:  # a line caught half-written: sample next time
                    continue
                step = records[-1]["step"] if records else 0
                samples.append({"t_s": round(time.time() - start), "step": step, "rss": rss_bytes(proc.pid),
                                "checkpoint_bytes": folder_bytes(workdir / "checkpoints"),
                                "workdir_bytes": folder_bytes(workdir)})  # fmt: skip
                log(f"{samples[-1]['t_s']:6d}s  step {step:7d}  rss {samples[-1]['rss'] / 2**20:8.1f} MiB  "
                    f"checkpoints {samples[-1]['checkpoint_bytes'] / 2**20:7.2f} MiB  "
                    f"workdir {samples[-1]['workdir_bytes'] / 2**20:7.2f} MiB")  # fmt: skip
        try:
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended early: {proc.stderr.read()[-2000:]}")
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.wait()
        records = [r for r in metrics(workdir) if r.get("tokens_per_s")]
        quarter = max(1, len(records) // 4)
        first = statistics.median(r["tokens_per_s"] for r in records[:quarter])
        last = statistics.median(r["tokens_per_s"] for r in records[-quarter:])
        # Memory settles after the first checkpoints and evaluation: growth is measured from the second sample.
        base = samples[1] if len(samples) > 2 else samples[0]
        return {
            "minutes": minutes,
            "steps": records[-1]["step"] if records else 0,
            "checkpoints_kept": sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()),
            "rss_mib": [round(base["rss"] / 2**20, 1), round(samples[-1]["rss"] / 2**20, 1)],
            "rss_slope_mib_per_min_second_half": round(rss_slope(samples), 2),
            "checkpoints_mib": [
                round(base["checkpoint_bytes"] / 2**20, 2),
                round(samples[-1]["checkpoint_bytes"] / 2**20, 2),
            ],
            # metrics.jsonl and TensorBoard events grow with the steps by design (about 200 bytes per record)
            "workdir_mib": [round(base["workdir_bytes"] / 2**20, 2), round(samples[-1]["workdir_bytes"] / 2**20, 2)],
            "tokens_per_s_first_last_quarter": [round(first), round(last)],
            "samples": samples,
            "exit_code": proc.returncode,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="how long to train")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--max-rss-growth", type=float, default=0.2, help="allowed relative RSS growth")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for the trainer, e.g. "
                        "MALLOC_ARENA_MAX=2 (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    result = soak(args.minutes, args.every, checkpoint_every=args.checkpoint_every, env=env)
    (r0, r1), (d0, d1), (t0, t1) = (
        result["rss_mib"],
        result["checkpoints_mib"],
        result["tokens_per_s_first_last_quarter"],
    )
    w0, w1 = result["workdir_mib"]
    print(f"{result['steps']} steps in {args.minutes} min; checkpoints kept {result['checkpoints_kept']}")
    slope = result["rss_slope_mib_per_min_second_half"]
    print(f"RSS {r0} -> {r1} MiB ({slope:+.2f} MiB/min over the second half); checkpoints {d0} -> {d1} MiB "
          f"(workdir {w0} -> {w1}); tokens/s {t0} -> {t1}")  # fmt: skip
    if args.out:
        meta = {"command": " ".join(["python", "tests/faults/soak.py", *(argv or sys.argv[1:])]),
                "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
                "date": time.strftime("%Y-%m-%dT%H:%M")}  # fmt: skip
        Path(args.out).write_text(json.dumps({**meta, **result}, indent=2) + "\n")
    # Memory must have settled: the second half's trend, carried over the whole run, stays within the allowance.
    flat_rss = r1 <= r0 * (1 + args.max_rss_growth) and slope * args.minutes <= args.max_rss_growth * r0
    # SIGTERM saves and exits 128 + 15, as a shell reports a stopped (not finished) run
    ok = flat_rss and d1 <= d0 * 1.5 and t1 >= 0.75 * t0 and result["exit_code"] == 128 + signal.SIGTERM
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
