"""mpt from Python: mpt.run makes mpt-run's run and returns its record; mpt.analyze measures any
network's numerics against float64 counts of its own tensors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpt
from mpt.config import ConfigError

from .conftest import TINY, read_record


def test_run_returns_the_record_mpt_run_writes(tmp_path, in_process):
    rec = mpt.run([TINY, "data=synthetic", "schedule=smoke", "checkpoint=false", f"hydra.run.dir={tmp_path}"])
    assert rec.status == "ok" and rec.choices["model"] == "mobilenet_v3_small"
    assert read_record(tmp_path)["metrics"] == rec.metrics and (tmp_path / ".hydra" / "config.yaml").exists()


def test_run_raises_mpt_runs_one_line_for_a_bad_value():
    with pytest.raises(ConfigError, match=r"^schedule.steps=-1: must be a positive number"):
        mpt.run([TINY, "schedule=smoke", "schedule.steps=-1"])


def test_run_raises_a_value_refused_as_the_run_is_built_even_over_an_earlier_record(tmp_path, in_process):
    own = f"model.builder={Path(__file__).parent / 'data' / 'own_model.py'}:small_cnn"
    args = ["model=custom", own, "data=synthetic", "schedule=smoke", "checkpoint=false", f"hydra.run.dir={tmp_path}"]
    assert mpt.run(args).status == "ok"
    with pytest.raises(ConfigError, match=r"calling it with \['depth', 'num_classes'\] failed"):
        mpt.run([*args, "+model.kwargs.depth=3"])


def sum_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def test_analyze_counts_what_fp16_flushes_and_loses_as_float64_does():
    """FP32 training of a linear layer of weights 1.0 on 16 equal rows. The inputs: 1e-9, which FP16
    flushes to zero; 6.25e-6, which it keeps as a subnormal; 6.25e-5 and 1/16, normal. The gradient of
    a weight is its input's sum over the rows: 1.6e-8, 1e-4, 1e-3 and 1 (twice); at lr 0.01 the updates
    are 1.6e-10, which not even FP32 applies to 1.0, 1e-6 and 1e-5, below half an FP16 ulp under 1.0
    (2^-12) and so lost in FP16, and 0.01 twice, kept: 2 of the 4 applied updates lost."""
    net = nn.Linear(5, 1, bias=False)
    nn.init.ones_(net.weight)
    x = torch.tensor([[1e-9, 6.25e-6, 6.25e-5, 1 / 16, 1 / 16]] * 16)
    kept = copy.deepcopy(net.state_dict())
    table = mpt.analyze(net, x, sum_loss, formats=["fp16"], precision="fp32", scale=None, lr=0.01)
    assert all(torch.equal(kept[k], v) for k, v in net.state_dict().items())  # the caller's network is untouched
    seen = x.double().abs()
    expected_underflow = float((seen < 2.0**-25).double().mean())  # below half FP16's smallest subnormal
    expected_subnormal = float(((seen >= 2.0**-25) & (seen < 2.0**-14)).double().mean())
    assert (expected_underflow, expected_subnormal) == (0.2, 0.2)
    rows = table.set_index(["role", "format"])
    assert set(table.layer) == {"(root)"}
    assert rows.loc[("input", "fp16"), "share_underflow"] == pytest.approx(expected_underflow)
    assert rows.loc[("input", "fp16"), "share_subnormal"] == pytest.approx(expected_subnormal)
    assert rows.loc[("update", "fp16"), "share_lost"] == pytest.approx(0.5)
    assert table.attrs["lost_update_share"] == pytest.approx(0.5) and table.attrs["skipped_steps"] == 0


def test_analyze_names_the_first_tensor_that_overflowed_at_too_large_a_scale():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    table = mpt.analyze(net, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), scale=2.0**40, steps=2)
    first = table.attrs["first_overflow"]
    assert table.attrs["skipped_steps"] == 2 and [f["step"] for f in first] == [0, 1]
    assert {f["module"] for f in first} <= {"0", "1", "2", "3"} and first[0]["scale"] == 2.0**40
    assert set(table.format) == {"fp16", "bf16", "e4m3", "e5m2"} and {"0", "3"} <= set(table.layer)
