"""Writing a run's files: whole or not at all, and a failure that names the file and its cause.

A file is written to a temporary file beside it, flushed to disk and renamed over the old one, so
a kill, a full disk or an I/O error part-way leaves the previous version whole (timm's habit for
checkpoints, here for every file a run rewrites).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, cast


class WriteError(OSError):
    """A file could not be written; the message names it and the cause (no space, I/O error)."""


def failed_write(path: Path, e: OSError) -> WriteError:
    err = WriteError(f"could not write {path}: {e.strerror or e}")
    err.errno = e.errno
    return err


class _Recorder:
    """The file a writer gets: it remembers the first OSError a write met, which a library writing
    through it may turn into something else (torch.save's zip writer raises a RuntimeError,
    "unexpected pos ...", when the disk is full)."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str):
        return getattr(self._f, name)


_TMP_SUFFIX = ".tmp"


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(f)` into a temporary file in `path`'s folder, then rename it to `path`."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    except OSError as e:
        raise failed_write(path, e) from e
    recorder = None
    try:
        with os.fdopen(fd, "wb") as f:
            recorder = _Recorder(f)
            write(cast(BinaryIO, recorder))  # duck-typed: it forwards all but write() to f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide files from the other users of a shared results folder
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        cause = recorder.error if recorder is not None and recorder.error is not None else e
        if isinstance(cause, OSError) and not isinstance(e, WriteError):
            raise failed_write(path, cause) from e
        raise


def _fsync_dir(folder: Path) -> None:
    """The rename itself on disk (a crash right after it would otherwise find the old file)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename is still atomic
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data))


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def remove_stale_temporaries(folder: Path) -> None:
    """The temporaries of writes a kill cut short; call only while no one else writes in `folder`."""
    for stale in folder.glob(f".*{_TMP_SUFFIX}"):
        stale.unlink(missing_ok=True)


def json_safe(value: Any) -> Any:
    """NaN and inf are not JSON: write them as strings so every record parses everywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json_atomic(path: Path, data: dict) -> None:
    write_bytes_atomic(path, json.dumps(json_safe(data), indent=2, allow_nan=False).encode())
