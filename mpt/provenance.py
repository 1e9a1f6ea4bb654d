"""Provenance: the code, the machine and the moment a result came from, for every record and
benchmark (the run's record, the scripts' own), at the bottom of the package so that any floor
may name them."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from . import host_memory

if TYPE_CHECKING:
    import torch


@functools.lru_cache(maxsize=None)
def git_commit(start: Path) -> dict:
    """The checkout's commit and whether tracked files differ from it, read once per process: the
    code a sweep runs is what its process imported, so a commit made while the sweep goes on must
    not be named by its later records."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=start, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        # results/ left out, as device_carry.sh's hash leaves it: a sweep rewriting its tracked
        # multirun.yaml, or records added beside the code, change nothing a run computes
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)results")
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed)}
    except (OSError, subprocess.SubprocessError):
        pass
    # A copy of the tree without .git (a remote GPU machine): scripts/device/device_carry.sh read the
    # checkout's state when it packed the tree, and device_session.sh passes it on.
    if os.environ.get("MPT_GIT_COMMIT"):
        return {
            "commit": os.environ["MPT_GIT_COMMIT"],
            "dirty": os.environ.get("MPT_GIT_DIRTY") == "1",
            "source": "MPT_GIT_COMMIT",
        }
    return {"commit": None, "dirty": None}


def code_identity(code: Optional[Path] = None, configs: Optional[Path] = None) -> dict:
    """`git_commit` of the code, with the configs' own where they come from another checkout or
    commit (a checkout reads the configs beside its `mpt/`, mpt/__init__.py, but code and configs
    can still part, e.g. an installed package's configs under a checkout's code): the record then
    names both, and is dirty, since the code's commit alone no longer reproduces the run."""
    identity = dict(git_commit(code or Path(__file__).resolve().parent))
    configs = configs or Path(str(resources.files("mpt.configs")))
    other = git_commit(configs)
    if other != identity:
        identity["configs"] = {"path": str(configs), **other}
        identity["dirty"] = True
    return identity


def describe_code(git: dict | None) -> str:
    """`commit 1a2b3c4d5e6f` with ` (with uncommitted changes)` where the tree was dirty: how a
    warning names the code that ran."""
    git = git or {}
    commit = git.get("commit")
    text = f"commit {commit[:12]}" if commit else "code of no known commit"
    return text + (" (with uncommitted changes)" if git.get("dirty") else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    # Imported here: the report reads records without loading torch.
    import hydra
    import torch
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
        "huge_pages": huge_pages(),
        "freed_memory_kept": host_memory.kept(),  # glibc asked to reuse freed memory (mpt/host_memory.py)
    }
    if device.type == "cuda":
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def huge_pages() -> dict:
    """Whether THP_MEM_ALLOC_ENABLE asks torch's CPU allocator for transparent huge pages, and the
    kernel's policy (null off Linux): CPU step times depend on both."""
    try:
        policy = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        policy = None
    return {"torch_thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1", "kernel_policy": policy}


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
