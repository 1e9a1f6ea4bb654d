"""The atlas's counts against a float64 evaluation with ml_dtypes' and numpy's casts as the oracle,
and its scales against their definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpt.precision.atlas import FormatAtlas, max_safe_scale
from mpt.precision.formats import get_format
from mpt.precision.grad_histogram import GradHistogram

md = pytest.importorskip("ml_dtypes")

ORACLE = {"fp16": np.float16, "bf16": md.bfloat16, "e4m3": md.float8_e4m3fn, "e5m2": md.float8_e5m2}
SCALAR = list(ORACLE)


def values(seed: int = 0) -> torch.Tensor:
    """Gradients' kind of spread (2^-40 to 2^20), with zeros, both infinities and a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6000, generator=g) * torch.exp2(torch.randint(-40, 20, (6000,), generator=g).float())
    x[::50] = 0.0
    x[7], x[11], x[13] = math.inf, -math.inf, math.nan
    return x


def cast(x: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float32).astype(ORACLE[name]).astype(np.float64)


def oracle(x: torch.Tensor, name: str) -> dict:
    """The shares and SQNR in float64 from the oracle's casts (which overflow to inf or NaN)."""
    fmt = get_format(name)
    v = x.double().numpy()
    finite = np.isfinite(v)
    nz = finite & (v != 0)
    q = cast(v, name)
    saturated = cast(np.clip(np.where(finite, v, 0), -fmt.max, fmt.max), name)
    clean = np.where(finite, v, 0)
    return {
        "share_underflow": (nz & (q == 0)).sum() / nz.sum(),
        "share_subnormal": (finite & (q != 0) & (np.abs(q) < fmt.min_normal)).sum() / nz.sum(),
        "share_overflow": (finite & ~np.isfinite(q)).sum() / nz.sum(),
        "sqnr_db": 10 * math.log10((clean**2).sum() / ((saturated - clean) ** 2).sum()),
    }


@pytest.mark.parametrize("name", SCALAR)
def test_shares_and_sqnr_match_a_float64_evaluation(name):
    x = values()
    atlas = FormatAtlas([get_format(name)])
    atlas.add(x[:3000])
    atlas.add(x[3000:])  # counts accumulate over calls
    got = atlas.summary()["formats"][name]
    want = oracle(x, name)
    for key in ("share_underflow", "share_subnormal", "share_overflow"):
        assert got[key] == pytest.approx(want[key], abs=1e-12), key
    assert got["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-9)
    assert got["share_lost"] == pytest.approx(want["share_underflow"] + want["share_overflow"])


@pytest.mark.parametrize("name", SCALAR)
def test_per_tensor_scaling_uses_the_largest_safe_power_of_two(name):
    fmt = get_format(name)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 2.0**-12
    atlas = FormatAtlas([fmt])
    atlas.add(x)
    got = atlas.summary()["formats"][name]
    s = got["max_safe_scale"]
    amax = x.abs().max().double().numpy()
    assert np.isfinite(cast(amax * s, name)) and not np.isfinite(cast(amax * 2 * s, name))  # the largest that fits
    v = x.double().numpy()
    noise = ((cast(v * s, name) / s - v) ** 2).sum()
    assert got["sqnr_db_scaled"] == pytest.approx(10 * math.log10((v**2).sum() / noise), rel=1e-9)
    assert got["sqnr_db_scaled"] >= got["sqnr_db"]


def test_fp16_recommended_scale_is_the_gradient_histograms():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5000, generator=g) * torch.exp2(torch.randint(-34, -8, (5000,), generator=g).float())
    atlas, hist = FormatAtlas([get_format("fp16")]), GradHistogram()
    atlas.add(x)
    hist.add(x)
    got, want = atlas.summary()["formats"]["fp16"], hist.summary()
    assert got["recommended_scale"] == want["recommended_scale"] and got["recommended_scale"] > 1
    assert got["max_safe_scale"] == want["max_safe_scale"]


def test_values_too_large_get_a_scale_below_one_and_too_spread_get_none():
    fmt = get_format("e4m3")
    big = FormatAtlas([fmt])
    big.add(torch.tensor([3000.0, 100.0, 20.0]))
    assert (
        big.summary()["formats"]["e4m3"]["recommended_scale"] == 0.125 == max_safe_scale(3000.0, fmt)
    )  # 375 fits, 750 does not
    spread = FormatAtlas([fmt])
    spread.add(torch.tensor([2.0**8, *([2.0**-20] * 10)]))  # E4M3 spans 2^-10 to 448: no scale keeps both ends
    assert spread.summary()["formats"]["e4m3"]["recommended_scale"] is None


def test_block_formats_are_scored_under_their_own_scales():
    torchao_round_trip = pytest.importorskip("tests.test_formats").torchao_mx()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * 2.0**-30
    atlas = FormatAtlas([get_format("mxfp4"), get_format("e2m1")])
    atlas.add(x)
    got = atlas.summary()["formats"]
    v = x.double()
    theirs = torchao_round_trip(x, "mxfp4").double()
    assert (
        got["mxfp4"]["sqnr_db"]
        == got["mxfp4"]["sqnr_db_scaled"]
        == pytest.approx(10 * math.log10((v**2).sum() / ((theirs - v) ** 2).sum()), rel=1e-9)
    )
    assert (
        got["e2m1"]["share_underflow"] == 1.0 and got["mxfp4"]["share_underflow"] < 0.2
    )  # FP4 alone cannot hold 2^-30


def test_the_state_round_trips():
    a = FormatAtlas([get_format("fp16"), get_format("mxfp8_e4m3")])
    a.add(values(4).reshape(60, 100))
    b = FormatAtlas([get_format("fp16"), get_format("mxfp8_e4m3")])
    b.load_state_dict(a.state_dict())
    assert b.summary() == a.summary()


def test_scaled_sqnr_reaches_tensors_far_below_fp32s_normals():
    """BF16's largest safe scale for values near 2^-140 is about 2^267: applied in FP32-sized steps."""
    x = torch.randn(512, generator=torch.Generator().manual_seed(8)) * 2.0**-140
    atlas = FormatAtlas([get_format("bf16")])
    atlas.add(x)
    got = atlas.summary()["formats"]["bf16"]
    assert (
        got["max_safe_scale"] > 2.0**260
        and got["sqnr_db_scaled"] is not None
        and got["sqnr_db_scaled"] > 50 > got["sqnr_db"]
    )


def test_a_block_holding_an_infinity_leaves_the_noise_finite():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
    x[0, 3] = math.inf
    atlas = FormatAtlas([get_format("mxfp8_e4m3")])
    atlas.add(x)
    got = atlas.summary()["formats"]["mxfp8_e4m3"]
    assert got["sqnr_db"] is not None and 25 < got["sqnr_db"] < 40
