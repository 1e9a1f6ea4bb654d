"""Loss scalers: none, static, dynamic and auto behind one interface.

The scale is a host float: the overflow decision has to reach the host anyway (to skip the update
and to leave the LR schedule alone), so keeping S on the device would buy nothing.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from omegaconf import DictConfig

from ..config import MAX_SHIFT_DOWN, SCALE_NAMES, ConfigError, static_scale_value
from .grad_histogram import FP16_MAX

log = logging.getLogger("mpt")


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
        # The overflows before the first clean step are the search for a scale that fits (a dynamic
        # scaler backing off from its start); the summary tells them from later ones.
        initial = next((i for i, o in enumerate(self.overflows) if not o), len(self.overflows))
        return {
            "initial": self.scales[0] if self.scales else final,
            "final": final,
            "min": min([*self.scales, final]),  # final: the scale the next step would use
            "max": max([*self.scales, final]),
            "skipped_steps": sum(self.overflows),
            "initial_skips": initial,
            "steps": len(self.scales),
        }


class LossScaler:
    """S = 1 and no overflow check (scale=none). Subclasses add to state_dict; the history is kept
    by `full_state_dict`, so a resumed run's record counts the steps before the checkpoint."""

    checks_overflow = False
    observes_grad_max = False  # whether update() needs the step's largest unscaled gradient

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)
        self.history = ScaleHistory()

    def update(self, overflow: bool, grad_max: float | None = None) -> None:
        """Called once per step after the overflow check, before the next backward. `grad_max`:
        the largest finite |gradient| of the step, unscaled (only for a scaler that observes it)."""
        self.history.scales.append(self.scale)
        self.history.overflows.append(overflow)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])

    def summary(self) -> dict:
        return self.history.summary(self.scale)

    def untrained(self) -> str | None:
        """Why a run that ended now trained nothing: every one of its steps was skipped. None where
        a step was applied (or none was taken)."""
        h = self.history
        if not h.overflows or not all(h.overflows):
            return None
        return (
            f"skipped every one of its {len(h.overflows)} steps: the gradients overflowed FP16 {self._scales_tried()}"
        )

    def _scales_tried(self) -> str:
        return f"at every scale it tried, {self.history.scales[0]:g} down to {min(self.history.scales):g}"

    def full_state_dict(self) -> dict:
        return {
            **self.state_dict(),
            "history": {"scales": list(self.history.scales), "overflows": list(self.history.overflows)},
        }

    def load_full_state_dict(self, state: dict) -> None:
        self.load_state_dict(state)
        self.history = ScaleHistory(list(state["history"]["scales"]), list(state["history"]["overflows"]))


class StaticScaler(LossScaler):
    """A fixed S; an overflowing step is skipped and counted. `max_consecutive_skips` skipped steps
    in a row end the run as diverged: nothing changes S, so a scale that overflows that long would
    overflow to the end of the schedule."""

    checks_overflow = True

    def __init__(self, scale: float, max_consecutive_skips: int = 100, warn_consecutive_skips: int = 20):
        super().__init__(scale)
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.warn_consecutive_skips = int(warn_consecutive_skips)
        self.warned = False

    def update(self, overflow: bool, grad_max: float | None = None) -> None:
        super().update(overflow)
        # The skips in a row, read off the history (which a checkpoint keeps): it stops at the first
        # applied step from the end, so it never reads more than the limit.
        overflows = self.history.overflows
        in_a_row = next((i for i, o in enumerate(reversed(overflows)) if not o), len(overflows))
        if in_a_row >= self.warn_consecutive_skips and not self.warned and in_a_row < self.max_consecutive_skips:
            self.warned = True  # once a run: a scale that fits again and overflows again says nothing new
            log.warning(
                "static scale %g overflowed every step for %d steps, each skipped; lower scale.value "
                "(the run ends as diverged at %d: scale.max_consecutive_skips)",
                self.scale,
                in_a_row,
                self.max_consecutive_skips,
            )
        if in_a_row >= self.max_consecutive_skips:
            raise Diverged(
                f"static scale {self.scale:g} overflowed every step for {in_a_row} steps; lower scale.value "
                f"(scale.max_consecutive_skips={self.max_consecutive_skips})"
            )

    def load_full_state_dict(self, state: dict) -> None:
        super().load_full_state_dict(state)
        # warned before the checkpoint: its history holds a run of skips that long
        run, longest = 0, 0
        for overflow in self.history.overflows:
            run = run + 1 if overflow else 0
            longest = max(longest, run)
        self.warned = longest >= self.warn_consecutive_skips

    def _scales_tried(self) -> str:
        return f"at the static scale {self.scale:g}; lower scale.value"


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

    def update(self, overflow: bool, grad_max: float | None = None) -> None:
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


