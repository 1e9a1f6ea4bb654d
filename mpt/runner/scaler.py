"""Loss scalers: none, static and dynamic behind one interface.

The scale is a host float: the overflow decision has to reach the host anyway (to skip the update
and to leave the LR schedule alone), so keeping S on the device would buy nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from .config import static_scale_value


class Diverged(RuntimeError):
    """Training can no longer make progress: a non-finite loss or weight, or overflow at the minimum scale."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


@dataclass
class ScaleHistory:
    scales: list[float] = field(default_factory=list)  # the scale each step's backward ran with
    overflows: list[bool] = field(default_factory=list)

    def summary(self, final: float) -> dict:
        return {
            "final": final,
            "min": min([*self.scales, final]),  # final: the scale the next step would use
            "max": max([*self.scales, final]),
            "skipped_steps": sum(self.overflows),
            "steps": len(self.scales),
        }


class LossScaler:
    """S = 1 and no overflow check (scale=none). Subclasses add to state_dict; the history is kept
    by `full_state_dict`, so a resumed run's record counts the steps before the checkpoint."""

    checks_overflow = False

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)
        self.history = ScaleHistory()

    def update(self, overflow: bool) -> None:
        """Called once per step after the overflow check, before the next backward."""
        self.history.scales.append(self.scale)
        self.history.overflows.append(overflow)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])

    def summary(self) -> dict:
        return self.history.summary(self.scale)

    def full_state_dict(self) -> dict:
        return {**self.state_dict(), "history": {"scales": list(self.history.scales), "overflows": list(self.history.overflows)}}

    def load_full_state_dict(self, state: dict) -> None:
        self.load_state_dict(state)
        self.history = ScaleHistory(list(state["history"]["scales"]), list(state["history"]["overflows"]))


class StaticScaler(LossScaler):
    """A fixed S; an overflowing step is skipped and counted."""

    checks_overflow = True


class DynamicScaler(LossScaler):
    """torch.amp.GradScaler's rule: on overflow S *= backoff and the clean-step count restarts;
    after `interval` clean steps in a row S *= growth. Bounded by [min, max]; an overflow at `min`
    means no scale can save the step, and the run is declared diverged."""

    checks_overflow = True

    def __init__(self, init: float, interval: int, growth: float, backoff: float, min: float, max: float):
        super().__init__(init)
        self.interval, self.growth, self.backoff = int(interval), float(growth), float(backoff)
        self.min, self.max = float(min), float(max)
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        super().update(overflow)
        if overflow:
            if self.scale <= self.min:
                raise Diverged(f"gradients overflow at the minimum loss scale {self.min:g}")
            self.scale = max(self.scale * self.backoff, self.min)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.interval:
            self.scale = min(self.scale * self.growth, self.max)
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


def build_scaler(cfg: DictConfig) -> LossScaler:
    """cfg: the whole run config (a static scale defaults to the model's value)."""
    s = cfg.scale
    if s.name == "none":
        return LossScaler(1.0)
    if s.name == "static":
        return StaticScaler(static_scale_value(cfg))
    return DynamicScaler(s.init, s.interval, s.growth, s.backoff, s.min, s.max)
