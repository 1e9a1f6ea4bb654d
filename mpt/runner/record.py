"""The result record: one `result.json` per run (a RunRecord, written atomically) and
`metrics.jsonl` beside it.

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
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TextIO

from ..files import failed_write, write_bytes_atomic, write_text_atomic

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 1  # raised when a field changes meaning or type; new optional fields do not need it


class RecordError(ValueError):
    """A result.json that cannot be read as a record; the message names the file."""


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


@dataclass(kw_only=True)
class RunRecord:
    """One run's result.json. Sections measured by their own module (throughput, memory, flops,
    mfu, loss_scale, grad_stats, environment) stay plain dicts in the shape that module writes.

    A field is None until the run fills it. Fields listed in `absent` and still unset are left out
    of the file: those only some runs have (a diverged run's step), and, for a record read from
    disk, those it did not hold, so an older record reads back unchanged."""

    schema: int = SCHEMA_VERSION
    status: str  # running, ok, diverged, preempted, error, oom
    message: Optional[str] = None
    run_dir: Optional[str] = None  # where the run wrote it; readers find a run by the folder its result.json is in
    choices: dict[str, str]  # the config group options: model, precision, scale, data, schedule
    variant: Optional[str] = None  # the computational overrides beyond the choices and the seed (identity.variant)
    seed: Optional[int] = None
    config: Optional[dict] = None  # the resolved config
    precision: Optional[dict] = None  # what the mode ran as: dtypes, master weights, autocast, CPU kernels
    scale_config: Optional[dict] = None
    optim: Optional[dict] = None
    distributed: Optional[dict] = None
    data: Optional[dict] = None  # the data source's description (sizes, vocabulary, loader workers)
    total_steps: Optional[int] = None
    steps: Optional[int] = None
    samples: Optional[int] = None
    epochs: Optional[float] = None
    primary_metric: Optional[str] = None
    higher_is_better: Optional[bool] = None
    metrics: dict = field(default_factory=dict)  # the last evaluation's, with its step
    evaluation: Optional[dict] = None  # how the metric is computed, or why it is not
    sample_grids: Optional[list] = None  # pictures a task draws at each evaluation (DCGAN's grid), by step
    final_train_loss: Optional[float] = None
    last_finite_train_loss: Optional[float] = None
    diverged_at_step: Optional[int] = None
    preempted_at_step: Optional[int] = None
    resumed_from_step: Optional[int] = None
    resumed_at: Optional[str] = None
    checkpoint_step: Optional[int] = None  # the step of the last checkpoint written: where a relaunch resumes
    # The launches that trained it: steps [from_step, to_step) under a schedule of total_steps, by the
    # code in `git`. More than one when it resumed; to_step of a launch that died is its last checkpoint.
    segments: Optional[list] = None
    nondeterministic_ops: Optional[list] = None  # deterministic=true: ops torch ran without a deterministic kernel
    throughput: Optional[dict] = None  # throughput.py
    time_to_result: Optional[dict] = None  # time_to_result.py
    memory: Optional[dict] = None
    loss_scale: Optional[dict] = None  # per network: the scaler's summary
    compile: Optional[dict] = None  # compile.backend: what torch.compile made of the networks
    flops: Optional[dict] = None  # schedule.count_flops: model FLOPs of one step (flops.py)
    mfu: Optional[dict] = None
    grad_stats: Optional[dict] = None  # stats.grad_hist: gradient histograms against FP16's range
    overflow_origins: Optional[dict] = None  # stats.trace_overflow: which module overflowed first on each skipped step
    environment: Optional[dict] = None
    git: Optional[dict] = None
    started_at: Optional[str] = None
    finished_at: Optional[str] = None
    duration_s: Optional[float] = None
    extra: dict = field(default_factory=dict)  # keys of a newer or older version this one does not know
    absent: frozenset = field(
        default=frozenset(
            {
                "sample_grids",
                "epochs",
                "diverged_at_step",
                "preempted_at_step",
                "resumed_from_step",
                "resumed_at",
                "checkpoint_step",
                "segments",
                "time_to_result",
            }
        ),
        repr=False,
    )

    @classmethod
    def from_dict(cls, data: dict, source: str = "record") -> RunRecord:
        if not isinstance(data, dict):
            raise RecordError(f"{source}: not a JSON object")
        schema = data.get("schema", SCHEMA_VERSION)
        if not isinstance(schema, int) or schema > SCHEMA_VERSION:
            raise RecordError(f"{source}: record schema {schema!r}; this mpt reads schema {SCHEMA_VERSION} and older (update mpt to read it)")
        names = [f.name for f in fields(cls) if f.name not in ("extra", "absent")]
        missing = [k for k in ("status", "choices") if k not in data]
        if missing:
            raise RecordError(f"{source}: no {', '.join(missing)}: not a result record")
        known = {k: v for k, v in data.items() if k in names}
        return cls(**known, extra={k: v for k, v in data.items() if k not in names}, absent=frozenset(n for n in names if n not in data))

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise RecordError(f"{path}: not a readable result record ({e})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def partial(cls, status: str, message: str, run_dir: str, choices: dict, seed: int, config: dict) -> RunRecord:
        """The record of a run that failed while being set up: what it was asked to run, and why it did not."""
        kept = {"schema", "status", "message", "run_dir", "choices", "seed", "config"}
        absent = frozenset(f.name for f in fields(cls) if f.name not in kept)
        return cls(status=status, message=message, run_dir=run_dir, choices=choices, seed=seed, config=config, absent=absent)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            if f.name in ("extra", "absent"):
                continue
            value = getattr(self, f.name)
            if f.name in self.absent and value == (f.default_factory() if callable(f.default_factory) else f.default):
                continue
            out[f.name] = value
        return {**out, **self.extra}

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.to_dict())


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
        # results/ left out, as device_carry.sh's hash leaves it: a sweep rewriting its tracked
        # multirun.yaml, or records added beside the code, change nothing a run computes
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)results")
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed)}
    except (OSError, subprocess.SubprocessError):
        pass
    # A copy of the tree without .git (a remote GPU machine): scripts/device_carry.sh read the
    # checkout's state when it packed the tree, and device_session.sh passes it on.
    if os.environ.get("MPT_GIT_COMMIT"):
        return {"commit": os.environ["MPT_GIT_COMMIT"], "dirty": os.environ.get("MPT_GIT_DIRTY") == "1", "source": "MPT_GIT_COMMIT"}
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
