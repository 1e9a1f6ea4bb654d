"""The run's schedule in steps, and its precision engines: one per network of the task."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ..config import as_plain
from ..distributed import Dist
from ..models import Task
from ..precision.engine import PrecisionEngine
from ..precision.scaler import build_scaler


@dataclass(frozen=True)
class Plan:
    """A schedule counted in steps: its length, its learning-rate milestones and its evaluations."""

    total_steps: int
    milestones: list[int]
    eval_every: int

    @classmethod
    def of(cls, s: DictConfig, per_epoch: int) -> Plan:
        """`s`: the schedule, in steps or in epochs of `per_epoch` steps."""
        total = int(s.steps) if s.steps is not None else max(1, math.ceil(s.epochs * per_epoch))
        to_steps = (lambda x: int(x)) if s.steps is not None else (lambda x: int(round(x * per_epoch)))
        every = s.eval_every if s.eval_every is not None else (per_epoch if s.epochs is not None else total)
        return cls(total, [to_steps(m) for m in s.lr_milestones], every)


def build_engines(
    cfg: DictConfig, task: Task, plan: Plan, device: torch.device, dist: Dist, channels_last: bool
) -> dict[str, PrecisionEngine]:
    return {
        name: PrecisionEngine(
            net,
            cfg,
            build_scaler(cfg),
            plan.milestones,
            device,
            reduce_max=dist.reduce_max,
            clipped=task.clipped_parameters(name),
            channels_last=channels_last,
            total_steps=plan.total_steps,
        )
        for name, net in task.networks().items()
    }


def products_record(cfg: DictConfig, engines: dict[str, PrecisionEngine]) -> dict | None:
    """The FP8 or MX recipe of the products, and how many layers' products ran on each arithmetic path."""
    if cfg.precision.products.forward is None:
        return None
    paths = collections.Counter(path for e in engines.values() if e.products for path in e.products.paths().values())
    return {**as_plain(cfg.precision.products), "paths": dict(paths)}
