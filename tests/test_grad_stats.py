"""Gradient statistics collected during training, against gradients computed independently with
torch.autograd.grad, and through the real command line."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mpt.precision.engine import PrecisionEngine
from mpt.precision.grad_histogram import GradHistogram
from mpt.precision.scaler import build_scaler
from mpt.report.cli import build_report
from mpt.runner.instruments.grad_stats import GradStatsCollector

from .conftest import CPU, ROOT, build_run, compose_cfg, mpt_run, read_record


def stats_cfg(every: int = 1):
    return OmegaConf.create({"grad_hist": True, "every": every, "keep": 0.999})


def net() -> nn.Module:
    torch.manual_seed(0)
    # An in-place ReLU after batch-norm: the hook on BN's output must still see the gradient with
    # respect to that output, not to the ReLU's.
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True), nn.Linear(16, 3))


def hist_of(*tensors: torch.Tensor) -> dict:
    h = GradHistogram()
    for t in tensors:
        h.add(t)
    return h.summary()


def test_counts_are_the_unscaled_activation_and_weight_gradients_autograd_computes():
    x, G = torch.randn(8, 6), torch.randn(8, 3)
    model, oracle = net(), net()
    # The oracle: the same network unrolled by hand with an out-of-place ReLU, unscaled loss.
    h0 = oracle[0](x)
    h1 = oracle[1](h0)
    a = torch.relu(h1)
    y = oracle[3](a)
    loss = (y * G).sum()
    grads = torch.autograd.grad(loss, [h0, h1, a, y, *oracle.parameters()])
    g_h0, g_h1, g_a, g_y, (gw0, gb0, gw1, gb1, gw3, gb3) = *grads[:4], grads[4:]

    S = 1024.0  # a power of two: scaling commutes exactly with FP32 arithmetic
    c = GradStatsCollector(stats_cfg(), {"model": model}, CPU)
    with c.step(0):
        with c.backward("model", lambda: S):
            ((model(x) * G).sum() * S).backward()
    acts = {name: h.summary() for name, h in c.hists["model"]["activation"].items()}
    weights = {name: h.summary() for name, h in c.hists["model"]["weight"].items()}
    assert acts == {"0": hist_of(g_h0), "1": hist_of(g_h1), "3": hist_of(g_y)}
    assert weights == {"0": hist_of(gw0, gb0), "1": hist_of(gw1, gb1), "3": hist_of(gw3, gb3)}
    assert acts["1"]["zeros"] > 0 and hist_of(g_a)["zeros"] == 0  # BN's output (ReLU's mask applied), not the ReLU's
    total = c.summary()["networks"]["model"]["activation"]["total"]
    assert total["nonzero"] == sum(a["nonzero"] for a in acts.values()) and total["zeros"] == sum(
        a["zeros"] for a in acts.values()
    )
    assert c.summary()["loss_scales"] == {"model": [S]} and c.summary()["sampled_steps"] == [0]


def test_only_sampled_steps_install_hooks_and_none_outlive_their_step():
    model = net()
    c = GradStatsCollector(stats_cfg(every=2), {"model": model}, CPU)
    hooked = lambda: sum(len(m._forward_hooks) for m in model.modules())  # noqa: E731
    x = torch.randn(4, 6)
    with c.step(0):  # not sampled: no hook at all
        assert hooked() == 0
        with c.backward("model", lambda: 1.0):
            model(x).sum().backward()
    assert c.hists["model"] == {"activation": {}, "weight": {}} and c.sampled_steps == []
    with pytest.raises(RuntimeError, match="boom"):
        with c.step(1):  # sampled, and failing: its hooks still go
            assert hooked() == 3
            raise RuntimeError("boom")
    assert hooked() == 0
    with c.step(3):
        with c.backward("model", lambda: 1.0):
            model(x).sum().backward()
    assert hooked() == 0 and c.sampled_steps == [1, 3]  # the failed step too: whatever it counted stays counted
    with torch.no_grad():
        model(x)  # an evaluation between steps counts nothing
    assert c.summary()["networks"]["model"]["activation"]["total"]["values"] == 3 * 4 * 16 + 4 * 3 - 4 * 16


def test_each_network_counts_the_gradients_of_its_own_loss_only():
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    disc.requires_grad_(False)  # as a GAN's discriminator is while the generator's loss is formed
    c = GradStatsCollector(stats_cfg(), {"generator": gen, "discriminator": disc}, CPU)
    with c.step(0):
        with c.backward("generator", lambda: 2.0):
            (disc(gen(torch.randn(3, 4))).sum() * 2.0).backward()
    assert set(c.hists["generator"]["activation"]) == {"(root)"} and set(c.hists["generator"]["weight"]) == {"(root)"}
    assert c.hists["discriminator"] == {"activation": {}, "weight": {}}


def test_each_sampled_step_keeps_its_own_totals():
    """Per sampled step, the network's histogram of that step's gradients alone (the paper's
    Figure 3 at the start, middle and end of training), against the gradients autograd left."""
    model = net()
    c = GradStatsCollector(stats_cfg(every=2), {"model": model}, CPU)
    grads = {}
    for step, x in enumerate([torch.randn(4, 6), torch.randn(4, 6) * 1e-3, torch.randn(4, 6), torch.randn(4, 6)]):
        model.zero_grad()
        with c.step(step), c.backward("model", lambda: 1.0):
            model(x).pow(2).sum().backward()
        grads[step] = [p.grad.clone() for p in model.parameters()]
    steps = c.summary()["networks"]["model"]["weight"]["steps"]
    assert [s["step"] for s in steps] == [1, 3]
    for s in steps:
        assert {k: v for k, v in s.items() if k != "step"} == hist_of(*grads[s["step"]])
    assert steps[0]["log2_bins"] != steps[1]["log2_bins"]


def test_the_state_round_trips():
    model = net()
    c = GradStatsCollector(stats_cfg(), {"model": model}, CPU)
    with c.step(0):
        with c.backward("model", lambda: 4.0):
            (model(torch.randn(4, 6)).sum() * 4.0).backward()
    again = GradStatsCollector(stats_cfg(), {"model": model}, CPU)
    again.load_state_dict(c.state_dict())
    assert again.summary() == c.summary()


@pytest.mark.slow
def test_runs_count_unscaled_gradients_in_any_precision_and_the_report_draws_them(tmp_path):
    """FP32 with a loss scale of 8 computes exactly 8x FP32's gradients: counted unscaled, its
    histograms equal the unscaled run's bit for bit. Mixed runs record theirs too."""
    sweep = tmp_path / "runs"
    # DCGAN: two networks, each with its own loss and scaler; batch-norm and in-place activations.
    r = mpt_run(
        "-m",
        "model=dcgan64",
        "model.ngf=4",
        "model.ndf=4",
        "model.sample_grid=4",
        "data.train_samples=12",
        "data.val_samples=4",
        "schedule=smoke",
        "schedule.steps=7",
        "checkpoint=false",
        "stats.grad_hist=true",
        "stats.lost_updates=true",
        "stats.every=3",
        "schedule.throughput_warmup=1",
        "schedule.throughput_window=2",
        "precision=fp32,mixed",
        "scale=none,static",
        "scale.value=8",
        f"hydra.sweep.dir={sweep}",
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    recs = {
        (rec["choices"]["precision"], rec["choices"]["scale"]): rec
        for rec in map(read_record, (p.parent for p in sweep.rglob("result.json")))
    }
    assert len(recs) == 4
    for rec in recs.values():
        g = rec["grad_stats"]
        assert rec["status"] == "ok" and g["sampled_steps"] == [2, 5] and g["keep"] == 0.999
        assert g["cost"]["sampled_steps_timed"] == g["cost"]["plain_steps_timed"] == 2 and g["cost"]["ratio"] > 0
        # Steps 1, 3 and 4, 6 fill two windows of two: the sampled steps 2 and 5 are left out of
        # them (discarding the windows they fall in would leave one).
        assert rec["throughput"]["windows"] == 2
        for net, count in [
            ("generator", 9),
            ("discriminator", 8),
        ]:  # G: 5 transposed convolutions, 4 batch-norms; D: 5 and 3
            for kind in ("activation", "weight"):
                assert len(g["networks"][net][kind]["layers"]) == count, (net, kind)
        lost = g["lost_updates"]["networks"]
        for net, count in [("generator", 9), ("discriminator", 8)]:
            assert len(lost[net]["layers"]) == count and [s["step"] for s in lost[net]["steps"]] == [2, 5]
            assert lost[net]["counted"] == "would_be_lost"
            assert (
                lost[net]["total"]["updated"] > 0
                and 0 <= lost[net]["total"]["lost_fp16"] <= lost[net]["total"]["updated"]
            )
    plain, scaled = recs[("fp32", "none")]["grad_stats"], recs[("fp32", "static")]["grad_stats"]
    assert scaled["loss_scales"] == {"discriminator": [8.0, 8.0], "generator": [8.0, 8.0]}
    assert scaled["networks"] == plain["networks"]
    assert scaled["lost_updates"] == plain["lost_updates"]  # the same updates: a scale of 8 is exact

    out = tmp_path / "report"
    build_report([sweep], out, None)
    table = (out / "tables" / "gradient_stats.md").read_text()
    assert table.count("| activation |") == 8 and table.count("| weight |") == 8
    figs = sorted(
        p.name for p in (out / "figures").glob("grads_*.png") if not p.name.startswith("grads_over_training_")
    )
    assert len(figs) == 16 and all((out / "figures" / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in figs)
    over_training = list(
        (out / "figures").glob("grads_over_training_*.png")
    )  # 4 modes x 2 networks x 2 kinds, 2 sampled steps each
    assert len(over_training) == 16 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in over_training)
    csv = (out / "tables" / "gradient_stats.csv").read_text().splitlines()
    assert len(csv) == 17 and "share_lost_fp16" in csv[0]
    lost_csv = (out / "tables" / "lost_updates.csv").read_text().splitlines()
    assert len(lost_csv) == 9 and "share_lost_fp16" in lost_csv[0]  # 4 runs x 2 networks
    lost_md = (out / "tables" / "lost_updates.md").read_text()
    mixed = recs[("mixed", "none")]["grad_stats"]["lost_updates"]["networks"]["generator"]["total"]
    assert f"| an FP16 weight would lose | {mixed['updated']} | {mixed['share_lost_fp16'] * 100:.2f} |" in lost_md
    lost_figs = list((out / "figures").glob("lost_updates_*.png"))  # one cell: one figure of its 4 modes and 2 networks
    assert len(lost_figs) == 1 and lost_figs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Each sampled step's lr is the one its training-log line says it ran with, whatever the record's
    # own field holds (older records hold the rate after the step): planted here as 999.
    (path,) = [
        p
        for p in sweep.rglob("result.json")
        if (read_record(p.parent)["choices"]["precision"], read_record(p.parent)["choices"]["scale"])
        == ("mixed", "none")
    ]
    rec = json.loads(path.read_text())
    for lost in rec["grad_stats"]["lost_updates"]["networks"].values():
        for step in lost["steps"]:
            step["lr"] = 999.0
    path.write_text(json.dumps(rec))
    build_report([sweep], out, None)
    by_step = pd.read_csv(out / "tables" / "lost_updates_by_step.csv")
    assert len(by_step) == 16 and 999.0 not in set(by_step.lr)  # 4 runs x 2 networks x 2 sampled steps
    logged = {
        (row["group"], row["step"]): row["lr"]
        for row in map(json.loads, (path.parent / "metrics.jsonl").read_text().splitlines())
        if row["kind"] == "train"
    }
    mine = by_step[by_step.run_dir.str.endswith(path.parent.name)]
    assert len(mine) == 4 and all(logged[(r.network, r.step)] == r.lr for r in mine.itertuples())


def test_a_sampled_step_is_left_out_of_its_throughput_window(monkeypatch):
    from mpt.runner.instruments import throughput

    clock = [0.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock[0])
    meter = throughput.ThroughputMeter(CPU, warmup=1, window=2, unit="images")
    # Plain steps take 1 s for 10 images; the sampled one (third) takes 5 s.
    for seconds, sampled in [(1, False), (1, False), (5, True), (1, False), (1, False), (1, False)]:
        clock[0] += seconds
        meter.step(10, 0.0, excluded_s=seconds if sampled else None)
    assert meter.pipeline == [10.0, 10.0]  # without the exclusion the first window would read 20 images in 7 s


def engine_for(model: nn.Module, precision: str, lr_milestones: tuple[int, ...] = ()) -> PrecisionEngine:
    cfg = compose_cfg(
        f"precision={precision}", "schedule.batch_size=256", "optim.lr=0.1", "optim.momentum=0", "optim.weight_decay=0"
    )
    return PrecisionEngine(model, cfg, build_scaler(cfg), list(lr_milestones), CPU)


def test_lost_updates_are_counted_per_layer_on_sampled_steps_only():
    """Per layer, per sampled step with its lr, nothing on other steps, against numpy: an FP32
    network's updates (after minus before) added in FP32 to the weights' FP16 rounding and rounded
    to FP16; an FP16 network's (updated in place, momentum 0) -lr*g computed in FP32, lost where
    the stored weight did not change. The lr falls 10x right after the sampled step's update: the
    step is labelled with the lr it ran with."""
    nets = {"model": net(), "fp16": net()}
    engines = {name: engine_for(m, precision, (2,)) for (name, m), precision in zip(nets.items(), ["fp32", "fp16"])}
    c = GradStatsCollector(
        OmegaConf.create({"grad_hist": False, "lost_updates": True, "every": 2, "keep": 0.999}), nets, CPU
    )
    g = torch.Generator().manual_seed(3)
    oracle = {name: {} for name in nets}
    for step in range(2):
        with c.step(step):
            for name, model in nets.items():
                params = list(model.parameters())
                for p in params:  # gradients that make updates of 2^-16 to 2^-6
                    p.grad = (
                        torch.randn(p.shape, generator=g) * 2.0 ** torch.randint(-16, -6, p.shape, generator=g) * 10
                    ).to(p.dtype)
                before = [p.detach().clone() for p in params]
                grads = [p.grad.float().numpy() for p in params]
                with c.update(name, engines[name]):
                    engines[name].step()
                for p, b, gr in zip(params, before, grads) if step == 1 else []:
                    w16 = b.half().numpy()
                    u = (
                        (p.detach().double() - b.double()).numpy().astype(np.float32)
                        if name == "model"
                        else -np.float32(0.1) * gr
                    )
                    lost = (u != 0) & (np.float16(w16.astype(np.float32) + u) == w16)  # added in FP32, rounded once
                    layer = c.layer_of[name][id(p)]
                    prev = oracle[name].get(layer, (0, 0))
                    oracle[name][layer] = (prev[0] + int((u != 0).sum()), prev[1] + int(lost.sum()))
    s = c.summary()
    assert s["networks"] == {} and s["sampled_steps"] == [1]
    assert [e.lr for e in engines.values()] == [pytest.approx(0.01)] * 2  # the schedule has moved on
    for name, counted in [("model", "would_be_lost"), ("fp16", "lost")]:
        lost = s["lost_updates"]["networks"][name]
        assert lost["counted"] == counted
        assert {layer: (v["updated"], v["lost_fp16"]) for layer, v in lost["layers"].items()} == oracle[name]
        assert lost["steps"] == [{"step": 1, "lr": 0.1, **lost["total"]}]
        assert 0 < lost["total"]["lost_fp16"] < lost["total"]["updated"]


def atlas_of(fmts, *pieces) -> dict:
    from mpt.precision.atlas import FormatAtlas

    a = FormatAtlas(fmts)
    for t, axis in pieces:
        a.add(t, 1.0, axis)
    return a.summary()


def test_the_atlas_counts_each_products_input_weights_and_unscaled_gradients():
    from mpt.precision.formats import get_format

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x, G = torch.randn(2, 3, 8, 8), torch.randn(2, 5)
    h0 = model[0](x)
    flat = model[3](model[2](model[1](h0)))
    y = model[4](flat)
    g_h0, g_y, g_w0, g_w4 = torch.autograd.grad((y * G).sum(), [h0, y, model[0].weight, model[4].weight])
    model.zero_grad()

    S = 256.0
    names = ["fp16", "e4m3", "mxfp8_e4m3"]
    cfg = OmegaConf.create({"grad_hist": False, "every": 1, "keep": 0.999, "formats": names})
    c = GradStatsCollector(cfg, {"model": model}, CPU)
    with c.step(0):
        with c.backward("model", lambda: S):
            ((model(x) * G).sum() * S).backward()
    atlas = c.summary()["atlas"]
    assert atlas["formats"] == names and c.summary()["networks"] == {}  # the histograms stay off
    layers = atlas["networks"]["model"]["layers"]
    assert list(layers) == ["0", "4"]  # the products only: not batch-norm
    fmts = [get_format(n) for n in names]
    # Convolutions block along channels (axis 1, the weight's input channels), linear layers along features.
    assert layers["0"]["input"] == atlas_of(fmts, (x, 1))
    assert layers["0"]["weight"] == atlas_of(fmts, (model[0].weight.detach(), 1))
    assert layers["0"]["activation_grad"] == atlas_of(fmts, (g_h0, 1))
    assert layers["0"]["weight_grad"] == atlas_of(fmts, (g_w0, 1))
    assert layers["4"]["input"] == atlas_of(fmts, (flat, -1))
    assert layers["4"]["activation_grad"] == atlas_of(fmts, (g_y, -1))
    assert layers["4"]["weight_grad"] == atlas_of(fmts, (g_w4, -1))
    total = atlas["networks"]["model"]["total"]["input"]
    assert total["values"] == x.numel() + flat.numel()
    assert not [h for h in model.modules() if h._forward_hooks]  # none outlives the step


def test_an_atlas_run_writes_it_into_the_record(tmp_path, in_process):
    job = build_run(
        tmp_path,
        "model=mobilenet_v3_small",
        "schedule=smoke",
        "schedule.steps=1",  # a sampled step costs tens of plain ones
        "precision=mixed",
        "scale=dynamic",
        "stats.every=1",
        "stats.formats=[bf16,e5m2,mxfp4]",
    )
    assert job.execute().status == "ok"
    atlas = read_record(tmp_path)["grad_stats"]["atlas"]
    total = atlas["networks"]["model"]["total"]
    assert set(total) == {"input", "weight", "activation_grad", "weight_grad"}
    for role in total.values():
        assert set(role["formats"]) == {"bf16", "e5m2", "mxfp4"}
        assert 0 <= role["formats"]["mxfp4"]["share_lost"] <= 1 and role["formats"]["mxfp4"]["scaling"] == "block"
    assert total["weight"]["formats"]["bf16"]["share_lost"] == 0  # a network's weights fit BF16's range

    written = build_report([tmp_path], tmp_path / "report", None)
    table = (tmp_path / "report" / "tables" / "atlas.md").read_text()
    assert "| model | input | mxfp4 |" in table and "(block)" in table and "(per-tensor)" in table
    # the glance table above it: a row per role, a column per format in the order asked for
    assert (
        "| mode | seed | step | network | role | bf16 | e5m2 | mxfp4 |" in table and "| model | weight | 0 | " in table
    )
    heatmaps = sorted(p.name for p in written if p.name.startswith("atlas_") and not p.name.startswith("atlas_hist_"))
    assert len(heatmaps) == 3 and all(f"atlas_{f}_" in " ".join(heatmaps) for f in ("bf16", "e5m2", "mxfp4"))
    histograms = sorted(
        p.name for p in written if p.name.startswith("atlas_hist_")
    )  # one per role, a panel per scalar format
    assert len(histograms) == 4 and all(
        f"atlas_hist_{role}_" in " ".join(histograms)
        for role in ("input", "wt", "act_grad", "wt_grad")  # naming.py
    )
    assert (
        set(total["input"]["log2_bins"]) and total["input"]["zeros"] >= 0
    )  # the totals keep their histogram for these


def test_the_atlas_announces_its_cost_before_the_first_step_and_times_the_first_sampled_one(caplog):
    from mpt.runner.instruments import StepDone

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    cfg = OmegaConf.create({"grad_hist": False, "every": 2, "keep": 0.999, "formats": ["fp16", "e4m3"]})
    c = GradStatsCollector(cfg, {"model": model}, CPU, total_steps=10)
    with caplog.at_level("INFO", logger="mpt"):
        c.start()
        (announced,) = [r.getMessage() for r in caplog.records]
        # the weights and their gradients of both products: 2 x (4*3*3*3 + 5*144) values
        assert "2 format(s) (fp16, e4m3)" in announced and "every 2 steps" in announced
        assert f"({2 * (4 * 27 + 5 * 144) / 1e6:.3g} M values" in announced
        x = torch.randn(2, 3, 8, 8)
        for step in range(4):
            with c.step(step) as info:
                with c.backward("model", lambda: 1.0):
                    model(x).sum().backward()
            c.after_step(StepDone(step, 2, 0.0, info["sampled"], info["seconds"], info["overhead"], 0.0))
    timed = [r.getMessage() for r in caplog.records if "first timed sampled step" in r.getMessage()]
    assert len(timed) == 1 and "against" in timed[0]  # once, beside the plain step before it
    assert "; 4 more sampled step(s) to come: about" in timed[0]  # steps 3, 5, 7 and 9 of the 10


def test_a_bad_atlas_format_is_named_before_the_run():
    from mpt.config import ConfigError
    from mpt.runner.validation import validate

    with pytest.raises(ConfigError, match=r"^stats.formats: 'fp8' is no format; choose from fp16, bf16, e4m3, e5m2, "):
        validate(compose_cfg("stats.formats=[fp16,fp8]"))
