"""scale=auto (scaler.AutoScaler): the scale follows running statistics of log2 max|g|. Against
`dynamic` on a scripted gradient sequence, the engine's observation against gradients read
directly, and both strategies on the same run through the command line."""

from __future__ import annotations

import math
import random

import pandas as pd
import pytest
import torch

from mpt.precision.scaler import AutoScaler, Diverged, DynamicScaler, build_scaler
from mpt.report.cli import build_report

from .conftest import ROOT, compose_cfg, mpt_run, read_record
from .test_numerics import make_engine, train_step


def auto_scaler(**overrides) -> AutoScaler:
    cfg = compose_cfg("scale=auto", *(f"scale.{k}={v}" for k, v in overrides.items()))
    scaler = build_scaler(cfg)
    assert isinstance(scaler, AutoScaler)
    return scaler


def test_auto_never_overflows_a_drifting_noisy_sequence_on_which_dynamic_does():
    rng = random.Random(0)
    auto = auto_scaler()
    dynamic = DynamicScaler(init=2.0**16, interval=200, growth=2.0, backoff=0.5, min=1.0, max=2.0**24)
    largest = {"auto": [], "dynamic": []}
    for t in range(4000):
        # log2 max|g| drifts slowly over 4 bits and jitters from step to step
        g = 2.0 ** (-10 + 2 * math.sin(2 * math.pi * t / 700) + rng.gauss(0, 0.3))
        for name, scaler in (("auto", auto), ("dynamic", dynamic)):
            scaled = torch.tensor(scaler.scale * g).half()  # what the FP16 backward would hold
            largest[name].append(float(scaled))
            scaler.update(bool(scaled.isinf()), g)
    assert max(largest["auto"]) <= 65504 and auto.summary()["skipped_steps"] == 0
    assert dynamic.summary()["skipped_steps"] > 0 and max(largest["dynamic"]) == math.inf
    # It does not buy safety by giving the range away: the largest value sits in the top bits.
    assert sorted(largest["auto"])[len(largest["auto"]) // 2] > 2**8


def test_the_scale_is_the_papers_headroom_rule_on_the_bias_corrected_estimates():
    s = auto_scaler(std_devs=2.0, margin_bits=1.0)
    xs = [-12.0, -10.0, -11.0]
    for x in xs:
        s.update(False, 2.0**x)
    fast = sum(0.01 * 0.99 ** (len(xs) - 1 - i) * x for i, x in enumerate(xs)) / (1 - 0.99 ** len(xs))
    w = [0.001 * 0.999 ** (len(xs) - 1 - i) for i in range(len(xs))]
    slow = sum(wi * x for wi, x in zip(w, xs)) / (1 - 0.999 ** len(xs))
    sigma = math.sqrt(sum(wi * x * x for wi, x in zip(w, xs)) / (1 - 0.999 ** len(xs)) - slow**2)
    assert s.estimates() == pytest.approx((fast, sigma), rel=1e-9)
    assert s.scale == 2.0 ** math.floor(math.log2(65504) - 1.0 - (fast + 2.0 * sigma))


def test_every_overflow_at_least_halves_the_scale_until_the_minimum_declares_divergence():
    s = auto_scaler(init=64.0, min=1.0)
    scales = [s.scale]
    with pytest.raises(Diverged, match="minimum loss scale 1"):
        for _ in range(10):  # a loss that is itself non-finite: every step overflows
            s.update(True)
            scales.append(s.scale)
    assert all(b <= a / 2 for a, b in zip(scales, scales[1:])) and scales[-1] == 1.0
    assert s.summary()["skipped_steps"] == len(scales)


@pytest.mark.parametrize("precision", ["fp32", "mixed", "fp16"])
def test_the_engine_gives_the_scaler_the_largest_unscaled_gradient(precision):
    G = torch.tensor([3e-3, -7e-3, 1e-5, 0.0, 2.5e-3])
    model, engine = make_engine(torch.ones(5), precision, "auto", extra=["scale.init=1024"])
    out = model(torch.ones_like(G))
    engine.backward((out.float() * G).sum())
    # Read directly: the gradient the backward left, over the scale it ran with.
    expected = max(float(p.grad.float().abs().max()) for p in model.parameters()) / 1024
    assert expected == pytest.approx(7e-3, rel=1e-3)
    assert engine.step()
    assert 2.0 ** engine.scaler.estimates()[0] == pytest.approx(expected, rel=1e-12)
    assert engine.scaler.scale == 2.0 ** math.floor(
        math.log2(65504) - 1 - math.log2(expected)
    )  # one step: no spread yet


def test_an_overflowing_step_is_skipped_by_the_engine_and_its_weights_kept():
    model, engine = make_engine(torch.ones(4), "mixed", "auto", extra=["scale.init=1024"])
    before = model.w.detach().clone()
    assert not train_step(model, engine, torch.tensor([1.0, float("inf"), 0.5, 0.1]))
    assert torch.equal(model.w.detach(), before) and engine.scaler.scale <= 512


@pytest.mark.slow
def test_auto_and_dynamic_on_the_same_run_and_in_the_report(tmp_path):
    """The same DCGAN steps with dynamic started high (GradScaler's habit) and with auto: dynamic
    skips steps while it backs off, auto at most one per network (its second step: the generator's
    activation gradients run larger than the weight gradients it watches, and one overflow teaches
    it so). The report's loss-scaling table shows both."""
    common = [
        "model=dcgan64",
        "model.ngf=4",
        "model.ndf=4",
        "model.sample_grid=4",
        "data.train_samples=16",
        "data.val_samples=4",
        "schedule=smoke",
        "schedule.steps=8",
        "precision=mixed",
        "checkpoint=false",
        f"hydra.sweep.dir={tmp_path}/runs",
    ]
    # dynamic from GradScaler's 65536 fits at its 7th step; from 2**24 all 8 were skipped, a run that trained nothing
    for scale in (["scale=dynamic"], ["scale=auto"]):
        r = mpt_run("-m", *common, *scale, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
    recs = {
        rec["choices"]["scale"]: rec
        for rec in map(read_record, (p.parent for p in (tmp_path / "runs").rglob("result.json")))
    }
    assert recs["dynamic"]["status"] == recs["auto"]["status"] == "ok"
    for net in ("generator", "discriminator"):
        assert 3 <= recs["dynamic"]["loss_scale"][net]["skipped_steps"] < recs["dynamic"]["steps"]
        assert recs["auto"]["loss_scale"][net]["skipped_steps"] <= 1
        assert recs["auto"]["loss_scale"][net]["final"] >= 256
    build_report([tmp_path / "runs"], tmp_path / "report", None)
    table = pd.read_csv(tmp_path / "report" / "tables" / "loss_scaling.csv")
    assert set(table["scale"]) == {"dynamic", "auto"} and "Mixed + LS (auto)" in set(table["mode"])
    assert (table[table.scale == "auto"].skipped_steps <= 1).all() and (
        table[table.scale == "dynamic"].skipped_steps >= 3
    ).all()
