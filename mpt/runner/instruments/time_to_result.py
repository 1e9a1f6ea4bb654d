"""Time to result: how long training took to reach its final metric.

Jordan (2024) times airbench the way a reader of a leaderboard wants it: from the first training
step to the end of the final evaluation, the device synchronized at each edge, the evaluations made
along the way for the log left out. mpt times every run so, and leaves out the other work a run does
besides training: checkpoints, and the statistics steps and overflow traces (a sampled step is left
out whole, as throughput leaves it out). Building the run (decoding data, initialization) comes
before the first step and is not counted. A resumed run adds each launch's time, its warm-up again
included, as the time it really took."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from . import Instrument, RunEnd, StepDone
from .throughput import synchronize


class TimeToResult(Instrument):
    key = field = "time_to_result"

    def __init__(self, device: torch.device):
        self.device = device
        self._resumed_final: float | None = None  # the final evaluation a checkpoint counted
        self.seconds = 0.0  # earlier launches' and this one's closed spans
        self.left_out = 0.0
        self.final_evaluation: float | None = None
        self._started: float | None = None
        self._out_since: float | None = None  # inside leaving_out(): a checkpoint saved there leaves its span out

    def start(self) -> None:
        """Call as the first step of this launch begins."""
        if self._started is None:
            synchronize(self.device)
            self._started = time.perf_counter()

    def stop(self) -> None:
        """Call when the run ends, whichever way: the clock closes this launch's span."""
        if self._started is not None:
            synchronize(self.device)
            self.seconds += time.perf_counter() - self._started
            self._started = None

    @contextlib.contextmanager
    def leaving_out(self) -> Iterator[None]:
        """Work inside is not training's (an evaluation before the last, a checkpoint)."""
        synchronize(self.device)
        t0 = self._out_since = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self._out_since = None
            self.leave_out(time.perf_counter() - t0)

    @contextlib.contextmanager
    def final(self) -> Iterator[None]:
        """The final evaluation: counted, and its own share noted once it has finished (one that
        failed leaves the run without a result, so without a time to it)."""
        synchronize(self.device)
        t0 = time.perf_counter()
        yield
        synchronize(self.device)
        self.final_evaluation = time.perf_counter() - t0

    def after_step(self, done: StepDone) -> None:
        # a sampled step's own training counts: only what its statistics added to a plain step
        self.leave_out(done.traced_s if done.overhead_s is None else done.overhead_s)
        if self._resumed_final is not None:  # a longer schedule trains on: that evaluation was along the way
            self.left_out += self._resumed_final
            self._resumed_final = None

    def leave_out(self, seconds: float) -> None:
        """Seconds already measured with the device synchronized (a sampled step's)."""
        if self._started is not None:
            self.left_out += seconds

    def state_dict(self) -> dict:
        now = time.perf_counter()
        running = (
            0.0
            if self._started is None
            else now - self._started - (0.0 if self._out_since is None else now - self._out_since)
        )
        return {"seconds": self.seconds + running, "left_out": self.left_out, "final_evaluation": self.final_evaluation}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint written at the run's end counted its final evaluation. If a longer schedule
        resumes it, that evaluation was one along the way: it is left out once the next step is taken."""
        self.seconds, self.left_out = float(state["seconds"]), float(state["left_out"])
        self._resumed_final = None if state.get("final_evaluation") is None else float(state["final_evaluation"])

    def summary(self, end: RunEnd = RunEnd(finished=True, together=True)) -> dict:
        """`seconds`: training's, the final evaluation's included; None until that evaluation ran,
        and for a run that did not finish `ok`: it reached no result."""
        done = end.finished and self.final_evaluation is not None
        return {
            "seconds": self.seconds - self.left_out if done else None,
            "final_evaluation_s": self.final_evaluation,
            "left_out_s": self.left_out,
        }
