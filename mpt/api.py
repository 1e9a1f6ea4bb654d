"""mpt from Python, without a config file: `run` makes one run as `mpt-run` does and returns its record;
`analyze` takes any network, a batch and a loss function through a few training steps of a precision
mode and returns its numerics: the format atlas, the weight updates FP16 loses and the first tensor
that overflowed."""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable, Iterable, Iterator, Sequence

import pandas as pd
import torch
from hydra import compose, initialize_config_module
from torch import nn

from .config import ConfigError
from .distributed import Dist
from .models import LossTerm, OneNetwork
from .precision.engine import check_device_support, forward_context, fp32_math
from .runner import cli
from .runner.engines import Plan, build_engines
from .runner.instruments import RunEnd, around_step, standard
from .runner.record import RunRecord
from .runner.stepping import Stepper
from .runner.validation import validate


def run(overrides: Sequence[str] = ()) -> RunRecord:
    """One run of `mpt-run <overrides>`: the same folder, lock, record and summary. A run the folder
    already finished is not run again; its record is returned. A bad value raises ConfigError with
    mpt-run's one line."""
    args = [str(o) for o in overrides]
    if {"-m", "--multirun"} & set(args):
        raise ValueError("mpt.run makes one run: call it once per run, or sweep with mpt-run -m")
    problem = cli.preflight(args)
    if problem:
        raise ConfigError(problem)
    argv, sys.argv = sys.argv, ["mpt-run", *args]
    cli.LAST_RUN_DIR, cli.LAST_REFUSAL = None, None
    try:
        cli.launch()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if code >= 128:  # a preemption signal or a second Ctrl-C: the caller's loop stops too
            raise
        if cli.LAST_REFUSAL is not None:  # stopped before running: a bad value, or the folder's run is running
            raise cli.LAST_REFUSAL from None
        # a run that failed (`error`, `oom`) wrote its record: returned below, as for mpt-run's exit 1
    finally:
        sys.argv = argv
    if cli.LAST_RUN_DIR is None or not (cli.LAST_RUN_DIR / "result.json").exists():
        raise RuntimeError(f"mpt.run: mpt-run {' '.join(args)} wrote no record")
    return RunRecord.load(cli.LAST_RUN_DIR / "result.json")


class _Given(OneNetwork):
    """A network and its loss, as the training loop's Task."""

    sample_unit = "samples"
    primary_metric = "loss"
    higher_is_better = False

    def __init__(self, net: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor]):
        self.net, self.loss_fn = net, loss_fn

    def train_losses(self, batch: Any) -> Iterator[LossTerm]:
        yield LossTerm("model", self.loss_fn(self.net, batch).float())

    def count_samples(self, batch: Any) -> int:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        return int(first.shape[0]) if isinstance(first, torch.Tensor) else 1


ATLAS_COLUMNS = ["share_underflow", "share_subnormal", "share_overflow", "share_lost", "sqnr_db", "recommended_scale"]


def analyze(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    formats: Sequence[str] = ("fp16", "bf16", "e4m3", "e5m2"),
    precision: str = "mixed",
    scale: float | None = 65536.0,
    lr: float = 0.01,
    steps: int = 1,
) -> pd.DataFrame:
    """`steps` SGD steps of a copy of `model` (the model itself is left as it is) on `batch` (or on
    each batch of an iterable of them) in `precision`, its loss `loss_fn(model, batch)` scaled
    dynamically from `scale` (None: unscaled), with learning rate `lr`. One row per layer, tensor role
    and format of the atlas (the shares of values lost to underflow, subnormal or overflow, the SQNR,
    the scale the format wants), and per layer the share of its weights' updates an FP16 weight
    loses (role `update`, format `fp16`, in `share_lost`). `attrs`: `first_overflow` (step, module,
    role of each skipped step's first non-finite tensor), `lost_update_share` and `skipped_steps`."""
    scaling = ["scale=none"] if scale is None else ["scale=dynamic", f"scale.init={scale}", f"scale.max={scale}"]
    overrides = [
        f"precision={precision}", *scaling, f"stats.formats=[{','.join(formats)}]", "stats.lost_updates=true",
        "stats.every=1", "optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", f"optim.lr={lr}",
        "optim.lr_batch=null", "data=synthetic", "schedule=smoke", f"schedule.steps={steps}",
    ]  # fmt: skip
    device = next(model.parameters()).device
    overrides.append(f"device={device}")
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    validate(cfg)
    check_device_support(cfg.precision, device)
    with fp32_math(cfg.precision.tf32):  # as mpt-run sets the process: TF32 only where the mode says so
        return _steps(cfg, _Given(copy.deepcopy(model), loss_fn), batch, steps, device)


def _steps(cfg, task: _Given, batch: Any, steps: int, device: torch.device) -> pd.DataFrame:
    """The run's loop (runner/train.py), without its data, log or record."""
    plan = Plan(total_steps=steps, milestones=[], eval_every=steps)
    engines = build_engines(cfg, task, plan, device, Dist(), channels_last=False)
    tools = standard.build(cfg, engines, device, Dist(), task.sample_unit)
    instruments = tools.all()
    forward = lambda: forward_context(cfg, device)  # noqa: E731  # the mode's autocast, around each forward
    stepper = Stepper(task, engines, tools.grad_stats, tools.tracer, forward, device, deterministic=False)
    batches = _batches(batch, steps)
    for instrument in instruments:
        instrument.start()
    for step in range(steps):
        given = next(batches)
        with around_step(instruments, step):
            stepper.step(step, given, 0)
        done = tools.step_done(step, task.count_samples(given), 0.0)
        for instrument in instruments:
            instrument.after_step(done)
    for instrument in instruments:
        instrument.stop()
    end = RunEnd(finished=True, together=True)
    return _table(tools.grad_stats.summary(end) or {}, tools.tracer.summary(end), engines["model"].scaler.summary())


def _batches(batch: Any, steps: int) -> Iterator[Any]:
    """The same batch at every step, or the iterable's batches in turn."""
    if isinstance(batch, (torch.Tensor, tuple, list, dict)):
        return iter([batch] * steps)
    it: Iterable[Any] = batch
    return iter(it)


def _table(stats: dict, origins: dict | None, scaler: dict) -> pd.DataFrame:
    rows = []
    atlas = (stats.get("atlas") or {}).get("networks", {}).get("model", {})
    for layer, roles in atlas.get("layers", {}).items():
        for role, seen in roles.items():
            for fmt, shares in seen.get("formats", {}).items():
                rows.append({"layer": layer, "role": role, "format": fmt, **{k: shares.get(k) for k in ATLAS_COLUMNS}})
    lost = (stats.get("lost_updates") or {}).get("networks", {}).get("model", {})
    for layer, counts in lost.get("layers", {}).items():
        rows.append({"layer": layer, "role": "update", "format": "fp16", "share_lost": counts["share_lost_fp16"]})
    table = pd.DataFrame(rows, columns=["layer", "role", "format", *ATLAS_COLUMNS])
    first = (origins or {}).get("networks", {}).get("model", {}).get("first", [])
    table.attrs = {
        "first_overflow": first,
        "lost_update_share": lost.get("total", {}).get("share_lost_fp16"),
        "skipped_steps": scaler.get("skipped_steps", 0),
    }
    return table
