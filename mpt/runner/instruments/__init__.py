"""A run's instruments: what it measures besides training, each behind one protocol.

An instrument watches the run's steps and holds its own state. The run calls every instrument
the same way and names none of them for its lifecycle:
- `start()` as the run's steps begin (after any restore);
- `around_step(step)` around each training step;
- `after_step(done)` once the step is taken, with the step's facts (`StepDone`): a sampled step of
  the gradient statistics, or a step run again to trace an overflow, says so there;
- `stop()` when the steps end, whichever way;
- `state_dict()` / `load_state_dict()` under its `key` in a checkpoint;
- `summary(end)` into its `field` of the record.

A new statistic is one module here, a subclass of `Instrument`, and one line in the run's list.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar, ContextManager, Iterator


@dataclass(frozen=True)
class StepDone:
    """One training step's facts, as the run saw them."""

    step: int  # the step's index (0-based)
    samples: int  # this process's samples in it
    wait_s: float  # waiting for its batch
    sampled: bool  # a sampled step of the gradient statistics
    sampled_s: float | None  # a sampled step's synchronized wall time; None when not timed
    overhead_s: float | None  # what the sampling added to a plain step's time, where measured
    traced_s: float  # running an overflowing step again to trace it


@dataclass(frozen=True)
class RunEnd:
    """How the run ended, for the summaries."""

    finished: bool  # ended `ok`
    together: bool  # every process reached the end (the collectives may run)


class Instrument:
    """The protocol, each call a no-op until an instrument needs it."""

    key: ClassVar[str]  # its state's name in a checkpoint
    field: ClassVar[str]  # its summary's field in the record

    def start(self) -> None:
        pass

    def around_step(self, step: int) -> ContextManager[object]:
        return contextlib.nullcontext()

    def after_step(self, done: StepDone) -> None:
        pass

    def stop(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def summary(self, end: RunEnd) -> dict | None:
        return None


@contextlib.contextmanager
def around_step(instruments: list[Instrument], step: int) -> Iterator[None]:
    """Every instrument's around_step, entered in the list's order."""
    with contextlib.ExitStack() as stepping:
        for instrument in instruments:
            stepping.enter_context(instrument.around_step(step))
        yield
