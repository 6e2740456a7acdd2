"""What the training loop shows while it runs: a live status line on a terminal, plain log lines otherwise.

On a terminal (stdout is a TTY) a ``rich`` progress bar is redrawn in place: step / total, a bar, what the run is
doing (compiling, training, evaluating, saving), the last logged loss and its step, tokens/s, the last evaluation
and the estimated time left. The bar counts *finished* steps: JAX dispatches steps ahead of the device, so the
loop hands :meth:`TrainProgress.step` a way to wait for a step, which it uses at most every ``REDRAW_S`` (a wait
that costs one step's dispatch latency twice a second, well under 1%); the time left is the rate of finished steps
since the first one (compiling excluded) times the steps left. Messages (resumed, compiled, evaluations) are
printed above it. When stdout is a file or a pipe (CI, ``nohup``, ``| tee``), every update is one plain line with
no escape codes, so logs read and grep well. Only process 0 prints.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

REDRAW_S = 0.5  # the live line waits for a finished step and redraws at most this often


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class TrainProgress:
    """Progress of one run from step ``start`` to ``total``.

    ``live`` (default: stdout is a terminal and this is process 0) picks the redrawn bar; ``enabled=False`` prints
    nothing (processes other than 0). ``console`` is for tests. The plain lines carry the same figures, with the
    time left estimated from the steps timed since the last message.
    """

    def __init__(self, start: int, total: int, *, enabled: bool = True, live: bool | None = None, console=None):
        self.start, self.total, self.enabled = start, total, enabled
        self.live = enabled and (sys.stdout.isatty() if live is None else live)
        self.last_eval = ""
        self._status = ""  # the bar's training part, to which an evaluation is added when it finishes
        self._clock: tuple[float, int] | None = None  # (time, step) at which the speed estimate starts
        self._bar = None
        if self.live:
            self.console = console or Console()
            self._bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(bar_width=24),
                TextColumn("{task.fields[doing]}"),
                TextColumn("{task.fields[status]}"),
                TextColumn("eta {task.fields[eta]}"),
                console=self.console,
                transient=False,
                auto_refresh=False,
            )
            fields = {"doing": "compiling", "status": "", "eta": "-:--"}
            self._task = self._bar.add_task("train", total=total, completed=start, **fields)
            self._drawn = 0.0
            self._bar.start()
        elif enabled:
            self.console = console

    def message(self, line: str) -> None:
        """A line that stays (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.console.file if self.console else sys.stdout, flush=True)

    def step(self, step: int, wait=None) -> None:
        """Called after every step is dispatched; ``wait()`` (optional) blocks until that step has finished. The
        live line waits and redraws at most every REDRAW_S, so it shows finished steps only; without ``wait`` (or
        in plain mode) nothing waits."""
        first = self._clock is None
        if first:  # the first step compiled; the speed estimate starts once it has finished
            if wait is not None:
                wait()
            self._clock = (time.perf_counter(), step)
            self.doing("training")
        if self._bar is None:
            return
        now = time.perf_counter()
        if wait is not None and now - self._drawn < REDRAW_S and step < self.total:
            return
        if wait is not None and not first:
            wait()
        eta = self.eta_s(step)
        self._bar.update(self._task, completed=step, eta=_duration(eta) if eta is not None else "-:--")
        self._bar.refresh()
        self._drawn = time.perf_counter()

    def doing(self, word: str) -> None:
        """What the run is doing now (compiling, training, evaluating, saving checkpoint), on the live line."""
        if self._bar is not None:
            self._bar.update(self._task, doing=word)
            self._bar.refresh()

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the rate measured since the first step (None before two steps)."""
        if self._clock is None or step <= self._clock[1]:
            return None
        t0, s0 = self._clock
        return (time.perf_counter() - t0) / (step - s0) * (self.total - step)

    def log(self, record: dict) -> None:
        """A training record from the loop (step, loss, bits_per_byte, learning_rate, tokens_per_s, mfu)."""
        speed = (
            f" {record['tokens_per_s']:,.0f} tok/s mfu {100 * record['mfu']:.1f}%" if "tokens_per_s" in record else ""
        )
        self._status = f"loss {record['loss']:.4f} @ {record['step']}{speed}"
        status = self._status + self.last_eval
        if self._bar is not None:
            eta = self.eta_s(record["step"])
            eta = _duration(eta) if eta is not None else "-:--"
            self._bar.update(self._task, completed=record["step"], status=status, eta=eta)  # a logged step finished
            self._bar.refresh()
            self._drawn = time.perf_counter()
            return
        eta = self.eta_s(record["step"])
        self.message(
            f"step {record['step']}/{self.total} loss {record['loss']:.4f} bpb {record['bits_per_byte']:.3f} "
            f"lr {record['learning_rate']:.2e}{speed}" + (f" eta {_duration(eta)}" if eta is not None else "")
        )

    def evaluated(self, step: int, ev: dict) -> None:
        self.last_eval = f" | eval {ev['loss']:.4f} @ {step}"
        if self._bar is not None:  # shown now, not at the next logged step (it lagged one evaluation behind)
            self._bar.update(self._task, status=self._status + self.last_eval)
            self._bar.refresh()
        self.message(f"step {step} eval {ev['split']} loss {ev['loss']:.4f} bpb {ev['bits_per_byte']:.3f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
