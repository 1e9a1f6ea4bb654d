"""The loss scale kept on the device, so that a step never waits for the host (scale.on_device).

The host path (scaler.py) brings each step's overflow flag to the host: to skip the update and to
leave the LR schedule where it is. On a GPU that read is a synchronization per step, which stalls
the queue of kernels the CPU has launched ahead. Here, as in GradScaler's path for fused
optimizers, nothing is read back while training:

- the overflow flag, the scale and the growth tracker are device tensors; torch's own kernels
  check and unscale the gradients and update the scale (`torch._amp_update_scale_`);
- the fused optimizers read the flag and skip the update themselves (their `found_inf`);
- the LR schedule advances on applied steps only, as on the host path: the count of steps applied
  since the last read-back is a device tensor, and each step's lr is read from a table of the
  schedule's next values, which the host computed from its own scheduler.

At a read-back (each flush of the log) the host scaler replays the flags one by one: its history,
its decisions (a divergence at the minimum scale, a static scale that overflows too long) and its
checkpointed state are the host path's own, and the scale it reaches is checked against the
device's. A divergence is therefore found at the flush after it, with the step it happened at.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Callable, Iterator

import numpy as np
import torch
from omegaconf import DictConfig

from ..config import ConfigError, Update, static_scale_value
from .scaler import Diverged, DynamicScaler, LossScaler, StaticScaler

# optim.name -> the device types whose fused kernel takes `found_inf` (torch's fused Adagrad is CPU only)
FUSED_SKIPS = {"sgd": ("cpu", "cuda"), "adam": ("cpu", "cuda"), "adagrad": ("cpu",)}


def why_not(cfg: DictConfig, device: torch.device) -> str | None:
    """Why this run's scale cannot live on the device; None where it can."""
    o, p = cfg.optim, cfg.precision
    if Update(p.update_rule) != Update.optimizer:
        return (
            f"precision={p.name} updates FP16 weights with this project's own update, "
            "which cannot skip a step on the device"
        )
    if o.implementation != "fused":
        return (
            f"optim.implementation={o.implementation}: "
            "only the fused optimizers skip an overflowing step on the device; set optim.implementation=fused"
        )
    if device.type not in FUSED_SKIPS.get(o.name, ()):
        return f"optim.name={o.name} has no fused kernel on {device.type} that skips a step on the device"
    if o.lookahead.start_epoch is not None:
        return "optim.lookahead averages after applied steps, which only the host path counts"
    return _drifting_scale(cfg)


def _drifting_scale(cfg: DictConfig) -> str | None:
    """A scale whose FP32 value on the device would part from the host scaler's float64 one."""
    s = cfg.scale
    if s.name == "static":
        exact = {"value": static_scale_value(cfg)}
    elif s.name == "dynamic":
        for key in ("growth", "backoff"):
            if math.frexp(s[key])[0] != 0.5:
                return (
                    f"scale.{key}={s[key]} is not a power of two: "
                    "the device's FP32 scale would drift from the host scaler's"
                )
        exact = {k: s[k] for k in ("init", "min", "max")}
    else:
        return None
    for key, value in exact.items():
        if float(np.float32(value)) != float(value):
            return f"scale.{key}={value} has no exact FP32 value, which the device's scale would be"
    return None


def resolve(cfg: DictConfig, device: torch.device) -> bool:
    """Whether the run keeps its scale on the device: scale.on_device, or where it is null, on a GPU
    wherever the run allows it. A scaler with nothing to check (scale=none) has nothing to keep, and
    scale=auto reads the largest gradient on the host every step."""
    if cfg.scale.name not in ("static", "dynamic"):
        if cfg.scale.on_device:
            raise ConfigError(
                f"scale.on_device=true: scale={cfg.scale.name} has no device path (static or dynamic have)"
            )
        return False
    why = why_not(cfg, device)
    if cfg.scale.on_device is None:
        return device.type == "cuda" and why is None
    if cfg.scale.on_device and why is not None:
        raise ConfigError(f"scale.on_device=true: {why}")
    return bool(cfg.scale.on_device)


