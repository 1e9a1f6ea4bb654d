"""Updates FP16 weights lose (precision/lost_updates.py and the engine's counting), against a
float64 evaluation in numpy: the weight's FP16 rounding plus the update, rounded once to FP16
from float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpt.precision.lost_updates import LostUpdates, would_be_lost

from .test_numerics import make_engine


def weights_and_updates(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FP16-representable weights (normal, subnormal, powers of two where the ulp below is half the
    ulp above, zero, negative) and updates in steps of 1/64 of the weight's ulp, so that every sum
    is exact in FP32 and ties fall exactly on FP16's midpoints."""
    g = torch.Generator().manual_seed(seed)
    w = torch.cat(
        [
            torch.randn(2000, generator=g),
            torch.randn(500, generator=g) * 2.0**-18,
            torch.tensor([1.0, -1.0, 2.0**-10, 2.0**-14, 0.0, 2.0**-24, 1024.0]),
        ]
    )
    w16 = w.half()
    spacing = torch.from_numpy(np.spacing(np.abs(w16.numpy())).astype(np.float32))  # one ulp above |w|
    k = torch.randint(-200, 201, (w.numel(),), generator=g).float()
    return w16.float(), k * spacing / 64


def test_would_be_lost_is_one_rounding_of_the_exact_sum():
    w, u = weights_and_updates()
    exact = np.float16(w.double().numpy() + u.double().numpy())
    oracle = (u.numpy() != 0) & (exact == w.half().numpy())
    ours = would_be_lost(w, u).numpy()
    assert 0 < oracle.sum() < oracle.size and (u.numpy() == 0).any()  # the cases differ
    assert np.array_equal(ours, oracle)


def test_counts_per_step_are_the_updated_and_the_lost():
    w, u = weights_and_updates(1)
    lost = LostUpdates()
    lost.add(w, w + u)
    lost.add(w, w)  # a step that changes nothing updates nothing
    s = lost.summary()
    oracle = (u.numpy() != 0) & (np.float16(w.double().numpy() + u.double().numpy()) == w.half().numpy())
    assert s["updated"] == int((u != 0).sum()) and s["lost_fp16"] == int(oracle.sum())
    assert s["share_lost_fp16"] == s["lost_fp16"] / s["updated"]
    total = LostUpdates().merge(lost).merge(lost)
    assert total.summary()["lost_fp16"] == 2 * s["lost_fp16"]


def test_at_a_weight_of_one_updates_below_half_an_ulp_vanish():
    """Above 1, FP16's ulp is 2^-10, below it 2^-11: 2^-12 up is lost, 1.5 * 2^-11 up is kept; 2^-12
    down is a tie that rounds back to 1 (its mantissa is even), 1.5 * 2^-12 down is kept."""
    w = torch.ones(4)
    u = torch.tensor([2.0**-12, 1.5 * 2.0**-11, -(2.0**-12), -1.5 * 2.0**-12])
    assert would_be_lost(w, u).tolist() == [True, False, True, False]


@pytest.mark.parametrize("precision", ["fp16", "fp16_modmom", "mixed", "fp32"])
def test_the_engine_counts_what_its_update_loses_against_float64(precision):
    """One SGD step with momentum through the precision engine, gradients chosen so that the update
    is the exact -lr*g = u of `weights_and_updates` (powers of two throughout, loss scale 2^10 to
    keep the small gradients in FP16's range): FP16 weights updated in place count what they did
    lose (the stored weight unchanged), the others what an FP16 weight would lose, and both are
    the float64 evaluation's."""
    w, u = weights_and_updates(2)
    keep = w.abs() >= 2.0**-14  # FP16-normal weights, whose gradients -u/lr stay FP16-normal under the scale
    w, u = w[keep], u[keep]
    lr = 2.0**-4
    model, engine = make_engine(w, precision, "static", lr=lr, momentum=0.9, extra=["scale.value=1024"])
    out = model(torch.ones_like(w))
    engine.backward((out.float() * (-u / lr)).sum())
    with engine.counting_lost() as counts:
        assert engine.step()
    w64, u64 = w.double().numpy(), u.double().numpy()
    oracle = (u64 != 0) & (np.float16(w64 + u64) == w.half().numpy())
    ours = counts[model.w].summary()
    assert (ours["updated"], ours["lost_fp16"]) == (int((u64 != 0).sum()), int(oracle.sum()))
    assert 0 < oracle.sum() < (u64 != 0).sum()
    assert engine.lost_counted == ("lost" if precision.startswith("fp16") else "would_be_lost")
    if precision.startswith("fp16"):  # what it lost is what the weight shows
        assert int(((u64 != 0) & (model.w.detach().numpy() == w.half().numpy())).sum()) == oracle.sum()


@pytest.mark.parametrize("precision", ["fp16", "mixed"])
def test_a_skipped_step_updates_nothing(precision):
    w = torch.ones(8)
    model, engine = make_engine(w, precision, "dynamic")
    out = model(torch.ones_like(w))
    engine.backward((out.float() * torch.full((8,), float("inf"))).sum())
    with engine.counting_lost() as counts:
        assert not engine.step()
    assert LostUpdates().merge_all(counts.values()).summary()["updated"] == 0
