"""The first tensor to overflow: an overflow injected into a chosen layer of each model family is
named, in the forward and in the backward, and tracing leaves the training itself unchanged."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mpt.report.cli import build_report

from .conftest import build_run

FAMILIES = {
    "classifier": (["model=mobilenet_v3_small"], "model", "features.2.block.0.0"),
    "translation": (
        ["model=gnmt_small", "model.hidden_size=16", "data.train_samples=64"],
        "model",
        "decoder.classifier",
    ),
    "language_model": (
        ["model=biglstm_tiny", "model.hidden_size=32", "model.proj_size=8", "model.num_sampled=64", "model.bptt=5"],
        "model",
        "lstm",
    ),
    "gan": (
        [
            "model=dcgan64",
            "model.ngf=4",
            "model.ndf=4",
            "model.sample_grid=4",
            "data.train_samples=16",
            "data.val_samples=8",
        ],
        "discriminator",
        "net.2",
    ),
}
SLOW_FAMILIES = {"detection": (["model=ssd", "schedule.batch_size=2"], "model", "backbone.extra.1.0")}  # conv8_1


def inject(module: torch.nn.Module, where: str) -> None:
    """Every call, an infinity in the module's output (forward) or in its output's gradient (backward)."""

    def hook(_m, _args, output):
        out = output[0] if isinstance(output, tuple) else output
        if where == "output":
            return (out * math.inf, *output[1:]) if isinstance(output, tuple) else out * math.inf
        if out.requires_grad:  # not in evaluation
            out.register_hook(lambda g: g * math.inf)

    module.register_forward_hook(hook)


def traced_run(tmp_path, overrides, network, layer, where, *more):
    run = build_run(
        tmp_path,
        *overrides,
        "schedule=smoke",
        "schedule.steps=2",
        "precision=mixed",
        "scale=dynamic",
        "checkpoint=false",
        "logger=none",
        *more,
    )
    inject(dict(run.engines[network].model.named_modules())[layer], where)
    return run.train()


def check_named(rec, network, layer, role, nets):
    # Every step overflows: a run that skipped all its steps trained nothing, and ends diverged. An
    # infinite output may reach batch-norm's statistics first, which the weight check calls diverged.
    assert rec.status == "diverged", rec.message
    if role == "activation_grad":
        assert (
            "skipped every one of its 2 steps: the gradients overflowed FP16 at every scale it tried,"
            " 65536 down to 32768" in rec.message
        )
    origins = rec.overflow_origins["networks"]
    shown = f"{network}.{layer}" if nets > 1 else layer
    for net, found in origins.items():
        assert found["skips_traced"] == 2 == rec.loss_scale[net]["skipped_steps"]
        assert found["by_module"] == [{"module": shown, "role": role, "skips": 2}]
        assert [f["step"] for f in found["first"]] == [0, 1] and found["first"][1]["scale"] == found["first"][0][
            "scale"
        ] / 2


@pytest.mark.parametrize("where,role", [("output", "output"), ("grad", "activation_grad")])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_injected_overflow_is_named_with_its_module_and_role(family, where, role, tmp_path, in_process):
    overrides, network, layer = FAMILIES[family]
    rec = traced_run(tmp_path, overrides, network, layer, where)
    check_named(rec, network, layer, role, nets=2 if family == "gan" else 1)
    if family == "gan" and where == "output":  # the generator's loss overflows in the discriminator too
        assert set(rec.overflow_origins["networks"]) == {"generator", "discriminator"}
    if family == "classifier" and where == "grad":
        build_report([tmp_path], tmp_path / "report", None)
        rows = (tmp_path / "report" / "tables" / "overflow_origins.md").read_text()
        assert f"| model | {layer} | activation_grad | 2 |" in rows


@pytest.mark.slow
@pytest.mark.parametrize("where,role", [("output", "output"), ("grad", "activation_grad")])
def test_an_injected_overflow_in_ssd_is_named(where, role, tmp_path, in_process):
    overrides, network, layer = SLOW_FAMILIES["detection"]
    check_named(traced_run(tmp_path, overrides, network, layer, where), network, layer, role, nets=1)


def test_a_traced_run_trains_bit_for_bit_as_an_untraced_one(tmp_path, in_process):
    """Dropout's random numbers and batch-norm's statistics are put back after each re-run."""
    logs = {}
    for trace in ("true", "false"):
        run = build_run(
            tmp_path / trace, "model=mobilenet_v3_small", "schedule=smoke", "schedule.steps=4", "precision=mixed",
            "scale=dynamic", "scale.init=16777216", "checkpoint=false", "logger=none", f"stats.trace_overflow={trace}",
        )  # fmt: skip
        rec = run.train()
        assert rec.loss_scale["model"]["skipped_steps"] > 0  # 2^24 overflows this network's FP16 gradients at first
        assert (rec.overflow_origins is None) == (trace == "false")
        logs[trace] = [json.loads(line) for line in (tmp_path / trace / "metrics.jsonl").read_text().splitlines()]
        logs[trace + "_weights"] = [p.detach().clone() for p in run.engines["model"].model.parameters()]
    assert logs["true"] == logs["false"]
    assert all(torch.equal(a, b) for a, b in zip(logs["true_weights"], logs["false_weights"]))
