"""Preemption: SLURM's SIGTERM, submitit's preemption signal (SIGUSR2 unless
SUBMITIT_PREEMPT_SIGNAL says otherwise) or Ctrl-C's SIGINT, turned into a clean stop at a step boundary.

While a run trains (`catching()`), the handler only notes the signal: the loop finishes its step,
writes a checkpoint and a record with status `preempted`, and the command line then hands the
signal to whoever handled it before (submitit's handler calls hydra-submitit-launcher's
`checkpoint` hook, which requeues the job) or exits with 128 + the signal's number. A second signal
of the same kind does at once what it would have done without us, and outside training (setting a run up, between
the runs of a sweep) the signals keep their usual effect: there is no step to finish there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, Iterator, NoReturn

_received: list[int] = []
_previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}


def submitit_signal() -> signal.Signals:
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), signal.SIGUSR2)


def signals() -> list[signal.Signals]:
    # SIGINT (Ctrl-C) as SIGTERM: the steps since the last checkpoint are kept, not lost to a traceback.
    return sorted({signal.SIGINT, signal.SIGTERM, submitit_signal()})


def _restore() -> None:
    for sig, handler in _previous.items():
        # None: a handler installed outside Python, which cannot be put back from here
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _note(signum: int, frame) -> None:
    if signum in _received:  # asked twice: no more waiting for the step
        _restore()
        previous = _previous.get(signum)
        if callable(previous):
            previous(signum, frame)
            return
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)
    again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
    message = f"mpt-run: {signal.Signals(signum).name} received: stopping after this step, with a checkpoint{again}\n"
    # os.write: a print could interrupt a print of the main thread's
    os.write(2, message.encode())


@contextlib.contextmanager
def catching() -> Iterator[None]:
    """Note the preemption signals while the block runs (signals reach only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    for sig in signals():
        # An ignored signal stays ignored: a job started in the background of a script inherits an
        # ignored SIGINT, and its parent's Ctrl-C is not meant for it.
        if signal.getsignal(sig) is not signal.SIG_IGN:
            _previous[sig] = signal.signal(sig, _note)
    try:
        yield
    finally:
        _restore()


def requested() -> int | None:
    """The signal to hand over: submitit's if it came (its handler requeues), else the first one."""
    if not _received:
        return None
    return submitit_signal() if submitit_signal() in _received else _received[0]


def hand_over(default: int = signal.SIGTERM) -> NoReturn:
    """After the record is written: what the signal would have done without us. `default`: the
    signal to act on where this process got none (a torchrun rank whose peer got it)."""
    signum = requested() or default
    previous = _previous.get(signum)
    reset()
    # submitit's: requeues the job through the launcher's checkpoint hook, then exits. Python's own
    # SIGINT handler would only raise KeyboardInterrupt, a traceback after a clean stop.
    if callable(previous) and previous is not signal.default_int_handler:
        previous(signum, None)
    sys.exit(128 + signum)


def reset() -> None:
    _received.clear()
    _previous.clear()


class Preempted(Exception):
    """Raised by the loop at the step boundary after a preemption signal, its checkpoint written."""

    def __init__(self, signum: int, step: int, checkpointed: bool):
        name = signal.Signals(signum).name
        kept = (
            "a checkpoint at that step; run the same command again to resume"
            if checkpointed
            else "no checkpoint (checkpoint=false, or a smoke run): a relaunch starts over"
        )
        super().__init__(f"{name} at step {step}: stopped after it, with {kept}")
        self.step = step
