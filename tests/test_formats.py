"""The format module against independent oracles: ml_dtypes for every encoding of every format of 8
bits or fewer, torch's and numpy's IEEE casts for FP16 and BF16, torchao's MX conversion, and hand
computations from the OCP MX spec. Where a library differs, the test pins the difference that
docs/formats.md states."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpt.config import ConfigError
from mpt.precision.formats import (
    BF16,
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    FORMATS,
    FP16,
    BlockFormat,
    block_scale_exponents,
    get_format,
    quantize,
    quantize_detail,
)

md = pytest.importorskip("ml_dtypes")

NARROW = [E4M3, E5M2, E3M2, E2M3, E2M1]
ML_DTYPE = {
    "e4m3": md.float8_e4m3fn,
    "e5m2": md.float8_e5m2,
    "e3m2": md.float6_e3m2fn,
    "e2m3": md.float6_e2m3fn,
    "e2m1": md.float4_e2m1fn,
}
# ml_dtypes' overflow for each: E4M3 to NaN, E5M2 to inf, FP6 and FP4 saturate.
ML_POLICY = {"e4m3": "nan", "e5m2": "inf", "e3m2": "saturate", "e2m3": "saturate", "e2m1": "saturate"}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, so -0.0 differs from 0.0 and NaN equals NaN."""
    a, b = a.float().contiguous(), b.float().contiguous()
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]))


def ml_cast(x: torch.Tensor, fmt) -> torch.Tensor:
    return torch.from_numpy(x.numpy().astype(ML_DTYPE[fmt.name]).astype(np.float32))


def every_code(fmt) -> torch.Tensor:
    return torch.arange(1 << fmt.bits)


def finite_values(fmt) -> torch.Tensor:
    v = fmt.decode(every_code(fmt))
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("fmt", NARROW, ids=lambda f: f.name)
def test_every_encoding_decodes_as_ml_dtypes_reads_it(fmt):
    codes = every_code(fmt)
    ours = fmt.decode(codes)
    theirs = torch.from_numpy(codes.numpy().astype(np.uint8).view(ML_DTYPE[fmt.name]).astype(np.float32))
    assert same(ours, theirs)
    assert ours[torch.isfinite(ours)].abs().max() == fmt.max == md.finfo(ML_DTYPE[fmt.name]).max
    assert ours[ours > 0].min() == fmt.min_subnormal and fmt.min_normal == float(
        md.finfo(ML_DTYPE[fmt.name]).smallest_normal
    )


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_every_fp8_encoding_decodes_as_torch_reads_it(fmt):
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt.name]
    codes = every_code(fmt)
    assert same(fmt.decode(codes), codes.to(torch.uint8).view(dtype).float())


@pytest.mark.parametrize("fmt", NARROW, ids=lambda f: f.name)
@pytest.mark.parametrize("stochastic", [False, True])
def test_every_value_of_a_format_is_its_own_quantization(fmt, stochastic):
    v = finite_values(fmt)
    assert same(quantize(v, fmt, stochastic=stochastic), v)


def neighbours(values: torch.Tensor) -> torch.Tensor:
    """Each midpoint between adjacent values and the FP32 numbers either side of it, beyond the
    largest value too, with both signs."""
    v = values[values >= 0].unique().sort().values.double()
    step = v[-1] - v[-2]
    mids = torch.cat([(v[:-1] + v[1:]) / 2, v[-1:] + step / 2, v[-1:] + step, v[-1:] * 4]).float()
    around = torch.cat([mids, torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(0.0))])
    return torch.cat([around, -around])


@pytest.mark.parametrize("fmt", NARROW, ids=lambda f: f.name)
def test_every_midpoint_rounds_to_even_as_ml_dtypes_does(fmt):
    x = neighbours(finite_values(fmt))
    assert same(quantize(x, fmt, overflow=ML_POLICY[fmt.name]), ml_cast(x, fmt))


