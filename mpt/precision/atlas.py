"""What a list of number formats would do to one set of values (a layer's tensors of one role):
the numerics atlas's counts.

For each format, of the non-zero finite values: the share that would underflow to zero, that
would be subnormal, and that would overflow (become inf or NaN, or saturate) as they are, at scale
1; the SQNR of the round trip as they are and under current per-tensor scaling (each tensor
multiplied by the largest power of two that keeps its largest value from overflowing, as FP8
recipes scale; block formats under their own block scales); and, from the histogram of log2|v|,
the power-of-two scale that would keep `keep` of them from underflowing without overflow.
SQNR counts an overflowing value at the format's largest value (the saturating policy), so a
single overflow does not make it -inf; the overflow share says how many there were.
"""

from __future__ import annotations

import math

import torch

from .formats import BlockFormat, FloatFormat, Format, quantize_detail
from .grad_histogram import FP32_MIN_EXP, GradHistogram

# Per format: counts of [underflow, subnormal, overflow] and sums of [signal, noise, noise scaled].
_COUNTS, _POWERS = ("underflow", "subnormal", "overflow"), ("signal", "noise", "noise_scaled")


def overflow_threshold(fmt: FloatFormat) -> tuple[float, bool]:
    """The magnitude T from which values round beyond the largest one, and whether T itself does
    (a tie goes to the even neighbour: up when the largest value's last fraction bit is odd)."""
    half_ulp = 2.0 ** (fmt.emax - fmt.man_bits - 1)
    return fmt.max + half_ulp, fmt.specials != "fn"


def max_safe_scale(max_abs: float, fmt: FloatFormat) -> float | None:
    """The largest 2^k with max_abs * 2^k not overflowing `fmt`; None for no non-zero values."""
    if not (max_abs > 0 and math.isfinite(max_abs)):
        return None
    threshold, tie_overflows = overflow_threshold(fmt)

    def fits(k: int) -> bool:
        v = max_abs * 2.0**k
        return v < threshold or (v == threshold and not tie_overflows)

    k = math.floor(math.log2(threshold / max_abs))
    while not fits(k):  # log2's rounding near a power of two, either way
        k -= 1
    while fits(k + 1):
        k += 1
    return 2.0**k


def kept_share(bins: torch.Tensor, log2_scale: int, fmt: FloatFormat) -> float:
    """The share of non-zero values that stay non-zero in `fmt` after scaling by 2^log2_scale: the
    ones at or above half its smallest subnormal (that value itself, a tie, is counted as kept)."""
    total = int(bins.sum())
    if total == 0:
        return 1.0
    cut = min(max(0, (fmt.emin - fmt.man_bits - 1) - log2_scale - FP32_MIN_EXP), bins.numel())
    return int(bins[cut:].sum()) / total


def recommended_scale(bins: torch.Tensor, keep: float, max_safe: float | None, fmt: FloatFormat) -> float | None:
    """The power of two closest to 1 that keeps `keep` of the non-zero values from underflowing
    and overflows none: 1 when the values fit as they are, above 1 when too many would underflow,
    `max_safe` when they would overflow. None when no scale does both."""
    if max_safe is None:
        return None
    if max_safe < 1:
        return max_safe if kept_share(bins, round(math.log2(max_safe)), fmt) >= keep else None
    for k in range(0, round(math.log2(max_safe)) + 1):
        if kept_share(bins, k, fmt) >= keep:
            return 2.0**k
    return None


