"""A user's own classifier (model=custom), any torchvision classifier by name (model=torchvision) and
timm's (model=timm): built from their names, trained in every precision mode, and named after
themselves in the folder, summary, record and report."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mpt.report.cli import build_report

from .conftest import build_run, mpt_run, read_record

BUILDER = Path(__file__).resolve().parent / "data" / "own_model.py"
OWN = ["model=custom", f"model.builder={BUILDER}:small_cnn", "data=synthetic", "schedule=smoke", "checkpoint=false"]
OWN += ["device=cpu"]  # the CPU's paths (FP8 emulated) are what some tests assert
MODES = ["fp32", "fp16", "mixed", "fp16_modmom", "amp", "bf16", "tf32", "fp8", "fp8_delayed", "mxfp8", "mxfp6", "mxfp4"]


def test_an_own_model_takes_torchs_sgd_step_in_fp32(tmp_path, in_process):
    """One FP32 step of the user's network is torch.optim.SGD's step on a copy of it."""
    run = build_run(tmp_path, *OWN, "precision=fp32", "optim.name=sgd", "optim.momentum=0.9", "logger=none")
    net = run.task.net
    assert type(net).__name__ == "SmallCNN" and net.width == 8  # the builder's own default width
    ref = copy.deepcopy(net)
    images, labels = next(run.data.epoch(0))
    rows = run._train_step(0, (images, labels))
    lr = float(rows[0]["lr"])
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9, weight_decay=run.cfg.optim.weight_decay)
    F.cross_entropy(ref(images), labels).backward()
    opt.step()
    for ours, theirs in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["mixed", "fp8"])
def test_an_own_model_trains_with_every_statistic(tmp_path, in_process, mode):
    """Loss scaling, the overflow tracer, the lost updates and the format atlas all reach the user's
    layers; its kwargs reach its builder."""
    rec = build_run(
        tmp_path, *OWN, "+model.kwargs.width=4", f"precision={mode}", "scale=dynamic", "stats.grad_hist=true",
        "stats.lost_updates=true", "stats.formats=[e4m3]", "stats.every=1", "schedule.steps=8",
        "scale.init=524288",  # above what this network's gradients fit in FP16 at: the first steps overflow
    ).execute()  # fmt: skip
    assert rec.status == "ok", rec.message
    assert rec.choices["model"] == "small_cnn" and rec.config["model"]["kwargs"] == {"width": 4}
    assert set(rec.grad_stats["atlas"]["networks"]["model"]["layers"]) == {"conv", "head"}  # the matrix products
    assert set(rec.grad_stats["lost_updates"]["networks"]["model"]["layers"]) == {"conv", "bn", "head"}
    if mode == "mixed":
        assert rec.loss_scale["model"]["skipped_steps"] >= 1
        traced = rec.overflow_origins["networks"]["model"]["by_module"]
        assert traced and {t["module"] for t in traced} <= {"conv", "bn", "head"}
    else:  # the CPU's FP8 is emulated, in the network's two products
        assert rec.precision["products"]["paths"] == {"emulated": 2}


@pytest.mark.parametrize("mode", MODES)
def test_an_own_model_trains_in_every_precision_mode(tmp_path, in_process, mode):
    scale = "static" if mode in ("fp16", "fp16_modmom") else "dynamic" if mode in ("mixed", "amp") else "none"
    run = build_run(tmp_path, *OWN, f"precision={mode}", f"scale={scale}", "optim.name=sgd", "optim.momentum=0.9")
    before = [p.detach().float().clone() for p in run.task.net.parameters()]
    rec = run.execute()
    assert rec.status == "ok", rec.message
    assert any(not torch.equal(b, p.detach().float()) for b, p in zip(before, run.task.net.parameters()))


def test_the_command_line_names_the_run_after_its_builder_and_the_report_too(tmp_path):
    out = mpt_run(*OWN, "device=cpu", "hydra.run.dir=" + str(tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mpt-run small_cnn precision=fp32" in out.stdout
    assert read_record(tmp_path / "run")["choices"]["model"] == "small_cnn"
    written = build_report([tmp_path], tmp_path / "report", None)
    assert "small_cnn" in (tmp_path / "report" / "tables" / "accuracy.md").read_text()
    assert any(p.name.startswith("loss_small_cnn_") for p in written)


@pytest.mark.parametrize(
    ("overrides", "folder"),
    [
        (["model=torchvision", "model.arch=resnet18"], "resnet18_fp32_none_synthetic_smoke_cpu_seed0__arch-resnet18_"),
        (["model=timm", "model.name=resnet10t"], "resnet10t_fp32_none_synthetic_smoke_cpu_seed0__name-resnet10t_"),
        (["model=custom", "model.builder=pkg.nets:wide_resnet"], "wide_resnet_fp32_none_synthetic_smoke_cpu_seed0__"),
        (["model=resnet50"], "resnet50_fp32_none_synthetic_smoke_cpu_seed0"),  # a zoo model's, as before
    ],
)
def test_the_run_folder_is_named_after_the_model_itself(overrides, folder):
    """hydra.run.dir as mpt-run resolves it: Hydra's choices and overrides, and the model's name."""
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig

    import mpt.runner.cli  # noqa: F401  # registers the folder name's resolver

    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "data=synthetic", "schedule=smoke", "device=cpu"],
                      return_hydra_config=True)  # fmt: skip
    HydraConfig.instance().set_config(cfg)
    try:
        name = Path(str(cfg.hydra.run.dir)).name
    finally:
        HydraConfig.instance().cfg = None
    assert name.startswith(folder) and (name == folder or "__" in folder), name


def test_the_model_a_timm_name_builds(tmp_path, in_process):
    pytest.importorskip("timm")
    run = build_run(
        tmp_path, "model=timm", "model.name=resnet10t", "data=synthetic", "schedule=smoke", "checkpoint=false"
    )
    assert type(run.task.net).__module__.startswith("timm.") and run.task.net.num_classes == 10


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=custom"], "model.builder: not given; model=custom needs model.builder=<package.module:function"),
        (["model=custom", "model.builder=nets"], "model.builder=nets: expected package.module:function or path/"),
        (["model=custom", "model.builder=no_such_module:f"], "model.builder=no_such_module:f: no module named"),
        (["model=custom", f"model.builder={BUILDER}:absent"], f"model.builder={BUILDER}:absent: "),
        (["model=custom", "model.builder=/no/such/file.py:f"], "model.builder=/no/such/file.py:f: no file /no/such"),
        (["model=timm"], "model.name: not given; this model needs model.name=<a timm model>"),
        (["model=torchvision"], "model.arch: not given; this model needs model.arch=<a torchvision classifier>"),
        (["model=torchvision", "model.arch=resnet19"], "model.arch=resnet19: not a torchvision classifier"),
        (["model=resnet50", "model.arch=resnet18"], "model.arch=resnet18 under model=resnet50: use model=torchvision"),
        (["model=custom", f"model.builder={BUILDER}:not_a_module"], "returned a dict, not a torch.nn.Module"),
    ],
)
def test_a_bad_model_is_one_line_naming_it(tmp_path, overrides, message):
    from mpt.config import ConfigError
    from mpt.runner.validation import validate

    from .conftest import compose_cfg

    cfg = compose_cfg(*overrides, "data=synthetic", "schedule=smoke")
    with pytest.raises(ConfigError) as error:
        validate(cfg)
        build_run(tmp_path, *overrides, "data=synthetic", "schedule=smoke")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_builders_keyword_arguments_are_checked_when_it_is_called(tmp_path, in_process):
    from mpt.config import ConfigError

    with pytest.raises(ConfigError, match=r"calling it with \['depth', 'num_classes'\] failed: .*depth"):
        build_run(tmp_path, *OWN, "+model.kwargs.depth=3")


def test_the_summary_says_what_the_train_loss_is_and_it_is_that(tmp_path, in_process):
    """model.loss_reduction=sum: the logged loss is the batch's summed cross-entropy, and the summary says so."""
    from mpt.runner.cli import summary_lines

    run = build_run(tmp_path, *OWN, "model.loss_reduction=sum")
    images, labels = next(run.data.epoch(0))
    expected = F.cross_entropy(copy.deepcopy(run.task.net)(images), labels, reduction="sum")
    rows = run._train_step(0, (images, labels))
    assert float(rows[0]["loss"]) == pytest.approx(float(expected), rel=1e-6)
    rec = run.execute()
    line = next(x for x in summary_lines(rec) if x.lstrip().startswith("train loss:"))
    assert line.endswith("steps (cross-entropy, summed over the batch's images)"), line
