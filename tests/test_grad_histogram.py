"""Gradient histograms against FP16's range: bucket counts and derived shares against values
computed independently (direct comparisons, not the bins)."""

from __future__ import annotations

import math

import pytest
import torch

from mpt.precision import grad_histogram as grad_stats
from mpt.precision.grad_histogram import GradHistogram, kept_share


def test_hand_made_values_land_in_their_buckets():
    values = torch.tensor(
        [0.0, -0.0, 2.0**-30, -(2.0**-20), 1.0, -3.0, 70000.0, float("inf"), float("nan"), 2.0**-149, 3e-8, 65510.0]
    )
    h = GradHistogram()
    h.add(values[:5])  # in two calls: counts accumulate
    h.add(values[5:])
    s = h.summary(keep=0.8)
    assert (s["values"], s["zeros"], s["nonfinite"], s["nonzero"]) == (12, 2, 2, 8)
    assert s["log2_bins"] == {"-149": 1, "-30": 1, "-25": 1, "-20": 1, "0": 1, "1": 1, "15": 1, "16": 1}
    assert s["share_lost_fp16"] == 2 / 8  # 2^-30 and 2^-149 flush to zero; 3e-8 rounds up to 2^-24
    assert s["share_subnormal_fp16"] == 2 / 8  # 3e-8 and 2^-20
    assert s["share_overflow_fp16"] == 1 / 8  # 70000; 65510 rounds to 65504
    assert s["share_normal_fp16"] == 3 / 8
    assert s["share_zero"] == 2 / 10
    assert s["max_abs"] == 70000.0 and s["max_safe_scale"] == 0.5  # 70000 * 0.5 < 65504 < 70000
    assert s["recommended_scale"] is None  # keeping 80% needs 2^5, and the largest value already overflows
    assert [v for v in values.tolist() if v == v and abs(v) != float("inf") and values.new_tensor(v).half() == 0] == [
        0.0,
        -0.0,
        2.0**-30,
        2.0**-149,
    ]


def test_the_largest_safe_scale_stops_where_fp16_rounds_to_inf():
    for top in [65519.0, 65520.0 / 8, 1.0, 3e-8]:
        h = GradHistogram()
        h.add(torch.tensor([top, -top / 3]))
        safe = h.summary()["max_safe_scale"]
        assert torch.isfinite(torch.tensor(top * safe).half()) and torch.isinf(torch.tensor(top * safe * 2).half()), top


def test_shares_match_direct_comparisons_on_random_gradients(monkeypatch):
    g = torch.Generator().manual_seed(0)
    values = torch.exp(torch.randn(100_000, generator=g) * 6 - 12) * torch.sign(torch.randn(100_000, generator=g))
    values[:5000] = 0
    h = GradHistogram()
    for chunk in values.split(30_000):
        h.add(chunk)
    s = h.summary()
    monkeypatch.setattr(grad_stats, "CHUNK", 7_001)  # counted a chunk at a time: the same counts
    chunked = GradHistogram()
    chunked.add(values)
    assert chunked.summary() == s
    a = values.abs().double()
    nz = a[a > 0]
    assert s["nonzero"] == nz.numel() and s["zeros"] == 5000
    # What a cast to FP16 really does: what it turns to zero and to inf.
    half = nz.float().half()
    assert (
        s["share_lost_fp16"] == pytest.approx(float((half == 0).double().mean()), abs=1e-12)
        and s["share_lost_fp16"] > 0.01
    )
    assert (
        s["share_overflow_fp16"] == pytest.approx(float(half.isinf().double().mean()), abs=1e-12)
        and s["share_overflow_fp16"] > 0
    )
    assert s["share_subnormal_fp16"] == pytest.approx(
        float(((nz >= 2**-25) & (nz < 2**-14)).double().mean()), abs=1e-12
    )


@pytest.mark.parametrize("keep", [0.99, 0.999])
def test_the_recommended_scale_keeps_the_stated_share_and_half_of_it_does_not(keep):
    g = torch.Generator().manual_seed(1)
    values = torch.exp(torch.randn(50_000, generator=g) * 3 - 20)  # mostly below FP16's normal range
    h = GradHistogram()
    h.add(values)
    s = h.summary(keep=keep)
    scale = s["recommended_scale"]
    assert scale is not None and scale > 1 and math.log2(scale).is_integer()
    kept = lambda sc: float(((values * sc).half() != 0).double().mean())  # noqa: E731  (exact: sc is a power of two)
    assert kept(scale) >= keep > kept(scale / 2)
    assert kept_share(h.bins, int(math.log2(scale))) == pytest.approx(kept(scale), abs=1e-12)
    assert (
        scale <= s["max_safe_scale"]
        and float(values.max()) * s["max_safe_scale"] < 65520 <= float(values.max()) * 2 * s["max_safe_scale"]
    )


def test_a_channels_last_gradient_is_counted_without_a_copy():
    from mpt.precision.grad_histogram import flat_view

    g = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert flat_view(g).data_ptr() == g.data_ptr() and flat_view(g).numel() == g.numel()
    assert sorted(flat_view(g).tolist()) == sorted(g.flatten().tolist())
