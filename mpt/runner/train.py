"""The training loop. It knows the Task seam and the precision engine's two calls, nothing else."""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig

from .. import preemption
from ..config import checkpointing
from ..datasets import build_data
from ..datasets.imagefolder import CorruptImage
from ..distributed import from_env
from ..models import build_task
from ..precision.engine import default_channels_last, forward_context, held_for_the_run
from ..precision.scaler import Diverged
from ..provenance import now_iso
from . import checkpoint, data_parallel, determinism, outcomes, process
from .compiling import compile_networks, compile_summary
from .engines import Plan, build_engines, products_record
from .evaluation import Evaluation
from .instruments import Instrument, RunEnd, around_step, standard
from .instruments.flops import mfu
from .logbook import Logbook
from .record import RunRecord
from .resumption import Resumption
from .stepping import Stepper
from .tensorboard_log import RunAbout

log = logging.getLogger("mpt")


class Run:
    """One training run: built from a validated config, writing into `run_dir`."""

    def __init__(self, cfg: DictConfig, run_dir: Path, variant: str = "", label: str | None = None):
        self.cfg = cfg
        self.variant = variant
        self.run_dir = run_dir
        self.checkpointing = checkpointing(cfg)
        self.label = label or run_dir.name  # what its progress line calls it
        self.dist = from_env()
        self.device, self.fp32_math = process.prepare(cfg, self.dist)

        self.resumption = Resumption(cfg, run_dir, self.dist, self.device)
        # Before the data: a source that makes files in the run folder (a tokenizer) reuses them only
        # for a checkpoint it continues.
        saved = self.resumption.checkpoint()
        self.data = build_data(cfg, self.device, workdir=run_dir, resuming=saved is not None, shard=self.dist)
        self.task = build_task(cfg, self.data.info, shard=self.dist)
        self.task.prepare(self.data)
        s = cfg.schedule
        plan = Plan.of(s, self.data.steps_per_epoch)
        self.total_steps, self.eval_every = plan.total_steps, plan.eval_every
        self.channels_last = (
            cfg.channels_last if cfg.channels_last is not None else default_channels_last(cfg.precision, self.device)
        )
        self.engines = build_engines(cfg, self.task, plan, self.device, self.dist, self.channels_last)
        if self.dist.enabled:
            data_parallel.wrap(cfg, self.task, self.engines, self.device)
        if cfg.compile.backend is not None:
            compile_networks(self.task, cfg.compile)
        self.forward_context = lambda: forward_context(cfg, self.device)
        self.tools = tools = standard.build(
            cfg, self.engines, self.device, self.dist, self.task.sample_unit, self.total_steps
        )
        self.grad_stats, self.tracer, self.meter, self.clock = tools.grad_stats, tools.tracer, tools.meter, tools.clock
        self.instruments: list[Instrument] = [*tools.all(), *self.own_instruments()]
        self.stepper = Stepper(
            self.task, self.engines, self.grad_stats, self.tracer, self.forward_context, self.device, cfg.deterministic
        )
        self.evaluation = Evaluation(
            self.task, self.data, self.engines, self.dist, self.forward_context, s.eval_batches
        )
        self.step = 0
        self.samples, self.samples_before_resume = 0, 0  # this process's since it started; the whole run's before it
        self.epoch, self.batch_in_epoch = 0, 0  # the data position
        self.checkpoint_every = s.checkpoint_every
        self.checkpointed_at: int | None = None
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
            products=products_record(cfg, self.engines),
        )
        saved = self.resumption.within_schedule(saved, self.total_steps)
        self.logbook = Logbook(self.engines, self.dist, self.device, self.meter, self.grad_stats)
        if saved is not None:
            self._restore(saved)
        if self.dist.is_main:  # rank 0 writes everything; the other ranks compute the same rows and drop them
            about = RunAbout.of(cfg, self.record.choices, self.task.primary_metric)
            resumed_at = saved["step"] if saved else None
            self.logbook.open(
                run_dir, cfg.logger, resumed_at, self.record.metrics, about, self.record.sample_grids, cfg.wandb
            )

    def own_instruments(self) -> list[Instrument]:
        """A subclass's statistics besides the run's own, each checkpointed and summarized like them."""
        return []

    def _state(self) -> dict:
        """The checkpoint: each part's own state, collected on every rank (some parts gather)."""
        return {
            **self.record.state_dict(),
            **self.logbook.state_dict(),
            "step": self.step,
            "samples": self._global_samples(),
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "data": self.data.state_dict(),
            "engines": {
                name: {"model": data_parallel.model_state(self.task, self.dist, name, e.model), **e.state_dict()}
                for name, e in self.engines.items()
            },
            "rng": checkpoint.rng_state(),
            # Every rank's own GPU generator advances alike (the same draws): rank 0's stands for all.
            "device_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "data_fingerprint": self.resumption.data_fingerprint()
            if self.dist.is_main
            else None,  # only rank 0's is saved
            **{i.key: i.state_dict() for i in self.instruments},
        }

    def _restore(self, saved: dict) -> None:
        for name, engine in self.engines.items():
            engine.model.load_state_dict(
                data_parallel.own_rows(self.task, self.dist, name, engine.model, saved["engines"][name]["model"])
            )
            engine.load_state_dict(saved["engines"][name])
        self.data.load_state_dict(saved["data"])
        self.step, self.samples_before_resume = saved["step"], saved["samples"]
        self.checkpointed_at = saved["step"]
        self.epoch, self.batch_in_epoch = saved["epoch"], saved["batch_in_epoch"]
        self.record.resume(saved)
        self.logbook.load_state_dict(saved)
        for instrument in self.instruments:
            if saved.get(instrument.key):  # one the checkpoint predates (its key absent) starts afresh
                instrument.load_state_dict(saved[instrument.key])
        checkpoint.set_rng_state(saved["rng"])  # last: building the run drew from the generators
        if saved["device_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(saved["device_rng"], self.device)
        log.info("resuming %s from its checkpoint at step %d of %d", self.run_dir, self.step, self.total_steps)
        length = saved["segments"][-1].get("total_steps")
        longer = f", extending the run from {length} steps" if length is not None and length != self.total_steps else ""
        print(
            f"mpt-run: resuming from the checkpoint at step {self.step} of {self.total_steps}{longer} "
            "(resume=false starts over)",
            flush=True,
        )

    def _global_samples(self, together: bool = True) -> int:
        """Samples the whole run has trained on: the processes' counts summed (collective unless
        `together` is false: a rank leaving on an exception alone can meet no other)."""
        if not together:  # an estimate: this rank's count for every rank
            return int(self.samples_before_resume + self.samples * self.dist.world_size)
        return int(self.samples_before_resume + self.dist.total(float(self.samples), self.device))

    def save_checkpoint(self) -> None:
        self.logbook.flush(self.step)  # the log on disk covers every step the checkpoint does
        self.logbook.board.flush()
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
        # Under torchrun the ranks end together (finishing, or diverging on a shared decision) and
        # meet in the collectives below; a rank leaving on an exception is alone and skips them.
        together = interrupted = False
        try:
            if self.dist.is_main:
                self.logbook.show_progress(self.label, self.total_steps, self.step)
            with (
                preemption.catching(),
                held_for_the_run(self.cfg, self.device),
                determinism.noting(rec.nondeterministic_ops),
            ):
                for _ in self.steps():
                    pass
                outcomes.check_trained(self.engines, self.step)
            rec.status = "ok"
            together = True
        except Diverged as e:
            together = True
            # A scale kept on the device: the other network's read-back may find an earlier divergence
            e = outcomes.earliest(e, self.logbook.flush(self.step, check=False, diverged_at=e.step)) or e
            rec.status, rec.message, rec.diverged_at_step = (
                "diverged",
                str(e),
                e.step if e.step is not None else self.step,
            )
            log.warning("diverged at step %s: %s", rec.diverged_at_step, e)
        except preemption.Preempted as e:  # resumable, like `running`
            together = True
            rec.status, rec.message, rec.preempted_at_step = "preempted", str(e), e.step
            log.warning("%s", e)
        except KeyboardInterrupt:  # a second Ctrl-C: stopped mid-step; the last checkpoint resumes
            rec.status, rec.preempted_at_step = "preempted", self.step
            kept = (
                f"the checkpoint at step {self.checkpointed_at} resumes"
                if self.checkpointed_at is not None
                else "no checkpoint was written"
            )
            rec.message = f"SIGINT twice at step {self.step}: stopped at once; {kept}"
            interrupted = True
        finally:
            together = together or not self.dist.enabled
            rec.steps, rec.samples, rec.epochs = (
                self.step,
                self._global_samples(together),
                self.step / self.data.steps_per_epoch,
            )
            rec.segments[-1]["to_step"] = self.step
            rec.final_train_loss = self.logbook.last_loss
            rec.last_finite_train_loss = self.logbook.last_finite_loss
            for instrument in self.instruments:
                instrument.stop()
            # stopped between read-backs (interrupted, failed): the steps since the last
            self.logbook.read_back_quietly()
            end = RunEnd(finished=rec.status == "ok", together=together)
            for instrument in self.instruments:
                rec.put(instrument.field, instrument.summary(end))
            assert rec.memory is not None and rec.throughput is not None  # their instruments always summarize
            if self.grad_stats.sampled_steps:
                rec.memory["note"] = self.grad_stats.MEMORY_NOTE
            if self.cfg.compile.backend is not None:
                rec.compile = compile_summary(self.cfg.compile)
            rec.mfu = mfu(rec.flops, rec.throughput, self.cfg.precision, self.device, rec.environment["device_name"])
            rec.loss_scale = {
                name: {**e.scaler.summary(), "on_device": e.on_device} for name, e in self.engines.items()
            }
            rec.precision["products"] = products_record(self.cfg, self.engines)  # the paths its products took
            rec.finished_at = now_iso()
            rec.duration_s = time.perf_counter() - t_start
            try:
                self.logbook.close()
            finally:
                self.data.close()
        self.save_record()
        if interrupted:
            raise KeyboardInterrupt
        return rec

    def execute(self) -> RunRecord:
        """train(), with a failure recorded instead of raised: `oom` naming the batch size, any other
        exception `error` with its one-line message. The checkpoint stays for a rerun to resume."""
        try:
            return self.train()
        except Exception as e:
            self.record.status, self.record.message = outcomes.failure(e, self.cfg.schedule.batch_size)
            if isinstance(e, CorruptImage):  # a file to fix, not a bug: one line names it
                log.error("run failed: %s", self.record.message)
            else:
                log.exception("run failed")
            try:
                self.save_record()
            except OSError as write_error:  # a full disk: the record on disk stays as it last was
                print(f"mpt-run: error: {write_error}", file=sys.stderr, flush=True)
            return self.record

    def steps(self) -> Iterator[int]:
        """The training loop, yielding after each step (a benchmark can drive it a window at a time)."""
        batches = self.data.epoch(self.epoch, self.batch_in_epoch)
        self._begin_epoch()
        for instrument in self.instruments:
            instrument.start()
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
            with around_step(self.instruments, self.step):
                self.logbook.pending.extend(self._train_step(self.step, batch))
            n = self.task.count_samples(batch)
            done = self.tools.step_done(self.step, n, wait)
            self.step += 1
            if self.batch_in_epoch == self.data.steps_per_epoch or self.step == self.total_steps:
                for engine in self.engines.values():  # optim.lookahead: the weights become the average
                    engine.settle()
            self.samples += n
            for instrument in self.instruments:
                instrument.after_step(done)
            if self.step % self.cfg.schedule.log_every == 0 or self.step == self.total_steps:
                self.logbook.flush(self.step)
            if self.step % self.eval_every == 0 or self.step == self.total_steps:
                with self.clock.final() if self.step == self.total_steps else self.clock.leaving_out():
                    self._evaluate(self.step)
                self.meter.interrupt()
            if self.checkpointing and (
                (self.checkpoint_every and self.step % self.checkpoint_every == 0) or self.step == self.total_steps
            ):
                with self.clock.leaving_out():
                    self.save_checkpoint()
                self.meter.interrupt()
            if self.step < self.total_steps and self._preempted():
                if self.checkpointing and self.checkpointed_at != self.step:
                    self.save_checkpoint()
                raise preemption.Preempted(
                    preemption.requested() or signal.SIGTERM, self.step, checkpointed=self.checkpointing
                )
            yield self.step

    def _begin_epoch(self) -> None:
        self.task.begin_epoch(self.epoch)
        for name, engine in self.engines.items():
            engine.frozen = {id(p) for p in self.task.frozen_parameters(name)}

    def _preempted(self) -> bool:
        """Whether to stop here for a preemption signal. Under torchrun, whether any rank got one, as
        of the last flush of the log (its collective carries the flag, so every rank stops at the
        same step, and no step waits for a collective of its own)."""
        return self.logbook.peers_preempted if self.dist.enabled else preemption.requested() is not None

    def _train_step(self, step: int, batch: Any) -> list[dict]:
        return self.stepper.step(step, batch, self.epoch)

    def _evaluate(self, step: int) -> None:
        metrics = self.evaluation(step, final=step == self.total_steps)
        self.record.metrics = {**metrics, "step": step}
        self.logbook.write_eval({"kind": "eval", "step": step, **metrics})
        if self.record.sample_grids is not None and self.dist.is_main:
            path = self.task.save_samples(self.run_dir / "samples" / f"step_{step:06d}.png", self.forward_context)
            assert path is not None  # a task with sample grids saves them
            self.logbook.board.image("samples", path, step)
            self.record.sample_grids = [
                *(g for g in self.record.sample_grids if g["step"] != step),
                {"step": step, "path": path.relative_to(self.run_dir).as_posix()},
            ]
        log.info("step %d/%d eval %s", step, self.total_steps, {k: round(v, 4) for k, v in metrics.items()})