class FormatAtlas:
    """Counts of one set of values against `formats`, accumulated over calls to `add`; on the
    values' device until `summary()`."""

    def __init__(self, formats: list[Format], device: torch.device | str = "cpu"):
        self.formats = list(formats)
        self.hist = GradHistogram(device)
        self.counts = torch.zeros(len(self.formats), len(_COUNTS), dtype=torch.int64, device=device)
        self.powers = torch.zeros(len(self.formats), len(_POWERS), dtype=torch.float64, device=device)

    def add(self, values: torch.Tensor, scale: float = 1.0, axis: int = -1) -> None:
        """Count `values / scale` (a scaled backward's gradients, counted unscaled); block formats
        group `axis` into blocks."""
        x = values.detach().float()
        if scale != 1.0:
            x = x / scale
        self.hist.add(x)
        finite = torch.isfinite(x)
        nonzero = finite & (x != 0)
        clean = torch.where(finite, x, 0.0)
        signal = clean.double().square().sum()
        max_abs = float(clean.abs().max()) if clean.numel() else 0.0
        for i, fmt in enumerate(self.formats):
            q = quantize_detail(x, fmt, axis=axis)
            saturated = (
                quantize_detail(x, fmt, overflow="saturate", axis=axis).values
                if fmt.overflow != "saturate"
                else q.values
            )
            # A block holding an infinity reads NaN throughout: its finite values count as signal
            # but their error cannot be told, so they are left out of the noise.
            noise = torch.where(finite & torch.isfinite(saturated), saturated - clean, 0.0).double().square().sum()
            if isinstance(fmt, BlockFormat):
                noise_scaled = noise  # the block scales are the format's own
            else:
                k = round(math.log2(max_safe_scale(max_abs, fmt) or 1.0))
                rescaled = _times_pow2(quantize_detail(_times_pow2(clean, k), fmt, overflow="saturate").values, -k)
                noise_scaled = (rescaled - clean).double().square().sum()
            counts = [(nonzero & (q.values == 0)).sum(), (q.subnormal & finite).sum(), (q.overflow & finite).sum()]
            self.counts[i] += torch.stack(counts).to(self.counts.device)
            self.powers[i] += torch.stack([signal, noise, noise_scaled]).to(self.powers.device)

    def merge(self, other: "FormatAtlas") -> "FormatAtlas":
        self.hist.merge(other.hist)
        self.counts += other.counts.to(self.counts.device)
        self.powers += other.powers.to(self.powers.device)
        return self

    def state_dict(self) -> dict:
        return {"hist": self.hist.state_dict(), "counts": self.counts.cpu(), "powers": self.powers.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.hist.load_state_dict(state["hist"])
        self.counts, self.powers = state["counts"].to(self.counts.device), state["powers"].to(self.powers.device)

    def summary(self, keep: float = 0.999, with_bins: bool = False) -> dict:
        """With `with_bins`, also the histogram of floor(log2|v|) (exponent -> count) and the zeros."""
        h = self.hist.summary(keep)
        bins, nonzero, max_abs = self.hist.bins.cpu(), h["nonzero"], h["max_abs"]
        share = (lambda n: n / nonzero) if nonzero else (lambda n: 0.0)
        out = {
            "values": h["values"],
            "nonzero": nonzero,
            "nonfinite": h["nonfinite"],
            "share_zero": h["share_zero"],
            "max_abs": max_abs,
            "formats": {},
        }
        if with_bins:
            out |= {"zeros": h["zeros"], "log2_bins": h["log2_bins"]}
        for i, fmt in enumerate(self.formats):
            underflow, subnormal, overflow = (int(c) for c in self.counts[i].cpu())
            signal, noise, noise_scaled = (float(p) for p in self.powers[i].cpu())
            entry = {
                "share_underflow": share(underflow),
                "share_subnormal": share(subnormal),
                "share_overflow": share(overflow),
                "share_lost": share(underflow + overflow),
                "sqnr_db": _sqnr(signal, noise),
                "sqnr_db_scaled": _sqnr(signal, noise_scaled),
                "scaling": "block" if isinstance(fmt, BlockFormat) else "per-tensor",
            }
            if isinstance(fmt, FloatFormat):
                safe = max_safe_scale(max_abs, fmt)
                entry |= {"max_safe_scale": safe, "recommended_scale": recommended_scale(bins, keep, safe, fmt)}
            out["formats"][fmt.name] = entry
        return out


def _times_pow2(x: torch.Tensor, k: int) -> torch.Tensor:
    """x * 2^k in exact steps of powers of two FP32 holds (BF16's scales reach 2^277)."""
    while k:
        step = max(-126, min(127, k))
        x = x * 2.0**step
        k -= step
    return x


def _sqnr(signal: float, noise: float) -> float | None:
    """10 log10(signal / noise) in dB; None without signal, and for an exact round trip (no noise)."""
    if not (signal > 0 and noise > 0):
        return None
    return 10 * math.log10(signal / noise)