def wide_fp32(n: int, seed: int) -> torch.Tensor:
    """FP32 numbers across the whole exponent range, FP32 subnormals included, and random bits."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.randn(n, generator=g) * torch.exp2(torch.randint(-150, 128, (n,), generator=g).float())
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([spread, bits, torch.tensor([0.0, -0.0, math.inf, -math.inf])])
    return x[~torch.isnan(x)]


@pytest.mark.parametrize("fmt", NARROW, ids=lambda f: f.name)
def test_random_fp32_quantize_as_ml_dtypes_casts(fmt):
    x = wide_fp32(200_000, seed=1)
    assert same(quantize(x, fmt, overflow=ML_POLICY[fmt.name]), ml_cast(x, fmt))


@pytest.mark.parametrize("fmt,dtype", [(FP16, torch.float16), (BF16, torch.bfloat16)], ids=["fp16", "bf16"])
def test_fp16_and_bf16_match_torch_and_numpy_casts_on_every_encoding_and_midpoint(fmt, dtype):
    everything = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).float()
    finite = everything[torch.isfinite(everything)]
    assert same(quantize(finite, fmt), finite)
    assert quantize(finite, fmt).abs().max() == fmt.max
    x = torch.cat([neighbours(finite), wide_fp32(200_000, seed=2)])
    assert same(quantize(x, fmt), x.to(dtype).float())
    oracle = np.float16 if dtype == torch.float16 else md.bfloat16
    with np.errstate(over="ignore"):  # numpy warns of the overflow to inf that is being checked
        cast = x.numpy().astype(oracle).astype(np.float32)
    assert same(quantize(x, fmt), torch.from_numpy(cast))


def test_where_torch_fp8_casts_differ_from_ml_dtypes_and_which_policy_each_is():
    """docs/formats.md: torch's E4M3 cast saturates, +-inf included (our `saturate`, CUDA's
    SATFINITE); ml_dtypes gives NaN (our `nan`). For E5M2 both overflow to inf (our `inf`)."""
    x = torch.cat([neighbours(finite_values(E4M3)), torch.tensor([math.inf, -math.inf, 1e30])])
    torch_e4m3 = x.to(torch.float8_e4m3fn).float()
    assert same(quantize(x, E4M3, overflow="saturate"), torch_e4m3)
    assert torch_e4m3[x == math.inf].item() == 448 and torch.isnan(ml_cast(torch.tensor([math.inf]), E4M3)).all()
    y = torch.cat([neighbours(finite_values(E5M2)), torch.tensor([math.inf, -math.inf, 1e30])])
    assert same(quantize(y, E5M2, overflow="inf"), y.to(torch.float8_e5m2).float())


def test_nan_stays_nan_where_ml_dtypes_makes_fp6_and_fp4_nan_a_negative_zero():
    nan = torch.tensor([math.nan])
    for fmt in NARROW + [FP16, BF16]:
        assert torch.isnan(quantize(nan, fmt)).all()
    for fmt in (E3M2, E2M3, E2M1):
        assert same(ml_cast(nan, fmt), torch.tensor([-0.0]))  # no NaN encoding: ml_dtypes' choice


@pytest.mark.parametrize(
    "fmt,lo,hi",
    [(E4M3, 256.0, 288.0), (E4M3, 2.0**-9, 2.0**-8), (E2M1, 4.0, 6.0), (BF16, 1.0, 1.0078125)],
    ids=["e4m3", "e4m3-subnormal", "e2m1", "bf16"],
)
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased(fmt, lo, hi):
    for frac in (0.125, 0.5, 0.875):
        x = torch.full((40_000,), lo + frac * (hi - lo))
        q = quantize(x, fmt, stochastic=True, generator=torch.Generator().manual_seed(3))
        assert set(q.unique().tolist()) == {lo, hi}
        share_up = (q == hi).float().mean().item()
        assert abs(share_up - frac) < 4 * math.sqrt(frac * (1 - frac) / x.numel())  # four standard errors
        assert same(q, quantize(x, fmt, stochastic=True, generator=torch.Generator().manual_seed(3)))
        assert not same(q, quantize(x, fmt))


def mx(name: str) -> BlockFormat:
    fmt = get_format(name)
    assert isinstance(fmt, BlockFormat)
    return fmt


def test_an_mxfp4_block_by_hand():
    """amax 1.9: floor(log2 1.9) = 0, E2M1's emax is 2, so X = 2^-2; 1.9 / X = 7.6 saturates to 6."""
    block = torch.zeros(32)
    block[:6] = torch.tensor([1.9, 0.3, -0.1, 0.06, 1.2, -0.7])
    q = quantize(block, "mxfp4")
    assert block_scale_exponents(block, mx("mxfp4")).item() == -2
    assert q[:6].tolist() == [1.5, 0.25, -0.125, 0.0, 1.0, -0.75]  # X * {6, 1, -0.5, 0 (0.24 rounds down), 4, -3}
    assert same(q[6:], torch.zeros(26))


