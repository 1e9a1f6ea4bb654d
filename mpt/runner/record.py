"""The result record: one `result.json` per run (written atomically) and `metrics.jsonl` beside it.

`result.json` is the only thing reports read. It is written when the run starts (status
`running`), so a run killed before it ends never leaves a record that claims `ok`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from ..files import failed_write, write_bytes_atomic, write_text_atomic

SCHEMA_VERSION = 1


def _json_safe(value: Any) -> Any:
    """NaN and inf are not JSON: write them as strings so every record parses everywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json_atomic(path: Path, data: dict) -> None:
    write_bytes_atomic(path, json.dumps(_json_safe(data), indent=2, allow_nan=False).encode())


class NullLog:
    """The log of a process that writes none (a torchrun rank other than 0)."""

    def write(self, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsLog:
    """metrics.jsonl: one line per training step and network, one per evaluation."""

    def __init__(self, path: Path, keep_before_step: int | None = None):
        """A fresh log, or, resuming from a checkpoint at `keep_before_step`, the log of the steps
        before it (and the evaluation at it): rows a killed run wrote past its checkpoint go."""
        self.path = path
        kept = []
        if keep_before_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut short by the kill
                    continue
                limit = keep_before_step if row.get("kind") == "eval" else keep_before_step - 1
                if row.get("step", limit + 1) <= limit:
                    kept.append(line + "\n")
        # Rewritten through a temporary file: a kill now must not lose the log of the steps kept.
        write_text_atomic(path, "".join(kept))
        self._file: TextIO = open(path, "a")

    def write(self, rows: list[dict]) -> None:
        # A line cut short by a full disk is dropped when a resume reads the log back.
        try:
            for row in rows:
                self._file.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as e:
            raise failed_write(self.path, e) from e

    def close(self) -> None:
        try:
            self._file.close()  # flushes what a failed write left in the buffer: it can fail again
        except OSError as e:
            raise failed_write(self.path, e) from e


@functools.lru_cache(maxsize=None)
def git_commit(start: Path) -> dict:
    """The checkout's commit and whether tracked files differ from it, read once per process: the
    code a sweep runs is what its process imported, so a commit made while the sweep goes on must
    not be named by its later records."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=start, capture_output=True, text=True, timeout=10, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        pass
    # A copy of the tree without .git (a remote GPU machine): scripts/device_carry.sh read the
    # checkout's state when it packed the tree, and device_session.sh passes it on.
    if os.environ.get("MPT_GIT_COMMIT"):
        return {"commit": os.environ["MPT_GIT_COMMIT"], "dirty": os.environ.get("MPT_GIT_DIRTY") == "1", "source": "MPT_GIT_COMMIT"}
    return {"commit": None, "dirty": None}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    import hydra
    import torchvision

    env = {
        "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "device_count": torch.cuda.device_count() if device.type == "cuda" else 1,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "hydra": hydra.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
    }
    if device.type == "cuda":
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
