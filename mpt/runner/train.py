"""The training loop. It knows the Task seam and the precision engine's two calls, nothing else."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import math
import random
import signal
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from omegaconf import DictConfig

from .. import preemption
from ..config import ConfigError, as_plain
from ..datasets import build_data
from ..datasets.fingerprint import fingerprint
from ..distributed import Dist, allreduce_in, from_env
from ..distributed import setup as setup_distributed
from ..models import build_task
from ..precision.engine import (
    PrecisionEngine,
    check_device_support,
    default_channels_last,
    forward_context,
    held_for_the_run,
    set_fp32_math,
    torch_dtype,
)
from ..precision.scaler import Diverged, build_scaler
from ..provenance import describe_code, now_iso
from . import checkpoint, determinism, identity
from .compiling import compile_networks, compile_summary
from .flops import counting_flops, flops_record, mfu
from .grad_collector import GradStatsCollector
from .memory import MemoryPeaks
from .overflow_trace import OverflowTracer
from .progress import Progress
from .record import MetricsLog, NullLog, RunRecord
from .tensorboard_log import NullBoard, TensorBoardLog, open_board
from .throughput import ThroughputMeter
from .time_to_result import TimeToResult

log = logging.getLogger("mpt")


def resolve_device(name: str, dist: Dist = Dist()) -> torch.device:
    """`dist`: under torchrun, the process's place: its GPU is cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and device.index is not None and dist.enabled:
        raise ConfigError(f"device={name}: under torchrun each process takes cuda:LOCAL_RANK; use device=cuda or auto")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", dist.local_rank)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name}: no CUDA device is available here (torch.cuda.is_available() is False); use device=cpu or auto")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={name}: expected auto, cpu, cuda or cuda:N")
    return device


def failure(e: BaseException, batch_size: int) -> tuple[str, str]:
    """A record's status and message for an exception: `oom` naming the batch size, else `error`."""
    text = str(e).strip()
    if "Original Traceback" in text:  # raised in a data-loader worker: the last line is the error itself
        text = text.splitlines()[-1]
    first = text.splitlines()[0] if text else ""
    # torch's CPU allocator raises a RuntimeError, not torch.OutOfMemoryError
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "DefaultCPUAllocator: can't allocate memory" in first:
        return "oom", f"out of memory at schedule.batch_size={batch_size}; try a smaller batch ({type(e).__name__}: {first})"
    return "error", first if "Original Traceback" in str(e) else f"{type(e).__name__}: {first}"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _non_finite(engine: PrecisionEngine) -> str:
    """Which of a network's tensors are not finite, named, for a divergence's message."""
    named = [
        *((n, "weight") for n, t in engine.model.named_parameters() if not torch.isfinite(t).all()),
        *((n, "buffer") for n, t in engine.model.named_buffers() if t.is_floating_point() and not torch.isfinite(t).all()),
    ]
    masters = sum(not torch.isfinite(m).all() for m in engine.master_weights())
    if not named and not masters:
        return "all finite on this process: another process's"
    parts = [f"{named[0][0]} ({named[0][1]})" + (f" and {len(named) - 1} more" if len(named) > 1 else "")] if named else []
    return "; ".join(parts + ([f"{masters} FP32 master weight{'s' * (masters != 1)}"] if masters else []))


