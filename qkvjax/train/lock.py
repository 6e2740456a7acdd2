"""One training run per workdir: ``WORKDIR/train.lock``, held by the running trainer (:class:`WorkdirLock`).

The training loop (process 0 of a multi-process run) takes it once the folder exists, before it reads or writes
anything in it, and holds it to the end; tools that only read a workdir (info, eval, sample, analyze) do not take it,
and import and convert write folders of their own (``qkvjax.workdir.whole_or_absent``)."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

try:
    import fcntl
except ImportError:  # Windows: no flock, the lock file alone
    fcntl = None

from qkvjax.workdir import is_remote, path, pid_gone, writing

LOCK_FILE = "train.lock"
STALE_AFTER_S = 600.0  # a holder on another host that has not refreshed its lock for this long is presumed dead


class WorkdirLock:
    """One training run per workdir: ``WORKDIR/train.lock`` names the holder (host, pid, start and refresh times).

    Locally the holder keeps an exclusive ``flock`` on the file for the whole run. The kernel grants it to one open
    file at a time and drops it when its process ends, however it ends: of runs starting together exactly one wins,
    whether the file is absent or left by a killed run, which the winner then takes. The file's contents are
    checked too, for holders that take no flock (qkvjax before 2026-11-30, a host on a network mount whose locks
    are local only): one names a live pid on this host, or was refreshed (:meth:`refresh`, called by the loop as
    it logs) within ``STALE_AFTER_S`` on another, still refuses. Where there is no flock (an object store, a mount
    without locks), the file itself is the lock: created with O_EXCL locally (a stale one renamed away first; two
    runs that find it stale at the same moment can then both take it, which flock rules out); on an object store a
    run writes its own token, waits, and reads it back, so of runs racing the last write wins and the others see a
    foreign token and refuse.
    """

    SETTLE_S = 2.0  # object stores: how long a racing writer gets before the read-back

    def __init__(self, workdir):
        self.path = path(workdir) / LOCK_FILE
        self.held = False
        self.fd: int | None = None  # the open file that holds the flock
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}

    def _content(self) -> str:
        return json.dumps({**self.me, "started": self.started, "refreshed": time.time()})

    def acquire(self) -> None:
        self.started = time.strftime("%Y-%m-%d %H:%M:%S")
        for _ in range(3):
            taken = self._flock() if fcntl is not None and not is_remote(self.path) else None
            if taken is None:  # no flock here: the file alone
                taken = self._take_file()
            if taken:
                self.held = True
                return
        raise ValueError(f"could not take the lock {self.path}: other runs keep taking it")

    def _flock(self) -> bool | None:
        """Takes the file's flock and writes this run into it: True; False to try again (a holder releasing it
        unlinked the file this opened); None where the filesystem has no flock. Refuses a live holder."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's file: the file protocol reads it and refuses a live holder
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._refuse(self._holder())
            except OSError:  # ENOLCK, EOPNOTSUPP: a mount without locks
                return None
            opened = os.fstat(fd)
            try:
                if not os.path.samestat(opened, os.stat(self.path)):
                    return False
            except FileNotFoundError:
                return False
            if opened.st_size:  # left by a holder gone, or one that takes no flock
                holder = self._holder()
                if not self._stale(holder):
                    self._refuse(holder)
            try:
                with writing(f"the lock {self.path}"):
                    self._write(fd)
            except OSError:  # a full disk: the file this holds the flock on goes (nobody else can hold it)
                os.unlink(self.path)
                raise
            self.fd, fd = fd, None
            return True
        finally:
            if fd is not None:
                os.close(fd)

    def _write(self, fd: int) -> None:
        """This run's record, in place (a rename would leave the flock on the old file); readers that catch it half
        written see a fresh file and refuse."""
        data = self._content().encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def _take_file(self) -> bool:
        """The lock without flock: the file's existence. True when taken, False to try again."""
        holder = self._holder() if self.path.exists() else None
        if holder is not None:
            if not self._stale(holder):
                self._refuse(holder)
            if not self._remove_stale():
                return False
        return self._create()

    def _refuse(self, holder: dict):
        who = "unknown" if holder.get("pid", -1) == -1 else f"pid {holder['pid']} on {holder['host']}"
        since = f" since {holder['started']}" if holder.get("started") else ""
        raise ValueError(
            f"workdir {self.path.parent} is in use by another training run ({who}{since}); "
            f"wait for it, or delete {self.path} if that run is gone"
        ) from None

    def _create(self) -> bool:
        if not is_remote(self.path):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(self._content())
            return True
        self.path.write_text(self._content())
        time.sleep(self.SETTLE_S)
        holder = self._holder()
        if holder.get("token") != self.me["token"]:
            self._refuse(holder)
        return True

    def _remove_stale(self) -> bool:
        """Removes a stale lock; False when another run got to it first (then try again)."""
        if is_remote(self.path):
            self.path.unlink(missing_ok=True)
            return True
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)
            os.remove(aside)
        except FileNotFoundError:
            return False
        return True

    def _holder(self) -> dict:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            holder = None
        if isinstance(holder, dict) and isinstance(holder.get("pid"), int) and "host" in holder:
            return holder
        try:  # vanished, half written by a holder that died at once, or not a lock's record
            age = time.time() - self.path.stat().mtime
        except OSError:
            return {"host": "?", "pid": -1, "stale": True}
        return {"host": "?", "pid": -1, "stale": age > 5.0}

    def _stale(self, holder: dict) -> bool:
        if "stale" in holder:
            return holder["stale"]
        if holder.get("host") == socket.gethostname():
            return pid_gone(holder["pid"])
        refreshed = holder.get("refreshed")
        if refreshed is None:  # written by an older version: the file's own time
            refreshed = self.path.stat().mtime
        return time.time() - refreshed > STALE_AFTER_S

    def refresh(self) -> None:
        if self.fd is not None:
            self._write(self.fd)
        elif self.held:
            self.path.write_text(self._content())

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self.fd is None:
            self.path.unlink(missing_ok=True)
            return
        try:  # unlinked while the flock is held: a run waiting on this file sees it gone and opens a new one
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
