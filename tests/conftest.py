from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module
from torch import nn

from mpt.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
CPU = torch.device("cpu")

register_configs()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA device; none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


# The plumbing tests' model (CLI, record, report, sweeps, faults): a real torchvision classifier
# small enough that a run takes a fraction of a second on a CPU.
TINY = "model=mobilenet_v3_small"


def compose_cfg(*overrides: str):
    """The config these overrides compose to: a copy of its own, since a test or run may change it."""
    return copy.deepcopy(_composed(overrides))


# Composing is a third of a second (Hydra merges the schema and every group's file); the fast tier
# composes the same overrides about 80 times over. The files do not change during a session, and a
# composition that fails raises before anything is kept.
@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]):
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# The FP32 math flags a run sets (engine.set_fp32_math): precision=tf32 would leave TF32 on for later tests.
FP32_MATH = (
    [
        (torch.backends.cuda.matmul, "fp32_precision"),
        (torch.backends.cudnn.conv, "fp32_precision"),
        (torch.backends.cudnn.rnn, "fp32_precision"),
    ]
    if hasattr(torch.backends.cuda.matmul, "fp32_precision")
    else [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]
)


@contextlib.contextmanager
def process_settings_kept():
    """Settings a run makes process-wide are put back when the block ends."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    benchmark = torch.backends.cudnn.benchmark
    fp32_math = [getattr(obj, name) for obj, name in FP32_MATH]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.benchmark = benchmark
        for (obj, name), value in zip(FP32_MATH, fp32_math):
            setattr(obj, name, value)


@pytest.fixture
def in_process():
    """Build runs in this process; settings a run makes process-wide are put back afterwards."""
    with process_settings_kept():
        yield


def build_run(run_dir: Path, *overrides: str):
    """The Run `mpt-run` would build for these overrides, writing into `run_dir`."""
    from mpt.runner.train import Run
    from mpt.runner.validation import validate

    cfg = compose_cfg(*overrides)
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Run(cfg, run_dir)


def mpt_run(*args: str, cwd: Path, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real command line, in a subprocess (what a user types, minus the console-script shim)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mpt.runner.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def read_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def shared_data(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: CI must run with ../shared/data beside the checkout")
        pytest.skip(f"{path} not present")
    return path


def cifar_mini_run(*overrides: str) -> list[str]:
    """A tiny classifier's smoke run on ../shared/data/cifar10-mini (its test/ split for validation)."""
    return [
        TINY,
        "data=imagefolder",
        f"data.root={shared_data('cifar10-mini')}",
        "data.val_split=test",
        "data.num_workers=0",
        "schedule=smoke",
        *overrides,
    ]


class Vector(nn.Module):
    """A parameter vector; forward(x) = w * x, so loss = (forward(1) * G).sum() has gradient G."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


@pytest.fixture(autouse=True)
def event_files_named_in_opening_order(monkeypatch):
    """TensorBoard names an event file by the second it opened and a counter of this process, and its
    reader takes a folder's files in name order: two files a test opens within one second sort wrong
    once the counter passes a power of ten (".100" before ".99"), which puts a resumed run's events
    before the killed run's. Here each file opens in a second of its own, so names sort in opening
    order, as a killed run's and its relaunch's do, seconds apart."""
    try:
        from tensorboard.summary.writer import event_file_writer as writer
    except ImportError:
        return
    clock = itertools.count(int(time.time()))
    monkeypatch.setattr(writer, "time", SimpleNamespace(time=lambda: float(next(clock))))


def events(run_dir: Path):
    """A run folder's TensorBoard events, read by tensorboard's own reader (skips the test without tensorboard)."""
    reader = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = reader.EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc
