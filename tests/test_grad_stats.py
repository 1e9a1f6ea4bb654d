"""Gradient histograms against FP16's range: bucket counts and derived shares against values
computed independently (direct comparisons, not the bins)."""

from __future__ import annotations

import math

import pytest
import torch

from mpt.runner.grad_stats import GradHistogram, kept_share


def test_hand_made_values_land_in_their_buckets():
    values = torch.tensor([0.0, -0.0, 2.0**-30, -(2.0**-20), 1.0, -3.0, 70000.0, float("inf"), float("nan"), 2.0**-149])
    h = GradHistogram()
    h.add(values[:5])  # in two calls: counts accumulate
    h.add(values[5:])
    s = h.summary(keep=0.8)
    assert (s["values"], s["zeros"], s["nonfinite"], s["nonzero"]) == (10, 2, 2, 6)
    assert s["log2_bins"] == {"-149": 1, "-30": 1, "-20": 1, "0": 1, "1": 1, "16": 1}
    assert s["share_lost_fp16"] == 2 / 6  # 2^-30 and 2^-149 flush to zero
    assert s["share_subnormal_fp16"] == 1 / 6  # 2^-20
    assert s["share_overflow_fp16"] == 1 / 6  # 70000
    assert s["share_zero"] == 2 / 8
    assert s["max_abs"] == 70000.0 and s["max_safe_scale"] == 0.5  # 70000 * 0.5 < 65504 < 70000
    assert s["recommended_scale"] is None  # keeping 80% needs 2^6, and the largest value already overflows


def test_shares_match_direct_comparisons_on_random_gradients():
    g = torch.Generator().manual_seed(0)
    values = torch.exp(torch.randn(100_000, generator=g) * 6 - 12) * torch.sign(torch.randn(100_000, generator=g))
    values[:5000] = 0
    h = GradHistogram()
    for chunk in values.split(30_000):
        h.add(chunk)
    s = h.summary()
    a = values.abs().double()
    nz = a[a > 0]
    assert s["nonzero"] == nz.numel() and s["zeros"] == 5000
    assert s["share_lost_fp16"] == pytest.approx(float((nz < 2**-24).double().mean()), abs=1e-12)
    assert s["share_subnormal_fp16"] == pytest.approx(float(((nz >= 2**-24) & (nz < 2**-14)).double().mean()), abs=1e-12)
    assert s["share_overflow_fp16"] == pytest.approx(float((nz > 65504).double().mean()), abs=1e-12)
    # What FP16 really does: the values a cast turns to zero (below half the smallest subnormal)
    # are among those counted lost, and nearly all of them.
    flushed = float((nz.float().half() == 0).double().mean())
    assert flushed <= s["share_lost_fp16"] and flushed > 0.5 * s["share_lost_fp16"]


@pytest.mark.parametrize("keep", [0.99, 0.999])
def test_the_recommended_scale_keeps_the_stated_share_and_half_of_it_does_not(keep):
    g = torch.Generator().manual_seed(1)
    values = torch.exp(torch.randn(50_000, generator=g) * 3 - 20)  # mostly below FP16's normal range
    h = GradHistogram()
    h.add(values)
    s = h.summary(keep=keep)
    scale = s["recommended_scale"]
    assert scale is not None and scale > 1 and math.log2(scale).is_integer()
    kept = lambda sc: float(((values.double() * sc) >= 2**-24).double().mean())  # noqa: E731
    assert kept(scale) >= keep > kept(scale / 2)
    assert kept_share(h.bins, int(math.log2(scale))) == pytest.approx(kept(scale), abs=1e-12)
    assert scale <= s["max_safe_scale"] and float(values.max()) * s["max_safe_scale"] <= 65504 < float(values.max()) * 2 * s["max_safe_scale"]
