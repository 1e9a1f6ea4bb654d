"""Peak memory: the run's, and its steady state's.

The peak is `torch.cuda.max_memory_allocated` on CUDA and, on a CPU, the peak resident set size
(Linux's resettable VmHWM, so the runs of a sweep, which share one process, do not inherit each
other's; elsewhere the process-lifetime peak, labelled so). The steady-state peak is the peak
from the end of the throughput warm-up on: it leaves out what only the first steps allocate, such
as cuDNN's benchmark trying algorithms with their workspaces. One counter gives both: when the
warm-up ends, the peak so far is read and the counter reset.
"""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

from ... import host_memory
from ...distributed import Dist
from . import Instrument, RunEnd, StepDone

LIFETIME = "cpu_process_lifetime_peak_rss"  # a peak that cannot be reset, so has no steady part


def _high_water_mark_kib() -> int | None:
    """Linux's resettable peak resident set size of this process (VmHWM)."""
    try:
        match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def reset_peak_memory(device: torch.device) -> None:
    """Start a run's peak from now: the runs of a sweep share one process."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    host_memory.release()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_bytes": torch.cuda.max_memory_allocated(device), "kind": "cuda_max_memory_allocated"}
    hwm = _high_water_mark_kib()
    if hwm is not None:
        return {"peak_bytes": hwm * 1024, "kind": "cpu_peak_rss"}
    # Elsewhere only the process-lifetime peak exists, which runs earlier in a sweep inflate.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_bytes": rss if sys.platform == "darwin" else rss * 1024, "kind": "cpu_process_lifetime_peak_rss"}


class MemoryPeaks(Instrument):
    """One run's peaks, over its processes (a resumed run carries its earlier ones). The steady
    state begins where throughput's does: after `warmup` steps of this process, and at least one."""

    key = field = "memory"

    def __init__(self, device: torch.device, warmup: int = 0, dist: Dist = Dist()):
        self.device, self.warmup, self.dist = device, max(warmup, 1), dist
        self.steps_seen = 0
        self.warmup_peak: Optional[int] = None  # this process's peak through its warm-up, once over
        self.before = {"peak_bytes": 0, "steady_peak_bytes": 0}  # the run's, before this process

    def start(self) -> None:
        reset_peak_memory(self.device)

    def steady_from_now(self) -> None:
        """The warm-up is over: its peak is kept, and the counter starts again."""
        if self.warmup_peak is None:
            self.warmup_peak = peak_memory(self.device)["peak_bytes"]
            reset_peak_memory(self.device)

    def after_step(self, done: StepDone) -> None:
        self.steps_seen += 1
        if self.steps_seen >= self.warmup:
            self.steady_from_now()

    def summary(self, end: RunEnd = RunEnd(finished=True, together=True)) -> dict:
        """The peaks; under torchrun, once every process got here, the largest process's."""
        out = self._peaks()
        for key in ("peak_bytes", "steady_peak_bytes"):
            if end.together and key in out:
                out[key] = int(self.dist.largest(out[key], self.device))
        if self.dist.enabled:
            out["over"] = f"the largest of {self.dist.world_size} processes"
        return out

    def _peaks(self) -> dict:
        """`peak_bytes`, its `kind`, and `steady_peak_bytes` where a steady state was reached."""
        now = peak_memory(self.device)
        out = {**now, "peak_bytes": max(now["peak_bytes"], self.warmup_peak or 0, self.before["peak_bytes"])}
        steady = max(now["peak_bytes"] if self.warmup_peak is not None else 0, self.before["steady_peak_bytes"])
        if steady and now["kind"] != LIFETIME:
            out["steady_peak_bytes"] = steady
        return out

    def state_dict(self) -> dict:
        """The largest process's (collective: every process saves)."""
        s = self._peaks()
        return {k: int(self.dist.largest(s.get(k, 0), self.device)) for k in ("peak_bytes", "steady_peak_bytes")}

    def load_state_dict(self, state: dict) -> None:
        self.before = {
            "peak_bytes": int(state["peak_bytes"]),
            "steady_peak_bytes": int(state.get("steady_peak_bytes", 0)),
        }
