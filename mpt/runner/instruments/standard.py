"""Every run's own instruments, built from its config, in the order a step enters them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ...distributed import Dist
from ...precision.engine import PrecisionEngine
from . import Instrument, StepDone
from .flops import FlopCount
from .grad_stats import GradStatsCollector
from .memory import MemoryPeaks
from .overflow_trace import OverflowTracer
from .throughput import ThroughputMeter
from .time_to_result import TimeToResult


@dataclass
class Standard:
    grad_stats: GradStatsCollector
    flops: FlopCount
    tracer: OverflowTracer
    meter: ThroughputMeter
    peaks: MemoryPeaks
    clock: TimeToResult

    def all(self) -> list[Instrument]:
        """Entered around a step in this order: the statistics' timing holds the rest."""
        return [self.grad_stats, self.flops, self.tracer, self.meter, self.peaks, self.clock]

    def step_done(self, step: int, samples: int, wait_s: float) -> StepDone:
        """The facts of the step just taken: what the statistics and the tracer made of it."""
        sampled = self.grad_stats.current
        return StepDone(
            step, samples, wait_s, sampled["sampled"], sampled["seconds"], sampled["overhead"], self.tracer.step_seconds
        )


def build(
    cfg: DictConfig,
    engines: dict[str, PrecisionEngine],
    device: torch.device,
    dist: Dist,
    unit: str,
    total_steps: int | None = None,
) -> Standard:
    """`unit`: what the run's throughput counts (its task's samples); `total_steps`: the run's length."""
    s = cfg.schedule
    networks = {name: e.model for name, e in engines.items()}
    # Not under torchrun: a re-run's backward would enter data parallelism's collectives alone;
    # nor for compiled networks, whose leaves run inside their graphs, out of the hooks' reach.
    tracing = cfg.stats.trace_overflow and not dist.enabled and cfg.compile.backend is None
    tracing = tracing and any(e.scaler.checks_overflow for e in engines.values())
    on_device = any(e.on_device for e in engines.values())  # a scale kept on the device (resident_scale.py)
    meter = ThroughputMeter(device, s.throughput_warmup, s.throughput_window, unit, dist)
    return Standard(
        grad_stats=GradStatsCollector(cfg.stats, networks, device, s.throughput_warmup, total_steps),
        flops=FlopCount(list(networks.values()), s.count_flops, meter.unit),
        tracer=OverflowTracer(networks, tracing, sampled_only=on_device),
        meter=meter,
        peaks=MemoryPeaks(device, s.throughput_warmup, dist),
        clock=TimeToResult(device),
    )