def test_blocks_run_along_the_axis_and_the_last_one_is_padded():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 3, generator=g) * torch.exp2(torch.arange(40).float()).unsqueeze(1) / 2**20
    along0 = quantize(x, "mxfp8_e4m3", axis=0)
    assert same(along0, quantize(x.t().contiguous(), "mxfp8_e4m3").t())
    padded = torch.cat([x, torch.zeros(24, 3)])
    assert same(along0, quantize(padded, "mxfp8_e4m3", axis=0)[:40])
    assert not same(along0, quantize(x, "mxfp8_e4m3", axis=1))


def test_a_block_with_a_nan_or_an_infinity_is_nan_and_the_others_are_untouched():
    x = torch.randn(3, 32)
    x[1, 5] = math.inf
    x[2, 7] = math.nan
    q = quantize(x, "mxfp8_e5m2")
    assert torch.isnan(q[1:]).all() and torch.isfinite(q[0]).all()


@pytest.mark.parametrize("name", ["e4m3", "mxfp8_e4m3", "mxfp6_e3m2"])
def test_an_infinity_is_an_overflow_in_a_scalar_format_and_in_an_mx_block(name):
    x = torch.ones(2, 32)
    x[0, 3], x[1, 9] = math.inf, -math.inf
    assert torch.equal(quantize_detail(x, name).overflow, torch.isinf(x))


def test_bad_format_and_policy_names_say_what_is_accepted():
    with pytest.raises(ConfigError, match=r"^format 'fp8': no such format; choose from fp16, bf16, e4m3, e5m2,"):
        get_format("fp8")
    with pytest.raises(ConfigError, match=r"^overflow='inf': e4m3 can express saturate, nan$"):
        quantize(torch.ones(2), "e4m3", overflow="inf")
    with pytest.raises(ConfigError, match=r"^overflow='nan': mxfp4 elements saturate; choose saturate$"):
        quantize(torch.ones(2), "mxfp4", overflow="nan")


def torchao_mx():
    try:
        from torchao.prototype.mx_formats import constants
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except Exception as e:  # torchao built for another torch can fail with more than ImportError
        pytest.skip(f"torchao's MX formats unavailable: {e}")
    elem = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp6_e3m2": constants.DTYPE_FP6_E3M2,
        "mxfp6_e2m3": constants.DTYPE_FP6_E2M3,
        "mxfp4": torch.float4_e2m1fn_x2,
    }

    def round_trip(x: torch.Tensor, name: str) -> torch.Tensor:
        scale, data = to_mx(x, elem[name], 32)
        return to_dtype(data, scale, elem[name], 32, torch.float32)

    return round_trip


MX_NAMES = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4"]


@pytest.mark.parametrize("name", MX_NAMES)
def test_mx_matches_torchao_where_block_scales_are_normal(name):
    round_trip = torchao_mx()
    g = torch.Generator().manual_seed(5)
    # 512 blocks, each at its own magnitude between 2^-90 and 2^90, with a spread inside the block.
    x = torch.randn(512, 32, generator=g) * torch.exp2(torch.randint(-90, 90, (512, 1), generator=g).float())
    x = x * torch.exp2(torch.randint(-12, 1, (512, 32), generator=g).float())
    assert same(quantize(x, name), round_trip(x, name))


