"""Number formats as data, and exact quantization to them on any device.

Scalar floats (FP16, BF16, OCP FP8 E4M3/E5M2, OCP FP6 E3M2/E2M3 and FP4 E2M1) and the OCP
Microscaling block formats built on them (32 elements sharing one E8M0 power-of-two scale).
`quantize` returns the value each element takes in the format (a quantize-dequantize round trip,
in FP32); it is computed from the FP32 bit pattern and IEEE FP32 addition, never with
`.to(dtype)`, because casts differ between libraries and devices at the edges (torch saturates
E4M3 on a CPU, +inf included; ml_dtypes gives NaN): docs/formats.md lists every difference found.

Rounding is to nearest, ties to even, or stochastic (rounding up with probability equal to the
distance from the value below, in units of the quantum). What an overflow becomes is the format's
policy: `inf` (IEEE), `saturate` (to the largest finite value, +-inf included: CUDA's SATFINITE)
or `nan`. A NaN stays NaN in every format, even one with no NaN encoding (FP6, FP4: MX marks a
block NaN through its scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import ConfigError

_MANTISSA_MASK = (1 << 23) - 1
_SIGN = -(1 << 31)  # 0x80000000 as an int32
_INF_BITS = 0x7F800000
# Past this many dropped bits (of a 24-bit significand) everything rounds to zero; capping the
# shift keeps it defined for int32.
_MAX_SHIFT = 30


@dataclass(frozen=True)
class FloatFormat:
    """A scalar binary floating-point format: sign, `exp_bits` of exponent (bias `bias`) and
    `man_bits` of fraction, with subnormals. `specials` says what the top exponent holds: `ieee`
    (infinities and NaNs, as FP16), `fn` (finite-only with a single NaN mantissa pattern, all ones,
    as OCP E4M3) or `none` (no infinities, no NaN: FP6 and FP4)."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    specials: str
    overflow: str  # the default policy
    overflows: tuple[str, ...]  # the policies the format can express

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        top = (1 << self.exp_bits) - 1
        return top - 1 - self.bias if self.specials == "ieee" else top - self.bias

    @property
    def max(self) -> float:
        # E4M3's all-ones mantissa at the top exponent is its NaN, so its largest fraction is one
        # step lower.
        steps = (1 << self.man_bits) - (2 if self.specials == "fn" else 1)
        return (1 + steps / (1 << self.man_bits)) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.man_bits)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The FP32 value of each integer code (sign in the top bit of `bits`); for tests and tables."""
        codes = codes.to(torch.int64)
        sign = torch.where((codes >> (self.bits - 1)) & 1 == 1, -1.0, 1.0).double()
        e = (codes >> self.man_bits) & ((1 << self.exp_bits) - 1)
        f = (codes & ((1 << self.man_bits) - 1)).double()
        top = (1 << self.exp_bits) - 1
        normal = (1 + f / (1 << self.man_bits)) * torch.pow(2.0, (e - self.bias).double())
        value = torch.where(e == 0, f / (1 << self.man_bits) * 2.0**self.emin, normal)
        if self.specials == "ieee":
            value = torch.where(e == top, torch.where(f == 0, math.inf, math.nan), value)
        elif self.specials == "fn":
            value = torch.where((e == top) & (f == (1 << self.man_bits) - 1), math.nan, value)
        return (sign * value).float()


@dataclass(frozen=True)
class BlockFormat:
    """An OCP Microscaling format: blocks of `block` consecutive elements along one axis share a
    power-of-two scale X (E8M0: 2^-127 .. 2^127, and NaN). X = 2^(floor(log2 amax) - emax of the
    element), clamped to E8M0's range; each element is the element format's value of v / X,
    saturating (OCP MX v1.0, section 6.3). A block holding a NaN or an infinity gets X = NaN: E8M0
    has no other way to say it, and FP6/FP4 elements have no infinity."""

    name: str
    element: FloatFormat
    block: int = 32
    scale_exp_min: int = -127
    scale_exp_max: int = 127
    overflow: str = field(default="saturate", init=False)

    @property
    def bits(self) -> int:
        return self.element.bits


Format = FloatFormat | BlockFormat

FP16 = FloatFormat("fp16", 5, 10, 15, "ieee", "inf", ("inf", "saturate"))
BF16 = FloatFormat("bf16", 8, 7, 127, "ieee", "inf", ("inf", "saturate"))
# FP8 casts on NVIDIA hardware (and Transformer Engine's) saturate; E5M2 also has the IEEE policy.
E4M3 = FloatFormat("e4m3", 4, 3, 7, "fn", "saturate", ("saturate", "nan"))
E5M2 = FloatFormat("e5m2", 5, 2, 15, "ieee", "saturate", ("saturate", "inf"))
E3M2 = FloatFormat("e3m2", 3, 2, 3, "none", "saturate", ("saturate",))
E2M3 = FloatFormat("e2m3", 2, 3, 1, "none", "saturate", ("saturate",))
E2M1 = FloatFormat("e2m1", 2, 1, 1, "none", "saturate", ("saturate",))

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (  # a tuple: mypy joins a list's two classes to object
        FP16,
        BF16,
        E4M3,
        E5M2,
        E3M2,
        E2M3,
        E2M1,
        BlockFormat("mxfp8_e4m3", E4M3),
        BlockFormat("mxfp8_e5m2", E5M2),
        BlockFormat("mxfp6_e3m2", E3M2),
        BlockFormat("mxfp6_e2m3", E2M3),
        BlockFormat("mxfp4", E2M1),
    )
}


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ConfigError(f"format {name!r}: no such format; choose from {', '.join(FORMATS)}")
    return FORMATS[name]


def _exp2(q: torch.Tensor) -> torch.Tensor:
    """2^q in FP32 for integer q in [-149, 127], built from its bits (normal or subnormal)."""
    normal = (q + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(q) << (q + 149).clamp(0, 22)
    return torch.where(q >= -126, normal, subnormal).to(torch.int32).view(torch.float32)


def round_nearest(
    x: torch.Tensor, fmt: FloatFormat, limit: Optional[float] = None, inplace: bool = False
) -> torch.Tensor:
    """x (FP32) rounded to nearest, ties to even, at `fmt`'s precision and subnormal range, after
    clamping to +-`limit`: by default 2^(emax+2), from where every value overflows whatever its
    rounding; `fmt.max` saturates. NaN and the overflow policy are left to the caller. `inplace`
    rounds x itself (a temporary of the caller's): on a CPU a large fresh temporary costs more to
    fault in than the arithmetic that fills it."""
    bound = 2.0 ** (fmt.emax + 2) if limit is None else limit
    if bound < 2.0**128:  # BF16's is beyond FP32
        y = x.clamp_(-bound, bound) if inplace else x.clamp(-bound, bound)
    else:
        y = x if inplace else x.clone()
    if fmt.emin <= -126:
        # BF16: its subnormals are FP32's, so its quantum is always the same bit of the encoding,
        # and adding half of it less one, plus the kept last bit, rounds to even (carrying into the
        # exponent, up to infinity). NaN is clamped to infinity first to keep the sum in range.
        drop = 23 - fmt.man_bits
        bits = y.contiguous().view(torch.int32)
        a = (bits & ~_SIGN).clamp_(max=_INF_BITS)
        a = (a + ((1 << (drop - 1)) - 1) + ((a >> drop) & 1)) & ~((1 << drop) - 1)
        return (a | (bits & _SIGN)).view(torch.float32)
    # Narrower formats, by FP32's own rounding: with y's quantum 2^q (2^(e - man_bits) for its
    # exponent e, or the smallest normal's below it), y + 1.5 * 2^(q+23) (signed as y) stays in the
    # binade whose ulp is 2^q, so IEEE addition rounds y there, to even because the constant is a
    # multiple of 2^(q+1), and subtracting the constant is exact. The clamp keeps it finite; the
    # last copysign gives a zero y's sign.
    magic = (y.view(torch.int32) & _INF_BITS).view(torch.float32)  # 2^e; NaN gives inf, and NaN after
    magic.clamp_(min=fmt.min_normal).mul_(1.5 * 2.0 ** (23 - fmt.man_bits)).copysign_(y)
    return y.add_(magic).sub_(magic).copysign_(magic)


def _round_stochastic(
    x: torch.Tensor,
    man_bits: int,
    emin: torch.Tensor | int,
    generator: torch.Generator,
) -> torch.Tensor:
    """|x| rounded stochastically to `man_bits` fraction bits with exponents clamped below at `emin`
    (subnormals below it), unbounded above; NaN and infinity are left to the caller."""
    bits = x.contiguous().view(torch.int32)
    a = bits & ~_SIGN
    biased = a >> 23
    subnormal = biased == 0
    s = torch.where(subnormal, a & _MANTISSA_MASK, (a & _MANTISSA_MASK) | (1 << 23))
    unit = torch.where(subnormal, -149, biased - 150)  # s counts units of 2^unit
    # The value's own exponent, floor(log2|x|); an FP32 subnormal's is read off its significand,
    # exactly (s < 2^23 converts to FP32 exactly).
    e = torch.where(subnormal, (s.float().view(torch.int32) >> 23) - 127 - 149, biased - 127)
    q = torch.maximum(e, torch.as_tensor(emin, dtype=e.dtype, device=e.device)) - man_bits  # the quantum's exponent
    shift = q - unit  # bits of s below the quantum (negative never: every format here is coarser than FP32)
    d = shift.clamp(0, _MAX_SHIFT)
    kept = s >> d
    rem = s & ((1 << d) - 1)  # with d at the cap, all of s: the quantum is then above the value
    # Up with probability rem / 2^shift, from 62 random bits (rem < 2^24, so beyond 62 the
    # probability is below 2^-38 and is taken as rem >> (shift - 62) / 2^62).
    draw = torch.randint(0, 1 << 62, s.shape, generator=generator, device=s.device, dtype=torch.int64)
    used = shift.clamp(0, 62).long()
    up = (draw >> (62 - used)) < (rem.long() >> (shift.long() - 62).clamp(min=0))
    kept = kept + up.to(kept.dtype)
    # kept * 2^q is exact: kept < 2^25 and every value these formats reach is an FP32 number.
    value = kept.float() * _exp2(q.clamp(min=-149))
    return (value.view(torch.int32) | (bits & _SIGN)).view(torch.float32)


@dataclass
class Quantized:
    """A quantize-dequantize round trip with what happened to each element: `values` (FP32),
    `overflow` (finite or infinite inputs that rounded beyond the largest value: became inf,
    saturated or NaN by the policy) and `min_normal` (the smallest normal magnitude each element
    could take: a scalar, or per element under block scales)."""

    values: torch.Tensor
    overflow: torch.Tensor
    min_normal: torch.Tensor | float

    @property
    def subnormal(self) -> torch.Tensor:
        return (self.values != 0) & (self.values.abs() < self.min_normal)


def quantize(
    x: torch.Tensor,
    fmt: Format | str,
    overflow: Optional[str] = None,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
    axis: int = -1,
) -> torch.Tensor:
    """The value of each element of `x` in `fmt`, as FP32 (a quantize-dequantize round trip).
    `x` is cast to FP32 first (exactly, from FP16 or BF16). Block formats group `axis` into blocks
    (zero-padded at the end). Stochastic rounding draws from `generator` (a fresh one seeded 0 if
    none is given, so a call is reproducible)."""
    return quantize_detail(x, fmt, overflow, stochastic, generator, axis).values


def quantize_detail(
    x: torch.Tensor,
    fmt: Format | str,
    overflow: Optional[str] = None,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
    axis: int = -1,
) -> Quantized:
    """`quantize`, with which elements overflowed and where subnormals begin."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    x = x.float()
    if stochastic and generator is None:
        generator = torch.Generator(device=x.device).manual_seed(0)
    gen = generator if stochastic else None
    if isinstance(fmt, BlockFormat):
        if overflow not in (None, "saturate"):
            raise ConfigError(f"overflow={overflow!r}: {fmt.name} elements saturate; choose saturate")
        return _quantize_blocks(x, fmt, gen, axis)
    policy = overflow or fmt.overflow
    if policy not in fmt.overflows:
        raise ConfigError(f"overflow={policy!r}: {fmt.name} can express {', '.join(fmt.overflows)}")
    rounded = round_nearest(x, fmt) if gen is None else _round_stochastic(x, fmt.man_bits, fmt.emin, gen)
    values, over = _finish(x, rounded, fmt.max, policy)
    return Quantized(values, over, fmt.min_normal)


def _finish(
    x: torch.Tensor, rounded: torch.Tensor, max_value: torch.Tensor | float, policy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies the overflow policy to the rounded values and restores NaN; also returns which
    elements overflowed."""
    over = (rounded.abs() > max_value) & ~torch.isnan(x)  # includes x = +-inf, which _round leaves huge or infinite
    if policy == "saturate":
        out = torch.where(over, torch.copysign(torch.as_tensor(max_value, device=x.device).expand_as(x), x), rounded)
    elif policy == "inf":
        out = torch.where(over, torch.copysign(torch.full_like(x, math.inf), x), rounded)
    else:
        out = torch.where(over, torch.full_like(x, math.nan), rounded)
    return torch.where(torch.isnan(x), x, out), over


def block_scale_exponents(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The E8M0 exponent of each block of the last axis of `x` (already padded to whole blocks):
    floor(log2 amax) - emax of the element, clamped to [-127, 127]; NaN blocks are marked by the
    caller. floor(log2) is read off the exponent bits, so it is exact."""
    return amax_exponents(x.unflatten(-1, (-1, fmt.block)).abs().amax(-1), fmt)


def amax_exponents(amax: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """block_scale_exponents from each block's amax."""
    biased = (amax.view(torch.int32) >> 23) & 0xFF
    floor_log2 = biased - 127  # an FP32-subnormal or zero amax gives -127, which the clamp takes anyway
    return (floor_log2 - fmt.element.emax).clamp(fmt.scale_exp_min, fmt.scale_exp_max)


def _quantize_blocks(x: torch.Tensor, fmt: BlockFormat, generator: Optional[torch.Generator], axis: int) -> Quantized:
    moved = x.movedim(axis, -1)
    n = moved.shape[-1]
    padded = torch.nn.functional.pad(moved, (0, (-n) % fmt.block)).contiguous()
    exps = block_scale_exponents(padded, fmt)
    finite = torch.isfinite(padded.unflatten(-1, (-1, fmt.block))).all(-1)
    el = fmt.element
    if generator is None:
        # X * element(v / X), every step exact: v / X is an FP32 number wherever it could round
        # to anything but zero, and so is each element's value times X (at least 2^-149 apart).
        x_block = _exp2(exps).unsqueeze(-1)
        v = padded.unflatten(-1, (-1, fmt.block)) / x_block
        out, over = _finish(v, round_nearest(v, el), el.max, "saturate")
        out, over, scale = (out * x_block).flatten(-2), over.flatten(-2), x_block.expand_as(v).flatten(-2)
    else:
        # Quantizing v directly at the element's exponent range shifted by the block's exponent
        # gives X * element(v / X) with no intermediate rounding of v / X.
        per_element = exps.repeat_interleave(fmt.block, dim=-1)
        rounded = _round_stochastic(padded, el.man_bits, el.emin + per_element, generator)
        scale = _exp2(per_element)
        out, over = _finish(padded, rounded, el.max * scale, "saturate")
    out = torch.where(finite.repeat_interleave(fmt.block, dim=-1), out, math.nan)

    def back(t: torch.Tensor) -> torch.Tensor:
        return t[..., :n].movedim(-1, axis)

    return Quantized(back(out), back(over), back(el.min_normal * scale))
