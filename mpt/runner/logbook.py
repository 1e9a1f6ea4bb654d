"""The per-step rows on their way to disk, and the divergence they show.

A step's row holds device tensors (its loss, its scale, its overflow flag), so logging never waits
for the device. Every `log_every` steps a flush brings them to the host in one sync and writes
them to metrics.jsonl, TensorBoard and the progress line. A scale kept on the device is read back
there too: the steps since the last flush replay on the host scaler, which is where a divergence
that scaling finds is raised.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import preemption
from ..distributed import Dist
from ..precision.engine import PrecisionEngine
from ..precision.scaler import Diverged
from .csv_log import CSVLog
from .instruments.grad_stats import GradStatsCollector
from .instruments.throughput import ThroughputMeter
from .outcomes import earliest
from .progress import Progress
from .record import MetricsLog, NullLog
from .tensorboard_log import NullBoard, RunAbout, TensorBoardLog

if TYPE_CHECKING:
    from .wandb_log import WandbLog

log = logging.getLogger("mpt")


class Logbook:
    def __init__(
        self,
        engines: dict[str, PrecisionEngine],
        dist: Dist,
        device: torch.device,
        meter: ThroughputMeter,
        grad_stats: GradStatsCollector,
    ):
        self.engines, self.dist, self.device, self.meter, self.grad_stats = engines, dist, device, meter, grad_stats
        self.pending: list[dict[str, Any]] = []  # per-step rows whose tensors are not yet on the host
        self.last_loss: float | None = None
        self.last_finite_loss: float | None = None
        self.peers_preempted = False  # under torchrun: a rank got a preemption signal (as of the last flush)
        # Rank 0 writes everything; the other ranks compute the same rows and drop them.
        self.metrics: MetricsLog | NullLog = NullLog()
        self.board: TensorBoardLog | CSVLog | WandbLog | NullBoard = NullBoard()
        self.progress: Progress | None = None  # shown while a run trains, not while a benchmark drives its steps

    def open(
        self,
        run_dir: Path,
        logger: str | None,
        resumed_at: int | None,
        metrics: dict | None,
        about: RunAbout | None,
        grids: list | None = None,
        wandb=None,
    ) -> None:
        """Rank 0's files: metrics.jsonl, its rows past `resumed_at` (the checkpoint's step) dropped, and
        TensorBoard's. The evaluation at a resumed checkpoint is written to the board again: it was
        purged with the steps past it."""
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", keep_before_step=resumed_at)
        if logger == "csv":
            self.board = CSVLog(run_dir, resumed_at, self.meter)
        elif logger == "wandb":
            from .wandb_log import WandbLog  # an optional extra: imported only where asked for

            self.board = WandbLog(run_dir, wandb, self.meter, about, resumed_at)
        elif logger == "tensorboard":
            per_process = self.dist.enabled
            self.board = TensorBoardLog(run_dir, resumed_at, self.meter, self.grad_stats, per_process, about)
        if resumed_at is not None and metrics is not None and metrics.get("step") == resumed_at:
            self.board.write([{"kind": "eval", **metrics}])
            for grid in grids or []:  # the sample grid of that evaluation, purged with it
                if grid["step"] == resumed_at:
                    self.board.image("samples", run_dir / grid["path"], resumed_at)

    def show_progress(self, label: str, total_steps: int, step: int) -> None:
        """The progress line, from `step` of `total_steps` (what a resumed run skipped so far counted)."""
        skipped = {name: e.scaler.summary()["skipped_steps"] for name, e in self.engines.items()}
        unit = self.meter.unit + ("/s per process" if self.dist.enabled else "/s")
        self.progress = Progress(label, total_steps, step, skipped, unit)

    def close(self) -> None:
        try:
            self.metrics.close()
        finally:
            self.board.close()  # never raises: a failing writer only warns
            if self.progress is not None:
                self.progress.close()

    def state_dict(self) -> dict:
        return {"last_loss": self.last_loss, "last_finite_loss": self.last_finite_loss}

    def load_state_dict(self, state: dict) -> None:
        self.last_loss, self.last_finite_loss = state["last_loss"], state["last_finite_loss"]

    def flush(self, step: int, check: bool = True, diverged_at: int | None = None) -> Diverged | None:
        """Bring the logged tensors to the host in one sync, write them, and watch for divergence.
        A scale kept on the device is read back here: a divergence it finds is raised (`check`) or
        returned, and the log stops before its step, as it stops before `diverged_at`."""
        rows, self.pending = self.pending, []
        slots = [(r, k) for r in rows for k, v in r.items() if isinstance(v, torch.Tensor)]
        flags = {(id(r), k) for r, k in slots if r[k].dtype == torch.bool}  # written back as booleans
        values = [r[k].double().reshape(()) for r, k in slots]  # exact for FP32 values and a float64 lr
        if self.dist.enabled:  # the preemption flag rides along: positive if any rank got a signal
            values.append(
                torch.tensor(float(preemption.requested() is not None), dtype=torch.float64, device=self.device)
            )
        if values:
            # Under torchrun, each value is the mean over ranks: the global batch's loss, and one
            # divergence decision for all of them.
            means = self.dist.reduce_mean(torch.stack(values)).tolist()
            if self.dist.enabled:
                self.peers_preempted = self.peers_preempted or means.pop() > 0
            for (r, k), value in zip(slots, means):
                r[k] = value > 0 if (id(r), k) in flags else value
        found = self.read_back()
        stops = [at for at in (diverged_at, found.step if found is not None else None) if at is not None]
        if stops:  # the host path logs nothing of the step that diverged, nor after it
            rows = [r for r in rows if r["step"] < min(stops)]
        self._write(rows, step, check and found is None)
        if found is not None and check:
            raise found
        return found

    def read_back(self) -> Diverged | None:
        """Every engine's steps since its last read-back, replayed on its host scaler (a scale kept
        on the device); the earliest divergence that found, if any."""
        found = None
        for engine in self.engines.values():
            try:
                engine.read_back()
            except Diverged as e:
                found = earliest(found, e)  # of two at one step, the first network's, as the host path raises it
        return found

    def read_back_quietly(self) -> None:
        """read_back on the way out of a failed or interrupted run: what it finds is only recorded."""
        try:
            self.read_back()
        except Exception:  # the run's own failure is the one to report
            log.exception("reading the loss scale back from the device failed")

    def write_eval(self, row: dict) -> None:
        self.metrics.write([row])
        self.board.write([row])

    def _write(self, rows: list[dict], step: int, check: bool) -> None:
        self.metrics.write(rows)
        self.board.write(rows)
        self.board.sync(step, self.meter, self.grad_stats)
        if self.progress is not None:
            self.progress.update(step, rows, self.meter.pipeline[-1] if self.meter.pipeline else None)
        for r in rows:
            self.last_loss = r["loss"]
            if math.isfinite(r["loss"]):
                self.last_finite_loss = r["loss"]
            elif check and not self.engines[r["group"]].scaler.checks_overflow:
                raise Diverged(f"non-finite loss {r['loss']} at step {r['step']} (scale=none)", step=r["step"])
