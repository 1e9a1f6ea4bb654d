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

from .throughput import synchronize


class TimeToResult:
    def __init__(self, device: torch.device):
        self.device = device
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

    def leave_out(self, seconds: float) -> None:
        """Seconds already measured with the device synchronized (a sampled step's)."""
        if self._started is not None:
            self.left_out += seconds

    def state_dict(self) -> dict:
        now = time.perf_counter()
        running = 0.0 if self._started is None else now - self._started - (0.0 if self._out_since is None else now - self._out_since)
        return {"seconds": self.seconds + running, "left_out": self.left_out, "final_evaluation": self.final_evaluation}

    def load_state_dict(self, state: dict, extended: bool = False) -> None:
        """`extended`: the run resumes from its old end under a longer schedule, so the final
        evaluation it counted then was one along the way."""
        self.seconds, self.left_out = float(state["seconds"]), float(state["left_out"])
        if extended and state.get("final_evaluation") is not None:
            self.left_out += float(state["final_evaluation"])

    def summary(self, finished: bool = True) -> dict:
        """`seconds`: training's, the final evaluation's included; None until that evaluation ran,
        and for a run that did not finish `ok` (`finished` false): it reached no result."""
        done = finished and self.final_evaluation is not None
        return {
            "seconds": self.seconds - self.left_out if done else None,
            "final_evaluation_s": self.final_evaluation,
            "left_out_s": self.left_out,
        }
