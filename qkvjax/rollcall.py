"""A roll call of a multi-process run's processes before XLA's own handshake, so that a wrong start is said in one
line instead of ending in XLA's C++ abort.

XLA's coordination service takes a second process with a process id it has already seen for a restart of that
task: it declares the task failed and aborts every process of the run (``LOG(FATAL)``, exit 134, "another task
died"), the coordinator included, and Python cannot catch it. So before ``jax.distributed.initialize``, process 0
listens on the coordinator's own port and every other process checks in there with the process count and its id
(one line each way over TCP, as torchrun's rendezvous precedes NCCL's). Process 0 answers:

* ``ok``: counted; the process waits for ``go``, sent once every id 1..N-1 has checked in, after which process 0
  closes the port and XLA's service binds it (XLA's clients retry their connection until it is up);
* ``refused REASON``: another process count, an id out of range, or an id already checked in; the process prints
  the reason in one line and exits 2, and the run waits for the right process.

A process that reaches the port after the run has started meets XLA's service instead, which does not answer the
roll call: it stops there with one line, and the running processes are untouched. A second process 0 finds the
port taken and stops the same way.
"""

from __future__ import annotations

import socket
import time

GREETING = "qkvjax-rollcall 1"


class RollCallError(RuntimeError):
    """A process that may not join: the message is the one line to print."""


def _reason(line: str, count: int, seen: dict[int, str]) -> tuple[int | None, str | None]:
    """(id, None) for a valid check-in line ``GREETING N ID``, else (None, why it is refused)."""
    parts = line.split()
    if len(parts) != 4 or " ".join(parts[:2]) != GREETING or not (parts[2].isdigit() and parts[3].isdigit()):
        return None, f"a check-in of another form ({line[:60]!r})"
    n, i = int(parts[2]), int(parts[3])
    if n != count:
        return None, f"--num-processes {n}, but process 0 was started with --num-processes {count}"
    if not 1 <= i < count:
        return None, f"--process-id {i}; allowed: 1 to {count - 1} (0 is the coordinator's)"
    if i in seen:
        return None, f"--process-id {i} has already checked in (from {seen[i]}): each process needs its own id"
    return i, None


def host_roll_call(port: int, count: int, deadline: float) -> None:
    """Process 0: take every other process's check-in on ``port`` until ids 1..count-1 are all in, then send each
    ``go`` and free the port. Raises :class:`RollCallError` when the port is taken, or TimeoutError at
    ``deadline`` (time.monotonic())."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("", port))
    except OSError as e:
        server.close()
        raise RollCallError(f"process 0 cannot listen on the coordinator's port {port} ({e.strerror}): another "
                            "process holds it (a second process 0, or a run already there)") from None  # fmt: skip
    server.listen(max(16, count))
    joined: dict[int, socket.socket] = {}
    seen: dict[int, str] = {}
    try:
        while len(joined) < count - 1:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, (host, _) = server.accept()
            except TimeoutError:
                raise TimeoutError from None
            conn.settimeout(5)
            try:
                line = conn.makefile("rb").readline(200).decode(errors="replace").strip()
            except OSError:
                conn.close()
                continue
            i, refused = _reason(line, count, seen)
            if refused is not None:
                try:
                    conn.sendall(f"refused {refused}\n".encode())
                finally:
                    conn.close()
                continue
            conn.sendall(b"ok\n")
            joined[i], seen[i] = conn, host
        for conn in joined.values():  # all in: each may go on to XLA's handshake
            try:
                conn.sendall(b"go\n")
            except OSError:
                pass
    finally:
        for conn in joined.values():
            conn.close()
        server.close()


def join_roll_call(host: str, port: int, count: int, process_id: int, deadline: float) -> None:
    """Process ``process_id`` > 0: check in with the coordinator at ``host:port`` (retrying until process 0
    listens) and wait for ``go``. Raises :class:`RollCallError` when refused or when something else answers, or
    TimeoutError at ``deadline``."""
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
            break
        except OSError:  # refused (process 0 not listening yet), unreachable, or timed out
            if time.monotonic() >= deadline:
                raise TimeoutError from None
            time.sleep(0.2)
    with conn:
        try:
            conn.sendall(f"{GREETING} {count} {process_id}\n".encode())
            reader = conn.makefile("rb")
            for _ in range(2):  # "ok", then "go"
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                answer = reader.readline(200).decode(errors="replace").strip()
                if answer.startswith("refused "):
                    raise RollCallError(f"the coordinator {host}:{port} refused this process: {answer[8:]}")
                if answer not in ("ok", "go"):  # XLA's gRPC service answers with binary frames, or closes
                    raise RollCallError(
                        f"the coordinator {host}:{port} does not hold a roll call: the run has likely started "
                        f"without this process; is --process-id {process_id} given twice?"
                    )
                if answer == "go":
                    return
        except TimeoutError:
            raise
        except (ConnectionResetError, BrokenPipeError) as e:
            raise RollCallError(
                f"the coordinator {host}:{port} closed the connection ({e.strerror}) without a roll call: the run has "
                f"likely started without this process; is --process-id {process_id} given twice?"
            ) from None
