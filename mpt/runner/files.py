"""Writing a run's files: whole or not at all, and a failure that names the file and its cause.

A file is written to a temporary file beside it, flushed to disk and renamed over the old one, so
a kill, a full disk or an I/O error part-way leaves the previous version whole (timm's habit for
checkpoints, here for every file a run rewrites).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


class WriteError(OSError):
    """A file could not be written; the message names it and the cause (no space, I/O error)."""


def failed_write(path: Path, e: OSError) -> WriteError:
    err = WriteError(f"could not write {path}: {e.strerror or e}")
    err.errno = e.errno
    return err


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(f)` into a temporary file in `path`'s folder, then rename it to `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide files from the other users of a shared results folder
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise failed_write(path, e) from e
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data))


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())
