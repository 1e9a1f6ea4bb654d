"""Throughput: samples per second in steady state, the median over synchronized windows.

Throughput is samples per second in steady state: the first `warmup` steps are excluded, the
device is synchronized at the edges of each window of `window` steps, and the figure is the median
over windows. Two figures are kept:
- `pipeline`: samples / window wall time, data loading included;
- `compute`: samples / the time the steps themselves took, between each batch in hand and the end
  of its step. On a CPU that is the window's wall time less the time the loop waited for its
  batches. On CUDA the host runs ahead of the device and blocks wherever the launch queue is full,
  often in the next batch's fetch, so its waits say nothing about data: there each step's span is
  timed on the device with events recorded when its batch is in hand and when it ends, and idle
  gaps between steps (the device waiting for a batch) are left out.
A window that an evaluation interrupts is discarded, and the step after it reopens the window
without being counted (so is the last warm-up step: at least one step is always excluded). A step
that did extra work (a sampled step of gradient statistics) is left out of its window: its
synchronized wall time is subtracted and its samples are not counted.
"""

from __future__ import annotations

import statistics
import time

import torch

from ...distributed import Dist
from . import Instrument, RunEnd, StepDone


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ThroughputMeter(Instrument):
    key = field = "throughput"

    def __init__(self, device: torch.device, warmup: int, window: int, unit: str, dist: Dist = Dist()):
        self.device, self.warmup, self.window, self.unit, self.dist = device, warmup, window, unit, dist
        self.pipeline: list[float] = []
        self.compute: list[float] = []
        self.steps_seen = 0
        self._open = False
        self._events = device.type == "cuda"
        self._begin: torch.cuda.Event | None = None

    def _start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()
        self._samples = 0
        self._wait = 0.0
        self._excluded = 0.0
        self._steps = 0
        self._spans: list[tuple] = []
        self._open = True

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the run's device, whichever is current
        return event

    @property
    def warmed_up(self) -> bool:
        """Whether this process's warm-up steps are behind it (the first window opens as the last ends)."""
        return self.steps_seen >= max(self.warmup, 1)

    def batch_ready(self) -> None:
        """Call when the step's batch is in hand, before the step runs."""
        if self._events:
            self._begin = self._event()

    def step(self, samples: int, wait_s: float, excluded_s: float | None = None, untimed_s: float = 0.0) -> None:
        """Call after each training step with its sample count and the time spent waiting for its
        batch; `excluded_s`: the step's own synchronized wall time, batch wait included, when it is
        to be left out of throughput; `untimed_s`: time within a step that counts that is not
        training's (an overflowing step run again to trace it)."""
        self.steps_seen += 1
        begin, self._begin = self._begin, None
        if self._events and begin is None:
            raise RuntimeError(
                "ThroughputMeter.step on CUDA without batch_ready() before it: the step's device time has no start"
            )
        if self.steps_seen < self.warmup:
            return
        if not self._open:
            self._start()  # the window opens at the end of the last warm-up step
            return
        if excluded_s is not None:
            self._excluded += excluded_s
            return
        self._excluded += untimed_s
        self._samples += samples
        self._wait += wait_s
        self._steps += 1
        if self._events:
            self._spans.append((begin, self._event(), untimed_s))
        if self._steps == self.window:
            synchronize(self.device)
            elapsed = time.perf_counter() - self._t0 - self._excluded
            self.pipeline.append(self._samples / elapsed)
            if self._events:
                # untimed_s is host time (a traced step's rerun, which synchronizes): near enough
                # the device's for it, and a span never counts below zero.
                busy = sum(max(b.elapsed_time(e) / 1000 - untimed, 0.0) for b, e, untimed in self._spans)
            else:
                busy = elapsed - self._wait
            self.compute.append(self._samples / max(busy, 1e-12))
            self._start()

    def after_step(self, done: StepDone) -> None:
        if done.sampled and done.sampled_s is None:
            self.interrupt()  # a sampled step that was not timed: its window cannot be corrected
        # A sampled step's hooks are not training's work: the step is left out (its timed seconds
        # include any trace). Elsewhere only the time spent running an overflowing step again to
        # trace it is.
        excluded = None if done.sampled_s is None else done.sampled_s + done.wait_s
        self.step(done.samples, done.wait_s, excluded_s=excluded, untimed_s=done.traced_s)

    def state_dict(self) -> dict:
        return {"pipeline": list(self.pipeline), "compute": list(self.compute)}

    def load_state_dict(self, state: dict) -> None:
        """Windows timed before a checkpoint count; the resumed process warms up again."""
        self.pipeline, self.compute = list(state["pipeline"]), list(state["compute"])

    def interrupt(self) -> None:
        """An evaluation or a checkpoint ran: the open window no longer times training alone."""
        self._open = False

    def summary(self, end: RunEnd = RunEnd(finished=True, together=True)) -> dict:
        """The medians; under torchrun, once every process got here, the whole job's (summed)."""
        out: dict = {
            "unit": f"{self.unit}/s",
            "windows": len(self.pipeline),
            "window_steps": self.window,
            "warmup_steps": self.warmup,
            "method": "steady state, warm-up excluded, device synchronized at window edges, median over windows",
            "compute_method": "device time per step (CUDA events)"
            if self._events
            else "wall time less the waits for batches",
        }
        if not self.pipeline:
            out.update(pipeline=None, compute=None, note="the run had no complete timing window after warm-up")
        else:
            out.update(pipeline=statistics.median(self.pipeline), compute=statistics.median(self.compute))
        return self._over_processes(out) if end.together and self.dist.enabled else out

    def _over_processes(self, out: dict) -> dict:
        for key in ("pipeline", "compute"):
            if out.get(key) is not None:
                out[f"{key}_per_process"] = out[key]
                out[key] = self.dist.total(out[key], self.device)
        out["processes"] = self.dist.world_size
        out["method"] += f"; summed over {self.dist.world_size} processes"
        return out
