"""Where gradient values lie against FP16's range: the statistics behind the paper's Figures 2b and 3.

A histogram of floor(log2|v|) over FP32's whole range (2^-149 to 2^127, one bin per power of two),
with zeros, non-finite values and FP16 overflows (|v| > 65504) counted apart. Because the bins are
powers of two, a loss scale of 2^k moves every value exactly k bins, so what a scale would keep or
lose is read off the histogram without approximation.

FP16's thresholds: values below 2^-24 (its smallest subnormal) become zero; values in
[2^-24, 2^-14) are subnormal (fewer significant bits); values above 65504 overflow to inf.
Counts accumulate on the tensors' device: nothing reaches the host until `summary()`.
"""

from __future__ import annotations

import math

import torch

FP32_MIN_EXP = -149  # 2^-149: FP32's smallest subnormal
FP32_MAX_EXP = 127  # every finite FP32 value is below 2^128
NBINS = FP32_MAX_EXP - FP32_MIN_EXP + 1
FP16_MIN_SUBNORMAL_EXP = -24
FP16_MIN_NORMAL_EXP = -14
FP16_MAX = 65504.0


def exponents(values: torch.Tensor) -> torch.Tensor:
    """floor(log2|v|) of non-zero finite values, exactly (frexp: v = m * 2^e with |m| in [0.5, 1))."""
    _, e = torch.frexp(values.float())
    return e.long() - 1


class GradHistogram:
    """Counts of one set of gradient values (a layer's, or all of them), accumulated over calls to `add`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.bins = torch.zeros(NBINS, dtype=torch.int64, device=device)
        # zeros, non-finite, finite above FP16_MAX
        self.counts = torch.zeros(3, dtype=torch.int64, device=device)
        self.max_abs = torch.zeros((), dtype=torch.float32, device=device)

    def add(self, values: torch.Tensor, scale: float = 1.0) -> None:
        """Count `values / scale` (gradients of a loss multiplied by `scale`, counted unscaled)."""
        v = values.detach().float().flatten().abs()
        if scale != 1.0:
            v = v / scale
        finite = torch.isfinite(v)
        nonzero = finite & (v != 0)
        # Zeros and non-finite values go to one extra bin that is dropped: a boolean index would
        # make the host wait for the device on every call.
        index = torch.where(nonzero, exponents(v) - FP32_MIN_EXP, NBINS)
        self.bins += torch.bincount(index, minlength=NBINS + 1)[:NBINS]
        self.counts += torch.stack([(v == 0).sum(), (~finite).sum(), (finite & (v > FP16_MAX)).sum()])
        if v.numel():
            self.max_abs = torch.maximum(self.max_abs, torch.where(finite, v, 0).max())

    def merge(self, other: "GradHistogram") -> "GradHistogram":
        """Add another histogram's counts to this one (a network's total from its layers)."""
        self.bins += other.bins.to(self.bins.device)
        self.counts += other.counts.to(self.counts.device)
        self.max_abs = torch.maximum(self.max_abs, other.max_abs.to(self.max_abs.device))
        return self

    def state_dict(self) -> dict:
        return {"bins": self.bins.cpu(), "counts": self.counts.cpu(), "max_abs": self.max_abs.cpu()}

    def load_state_dict(self, state: dict) -> None:
        device = self.bins.device
        self.bins, self.counts, self.max_abs = (state[k].to(device) for k in ("bins", "counts", "max_abs"))

    def summary(self, keep: float = 0.999) -> dict:
        """The counts and what they mean for FP16: shares of the non-zero finite values that FP16
        turns to zero, holds as subnormals, or overflows; the smallest power-of-two scale (at least
        1) that keeps `keep` of them from becoming zero without overflowing the largest; the largest
        power-of-two scale that keeps the largest below 65504."""
        bins = self.bins.cpu()
        zeros, nonfinite, overflow = (int(c) for c in self.counts.cpu())
        nonzero = int(bins.sum())
        max_abs = float(self.max_abs)
        first = -FP32_MIN_EXP  # index of 2^0
        lost = int(bins[: first + FP16_MIN_SUBNORMAL_EXP].sum())
        subnormal = int(bins[first + FP16_MIN_SUBNORMAL_EXP : first + FP16_MIN_NORMAL_EXP].sum())
        max_safe = 2.0 ** math.floor(math.log2(FP16_MAX / max_abs)) if max_abs > 0 else None
        return {
            "values": nonzero + zeros + nonfinite,
            "zeros": zeros,
            "nonfinite": nonfinite,
            "nonzero": nonzero,
            "share_zero": zeros / max(1, nonzero + zeros),
            "share_lost_fp16": lost / nonzero if nonzero else 0.0,
            "share_subnormal_fp16": subnormal / nonzero if nonzero else 0.0,
            "share_overflow_fp16": overflow / nonzero if nonzero else 0.0,
            "max_abs": max_abs,
            "max_safe_scale": max_safe,
            "recommended_scale": recommended_scale(bins, keep, max_safe),
            "keep": keep,
            "log2_bins": {str(i + FP32_MIN_EXP): int(c) for i, c in enumerate(bins.tolist()) if c},
        }


def kept_share(bins: torch.Tensor, log2_scale: int) -> float:
    """The share of non-zero values that stay non-zero in FP16 after scaling by 2^log2_scale."""
    total = int(bins.sum())
    if total == 0:
        return 1.0
    cut = max(0, -FP32_MIN_EXP + FP16_MIN_SUBNORMAL_EXP - log2_scale)  # bins below it become zero
    return int(bins[cut:].sum()) / total


def recommended_scale(bins: torch.Tensor, keep: float, max_safe: float | None) -> float | None:
    """The smallest 2^k, k >= 0, keeping `keep` of the values from flushing to zero, capped at
    `max_safe`. None when no such scale exists: the share needs a scale that would overflow."""
    for k in range(0, FP32_MAX_EXP - FP32_MIN_EXP):
        if max_safe is not None and 2.0**k > max_safe:
            return None
        if kept_share(bins, k) >= keep:
            return 2.0**k
    return None
