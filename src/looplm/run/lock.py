"""One writer per run folder: ``fcntl.flock`` on ``RUN/.lock`` while a process trains into it.

The kernel drops the lock when the process ends in any way (``kill -9`` too), so no stale locks; the holder
writes its pid, host and start time into the file, so a refused run can name it (``filelock`` 3.x would
truncate them). POSIX only.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunLockedError(ValueError):
    """Another process holds the run folder's lock; the message names it (pid, host, start time)."""


class RunLock:
    """Exclusive lock of a run folder (a context manager); acquiring raises RunLockedError when held."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's details stay
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            try:
                info = json.loads(holder)
                holder = f"pid {info['pid']} on host {info['host']}, started {info['started']}"
            except (ValueError, KeyError, TypeError):
                holder = "holder unknown: it has not written its details yet"
            raise RunLockedError(f"{self.path.parent} is in use by another training process ({holder}); wait for "
                                 "it to finish, stop it, or choose another --out") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # the file stays (unlinking a lock file races with a new holder)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
