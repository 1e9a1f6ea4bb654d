"""The options that only make a run faster (torch.compile, torch's optimizer implementations) must
not change what it computes: each is checked against the same run without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpt.config import ConfigError
from mpt.runner.validation import validate

from .conftest import ROOT, TINY, compose_cfg, mpt_run, read_record

RUN = [TINY, "schedule=smoke", "checkpoint=false"]


def train_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("eager")
    r = mpt_run(*RUN, f"hydra.run.dir={run_dir}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_compiled_networks_train_as_the_eager_ones(eager, tmp_path):
    # aot_eager: dynamo's graph capture and AOTAutograd's joint forward-backward, without inductor's
    # C++ code generation (minutes on a CPU); inductor differs only in the kernels it emits.
    r = mpt_run(*RUN, "compile.backend=aot_eager", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = read_record(tmp_path)
    assert rec["compile"]["backend"] == "aot_eager" and rec["compile"]["unique_graphs"] >= 1  # it did compile
    assert train_losses(tmp_path) == pytest.approx(train_losses(eager), rel=1e-6)
    assert read_record(eager)["compile"] is None


@pytest.mark.slow  # two runs; fused SGD is a speed option
def test_fused_sgd_trains_as_torchs_default_sgd(eager, tmp_path):
    r = mpt_run(*RUN, "optim.implementation=fused", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert train_losses(tmp_path) == pytest.approx(train_losses(eager), rel=1e-6)
    assert len(train_losses(tmp_path)) == 3


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["optim.implementation=fast"], "optim.implementation=fast: expected one of default, for_loop, foreach, fused"),
        (["precision=fp16_modmom", "optim.implementation=fused"], "optim.implementation=fused: precision=fp16_modmom"),
        (["compile.mode=turbo", "compile.backend=inductor"], "compile.mode=turbo: expected one of"),
        (["compile.mode=reduce-overhead"], "set compile.backend=inductor"),
        (["compile.backend=inductor", "stats.grad_hist=true"], "gradient histograms need the eager networks"),
        (["compile.backend=nope"], "compile.backend=nope: no such torch.compile backend; choose one of .*inductor"),
    ],
)
def test_bad_speed_options_are_rejected_naming_the_value(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        validate(compose_cfg(*overrides))


@pytest.mark.slow  # a sweep process; the single-run error is checked by validate in the fast tier
def test_an_unknown_compile_backend_in_a_sweep_stops_it_before_any_run(tmp_path):
    r = mpt_run("-m", *RUN, "compile.backend=aot_eager,nope", f"hydra.sweep.dir={tmp_path}", cwd=ROOT)
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith("mpt-run: error: compile.backend=nope: no such torch.compile backend; choose one of")
    )
    assert "inductor" in r.stderr
    assert not list(tmp_path.glob("*/result.json"))  # not even the valid value's run started


def test_an_older_bench_record_without_flops_counts_as_another_computation():
    from mpt.config import as_plain
    from mpt.runner import upgrade
    from mpt.runner.identity import same_computation

    current = as_plain(compose_cfg("schedule=bench"))
    old = {**current, "schedule": {k: v for k, v in current["schedule"].items() if k != "count_flops"}}
    old = upgrade.config(old)  # as a record is read
    assert not same_computation(old, current)  # relaunching the sweep redoes it, with FLOPs
    assert same_computation(current, current)


def test_a_compile_record_says_why_no_graph_was_captured():
    import torch._dynamo
    from omegaconf import OmegaConf
    from torch._dynamo.utils import counters

    from mpt.runner.compiling import compile_summary

    c = OmegaConf.create({"backend": "aot_eager", "mode": None})
    torch._dynamo.reset()
    counters.clear()
    net = torch.compile(torch.nn.Linear(3, 2), backend="aot_eager")
    with torch.compiler.set_stance("force_eager"):  # as the FLOP-counting step runs it
        net(torch.randn(4, 3))
    summary = compile_summary(c)
    assert summary["unique_graphs"] == 0 and summary["why_no_graph"].startswith("no frame reached dynamo")
    net(torch.randn(4, 3))
    summary = compile_summary(c)
    assert summary["unique_graphs"] == 1 and summary["frames"]["ok"] >= 1 and "why_no_graph" not in summary