def test_where_mx_differs_from_torchao():
    """docs/formats.md: where the block's X is 2^-127, torchao divides by 2^-126 (it keeps the
    divisor an FP32 normal) but multiplies back by 2^-127, so the block comes back halved; and for
    a block holding an infinity it takes X from the infinity's exponent (2^120 for E4M3), so the
    infinity comes back infinite and every finite element of the block zero, where we mark the
    block NaN."""
    round_trip = torchao_mx()
    tiny = torch.full((1, 32), 2.0**-120)  # E4M3: X = 2^(-120 - 8) = 2^-128, clamped to 2^-127 by E8M0
    assert block_scale_exponents(tiny, mx("mxfp8_e4m3")).item() == -127
    ours, theirs = quantize(tiny, "mxfp8_e4m3"), round_trip(tiny, "mxfp8_e4m3")
    assert same(ours, tiny) and same(theirs, tiny / 2)
    inf = torch.ones(1, 32)
    inf[0, 0] = math.inf
    assert torch.isnan(quantize(inf, "mxfp8_e4m3")).all()
    assert same(round_trip(inf, "mxfp8_e4m3"), torch.cat([torch.tensor([math.inf]), torch.zeros(31)]).unsqueeze(0))


def test_the_registry_holds_the_issue_formats():
    assert {"fp16", "bf16", "e4m3", "e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4"} <= set(
        FORMATS
    )
    assert all(f.block == 32 for f in FORMATS.values() if isinstance(f, BlockFormat))


def mx_oracle(x: torch.Tensor, name: str) -> torch.Tensor:
    """The OCP MX conversion in float64 with ml_dtypes' element casts: X = 2^clamp(floor(log2
    amax) - emax, -127, 127), each element the saturated cast of v / X, times X."""
    fmt = mx(name)
    el = fmt.element
    v = x.double().numpy().reshape(-1, 32)
    amax = np.abs(v).max(axis=1, keepdims=True)
    k = np.clip(np.floor(np.log2(np.where(amax > 0, amax, 2.0**-200))) - el.emax, -127, 127)
    scaled = np.clip(v / 2.0**k, -el.max, el.max).astype(np.float32)  # exact: v / X is an FP32 number here
    return torch.from_numpy(
        (scaled.astype(ML_DTYPE[el.name]).astype(np.float64) * 2.0**k).astype(np.float32).reshape(x.shape)
    )


@pytest.mark.parametrize("name", MX_NAMES)
def test_mx_matches_a_float64_evaluation_down_to_fp32_subnormal_blocks(name):
    g = torch.Generator().manual_seed(6)
    # Blocks from 2^-135 (FP32 subnormals, X clamped at 2^-127) to 2^100.
    mags = torch.exp2(torch.randint(-135, 100, (600, 1), generator=g).float())
    x = torch.randn(600, 32, generator=g) * mags * torch.exp2(torch.randint(-10, 1, (600, 32), generator=g).float())
    assert (x.abs() < 2.0**-126).any()
    assert same(quantize(x, name), mx_oracle(x, name))
    tiny = torch.zeros(32)
    tiny[:2] = torch.tensor([2.0**-125, 1.5 * 2.0**-127])  # X = 2^-127: 1.5 is an E2M1 value
    assert quantize(tiny, "mxfp4")[:2].tolist() == [2.0**-125, 1.5 * 2.0**-127]


def test_stochastic_rounding_far_below_the_quantum_keeps_its_mean():
    """2^-20 in E4M3 (whose quantum there is 2^-9) rounds up to 2^-9 with probability 2^-11."""
    x = torch.full((1 << 20,), 2.0**-20)
    q = quantize(x, E4M3, stochastic=True, generator=torch.Generator().manual_seed(7))
    ups = int((q == 2.0**-9).sum())
    assert set(q.unique().tolist()) <= {0.0, 2.0**-9}
    expected = x.numel() / 2**11
    assert abs(ups - expected) < 5 * math.sqrt(expected)