class Run:
    """One training run: built from a validated config, writing into `run_dir`."""

    def __init__(self, cfg: DictConfig, run_dir: Path, variant: str = "", label: str | None = None):
        self.cfg = cfg
        self.variant = variant
        self.run_dir = run_dir
        self.label = label or run_dir.name  # what its progress line calls it
        self.progress: Progress | None = None  # shown while train() runs, not while a benchmark drives steps()
        self.dist = from_env()
        self.device = resolve_device(cfg.device, self.dist)
        check_device_support(cfg.precision, self.device)
        if cfg.schedule.batch_size % self.dist.world_size:
            raise ConfigError(f"schedule.batch_size={cfg.schedule.batch_size} is the global batch: it does not divide among {self.dist.world_size} processes")
        setup_distributed(self.dist, self.device)
        seed_everything(cfg.seed)
        if cfg.deterministic:
            determinism.enable()
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not cfg.deterministic
        self.fp32_math = set_fp32_math(cfg.precision.tf32)

        self._data_fingerprint: str | None = None  # of data.root, read once (by rank 0), when first needed
        # Before the data: a source that makes files in the run folder (a tokenizer) reuses them only
        # for a checkpoint it continues.
        saved = self._checkpoint_to_resume()
        self.data = build_data(cfg, self.device, workdir=run_dir, resuming=saved is not None, shard=self.dist)
        self.task = build_task(cfg, self.data.info, shard=self.dist)
        self.task.prepare(self.data)
        s = cfg.schedule
        per_epoch = self.data.steps_per_epoch
        self.total_steps = int(s.steps) if s.steps is not None else max(1, math.ceil(s.epochs * per_epoch))
        to_steps = (lambda x: int(x)) if s.steps is not None else (lambda x: int(round(x * per_epoch)))
        milestones = [to_steps(m) for m in s.lr_milestones]
        self.eval_every = s.eval_every if s.eval_every is not None else (per_epoch if s.epochs is not None else self.total_steps)

        self.channels_last = cfg.channels_last if cfg.channels_last is not None else default_channels_last(cfg.precision, self.device)
        self.engines = {
            name: PrecisionEngine(
                net,
                cfg,
                build_scaler(cfg),
                milestones,
                self.device,
                reduce_max=self.dist.reduce_max,
                clipped=self.task.clipped_parameters(name),
                channels_last=self.channels_last,
                total_steps=self.total_steps,
            )
            for name, net in self.task.networks().items()
        }
        if self.dist.enabled:
            self._wrap_for_data_parallel()
        if cfg.compile.backend is not None:
            compile_networks(self.task, cfg.compile)
        self.forward_context = lambda: forward_context(cfg, self.device)
        self.grad_stats = GradStatsCollector(cfg.stats, {name: e.model for name, e in self.engines.items()}, self.device, s.throughput_warmup)
        # Not under torchrun: a re-run's backward would enter data parallelism's collectives alone;
        # nor for compiled networks, whose leaves run inside their graphs, out of the hooks' reach.
        tracing = cfg.stats.trace_overflow and not self.dist.enabled and cfg.compile.backend is None
        tracing = tracing and any(e.scaler.checks_overflow for e in self.engines.values())
        self.on_device = any(e.on_device for e in self.engines.values())  # a scale kept on the device (resident_scale.py)
        self.tracer = OverflowTracer({name: e.model for name, e in self.engines.items()}, tracing, sampled_only=self.on_device)
        self.meter = ThroughputMeter(self.device, s.throughput_warmup, s.throughput_window, self.task.sample_unit)
        self.clock = TimeToResult(self.device)
        self.step, self.last_loss, self.last_finite_loss = 0, None, None
        self.samples, self.samples_before_resume = 0, 0  # this process's since it started; the whole run's before it
        self.epoch, self.batch_in_epoch = 0, 0  # the data position
        self.peaks = MemoryPeaks(self.device)
        self.pending: list[dict[str, Any]] = []  # per-step rows whose tensors are not yet on the host
        self.steps_before: dict[str, int] = {}  # each engine's steps_taken as the current step began
        self.checkpoint_every = s.checkpoint_every
        self.checkpointed_at: int | None = None
        self.peers_preempted = False  # under torchrun: a rank got a preemption signal (as of the last flush)
        self.record = RunRecord.starting(
            cfg,
            run_dir=run_dir,
            variant=variant,
            device=self.device,
            dist=self.dist,
            task=self.task,
            data_info=self.data.info,
            total_steps=self.total_steps,
            fp32_math=self.fp32_math,
            channels_last=self.channels_last,
            products=self._products_record(),
        )
        saved = self._within_schedule(saved)
        # Rank 0 writes everything; the other ranks compute the same log rows and drop them.
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", keep_before_step=saved["step"] if saved else None) if self.dist.is_main else NullLog()
        if saved is not None:
            self._restore(saved)
        self.board: TensorBoardLog | NullBoard = NullBoard()
        if self.dist.is_main:
            self.board = open_board(cfg.logger, run_dir, saved["step"] if saved else None, self.meter, self.grad_stats, per_process=self.dist.enabled)
            if saved is not None and (self.record.metrics or {}).get("step") == saved["step"]:  # purged with the steps past the checkpoint
                self.board.write([{"kind": "eval", **self.record.metrics}])

    def _checkpoint_to_resume(self) -> dict | None:
        """The folder's checkpoint if this run continues it. One it does not continue is moved aside
        (`checkpoint.pt.stale-<UTC time>`), so no later launch resumes it and no progress is lost;
        only force=true discards it. An unreadable or unsafe one raises: the run ends `error` and the
        file stays where it is. Under torchrun rank 0 decides, and the others read the file only
        after it has (a rank reading while rank 0 moves it aside would fail)."""
        saved = self._decide_on_checkpoint() if self.dist.is_main else None
        if self.dist.any(saved is not None, self.device) and not self.dist.is_main:
            saved = checkpoint.load(self.run_dir)
        return saved

    def _decide_on_checkpoint(self) -> dict | None:
        cfg, path = self.cfg, self.run_dir / checkpoint.FILENAME
        if not path.is_file():
            return None
        if cfg.force:
            path.unlink()
            print(f"mpt-run: force=true: discarded {path}; starting over", flush=True)
            return None
        why = "resume=false" if not cfg.resume else "checkpoint=false" if not cfg.checkpoint else None
        if why is None:
            saved = checkpoint.load(self.run_dir)
            assert saved is not None  # the file is there (is_file above)
            why = self._why_not_resumable(saved)
            if why is None:
                return saved
        self._set_aside(why)
        return None

    def _set_aside(self, why: str) -> None:
        aside = checkpoint.set_aside(self.run_dir)
        print(f"mpt-run: {why}: moved the checkpoint aside to {aside.name if aside else '(gone)'}; starting over", flush=True)

    def _why_not_resumable(self, saved: dict) -> str | None:
        """None if `saved` continues this run's computation. A longer or shorter schedule in the same
        unit continues it (steps for steps, epochs for epochs: milestones count in that unit), as does
        a data.root moved to a copy of the same files."""
        current = as_plain(self.cfg)
        differ = identity.differences(saved["config"], current)
        if "data.root" in differ and self._same_data(saved):
            differ.remove("data.root")
        saved_in_steps = (saved["config"].get("schedule") or {}).get("steps") is not None
        same_unit = saved_in_steps == (self.cfg.schedule.steps is not None)
        others = [k for k in differ if k not in identity.LENGTH or not same_unit]
        if others:
            shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
            return f"the checkpoint is of a different config ({shown})"
        return None

    def _within_schedule(self, saved: dict | None) -> dict | None:
        """`saved`, unless this run's schedule is another length and ends at or before its step: then
        there is nothing of the new schedule left to run from it (not even its last evaluation), and
        it is moved aside. Every rank reaches the same answer; rank 0 moves it once all have read it."""
        if saved is None or saved["step"] < self.total_steps:
            return saved
        if not [k for k in identity.differences(saved["config"], as_plain(self.cfg)) if k in identity.LENGTH]:
            return saved  # the same schedule, ended (its record was not written): nothing to redo
        self.dist.barrier()
        if self.dist.is_main:
            self._set_aside(f"the checkpoint is at step {saved['step']}, not before this schedule's end at step {self.total_steps}")
        return None

    def _same_data(self, saved: dict) -> bool:
        """Whether this run's data.root holds the files the checkpoint's did (names and sizes)."""
        return saved.get("data_fingerprint") is not None and saved["data_fingerprint"] == self.data_fingerprint()

    def data_fingerprint(self) -> str | None:
        root = self.cfg.data.get("root")
        if root is None:
            return None
        if self._data_fingerprint is None:
            self._data_fingerprint = fingerprint(Path(root))
        return self._data_fingerprint

    def _products_record(self) -> dict | None:
        """The FP8 or MX recipe of the products, and how many layers' products ran on each arithmetic path."""
        if self.cfg.precision.products.forward is None:
            return None
        paths = collections.Counter(path for e in self.engines.values() if e.products for path in e.products.paths().values())
        return {**as_plain(self.cfg.precision.products), "paths": dict(paths)}

    def _state(self) -> dict:
        return {
            "config": self.record.config,
            "step": self.step,
            "samples": self._global_samples(),
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "last_loss": self.last_loss,
            "last_finite_loss": self.last_finite_loss,
            "metrics": self.record.metrics,
            "sample_grids": self.record.sample_grids,
            "data": self.data.state_dict(),
            "engines": {name: {"model": self._model_state(name, e.model), **e.state_dict()} for name, e in self.engines.items()},
            "rng": checkpoint.rng_state(),
            # Every rank's own GPU generator advances alike (the same draws): rank 0's stands for all.
            "device_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "started_at": self.record.started_at,
            "nondeterministic_ops": self.record.nondeterministic_ops,
            "git": self.record.git,
            "segments": self.record.segments,
            "data_fingerprint": self.data_fingerprint() if self.dist.is_main else None,  # only rank 0's is saved
            "throughput": self.meter.state_dict(),
            "memory": {k: int(self.dist.largest(v, self.device)) for k, v in self.peaks.state_dict().items()},
            "grad_stats": self.grad_stats.state_dict(),
            "overflow_trace": self.tracer.state_dict(),
            "time_to_result": self.clock.state_dict(),
        }

    def _restore(self, saved: dict) -> None:
        for name, engine in self.engines.items():
            engine.model.load_state_dict(self._own_rows(name, engine.model, saved["engines"][name]["model"]))
            engine.load_state_dict(saved["engines"][name])
        self.data.load_state_dict(saved["data"])
        self.step, self.samples_before_resume = saved["step"], saved["samples"]
        # Until this launch writes one, the checkpoint it resumed is what a relaunch would resume.
        self.checkpointed_at = self.record.checkpoint_step = self.record.steps = saved["step"]
        self.record.samples = saved["samples"]
        self.epoch, self.batch_in_epoch = saved["epoch"], saved["batch_in_epoch"]
        self.last_loss, self.last_finite_loss = saved["last_loss"], saved["last_finite_loss"]
        self.record.metrics = saved["metrics"]
        if self.record.sample_grids is not None:
            self.record.sample_grids = saved["sample_grids"]
        self.record.resumed_from_step = saved["step"]
        self.record.started_at, self.record.resumed_at = saved["started_at"], now_iso()
        if saved.get("nondeterministic_ops") and self.record.nondeterministic_ops is not None:  # none before they were noted
            self.record.nondeterministic_ops.extend(op for op in saved["nondeterministic_ops"] if op not in self.record.nondeterministic_ops)
        if saved["git"] != self.record.git:
            print(f"mpt-run: warning: the checkpoint was written by {describe_code(saved['git'])}; this is {describe_code(self.record.git)}", flush=True)
        earlier = saved.get("segments") or [{"from_step": 0, "to_step": saved["step"], "total_steps": None, "git": saved["git"]}]
        assert self.record.segments is not None  # the initial record's
        self.record.segments = [*earlier, *self.record.segments]
        self.record.segments[-1]["from_step"] = self.record.segments[-1]["to_step"] = saved["step"]
        self.meter.load_state_dict(saved["throughput"])
        self.peaks.load_state_dict(saved.get("memory") or {"peak_bytes": saved["peak_memory_bytes"]})  # older checkpoints: the peak alone
        if saved.get("grad_stats"):  # checkpoints before gradient statistics have none
            self.grad_stats.load_state_dict(saved["grad_stats"])
        if saved.get("overflow_trace"):  # nor before overflow tracing
            self.tracer.load_state_dict(saved["overflow_trace"])
        if saved.get("time_to_result"):  # nor before the clock
            self.clock.load_state_dict(saved["time_to_result"], extended=saved["step"] < self.total_steps)
        checkpoint.set_rng_state(saved["rng"])  # last: building the run drew from the generators
        if saved.get("device_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(saved["device_rng"], self.device)
        log.info("resuming %s from its checkpoint at step %d of %d", self.run_dir, self.step, self.total_steps)
        length = earlier[-1].get("total_steps")
        longer = f", extending the run from {length} steps" if length is not None and length != self.total_steps else ""
        print(f"mpt-run: resuming from the checkpoint at step {self.step} of {self.total_steps}{longer} (resume=false starts over)", flush=True)

    def _wrap_for_data_parallel(self) -> None:
        """Each network in DistributedDataParallel: the task trains through the wrapper, whose
        backward all-reduces (averages) the gradients; the engine keeps the network itself."""
        from torch.nn.parallel import DistributedDataParallel

        if self.cfg.distributed.sync_batchnorm and self.device.type != "cuda":
            raise ConfigError("distributed.sync_batchnorm=true: torch's SyncBatchNorm runs on CUDA only; on CPU processes each rank normalizes its own slice")
        allreduce = self.cfg.precision.allreduce_dtype
        for name, engine in self.engines.items():
            if self.cfg.distributed.sync_batchnorm:  # BN modules swapped in place: the parameters stay the engine's
                engine.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(engine.model)
            # A network that carries per-stream state between batches in buffers (bigLSTM's LSTM
            # state): broadcasting rank 0's would overwrite each rank's own.
            rank_local: dict[str, Any] = {"broadcast_buffers": False} if self.task.stream_buffers(name) else {}
            # No device_ids: batches are already on the device, and DDP would move every tensor
            # argument there, GNMT's CPU sequence lengths included.
            ddp = DistributedDataParallel(engine.model, **rank_local)
            if allreduce is not None:
                ddp.register_comm_hook(None, allreduce_in(torch_dtype(allreduce)))
            self.task.set_network(name, ddp)

    def _model_state(self, network: str, model: torch.nn.Module) -> dict:
        """The network's state dict, with per-stream buffers gathered from every rank (collective)."""
        state = model.state_dict()
        for name, dim in self.task.stream_buffers(network).items():
            state[name] = self.dist.gather(state[name], dim)
        return state

    def _own_rows(self, network: str, model: torch.nn.Module, state: dict) -> dict:
        """A saved state dict with this rank's slice of each per-stream buffer (a checkpoint holds the
        global batch's, so it resumes with any number of processes)."""
        own = model.state_dict()
        state = dict(state)
        for name, dim in self.task.stream_buffers(network).items():
            rows, saved_rows = own[name].shape[dim], state[name].shape[dim]
            if saved_rows != rows and saved_rows == rows * self.dist.world_size:
                start, _ = self.dist.shard(0, saved_rows)
                state[name] = state[name].narrow(dim, start, rows)
        return state

    def _global_samples(self, together: bool = True) -> int:
        """Samples the whole run has trained on: the processes' counts summed (collective unless
        `together` is false: a rank leaving on an exception alone can meet no other)."""
        if not together:  # an estimate: this rank's count for every rank
            return int(self.samples_before_resume + self.samples * self.dist.world_size)
        return int(self.samples_before_resume + self.dist.total(float(self.samples), self.device))

    def save_checkpoint(self) -> None:
        self._flush()  # the log on disk covers every step the checkpoint does
        self.board.flush()
        assert self.record.segments is not None  # the initial record's
        self.record.segments[-1]["to_step"] = self.step
        state = self._state()  # on every rank: it gathers what each holds alone
        if self.dist.is_main:
            checkpoint.save(self.run_dir, state)
        self.checkpointed_at = self.step
        # The record follows the checkpoint: a run that dies now says how far it got, and what a
        # relaunch keeps.
        self.record.steps, self.record.samples, self.record.checkpoint_step = self.step, state["samples"], self.step
        self.save_record()

    def _over_ranks(self, tp: dict) -> dict:
        """Throughput of the whole job: each process's figure summed over processes."""
        if not self.dist.enabled:
            return tp
        for key in ("pipeline", "compute"):
            if tp.get(key) is not None:
                tp[f"{key}_per_process"] = tp[key]
                tp[key] = self.dist.total(tp[key], self.device)
        tp["processes"] = self.dist.world_size
        tp["method"] += f"; summed over {self.dist.world_size} processes"
        return tp

    def save_record(self) -> None:
        if self.dist.is_main:
            self.record.write(self.run_dir / "result.json")

    def train(self) -> RunRecord:
        """Run every step, then complete and save the record. Returns the record."""
        rec = self.record
        # the initial record's, which every later one extends
        assert rec.segments is not None and rec.environment is not None and rec.precision is not None
        self.save_record()
        t_start = time.perf_counter()
        self.peaks.start()
        # Under torchrun the ranks end together (finishing, or diverging on a shared decision) and
        # meet in the collectives below; a rank leaving on an exception is alone and skips them.
        together = interrupted = False
        try:
            if self.dist.is_main:
                skipped = {name: e.scaler.summary()["skipped_steps"] for name, e in self.engines.items()}
                unit = self.meter.unit + ("/s per process" if self.dist.enabled else "/s")
                self.progress = Progress(self.label, self.total_steps, self.step, skipped, unit)
            with (
                preemption.catching(),
                held_for_the_run(self.cfg, self.device),
                determinism.noting(rec.nondeterministic_ops),
            ):
                for _ in self.steps():
                    pass
                self._check_trained()
            rec.status = "ok"
            together = True
        except Diverged as e:
            together = True
            # A scale kept on the device: the other network's read-back may find an earlier divergence
            e = _earliest(e, self._flush(check=False, diverged_at=e.step)) or e
            rec.status, rec.message, rec.diverged_at_step = "diverged", str(e), e.step if e.step is not None else self.step
            log.warning("diverged at step %s: %s", rec.diverged_at_step, e)
        except preemption.Preempted as e:  # resumable, like `running`
            together = True
            rec.status, rec.message, rec.preempted_at_step = "preempted", str(e), e.step
            log.warning("%s", e)
        except KeyboardInterrupt:  # a second Ctrl-C: stopped mid-step; the last checkpoint resumes
            rec.status, rec.preempted_at_step = "preempted", self.step
            kept = f"the checkpoint at step {self.checkpointed_at} resumes" if self.checkpointed_at is not None else "no checkpoint was written"
            rec.message = f"SIGINT twice at step {self.step}: stopped at once; {kept}"
            interrupted = True
        finally:
            together = together or not self.dist.enabled
            rec.steps, rec.samples, rec.epochs = self.step, self._global_samples(together), self.step / self.data.steps_per_epoch
            rec.segments[-1]["to_step"] = self.step
            rec.final_train_loss = self.last_loss
            rec.last_finite_train_loss = self.last_finite_loss
            self.clock.stop()
            rec.throughput = self._over_ranks(self.meter.summary()) if together else self.meter.summary()
            rec.time_to_result = self.clock.summary(finished=rec.status == "ok")
            if self.cfg.compile.backend is not None:
                rec.compile = compile_summary(self.cfg.compile)
            rec.mfu = mfu(rec.flops, rec.throughput, self.cfg.precision, self.device, rec.environment["device_name"])
            rec.memory = self.peaks.summary()
            for key in ("peak_bytes", "steady_peak_bytes"):
                if together and key in rec.memory:
                    rec.memory[key] = int(self.dist.largest(rec.memory[key], self.device))
            if self.dist.enabled:
                rec.memory["over"] = f"the largest of {self.dist.world_size} processes"
            if self.grad_stats.sampled_steps:
                rec.memory["note"] = self.grad_stats.MEMORY_NOTE
            self._read_back_quietly()  # stopped between read-backs (interrupted, failed): the steps since the last
            rec.loss_scale = {name: {**e.scaler.summary(), "on_device": e.on_device} for name, e in self.engines.items()}
            rec.precision["products"] = self._products_record()  # the paths its products took
            rec.grad_stats = self.grad_stats.summary()
            rec.overflow_origins = self.tracer.summary()
            rec.finished_at = now_iso()
            rec.duration_s = time.perf_counter() - t_start
            try:
                self.metrics.close()
            finally:
                self.board.close()  # never raises: a failing writer only warns
                if self.progress is not None:
                    self.progress.close()
                self.data.close()
        self.save_record()
        if interrupted:
            raise KeyboardInterrupt
        return rec

    def _read_back_quietly(self) -> None:
        """_read_back on the way out of a failed or interrupted run: what it finds is only recorded."""
        try:
            self._read_back()
        except Exception:  # the run's own failure is the one to report
            log.exception("reading the loss scale back from the device failed")

    def _check_trained(self) -> None:
        """A run whose every step was skipped trained nothing: it ends `diverged`, never `ok`."""
        for name, engine in self.engines.items():
            why = engine.scaler.untrained()
            if why is not None:
                raise Diverged((f"{name}: " if len(self.engines) > 1 else "") + why, step=self.step)

    def execute(self) -> RunRecord:
        """train(), with a failure recorded instead of raised: `oom` naming the batch size, any other
        exception `error` with its one-line message. The checkpoint stays for a rerun to resume."""
        try:
            return self.train()
        except Exception as e:
            log.exception("run failed")
            self.record.status, self.record.message = failure(e, self.cfg.schedule.batch_size)
            try:
                self.save_record()
            except OSError as write_error:  # a full disk: the record on disk stays as it last was
                print(f"mpt-run: error: {write_error}", file=sys.stderr, flush=True)
            return self.record

    def steps(self) -> Iterator[int]:
        """The training loop, yielding after each step (a benchmark can drive it a window at a time)."""
        batches = self.data.epoch(self.epoch, self.batch_in_epoch)
        self._begin_epoch()
        self.clock.start()
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                batches = self.data.epoch(self.epoch)
                self._begin_epoch()
                continue
            self.batch_in_epoch += 1
            wait = time.perf_counter() - t0
            self.meter.batch_ready()
            # FLOPs once, on this process's first step: in the warm-up, which throughput leaves out.
            counting = self.cfg.schedule.count_flops and self.record.flops is None
            traced_before = self.tracer.seconds
            with (
                self.grad_stats.step(self.step) as stats_step,
                counting_flops([e.model for e in self.engines.values()]) if counting else contextlib.nullcontext() as counter,
            ):
                self.pending.extend(self._train_step(self.step, batch))
            traced = self.tracer.seconds - traced_before
            if counting and not traced:  # a traced step ran twice: the next one is counted instead
                assert counter is not None  # counting: the FLOP counter, not the null context
                self.record.flops = flops_record(counter, self.task.count_samples(batch), self.step, self.meter.unit)
            if stats_step["sampled"] and stats_step["seconds"] is None:
                self.meter.interrupt()  # a sampled step that was not timed: its window cannot be corrected
            self.step += 1
            if self.batch_in_epoch == self.data.steps_per_epoch or self.step == self.total_steps:
                for engine in self.engines.values():  # optim.lookahead: the weights become the average
                    engine.settle()
            n = self.task.count_samples(batch)
            self.samples += n
            # A sampled step's hooks are not training's work: the step is left out of throughput (its
            # timed seconds include any trace). Elsewhere only the time spent running an overflowing
            # step again to trace it is.
            excluded = None if stats_step["seconds"] is None else stats_step["seconds"] + wait
            self.meter.step(n, wait, excluded_s=excluded, untimed_s=traced)
            # a sampled step's own training counts: only what its statistics added to a plain step
            self.clock.leave_out(traced if stats_step.get("overhead") is None else stats_step["overhead"])
            if self.meter.warmed_up:
                self.peaks.steady_from_now()
            if self.step % self.cfg.schedule.log_every == 0 or self.step == self.total_steps:
                self._flush()
            if self.step % self.eval_every == 0 or self.step == self.total_steps:
                with self.clock.final() if self.step == self.total_steps else self.clock.leaving_out():
                    self._evaluate(self.step)
                self.meter.interrupt()
            if self.cfg.checkpoint and ((self.checkpoint_every and self.step % self.checkpoint_every == 0) or self.step == self.total_steps):
                with self.clock.leaving_out():
                    self.save_checkpoint()
                self.meter.interrupt()
            if self.step < self.total_steps and self._preempted():
                if self.cfg.checkpoint and self.checkpointed_at != self.step:
                    self.save_checkpoint()
                raise preemption.Preempted(preemption.requested() or signal.SIGTERM, self.step, checkpointed=self.cfg.checkpoint)
            yield self.step

    def _begin_epoch(self) -> None:
        self.task.begin_epoch(self.epoch)
        for name, engine in self.engines.items():
            engine.frozen = {id(p) for p in self.task.frozen_parameters(name)}

    def _preempted(self) -> bool:
        """Whether to stop here for a preemption signal. Under torchrun, whether any rank got one, as
        of the last flush of the log (its collective carries the flag, so every rank stops at the
        same step, and no step waits for a collective of its own)."""
        return self.peers_preempted if self.dist.enabled else preemption.requested() is not None

    def _train_step(self, step: int, batch: Any) -> list[dict]:
        rows: list[dict] = []
        if self.cfg.deterministic and self.device.type == "cuda":
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
                    engine.average(step + 1, self.epoch)
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
        self.tracer.seconds += time.perf_counter() - t0
        log.info("step %d: %s overflowed at loss scale %g and was skipped; first non-finite: %s (%s)", step, group, scale, found["module"], found["role"])

    def _flush(self, check: bool = True, diverged_at: int | None = None) -> Diverged | None:
        """Bring the logged tensors to the host in one sync, write them, and watch for divergence.
        A scale kept on the device is read back here: a divergence it finds is raised (`check`) or
        returned, and the log stops before its step, as it stops before `diverged_at`."""
        rows, self.pending = self.pending, []
        slots = [(r, k) for r in rows for k, v in r.items() if isinstance(v, torch.Tensor)]
        flags = {(id(r), k) for r, k in slots if r[k].dtype == torch.bool}  # written back as booleans
        values = [r[k].double().reshape(()) for r, k in slots]  # exact for FP32 values and a float64 lr
        if self.dist.enabled:  # the preemption flag rides along: positive if any rank got a signal
            values.append(torch.tensor(float(preemption.requested() is not None), dtype=torch.float64, device=self.device))
        if values:
            # Under torchrun, each value is the mean over ranks: the global batch's loss, and one
            # divergence decision for all of them.
            means = self.dist.reduce_mean(torch.stack(values)).tolist()
            if self.dist.enabled:
                self.peers_preempted = self.peers_preempted or means.pop() > 0
            for (r, k), value in zip(slots, means):
                r[k] = value > 0 if (id(r), k) in flags else value
        found = self._read_back()
        stops = [at for at in (diverged_at, found.step if found is not None else None) if at is not None]
        if stops:  # the host path logs nothing of the step that diverged, nor after it
            rows = [r for r in rows if r["step"] < min(stops)]
        self._write_rows(rows, check and found is None)
        if found is not None and check:
            raise found
        return found

    def _read_back(self) -> Diverged | None:
        """Every engine's steps since its last read-back, replayed on its host scaler (a scale kept
        on the device); the earliest divergence that found, if any."""
        found = None
        for engine in self.engines.values():
            try:
                engine.read_back()
            except Diverged as e:
                found = _earliest(found, e)  # of two at one step, the first network's, as the host path raises it
        return found

    def _write_rows(self, rows: list[dict], check: bool) -> None:
        self.metrics.write(rows)
        self.board.write(rows)
        self.board.sync(self.step, self.meter, self.grad_stats)
        if self.progress is not None:
            self.progress.update(self.step, rows, self.meter.pipeline[-1] if self.meter.pipeline else None)
        for r in rows:
            self.last_loss = r["loss"]
            if math.isfinite(r["loss"]):
                self.last_finite_loss = r["loss"]
            elif check and not self.engines[r["group"]].scaler.checks_overflow:
                raise Diverged(f"non-finite loss {r['loss']} at step {r['step']} (scale=none)", step=r["step"])

    def _check_weights(self, step: int) -> None:
        for name, engine in self.engines.items():
            # Buffers too: a forward overflow on a skipped step still updates batch-norm statistics.
            tensors = [*engine.model.parameters(), *engine.master_weights(), *(b for b in engine.model.buffers() if b.is_floating_point())]
            finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all()
            # Buffers can differ between ranks (batch-norm statistics, per-stream state): one decision for all.
            if self.dist.reduce_max((~finite).float().reshape(1)).item():
                raise Diverged(f"non-finite weights or batch-norm statistics in {name} by step {step} ({_non_finite(engine)})", step=step)

    def _evaluate(self, step: int) -> None:
        # Weights are checked here, off the timed path: between evaluations a non-finite weight
        # shows up as a non-finite loss at the next step anyway.
        self._check_weights(step - 1)
        cap = self.cfg.schedule.eval_batches
        batches = islice(self.data.val(), cap) if cap else self.data.val()
        final = step == self.total_steps
        metrics = self.task.evaluate(batches, self.forward_context, final=final)
        test = self.data.test() if final else None
        if test is not None:  # a held-out split the source was given, scored once, at the end, in full
            metrics.update({f"test_{k.removeprefix('val_')}": v for k, v in self.task.evaluate(test, self.forward_context, final=True).items()})
        self.record.metrics = {**metrics, "step": step}
        row = [{"kind": "eval", "step": step, **metrics}]
        self.metrics.write(row)
        self.board.write(row)
        if self.record.sample_grids is not None and self.dist.is_main:
            path = self.task.save_samples(self.run_dir / "samples" / f"step_{step:06d}.png", self.forward_context)
            assert path is not None  # a task with sample grids saves them
            self.record.sample_grids = [
                *(g for g in self.record.sample_grids if g["step"] != step),
                {"step": step, "path": path.relative_to(self.run_dir).as_posix()},
            ]
        log.info("step %d/%d eval %s", step, self.total_steps, {k: round(v, 4) for k, v in metrics.items()})


def _backward_scale(engine: PrecisionEngine) -> float:
    return engine.backward_scale


def _earliest(a: Diverged | None, b: Diverged | None) -> Diverged | None:
    """Of two divergences, the one at the earlier step (a step known before one that is not)."""
    if a is None or b is None:
        return a or b
    if b.step is not None and (a.step is None or b.step < a.step):
        return b
    return a
