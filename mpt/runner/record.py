"""The result record: one `result.json` per run (a RunRecord, written atomically) and
`metrics.jsonl` beside it.

`result.json` is the only thing reports read. It is written when the run starts (status
`running`), so a run killed before it ends never leaves a record that claims `ok`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TextIO

from ..files import failed_write, json_safe, write_json_atomic, write_text_atomic
from . import upgrade

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from ..distributed import Dist
    from ..models import Task

SCHEMA_VERSION = 1  # raised when a field changes meaning or type; new optional fields do not need it


class RecordError(ValueError):
    """A result.json that cannot be read as a record; the message names the file."""


@dataclass(kw_only=True)
class RunRecord:
    """One run's result.json. Sections measured by their own module (throughput, memory, flops,
    mfu, loss_scale, grad_stats, environment) stay plain dicts in the shape that module writes.

    A field is None until the run fills it. Fields listed in `absent` and still unset are left out
    of the file: those only some runs have (a diverged run's step), and, for a record read from
    disk, those it did not hold, so an older record reads back unchanged."""

    schema: int = SCHEMA_VERSION
    status: str  # running, ok, diverged, preempted, error, oom
    message: Optional[str] = None
    run_dir: Optional[str] = None  # where the run wrote it; readers find a run by the folder its result.json is in
    choices: dict[str, str]  # the config group options: model, precision, scale, data, schedule
    variant: Optional[str] = None  # the computational overrides beyond the choices and the seed (identity.variant)
    seed: Optional[int] = None
    config: Optional[dict] = None  # the resolved config
    precision: Optional[dict] = None  # what the mode ran as: dtypes, master weights, autocast, CPU kernels
    scale_config: Optional[dict] = None
    optim: Optional[dict] = None
    distributed: Optional[dict] = None
    data: Optional[dict] = None  # the data source's description (sizes, vocabulary, loader workers)
    total_steps: Optional[int] = None
    steps: Optional[int] = None
    samples: Optional[int] = None
    epochs: Optional[float] = None
    primary_metric: Optional[str] = None
    higher_is_better: Optional[bool] = None
    metrics: dict = field(default_factory=dict)  # the last evaluation's, with its step
    evaluation: Optional[dict] = None  # how the metric is computed, or why it is not
    sample_grids: Optional[list] = None  # pictures a task draws at each evaluation (DCGAN's grid), by step
    final_train_loss: Optional[float] = None
    train_loss_definition: Optional[str] = None  # what that loss is, in the task's words (a sum or a mean, over what)
    last_finite_train_loss: Optional[float] = None
    diverged_at_step: Optional[int] = None
    preempted_at_step: Optional[int] = None
    resumed_from_step: Optional[int] = None
    resumed_at: Optional[str] = None
    checkpoint_step: Optional[int] = None  # the step of the last checkpoint written: where a relaunch resumes
    # The launches that trained it: steps [from_step, to_step) under a schedule of total_steps, by the
    # code in `git`. More than one when it resumed; to_step of a launch that died is its last checkpoint.
    segments: Optional[list] = None
    nondeterministic_ops: Optional[list] = None  # deterministic=true: ops torch ran without a deterministic kernel
    throughput: Optional[dict] = None  # instruments/throughput.py
    time_to_result: Optional[dict] = None  # instruments/time_to_result.py
    memory: Optional[dict] = None
    loss_scale: Optional[dict] = None  # per network: the scaler's summary
    compile: Optional[dict] = None  # compile.backend: what torch.compile made of the networks
    flops: Optional[dict] = None  # schedule.count_flops: model FLOPs of one step (instruments/flops.py)
    mfu: Optional[dict] = None
    grad_stats: Optional[dict] = None  # stats.grad_hist: gradient histograms against FP16's range
    overflow_origins: Optional[dict] = None  # stats.trace_overflow: which module overflowed first on each skipped step
    environment: Optional[dict] = None
    git: Optional[dict] = None
    started_at: Optional[str] = None
    finished_at: Optional[str] = None
    duration_s: Optional[float] = None
    extra: dict = field(default_factory=dict)  # keys of a newer or older version this one does not know
    absent: frozenset = field(
        default=frozenset(
            {
                "sample_grids",
                "epochs",
                "train_loss_definition",
                "diverged_at_step",
                "preempted_at_step",
                "resumed_from_step",
                "resumed_at",
                "checkpoint_step",
                "segments",
                "time_to_result",
            }
        ),
        repr=False,
    )

    @classmethod
    def from_dict(cls, data: dict, source: str = "record") -> RunRecord:
        if not isinstance(data, dict):
            raise RecordError(f"{source}: not a JSON object")
        schema = data.get("schema", SCHEMA_VERSION)
        if not isinstance(schema, int) or schema > SCHEMA_VERSION:
            raise RecordError(
                f"{source}: record schema {schema!r}; "
                f"this mpt reads schema {SCHEMA_VERSION} and older (update mpt to read it)"
            )
        names = [f.name for f in fields(cls) if f.name not in ("extra", "absent")]
        missing = [k for k in ("status", "choices") if k not in data]
        if missing:
            raise RecordError(f"{source}: no {', '.join(missing)}: not a result record")
        known = {k: v for k, v in data.items() if k in names}
        return cls(
            **known,
            extra={k: v for k, v in data.items() if k not in names},
            absent=frozenset(n for n in names if n not in data),
        )

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise RecordError(f"{path}: not a readable result record ({e})") from None
        return cls.from_dict(upgrade.record(data, path.parent.name), str(path))

    @classmethod
    def partial(cls, status: str, message: str, run_dir: str, choices: dict, seed: int, config: dict) -> RunRecord:
        """The record of a run that failed while being set up: what it was asked to run, and why it did not."""
        kept = {"schema", "status", "message", "run_dir", "choices", "seed", "config"}
        absent = frozenset(f.name for f in fields(cls) if f.name not in kept)
        return cls(
            status=status, message=message, run_dir=run_dir, choices=choices, seed=seed, config=config, absent=absent
        )

    def put(self, name: str, value: object) -> None:
        """A section by name: a field of the record, or (a section this class does not declare, such
        as a new instrument's summary) a key of its own after them."""
        if name in {f.name for f in fields(self)} - {"extra", "absent"}:
            setattr(self, name, value)
        else:
            self.extra[name] = value

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the record: the run's history, which a resumed launch continues."""
        keys = ("config", "metrics", "sample_grids", "started_at", "nondeterministic_ops", "git", "segments")
        return {k: getattr(self, k) for k in keys}

    def resume(self, saved: dict) -> None:
        """This launch's record continues the run of the checkpoint `saved`: its start, its launches,
        its last evaluation, and the place it resumes from."""
        from ..provenance import describe_code, now_iso  # here: the report reads records without loading torch

        step = saved["step"]
        # Until this launch writes one, the checkpoint it resumed is what a relaunch would resume.
        self.checkpoint_step = self.steps = self.resumed_from_step = step
        self.samples = saved["samples"]
        self.metrics = saved["metrics"]
        if self.sample_grids is not None:
            self.sample_grids = saved["sample_grids"]
        self.started_at, self.resumed_at = saved["started_at"], now_iso()
        if self.nondeterministic_ops is not None:
            self.nondeterministic_ops.extend(
                op for op in saved["nondeterministic_ops"] if op not in self.nondeterministic_ops
            )
        if saved["git"] != self.git:
            print(
                f"mpt-run: warning: the checkpoint was written by {describe_code(saved['git'])}; "
                f"this is {describe_code(self.git)}",
                flush=True,
            )
        assert self.segments is not None  # the initial record's
        self.segments = [*saved["segments"], *self.segments]
        self.segments[-1]["from_step"] = self.segments[-1]["to_step"] = step

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            if f.name in ("extra", "absent"):
                continue
            value = getattr(self, f.name)
            if f.name in self.absent and value == (f.default_factory() if callable(f.default_factory) else f.default):
                continue
            out[f.name] = value
        return {**out, **self.extra}

    @classmethod
    def starting(
        cls,
        cfg: DictConfig,
        *,
        run_dir: Path,
        variant: str,
        device: torch.device,
        dist: Dist,
        task: Task,
        data_info: dict,
        total_steps: int,
        fp32_math: dict,
        channels_last: bool,
        products: dict | None,
    ) -> RunRecord:
        """A run's record as it starts (status `running`): its config, its mode as the engine set it
        up (`fp32_math`, `channels_last`, the FP8/MX `products`), the data, the task, the machine and
        the code."""
        # Imported here: the report reads records without loading torch.
        from ..config import GROUPS, as_plain, static_scale_value
        from ..distributed import backend
        from ..precision.engine import computes_low_precision_on_cpu
        from ..precision.optim import effective_lr
        from ..provenance import code_identity, environment, now_iso

        code = code_identity()
        plain = as_plain(cfg)
        return cls(
            status="running",
            run_dir=str(run_dir),
            choices={k: plain[k]["name"] for k in GROUPS},
            variant=variant,
            seed=cfg.seed,
            config=plain,
            precision={
                "name": cfg.precision.name,
                "label": cfg.precision.label,
                "param_dtype": cfg.precision.param_dtype.name,
                "master_weights": cfg.precision.master_weights,
                "norm_fp32": cfg.precision.norm_fp32,
                "autocast": cfg.precision.autocast.name if cfg.precision.autocast else None,
                "update": cfg.precision.update_rule.name,
                "fp32_math": fp32_math,
                "tf32_active": bool(cfg.precision.tf32 and device.type == "cuda"),  # TF32 exists only on CUDA
                "channels_last": channels_last,
                # FP16/BF16 products and LSTMs on a CPU: as a GPU's (cpu_tensor_cores.py) or torch's own kernels
                "cpu_arithmetic": ("emulated" if cfg.emulate_tensor_cores else "native")
                if computes_low_precision_on_cpu(cfg.precision, device)
                else None,
                "autocast_lists": "cuda" if cfg.precision.autocast else None,  # on a CPU too (cuda_autocast.py)
                "products": products,
            },
            scale_config={
                "strategy": cfg.scale.name,
                "value": static_scale_value(cfg) if cfg.scale.name == "static" else None,
            },
            optim={
                "name": cfg.optim.name,
                "lr": effective_lr(cfg),
                "lr_config": cfg.optim.lr,
                "lr_batch": cfg.optim.lr_batch,
                "batch_size": cfg.schedule.batch_size,
            },
            # schedule.batch_size is the global batch; each process trains on its slice of it.
            distributed={
                "world_size": dist.world_size,
                "backend": backend(device) if dist.enabled else None,
                "launcher": dist.launcher,  # who started the ranks: torchrun, or a SLURM step's tasks
                "global_batch_size": cfg.schedule.batch_size,
                "per_process_batch_size": cfg.schedule.batch_size // dist.world_size,
                "allreduce_dtype": cfg.precision.allreduce_dtype.name
                if cfg.precision.allreduce_dtype
                else "the gradients' own",
                "sync_batchnorm": cfg.distributed.sync_batchnorm,
                "gradient_as_bucket_view": cfg.distributed.gradient_as_bucket_view,
                "broadcast_buffers": cfg.distributed.broadcast_buffers,
                "static_graph": cfg.distributed.static_graph,
                "evaluation": "sharded" if dist.enabled else "whole",  # each rank scores its part of the set
            },
            data={k: v for k, v in data_info.items() if isinstance(v, (str, int, float, bool, type(None)))},
            total_steps=total_steps,
            steps=0,
            samples=0,
            primary_metric=task.primary_metric,
            higher_is_better=task.higher_is_better,
            evaluation=task.evaluation_info,
            train_loss_definition=task.loss_definition or None,
            sample_grids=[] if task.saves_samples else None,
            environment=environment(device),
            git=code,
            segments=[{"from_step": 0, "to_step": 0, "total_steps": total_steps, "git": dict(code)}],
            started_at=now_iso(),
            nondeterministic_ops=[] if cfg.deterministic else None,
        )

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.to_dict())


class NullLog:
    """The log of a process that writes none (a torchrun rank other than 0)."""

    def write(self, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsLog:
    """metrics.jsonl: one line per training step and network, one per evaluation."""

    def __init__(self, path: Path, keep_before_step: int | None = None):
        """A fresh log, or, resuming from a checkpoint at `keep_before_step`, the log of the steps
        before it (and the evaluation at it): rows a killed run wrote past its checkpoint go."""
        self.path = path
        kept = []
        if keep_before_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut short by the kill
                    continue
                limit = keep_before_step if row.get("kind") == "eval" else keep_before_step - 1
                if row.get("step", limit + 1) <= limit:
                    kept.append(line + "\n")
        # Rewritten through a temporary file: a kill now must not lose the log of the steps kept.
        write_text_atomic(path, "".join(kept))
        self._file: TextIO = open(path, "a")

    def write(self, rows: list[dict]) -> None:
        # A line cut short by a full disk is dropped when a resume reads the log back.
        try:
            for row in rows:
                self._file.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as e:
            raise failed_write(self.path, e) from e

    def close(self) -> None:
        try:
            self._file.close()  # flushes what a failed write left in the buffer: it can fail again
        except OSError as e:
            raise failed_write(self.path, e) from e
