"""The run folder, as tools see it: file names, the saved config, the metrics log.

Tools (eval, info, convert, analyze, the experiments) read a workdir through this module, never through the
training loop. Layout::

    WORKDIR/config.json            the run's Config (JSON of the frozen dataclasses)
    WORKDIR/metrics.jsonl          one JSON object per logged step; evaluation records carry "eval": true
    WORKDIR/checkpoints/<step>/    orbax: state, data iterator, config (see qkvjax.train.checkpoint)
    WORKDIR/params/<step>/         params only, written when a run finishes
    WORKDIR/tensorboard/           TensorBoard events
"""

from __future__ import annotations

import json
import math
import os
import socket
import time

from qkvjax.train.config import Config, from_dict

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


def load_config(workdir: str) -> Config:
    """The Config a run was started with; a clear error when ``workdir`` holds no run."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise ValueError(f"workdir {os.path.abspath(workdir)} holds no run (no {CONFIG_FILE})")
    with open(path) as f:
        return from_dict(Config, json.load(f))


def read_metrics(workdir: str) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) from ``metrics.jsonl``, in the order written; ([], []) if absent."""
    path = os.path.join(workdir, METRICS_FILE)
    train, evals = [], []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    (evals if record.get("eval") else train).append(record)
    return train, evals


LOCK_FILE = "train.lock"
STALE_AFTER_S = 600.0  # a holder on another host that has not refreshed its lock for this long is presumed dead


def json_safe(value):
    """``value`` with every non-finite float replaced by None, so the JSON written is strict (RFC 8259)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


class WorkdirLock:
    """One training run per workdir: ``WORKDIR/train.lock`` holds the holder's host, pid and start time.

    Created with O_EXCL, so of two runs starting together exactly one wins. A lock left by a dead process is taken
    over: on the same host when its pid no longer runs, on another host when it has not been refreshed
    (:meth:`refresh`, called by the loop as it logs) for ``STALE_AFTER_S``. Taking over renames the stale file
    first, so two runs that both find it stale cannot both win.
    """

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self.held = False

    def acquire(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None or not self._stale(holder):
                    who = "unknown" if holder is None else f"pid {holder['pid']} on {holder['host']}"
                    since = "" if holder is None else f" since {holder.get('started', '?')}"
                    raise ValueError(
                        f"workdir {os.path.dirname(self.path)} is in use by another training run ({who}{since}); "
                        f"wait for it, or delete {self.path} if that run is gone"
                    ) from None
                try:  # one of the runs that found it stale renames it away; the others retry and lose to it
                    os.rename(self.path, f"{self.path}.stale.{os.getpid()}")
                    os.remove(f"{self.path}.stale.{os.getpid()}")
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise ValueError(f"could not take the lock {self.path}: other runs keep taking it")

    def _holder(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):  # vanished, or half-written by a holder that died at once
            try:
                age = time.time() - os.path.getmtime(self.path)
            except OSError:
                return {"host": "?", "pid": -1, "stale": True}
            return {"host": "?", "pid": -1, "stale": age > 5.0}

    def _stale(self, holder: dict) -> bool:
        if "stale" in holder:
            return holder["stale"]
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder["pid"]), 0)
            except ProcessLookupError:
                return True
            except PermissionError:  # alive, another user's
                return False
            return False
        return time.time() - os.path.getmtime(self.path) > STALE_AFTER_S

    def refresh(self) -> None:
        if self.held:
            os.utime(self.path)

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def training_clock(train_records: list[dict], tokens_per_step: int) -> list[float]:
    """Cumulative training seconds at each training record: steps x tokens / the measured tokens/s of each
    interval. The compiling first interval and evaluations are left out, so curves of resumed runs continue."""
    clock, wall, prev = [], 0.0, 0
    for r in train_records:
        if r.get("tokens_per_s"):
            wall += (r["step"] - prev) * tokens_per_step / r["tokens_per_s"]
        prev = r["step"]
        clock.append(wall)
    return clock
