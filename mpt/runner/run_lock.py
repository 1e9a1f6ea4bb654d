"""One process per run folder: an exclusive lock, `.lock` in the folder, naming its holder.

A POSIX record lock (fcntl) dies with its process, so a lock left by a killed run is simply
taken: the file's contents then name the process that held it. It is the process's own, so the
data-loader workers it forks do not hold it after it dies (flock's would). The file is never
deleted (a process waiting on a deleted file would lock a different one than the next process
creates). On NFS the server keeps the lock, and a dead client's lease releases it. A file system
that has no locks at all runs the run unlocked, saying so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from .record import now_iso

FILENAME = ".lock"


class AlreadyRunning(Exception):
    """Another live process holds the run folder; the message names it (pid N on host H)."""


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no name"


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / FILENAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock. Returns the holder it took over from (a process that died holding it),
        if any; raises AlreadyRunning if a live process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):  # held
                text = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                raise AlreadyRunning(_describe(text)) from None
            os.close(fd)
            print(f"mpt-run: warning: cannot lock {self.path} ({e.strerror}); running without a lock", file=sys.stderr, flush=True)
            return None
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso()}).encode(), 0)
        self._fd = fd
        return _describe(previous) if previous.strip() else None

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty lock file: nobody held it when it was released
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
