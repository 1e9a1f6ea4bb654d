"""Preemption: SLURM's SIGTERM, or submitit's preemption signal (SIGUSR2 unless
SUBMITIT_PREEMPT_SIGNAL says otherwise), turned into a clean stop at a step boundary.

The handler only notes the signal. The loop finishes its step, writes a checkpoint and a record
with status `preempted`, and the command line then hands the signal to whoever handled it before
(submitit's handler calls hydra-submitit-launcher's `checkpoint` hook, which requeues the job) or
exits with 128 + the signal's number. A relaunch resumes from the checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import NoReturn

_received: int | None = None
_previous: dict[int, object] = {}


def signals() -> list[signal.Signals]:
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return sorted({signal.SIGTERM, getattr(signal, "SIG" + name, signal.SIGUSR2)})


def _note(signum: int, frame) -> None:
    global _received
    if _received is None:
        _received = signum
        # os.write: a print could interrupt a print of the main thread's
        os.write(2, f"mpt-run: {signal.Signals(signum).name} received: stopping after this step, with a checkpoint\n".encode())


def install() -> None:
    """Catch the preemption signals (once per process; signals reach only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signals():
        if sig not in _previous:
            _previous[sig] = signal.signal(sig, _note)


def requested() -> int | None:
    """The signal received since install(), if any."""
    return _received


def hand_over() -> NoReturn:
    """After the record is written: what the signal would have done without us."""
    signum = _received
    assert signum is not None
    previous = _previous.get(signum)
    uninstall()
    if callable(previous):  # submitit's: requeues the job through the launcher's checkpoint hook, then exits
        previous(signum, None)
    sys.exit(128 + signum)


def uninstall() -> None:
    global _received
    for sig, handler in _previous.items():
        signal.signal(sig, handler)
    _previous.clear()
    _received = None


class Preempted(Exception):
    """Raised by the loop at the step boundary after a preemption signal, its checkpoint written."""

    def __init__(self, signum: int, step: int, checkpointed: bool):
        name = signal.Signals(signum).name
        kept = "a checkpoint at that step; run the same command again to resume" if checkpointed else "no checkpoint (checkpoint=false): a relaunch starts over"
        super().__init__(f"{name} at step {step}: stopped after it, with {kept}")
        self.step = step