class AutoScaler(LossScaler):
    """A scale read off the gradients' running statistics, in the spirit of OpenSeq2Seq's LogMax
    scaler: x = log2 max|g| of each step's unscaled gradients; a fast bias-corrected mean of x
    (beta1) and a slow mean and second moment (beta2) give its spread sigma; the next scale is

        S = 2^floor(log2 65504 - margin_bits - (mean + std_devs * sigma)),

    clamped to [min, max]: the expected largest gradient times S stays below FP16's maximum by
    `std_devs` standard deviations and `margin_bits` more. Powers of two, so scaling is exact.

    A step is skipped only when its gradients did overflow. That step's x is unknown but at least
    log2(65504 / S); one bit above that enters the estimates, and the next scale is at most half
    the last, so a run whose loss is itself non-finite reaches `min` and is declared diverged, as
    with `dynamic`. Unlike `dynamic`, nothing probes upwards: the scale follows the gradients.

    OpenSeq2Seq (automatic_loss_scaler.py) differs in the details: it targets 2^16 with no margin,
    does not round to a power of two, and treats an overflow as an observation of 2^16 bits.
    """

    checks_overflow = True
    observes_grad_max = True

    def __init__(
        self, init: float, min: float, max: float, beta1: float, beta2: float, std_devs: float, margin_bits: float
    ):
        super().__init__(init)
        self.min, self.max = float(min), float(max)
        self.beta1, self.beta2, self.std_devs, self.margin_bits = (
            float(beta1),
            float(beta2),
            float(std_devs),
            float(margin_bits),
        )
        self.fast_mean = self.slow_mean = self.slow_square = 0.0  # uncorrected exponential averages of x
        self.observations = 0

    def estimates(self) -> tuple[float, float]:
        """The bias-corrected mean and standard deviation of log2 max|g|."""
        n = self.observations
        mean = self.fast_mean / (1 - self.beta1**n)
        slow_mean = self.slow_mean / (1 - self.beta2**n)
        square = self.slow_square / (1 - self.beta2**n)
        return mean, math.sqrt(max(square - slow_mean**2, 0.0))

    def update(self, overflow: bool, grad_max: float | None = None) -> None:
        super().update(overflow)
        if overflow:
            if self.scale <= self.min:
                raise Diverged(f"gradients overflow at the minimum loss scale {self.min:g}")
            x = math.log2(FP16_MAX / self.scale) + 1
        elif grad_max is None or not grad_max > 0:
            return  # no non-zero gradient: nothing to learn from
        else:
            x = math.log2(grad_max)
        self.observations += 1
        self.fast_mean = self.beta1 * self.fast_mean + (1 - self.beta1) * x
        self.slow_mean = self.beta2 * self.slow_mean + (1 - self.beta2) * x
        self.slow_square = self.beta2 * self.slow_square + (1 - self.beta2) * x * x
        mean, sigma = self.estimates()
        proposed = 2.0 ** math.floor(math.log2(FP16_MAX) - self.margin_bits - (mean + self.std_devs * sigma))
        if overflow:
            proposed = min(proposed, self.scale / 2)
        self.scale = min(max(proposed, self.min), self.max)

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "fast_mean": self.fast_mean,
            "slow_mean": self.slow_mean,
            "slow_square": self.slow_square,
            "observations": self.observations,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.fast_mean, self.slow_mean, self.slow_square = (
            float(state[k]) for k in ("fast_mean", "slow_mean", "slow_square")
        )
        self.observations = int(state["observations"])


def validate(cfg: DictConfig) -> None:
    """Raises ConfigError naming the first bad setting of `scale` (cfg: the whole run config)."""
    scale = cfg.scale
    if scale.name not in SCALE_NAMES:
        raise ConfigError(f"scale.name={scale.name}: expected one of {', '.join(SCALE_NAMES)}")
    if not 0 <= scale.shift_down <= MAX_SHIFT_DOWN:
        raise ConfigError(
            f"scale.shift_down={scale.shift_down}: must be an integer from 0 to {MAX_SHIFT_DOWN} "
            "(2^-k a normal FP32 number)"
        )
    if scale.name == "static":
        value = static_scale_value(cfg)
        if not (value >= 1 and math.isfinite(value)):
            raise ConfigError(f"scale.value={value}: a static loss scale must be a finite number >= 1")
        for key in ("max_consecutive_skips", "warn_consecutive_skips"):
            if scale[key] < 1:
                raise ConfigError(f"scale.{key}={scale[key]}: must be a positive number of steps")
    if scale.name == "dynamic":
        if not (1 <= scale.min <= scale.init <= scale.max and math.isfinite(scale.max)):
            raise ConfigError(
                "scale: need 1 <= scale.min <= scale.init <= scale.max "
                f"(got min={scale.min}, init={scale.init}, max={scale.max})"
            )
        if not scale.growth > 1:
            raise ConfigError(f"scale.growth={scale.growth}: must be > 1")
        if not 0 < scale.backoff < 1:
            raise ConfigError(f"scale.backoff={scale.backoff}: must be between 0 and 1")
        if scale.interval < 1:
            raise ConfigError(f"scale.interval={scale.interval}: must be a positive integer")
    if scale.name == "auto":
        if not (0 < scale.min <= scale.init <= scale.max and math.isfinite(scale.max)):
            raise ConfigError(
                "scale: need 0 < scale.min <= scale.init <= scale.max "
                f"(got min={scale.min}, init={scale.init}, max={scale.max})"
            )
        for key in ("beta1", "beta2"):
            if not 0 < scale[key] < 1:
                raise ConfigError(f"scale.{key}={scale[key]}: must be between 0 and 1")
        for key in ("std_devs", "margin_bits"):
            if not (scale[key] >= 0 and math.isfinite(scale[key])):
                raise ConfigError(f"scale.{key}={scale[key]}: must be a finite number >= 0")


def build_scaler(cfg: DictConfig) -> LossScaler:
    """cfg: the whole run config (a static scale defaults to the model's value)."""
    s = cfg.scale
    if s.name == "none":
        return LossScaler(1.0)
    if s.name == "static":
        return StaticScaler(static_scale_value(cfg), s.max_consecutive_skips, s.warn_consecutive_skips)
    if s.name == "auto":
        return AutoScaler(s.init, s.min, s.max, s.beta1, s.beta2, s.std_devs, s.margin_bits)
    return DynamicScaler(s.init, s.interval, s.growth, s.backoff, s.min, s.max)
