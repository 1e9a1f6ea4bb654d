"""A run's evaluations: the validation split at each one, the held-out test split too at the last."""

from __future__ import annotations

from typing import Callable, ContextManager

from ..datasets import DataSource
from ..distributed import Dist
from ..models import Task
from ..precision.engine import PrecisionEngine
from . import data_parallel, outcomes


class Evaluation:
    """Scores the task's networks. `forward_context` is entered around every forward; `eval_batches`
    caps the validation batches (None: all of them)."""

    def __init__(
        self,
        task: Task,
        data: DataSource,
        engines: dict[str, PrecisionEngine],
        dist: Dist,
        forward_context: Callable[[], ContextManager[object]],
        eval_batches: int | None,
    ):
        self.task, self.data, self.engines, self.dist = task, data, engines, dist
        self.forward_context, self.eval_batches = forward_context, eval_batches

    def __call__(self, step: int, final: bool) -> dict[str, float]:
        """The metrics after `step` steps (`final`: the run's last, which scores the test split too)."""
        # Weights are checked here, off the timed path: between evaluations a non-finite weight
        # shows up as a non-finite loss at the next step anyway.
        outcomes.check_weights(self.engines, self.dist, step - 1)
        if self.dist.enabled:
            data_parallel.before_evaluation(self.task, self.engines, self.dist)
        # Each rank scores its part of the batches; the task reduces its sums (or gathers its outputs)
        # over the ranks, so every rank ends with the whole set's metrics.
        batches = self.data.val(self.eval_batches or None)
        metrics = self.task.evaluate(batches, self.forward_context, final=final, ranks=self.dist)
        test = self.data.test() if final else None
        if test is not None:  # a held-out split the source was given, scored once, at the end, in full
            scored = self.task.evaluate(test, self.forward_context, final=True, ranks=self.dist)
            metrics.update({f"test_{k.removeprefix('val_')}": v for k, v in scored.items()})
        return metrics
