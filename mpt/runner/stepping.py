"""One training step: each loss term's backward and update through its network's precision engine,
and an overflowed term run again from the step's start for the overflow tracer."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from typing import Any, Callable, ContextManager

import torch

from ..models import Task
from ..precision.engine import PrecisionEngine
from ..precision.scaler import Diverged
from . import checkpoint, determinism
from .instruments.grad_stats import GradStatsCollector
from .instruments.overflow_trace import OverflowTracer

log = logging.getLogger("mpt")


class Stepper:
    """Takes the run's steps. `forward_context` is entered around every forward (autocast, where the
    mode has one); the backward runs outside it."""

    def __init__(
        self,
        task: Task,
        engines: dict[str, PrecisionEngine],
        grad_stats: GradStatsCollector,
        tracer: OverflowTracer,
        forward_context: Callable[[], ContextManager[object]],
        device: torch.device,
        deterministic: bool,
    ):
        self.task, self.engines, self.grad_stats, self.tracer = task, engines, grad_stats, tracer
        self.forward_context = forward_context
        self.device, self.deterministic = device, deterministic
        self.on_device = any(e.on_device for e in engines.values())  # a scale kept on the device (resident_scale.py)
        self.steps_before: dict[str, int] = {}  # each engine's steps_taken as the current step began

    def step(self, step: int, batch: Any, epoch: int) -> list[dict]:
        """The step's rows, one per loss term (a GAN's two networks: two)."""
        rows: list[dict] = []
        if self.deterministic and self.device.type == "cuda":
            determinism.reseed_cudnn_dropout(self.device)
        # Where a traced re-run starts. A scale kept on the device tells the host of an overflow only
        # at the next read-back, too late to run the step again: there, only sampled steps (which
        # read back at once) are traced.
        traced = self.tracer.enabled and (not self.on_device or self.grad_stats.sampling(step))
        rng = checkpoint.rng_state() if traced else None
        self.steps_before = {g: e.steps_taken for g, e in self.engines.items()}  # which engines step during it
        losses = self.task.train_losses(batch)
        for index in itertools.count():
            with self.forward_context():  # only the forward runs under autocast; backward is outside
                term = next(losses, None)
            if term is None:
                return rows
            engine = self.engines[term.group]
            row: dict[str, Any]
            row = {"kind": "train", "step": step, "group": term.group, **engine.logged()}
            with self.grad_stats.backward(term.group, functools.partial(_backward_scale, engine)):
                engine.backward(term.loss)
            try:
                with self.grad_stats.update(term.group, engine):
                    applied = engine.step(at=step, know=rng is not None)
                if applied:
                    engine.average(step + 1, epoch)
            except Diverged as e:  # an overflow at the scaler's smallest scale: trace it too
                # (a read-back within the step may find an earlier step's: that one is past tracing)
                if rng is not None and engine.scaler.checks_overflow and e.step in (None, step):
                    self._trace_overflow(step, batch, index, term.group, float(row["scale"]), rng)
                raise
            if applied is False and rng is not None:
                self._trace_overflow(step, batch, index, term.group, float(row["scale"]), rng)
            row["overflow"] = engine.logged_overflow(applied)
            row["loss"] = term.loss.detach()
            row.update({k: v.detach() for k, v in term.parts.items()})
            rows.append(row)
        return rows  # unreachable: the loop ends when the terms do

    def _trace_overflow(self, step: int, batch: Any, index: int, group: str, scale: float, rng: dict) -> None:
        """Runs the step's term `index` again from the step's start, as it ran, for the tracer."""
        t0 = time.perf_counter()
        engine = self.engines[group]

        def rerun(on_loss) -> None:
            checkpoint.set_rng_state(rng)
            losses = self.task.train_losses(batch)
            with self.forward_context():
                for _ in range(index + 1):  # an earlier network's term (a GAN's) only as far as its forward
                    term = next(losses)
            on_loss(term.loss)
            engine.backward(term.loss, scale=scale)

        with self.grad_stats.paused(), self.tracer.restoring(), contextlib.ExitStack() as replaying:
            for g, e in self.engines.items():  # a GAN's traced term runs the other network's forward too
                replaying.enter_context(e.replaying(stepped=e.steps_taken > self.steps_before[g]))
            found = self.tracer.trace(step, group, scale, rerun)
        engine.zero_grad()
        self.tracer.spent(time.perf_counter() - t0)
        log.info(
            "step %d: %s overflowed at loss scale %g and was skipped; first non-finite: %s (%s)",
            step,
            group,
            scale,
            found["module"],
            found["role"],
        )


def _backward_scale(engine: PrecisionEngine) -> float:
    return engine.backward_scale
