"""``experiments/scaling.py`` in several processes at once, for a machine one sweep process cannot fill (a GPU
training these small models is idle most of each step), under one deadline; resumable like the sweep itself.

    python experiments/parallel_sweep.py --workers 4 --budget-s 420 --out experiments/results/scaling_corpus2 \\
        -- --corpus experiments/corpora/python_docs.txt --stages lr-large,large --lr-grid 2e-3,4e-3,8e-3 ...

Everything after ``--`` goes to every worker as it is (``--out``, ``--claims`` and ``--stages``' order excepted).
Every worker takes the stages together, in the sweep's order: from a copy of ``--out``'s ``runs.csv``,
``curves.csv`` and ``protocol.json`` in a scratch folder of its own, it trains each stage's runs in turn that it
can plan and no other worker has claimed (``scaling.py --claims``: one claim file per run, created exclusively)
until none is left. A seeded stage plans a variant once that variant's own rate sweep is finished, so a worker with no
sweep run left starts the settled variants' seeds instead of waiting for the slowest sweep. Each finished run's
row and curve are appended to ``--out`` (fsynced, as the sweep does) within seconds of its end, so a parent killed
mid-run (a session's stop) loses only the runs still training; a worker that ran out of work starts afresh
whenever ``--out`` gains rows (a rate settled, a step past a winning edge planned), and the call ends when no
worker can plan anything. At the deadline the workers get SIGTERM (each saves its run's checkpoint; SIGKILL after
TERM_GRACE_S): finished runs are already in ``--out``; a stopped run's checkpoint stays in the scratch folder's one
``runs/`` (every worker's ``runs`` links to it), so whichever worker claims the run next resumes it, if the
scratch folder is still there, else starts it again. SIGTERM to the parent stops the workers the same way (its
exit code is then 143); a worker that fails is reported with its log's tail, and the exit code is then 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import budget
from experiments.rows import append_rows, read_csv
from experiments.scaling import (
    CURVE_COLUMNS,
    PROTOCOL_FILE,
    RUN_COLUMNS,
    STAGES,
    Sweep,
    build_parser,
    check_args,
    estimate_s,
    speeds,
    train_split_bytes,
)

SCALING = Path(__file__).resolve().parent / "scaling.py"
POLL_S = 10.0  # seconds between merges of the workers' finished rows into --out
TERM_GRACE_S = 90.0  # seconds a worker gets after SIGTERM to save its checkpoint before SIGKILL
COPIED = ("runs.csv", "curves.csv", PROTOCOL_FILE, "probe.json")  # probe.json: the plan's speeds, measured once


def workers_estimate_s(sweep: Sweep, stages: list[str], workers: int) -> float:
    """The plan's one-process estimate over ``workers``: the wall time when each worker keeps the tokens/s the
    plan read (the finished runs' median, else probe.json: the plan above made it, so nothing trains here). The
    real one is longer where a stage waits on another's rates or the last runs leave a worker idle, shorter where
    runs stopped part-way resume (counted whole)."""
    rates = speeds(sweep)
    return sum(estimate_s(r, rates) for stage in stages for r in sweep.stage_runs(stage)) / workers


def merge(out: Path, worker: Path) -> int:
    """Appends the rows (and their curves) that ``worker`` finished and ``out`` lacks; returns how many."""
    have = {r["run"] for r in read_csv(out / "runs.csv")}
    new = [r for r in read_csv(worker / "runs.csv") if r["run"] not in have]  # whole rows: a later call takes the rest
    if not new:
        return 0
    print(f"parallel_sweep: merged {', '.join(r['run'] for r in new)} from {worker.name}", flush=True)
    names = {r["run"] for r in new}
    curve = [c for c in read_csv(worker / "curves.csv") if c["run"] in names]
    append_rows(out / "curves.csv", CURVE_COLUMNS, curve)  # the curves first: a row names a finished curve
    append_rows(out / "runs.csv", RUN_COLUMNS, new)
    return len(new)


def _progress(run: Path) -> tuple[bool, int]:
    """How far a run folder got: finished (``params/`` written), then its latest checkpoint step."""
    steps = [int(c.name) for c in (run / "checkpoints").glob("*") if c.name.isdigit()]
    return (run / "params").is_dir(), max(steps, default=-1)


def pool_runs(scratch: Path, workers: int) -> Path:
    """One run folder, ``scratch/runs``, that every worker's ``runs`` links to: a run stopped in one round resumes
    from its checkpoint in whichever worker claims it next (a claim keeps two workers off one run). Worker folders
    from the older layout (a ``runs/`` each) are folded in; where two hold the same run, the one further on stays."""
    shared = scratch / "runs"
    shared.mkdir(parents=True, exist_ok=True)
    folders = {scratch / f"w{i}" for i in range(workers)} | {w for w in scratch.glob("w*") if w.is_dir()}
    for folder in sorted(folders):
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / "runs"
        if link.is_symlink():
            continue
        if link.is_dir():
            for run in sorted(link.iterdir()):
                dest = shared / run.name
                if dest.exists() and _progress(dest) >= _progress(run):
                    continue
                if dest.exists():
                    shutil.rmtree(dest)
                run.rename(dest)  # one file system: a rename, never a copy
            shutil.rmtree(link)
        link.symlink_to(Path("..") / "runs", target_is_directory=True)
    return shared


def _stop(procs) -> None:
    """SIGTERM to each worker still running (its training loop saves a checkpoint and exits), SIGKILL after
    TERM_GRACE_S to any that has not exited."""
    running = [p for p, _ in procs if p.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):  # exited since the poll
            os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + TERM_GRACE_S
    for proc in running:
        try:
            proc.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # 143, as a shell reports a SIGTERM


def start_worker(args, i: int, passed: list[str], stages: list[str], claims: Path):
    """Worker ``i``: ``scaling.py`` on fresh copies of ``--out``'s files, training the runs of ``stages`` it can
    plan and no other worker has claimed, stage by stage, until none is left; its output goes to its log."""
    out, folder = Path(args.out), Path(args.scratch) / f"w{i}"  # made by pool_runs
    for name in COPIED:
        if (out / name).exists():
            shutil.copyfile(out / name, folder / name)
        else:
            (folder / name).unlink(missing_ok=True)
    cmd = [sys.executable, str(SCALING), *passed, "--out", str(folder), "--stages", ",".join(stages),
           "--claims", str(claims)]  # fmt: skip
    log = open(folder / "worker.log", "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def run_pool(args, stages: list[str], passed: list[str], deadline: float) -> tuple[int, list[int]]:
    """Keeps ``--workers`` workers busy on every stage at once until nothing can be planned or the deadline; the
    number of rows added to ``--out`` and the workers that failed.

    A worker sees the rows finished when it started and its own: one that runs out of work exits, and its slot
    starts a fresh worker whenever ``--out`` has gained rows since (another worker's, which may have settled a
    rate or added a step past a winning edge). The claims last the whole call, so a worker's stale view never
    retrains a run another took; a later call takes a run this one stopped again."""
    out, scratch = Path(args.out), Path(args.scratch)
    claims = scratch / f"claims-{time.monotonic_ns()}"
    pool_runs(scratch, args.workers)
    slots: list = [None] * args.workers  # (process, log) while a worker runs
    started_at = [-1] * args.workers  # rows in --out when the slot's worker started
    failed, added = [], 0
    before = len(read_csv(out / "runs.csv"))  # only this call appends to --out: rows = before + added
    next_merge = time.monotonic() + POLL_S
    try:
        while time.monotonic() < deadline:
            # Finished runs are merged as they come, not when a worker exits: a parent killed mid-run (a
            # session's stop) then loses only the runs still training.
            if time.monotonic() >= next_merge or any(s and s[0].poll() is not None for s in slots):
                added += sum(merge(out, scratch / f"w{i}") for i in range(args.workers))
                next_merge = time.monotonic() + POLL_S
            for i, slot in enumerate(slots):
                if slot and slot[0].poll() is not None:
                    slot[1].close()
                    slots[i] = None
                    if slot[0].returncode != 0:
                        failed.append(i)
                        tail = (scratch / f"w{i}" / "worker.log").read_text().splitlines()[-15:]
                        print(f"worker {i} exited {slot[0].returncode}:\n" + "\n".join(tail), file=sys.stderr)
            rows = before + added
            for i in range(args.workers):
                if slots[i] is None and i not in failed and rows > started_at[i]:
                    again = " again" if started_at[i] >= 0 else ""
                    print(f"parallel_sweep: w{i} starts{again} from {rows} finished runs", flush=True)
                    slots[i], started_at[i] = start_worker(args, i, passed, stages, claims), rows
            if not any(slots):
                break
            time.sleep(0.5)
    finally:
        _stop([s for s in slots if s])  # the deadline, or SIGTERM to this process: each saves its checkpoint
        for slot in filter(None, slots):
            slot[1].close()
    added += sum(merge(out, scratch / f"w{i}") for i in range(args.workers))
    return added, failed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, passed = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the sweep's results folder (runs.csv, curves.csv, protocol.json)")
    p.add_argument("--workers", type=int, default=4, help="processes at once (default 4)")
    p.add_argument("--budget-s", type=float, default=420, help="seconds until every worker is stopped (default 420)")
    p.add_argument("--scratch", default="/tmp/parallel_sweep", help="the workers' folders and checkpoints")
    args = p.parse_args(ours)
    sweep = build_parser().parse_args([*passed, "--out", args.out])  # the workers' arguments, checked here once
    try:
        if args.workers < 1:
            raise ValueError(f"--workers={args.workers}; allowed: an integer >= 1")
        if args.budget_s <= 0:
            raise ValueError(f"--budget-s={args.budget_s}; allowed: seconds > 0")
        if any(a.startswith(("--out", "--claims")) for a in passed):
            raise ValueError("--out/--claims after '--'; allowed: the sweep's other arguments (--out goes before)")
        check_args(sweep)
    except ValueError as e:
        print(f"parallel_sweep: error: {e}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so a round's `finally` stops the workers, each checkpointing
    # the plan, and protocol.json in --out (the workers copy it, so all of them check the same protocol)
    subprocess.run([sys.executable, str(SCALING), *passed, "--out", args.out, "--plan-only"], check=True)
    plan = Sweep(sweep)  # what the plan above read: the rows so far and the measured speeds
    for _, data in filter(None, plan.corpora.values()):  # TFDS prepares each corpus here, once: workers
        train_split_bytes(data)  # preparing one data_dir at the same time would race
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the workers share one accelerator
    stages = [s for s in STAGES if s in sweep.stages]  # the sweep's own order
    wall = budget.hms(workers_estimate_s(plan, stages, args.workers))
    print(f"parallel_sweep: {args.workers} workers: ~{wall} of that, if each keeps the speed above "
          "(tokens/s per process)", flush=True)  # fmt: skip
    added, failed = run_pool(args, stages, passed, deadline)
    print(f"parallel_sweep: {added} runs added to {args.out}/runs.csv", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
