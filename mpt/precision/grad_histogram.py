"""Where gradient values lie against FP16's range: the statistics behind the paper's Figures 2b and 3.

A histogram of floor(log2|v|) over FP32's whole range (2^-149 to 2^127, one bin per power of two),
with zeros, non-finite values and FP16 overflows counted apart. Because the bins are powers of two,
a loss scale of 2^k moves every value exactly k bins, so what a scale would keep or lose is read
off the histogram without approximation.

FP16's thresholds, with round-to-nearest-even as a cast does it: values below 2^-25 become zero
(the paper's "below 2^-24": values in [2^-25, 2^-24) round up to the smallest subnormal, 2^-24,
except 2^-25 itself, a tie that rounds to zero and is counted as kept); values in [2^-25, 2^-14)
end up subnormal (fewer significant bits); values of 65520 and more overflow to inf (65504 is the
largest finite value and everything below 65520 rounds to it).
Counts accumulate on the tensors' device: nothing reaches the host until `summary()`.
"""

from __future__ import annotations

import math

import torch

FP32_MIN_EXP = -149  # 2^-149: FP32's smallest subnormal
FP32_MAX_EXP = 127  # every finite FP32 value is below 2^128
NBINS = FP32_MAX_EXP - FP32_MIN_EXP + 1
FP16_KEPT_EXP = -25  # the lowest bin that survives a cast (rounding up to 2^-24)
FP16_MIN_NORMAL_EXP = -14
FP16_MAX = 65504.0  # the largest finite value
FP16_OVERFLOW = 65520.0  # the smallest value that rounds to inf
CHUNK = 2**22  # values counted at once: bounds the temporaries (~40 bytes a value) on a sampled step


def exponents(values: torch.Tensor) -> torch.Tensor:
    """floor(log2|v|) of non-zero finite values, exactly (frexp: v = m * 2^e with |m| in [0.5, 1))."""
    _, e = torch.frexp(values.float())
    return e.long() - 1


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """The values of `t` as one dimension in memory order: a view, not a copy, for contiguous and
    channels-last tensors alike (the order does not matter to a histogram)."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    return t.permute(order).reshape(-1)


class GradHistogram:
    """Counts of one set of gradient values (a layer's, or all of them), accumulated over calls to `add`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.bins = torch.zeros(NBINS, dtype=torch.int64, device=device)
        # zeros, non-finite, finite that overflow FP16
        self.counts = torch.zeros(3, dtype=torch.int64, device=device)
        self.max_abs = torch.zeros((), dtype=torch.float32, device=device)

    def add(self, values: torch.Tensor, scale: float = 1.0) -> None:
        """Count `values / scale` (gradients of a loss multiplied by `scale`, counted unscaled)."""
        for chunk in flat_view(values.detach()).split(CHUNK):
            self._add(chunk, scale)

    def _add(self, values: torch.Tensor, scale: float) -> None:
        v = values.float().abs()
        if scale != 1.0:
            v = v / scale
        finite = torch.isfinite(v)
        nonzero = finite & (v != 0)
        # Zeros and non-finite values go to one extra bin that is dropped; scatter_add_ rather than
        # a boolean index or bincount, which make the host wait for a CUDA device on every call.
        index = torch.where(nonzero, exponents(v) - FP32_MIN_EXP, NBINS)
        extended = torch.zeros(NBINS + 1, dtype=torch.int64, device=v.device)
        extended.scatter_add_(0, index, torch.ones((), dtype=torch.int64, device=v.device).expand_as(index))
        self.bins += extended[:NBINS]
        self.counts += torch.stack([(v == 0).sum(), (~finite).sum(), (finite & (v >= FP16_OVERFLOW)).sum()])
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
        turns to zero, holds as subnormals, holds as normal numbers, or overflows; the smallest
        power-of-two scale (at least 1) that keeps `keep` of them from becoming zero without
        overflowing the largest; the largest power-of-two scale that keeps the largest finite."""
        bins = self.bins.cpu()
        zeros, nonfinite, overflow = (int(c) for c in self.counts.cpu())
        nonzero = int(bins.sum())
        max_abs = float(self.max_abs)
        first = -FP32_MIN_EXP  # index of 2^0
        lost = int(bins[: first + FP16_KEPT_EXP].sum())
        subnormal = int(bins[first + FP16_KEPT_EXP : first + FP16_MIN_NORMAL_EXP].sum())
        share = (lambda n: n / nonzero) if nonzero else (lambda n: 0.0)
        max_safe = max_safe_scale(max_abs)
        return {
            "values": nonzero + zeros + nonfinite,
            "zeros": zeros,
            "nonfinite": nonfinite,
            "nonzero": nonzero,
            "share_zero": zeros / max(1, nonzero + zeros),
            "share_lost_fp16": share(lost),
            "share_subnormal_fp16": share(subnormal),
            "share_normal_fp16": share(nonzero - lost - subnormal - overflow),
            "share_overflow_fp16": share(overflow),
            "max_abs": max_abs,
            "max_safe_scale": max_safe,
            "recommended_scale": recommended_scale(bins, keep, max_safe),
            "keep": keep,
            "log2_bins": {str(i + FP32_MIN_EXP): int(c) for i, c in enumerate(bins.tolist()) if c},
        }


def max_safe_scale(max_abs: float) -> float | None:
    """The largest 2^k with max_abs * 2^k still finite in FP16 (below 65520); None for no values."""
    if not max_abs > 0:
        return None
    k = math.floor(math.log2(FP16_OVERFLOW / max_abs))
    while max_abs * 2.0**k >= FP16_OVERFLOW:  # log2's rounding at an exact power of two
        k -= 1
    return 2.0**k


def kept_share(bins: torch.Tensor, log2_scale: int) -> float:
    """The share of non-zero values that stay non-zero in FP16 after scaling by 2^log2_scale."""
    total = int(bins.sum())
    if total == 0:
        return 1.0
    cut = max(0, -FP32_MIN_EXP + FP16_KEPT_EXP - log2_scale)  # bins below it become zero
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