def by_dtype(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """The tensors in groups of one dtype: torch's fused overflow check takes one dtype a call."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return iter(groups.values())


class ResidentScale:
    """One network's scale, overflow flag and schedule position on the device.

    `optimizer`: the fused optimizer that updates; its groups' lr become device tensors. `scheduler`:
    the run's LR schedule, driving a host-only copy of the groups (`shadow`); at each read-back it is
    stepped once per applied step, so its state is the host path's. `window`: the most steps between
    read-backs (the log's interval); a step past it reads back first."""

    def __init__(
        self, host: LossScaler, optimizer: torch.optim.Optimizer, scheduler, device: torch.device, window: int
    ):
        if not isinstance(host, (StaticScaler, DynamicScaler)):
            raise TypeError(f"a device-resident scale follows a static or dynamic scaler, not {type(host).__name__}")
        self.host, self.optimizer, self.scheduler, self.device = host, optimizer, scheduler, device
        self.window = int(window)
        # The fused CUDA kernels read an FP32 lr tensor; on a CPU a float64 one gives the host
        # path's updates bit for bit (its lr is a Python float).
        self.lr_dtype = torch.float64 if device.type == "cpu" else torch.float32
        self.scale = torch.zeros((), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.applied = torch.zeros(1, dtype=torch.int64, device=device)  # steps applied since the read-back
        self.last_found: torch.Tensor | None = None  # the last step's flag (1.0: overflowed, skipped)
        self.pending: list[tuple[int | None, torch.Tensor, torch.Tensor]] = []  # (step, scale, found_inf)
        self.lrs: list[torch.Tensor] = []
        self.sync_from_host()

    def sync_from_host(self) -> None:
        """Set the device state from the host scaler and schedule (at start, after a checkpoint)."""
        for group, lr in zip(self.scheduler.optimizer.param_groups, self._host_lrs()):
            group["lr"] = lr
        self.scale.fill_(self.host.scale)
        self.growth_tracker.fill_(getattr(self.host, "clean_steps", 0))
        self.applied.zero_()
        self.lrs = []
        for group, lr in zip(self.optimizer.param_groups, self._host_lrs()):
            group["lr"] = torch.tensor(lr, dtype=self.lr_dtype, device=self.device)
            self.lrs.append(group["lr"])
        self.table = self._lr_table()

    def _host_lrs(self) -> list[float]:
        # The schedule's own record of its last lr: a checkpoint restores it, not the host copy's groups
        return [float(lr) for lr in self.scheduler.get_last_lr()]

    def _lr_table(self) -> torch.Tensor:
        """Row k: each group's lr after k more applied steps, from the host schedule itself."""
        sched = self.scheduler
        saved, lrs = copy.deepcopy(sched.state_dict()), self._host_lrs()
        rows = [lrs]
        for _ in range(self.window):
            sched.step()
            rows.append(self._host_lrs())
        sched.load_state_dict(saved)
        for group, lr in zip(sched.optimizer.param_groups, lrs):
            group["lr"] = lr
        return torch.tensor(rows, dtype=self.lr_dtype).to(self.device)

    def backward_factor(self, shift: float) -> torch.Tensor:
        """What the loss is multiplied by: the scale, and the control's 2^-k."""
        return self.scale * shift

    def check_and_unscale(
        self, grads: list[torch.Tensor], shift: float, reduce_max: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Unscale the gradients in place; the step's overflow flag (1.0: some gradient is not finite)."""
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        # As GradScaler does: the reciprocal in float64, rounded once to FP32, as the host path's 1/S
        inv = (self.scale.double() * shift).reciprocal().float()
        for same_dtype in by_dtype(grads):
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found, inv)
        return reduce_max(found)

    @contextlib.contextmanager
    def skipping(self, found: torch.Tensor) -> Iterator[None]:
        """The fused optimizer's steps within hold the flag, and skip themselves where it is set."""
        self.optimizer.found_inf = found  # type: ignore[attr-defined]  # read by the fused step, as GradScaler sets it
        try:
            yield
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]

    def advance(self, found: torch.Tensor, step: int | None) -> None:
        """After the step's update: log the scale it ran with, update the scale, move the schedule."""
        if len(self.pending) >= self.window:
            raise RuntimeError(f"{self.window} steps without a read-back: the lr table holds no more")
        self.pending.append((step, self.scale.clone(), found))
        self.last_found = found
        h = self.host
        if isinstance(h, DynamicScaler):
            torch._amp_update_scale_(self.scale, self.growth_tracker, found, h.growth, h.backoff, h.interval)
            # The host scaler's bounds; an overflow at the minimum is its replay's to declare
            self.scale.clamp_(h.min, h.max)
        self.applied.add_((found == 0).long())
        row = self.table.index_select(0, self.applied)[0]
        for i, lr in enumerate(self.lrs):
            lr.copy_(row[i])

    def full(self) -> bool:
        """Whether the next step needs a read-back first."""
        return len(self.pending) >= self.window

    def read_back(self) -> list[tuple[int | None, bool]]:
        """Bring the steps since the last read-back to the host, in one sync, and replay them on
        the host scaler and schedule. Returns (step, overflowed) per step. Raises Diverged (with the
        step) where the host scaler gives up; the steps after it are dropped."""
        if not self.pending:
            return []
        entries, self.pending = self.pending, []
        values = torch.stack(
            [torch.stack([s, f]) for _, s, f in entries] + [torch.stack([self.scale, self.scale])]
        ).tolist()
        outcome: list[tuple[int | None, bool]] = []
        try:
            for (step, _, _), (scale, found) in zip(entries, values):
                self._check(scale, step)
                overflowed = found > 0
                try:
                    self.host.update(overflowed)
                except Diverged as e:
                    e.step = step if e.step is None else e.step
                    raise
                if not overflowed:
                    self.scheduler.step()
                outcome.append((step, overflowed))
            self._check(values[-1][0], None)
        finally:
            self.applied.zero_()
            self.table = self._lr_table()
        return outcome

    def _check(self, device_scale: float, step: int | None) -> None:
        # Both follow one rule from one start: any difference is a bug in this file, not a run's fate.
        if np.float32(self.host.scale) != np.float32(device_scale):
            where = f"at step {step}" if step is not None else "after the last step"
            raise RuntimeError(
                f"the device's loss scale {device_scale:g} left the host scaler's {self.host.scale:g} {where}"
            )
