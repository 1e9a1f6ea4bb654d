"""One process per run folder: an exclusive lock, `.lock` in the folder, naming its holder.

A POSIX record lock (fcntl) dies with its process, so a lock left by a killed run is simply
taken: the file's contents then name the process that held it. It is the process's own, so the
data-loader workers it forks do not hold it after it dies (flock's would). The file is never
deleted (a process waiting on a deleted file would lock a different one than the next process
creates). On NFS the server keeps the lock, and a dead client's lease releases it. A file system
that has no locks at all runs the run unlocked, saying so.

`held` asks, from another process, whether a live process holds a folder's lock (mpt-report tells a
run that died without writing its final status from a live one by it).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import struct
import sys
from pathlib import Path

from ..provenance import now_iso

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
            print(
                f"mpt-run: warning: cannot lock {self.path} ({e.strerror}); running without a lock",
                file=sys.stderr,
                flush=True,
            )
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


def held(run_dir: Path) -> bool | None:
    """Whether a live process holds `run_dir`'s lock: True; False where none does (also where the
    folder has no `.lock`: no process ever locked it here); None where nothing can tell (the file
    system has no locks, or the file cannot be opened).

    Never call it from the process that holds the lock. POSIX record locks belong to a process: its
    own lock never conflicts with its own probe (the answer would be False), and closing ANY
    descriptor of the file, such as the one the probe opens, drops every lock the process holds on
    it. On Linux the probe refuses (RuntimeError) in a process that has the file open; elsewhere
    nothing stops it.

    It does not take the lock on Linux (F_GETLK only asks). Elsewhere it takes a shared lock for an
    instant and drops it: a run starting at that instant would find its folder held.
    """
    path = run_dir / FILENAME
    if _open_in_this_process(path):
        raise RuntimeError(f"{path}: this process has the lock file open; probing it would drop its lock")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        return _conflicts(fd)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):  # the shared-lock probe met the holder's lock
            return True
        return None  # ENOLCK, EOPNOTSUPP, ...: no locks here
    finally:
        os.close(fd)


# struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (native alignment); the buffer is
# padded beyond the kernel's struct, which writes only its own size back.
_FLOCK_LINUX = "@hhqqi"


def _conflicts(fd: int) -> bool:
    """Whether another process's lock would conflict with an exclusive lock of the whole file."""
    if sys.platform.startswith("linux"):
        query = struct.pack(_FLOCK_LINUX, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0).ljust(64, b"\0")
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
        return struct.unpack_from(_FLOCK_LINUX, answer)[0] != fcntl.F_UNLCK
    # struct flock's layout differs between systems: a shared lock, taken and dropped at once.
    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # raises EACCES or EAGAIN while held
    fcntl.lockf(fd, fcntl.LOCK_UN)
    return False


def _open_in_this_process(path: Path) -> bool:
    """Whether this process has `path` open (Linux: /proc/self/fd; False where that is missing)."""
    try:
        target = os.stat(path)
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.path.samestat(os.stat(f"/proc/self/fd/{fd}"), target):
                return True
        except OSError:
            continue  # closed since the listing (the listing's own descriptor)
    return False
