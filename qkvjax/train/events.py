"""TensorBoard event files, written in the training loop's own thread.

tensorboardX's ``SummaryWriter`` hands each event to a writer thread through a queue of 10. When a write fails (a
full disk, an I/O error) that thread dies, the queue fills, and the loop blocks in ``add_scalar`` for ever, SIGTERM
included: a run whose disk filled hung silently instead of stopping with an error (found on 2026-11-30 on a 2 MB
tmpfs; ``tests/faults/test_faults.py``). Here the events go through tensorboardX's own file writer
(``EventsWriter``: TFRecord framing with CRCs, the file named as ``SummaryWriter`` names it) from the loop's thread,
so a failed write raises where the loop logs, and the loop's cleanup runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

FLUSH_EVERY_S = 30.0  # how stale a live TensorBoard may be between the loop's own flushes (evaluations, saves)


@contextlib.contextmanager
def without_torch():
    """Imports of tensorboardX inside this block leave PyTorch alone. Its package imports its writer module, which
    tries ``import torch`` (only to accept torch tensors as values) wherever torch is installed: 2-3 s and a few
    hundred MB per training process here, and on a GPU machine PyTorch's CUDA libraries loaded beside JAX's. A
    ``None`` in ``sys.modules`` makes that import raise ImportError, which tensorboardX catches; the entry is removed
    at once, so the caller's own ``import torch`` still works, and nothing changes where torch is already
    imported."""
    keep_out = "tensorboardX" not in sys.modules and "torch" not in sys.modules
    if keep_out:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if keep_out:
            del sys.modules["torch"]


class EventFile:
    """One events file in ``folder``, ``events.out.tfevents.<time>.<host>.from_step_<start>``. With ``purge_step``
    (a resume) its first event is TensorBoard's ``SessionLog.START`` at that step, which hides the earlier files'
    events from that step on: they are about to be recomputed."""

    def __init__(self, folder: str, start_step: int, purge_step: int | None):
        with without_torch():
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            from tensorboardX.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        os.makedirs(folder, exist_ok=True)
        self._writer = EventsWriter(os.path.join(folder, "events"), f".from_step_{start_step}")
        if purge_step is not None:
            self._writer.write_event(
                Event(step=purge_step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START))
            )
        self.flush()

    def scalars(self, values: dict[str, float], step: int) -> None:
        """One event holding every ``tag: value`` at ``step``; flushed when the last flush is ``FLUSH_EVERY_S`` old."""
        Summary = self._summary
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self._writer.write_event(self._event(step=step, wall_time=time.time(), summary=summary))
        if time.monotonic() - self._flushed > FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self._writer.flush()  # flushed and fsync'd: an error here is the disk's
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._writer.close()
