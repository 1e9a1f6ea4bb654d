"""Model FLOPs and MFU (mpt/runner/instruments/flops.py) against hand-counted matmuls and convolutions."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torchvision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mpt.config import ConfigError
from mpt.report import tables
from mpt.report.records import record_row
from mpt.runner.instruments.flops import counting_flops, math_of, mfu, peak_tflops
from mpt.runner.record import RunRecord
from mpt.runner.validation import validate

from .conftest import TINY, build_run, compose_cfg, read_record


def lstm_forward_flops(T: int, B: int, inputs: int, H: int, layers: int) -> int:
    """2 FLOPs per multiply-add: input-to-gates and hidden-to-gates matmuls of each layer and step."""
    return sum(2 * T * B * 4 * H * ((inputs if layer == 0 else H) + H) for layer in range(layers))


def test_an_lstm_is_counted_through_its_matmuls():
    lstm, x = nn.LSTM(32, 64, num_layers=2), torch.randn(5, 4, 32)
    with torch.no_grad():
        with FlopCounterMode(display=False) as fused:
            lstm(x)
        with counting_flops([lstm]) as counter:
            lstm(x)
    assert fused.get_total_flops() == 0  # the fused CPU kernel is one op the counter does not see into
    assert counter.get_total_flops() == lstm_forward_flops(5, 4, 32, 64, 2)
    assert torch.backends.mkldnn.enabled and torch.backends.cudnn.enabled  # restored


def test_a_convolutions_forward_and_weight_gradient_are_counted():
    conv, x = nn.Conv2d(3, 8, 3, bias=False), torch.randn(2, 3, 10, 10)
    with counting_flops([conv]) as counter:
        conv(x).sum().backward()
    forward = 2 * 2 * 8 * 8 * 8 * 3 * 3 * 3  # batch x out pixels x out channels x (in channels x 3x3)
    assert counter.get_total_flops() == 2 * forward  # the input needs no gradient: forward and weight gradient


def test_a_compiled_network_is_counted_eager_and_compiles_after(monkeypatch):
    """Dynamo skips a frame met under a dispatch mode such as the counter, and older torch marks its
    code skipped for the rest of the run (an H100 run with torch 2.11 compiled nothing): the counted
    step must not reach dynamo at all, and the network must compile on the next step."""
    import torch._dynamo.convert_frame as convert_frame

    wrapper = getattr(convert_frame, "CatchErrorsWrapper", None)
    if wrapper is None:
        pytest.skip("this torch has no CatchErrorsWrapper, dynamo's frame callback, to watch")
    reached, graphs = [], []
    called = wrapper.__call__
    monkeypatch.setattr(
        wrapper, "__call__", lambda self, frame, *a, **k: reached.append(frame) or called(self, frame, *a, **k)
    )

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        conv, x = nn.Conv2d(3, 8, 3, bias=False), torch.randn(2, 3, 10, 10)
        compiled = torch.compile(conv, backend=backend)
        with counting_flops([conv]) as counter:
            compiled(x).sum().backward()
        assert counter.get_total_flops() == 2 * 2 * 2 * 8 * 8 * 8 * 3 * 3 * 3  # forward and weight gradient, eager
        assert reached == [] and graphs == []
        compiled(x)
        assert len(graphs) == 1
    finally:
        torch._dynamo.reset()


def test_compile_and_flop_counting_are_refused_on_a_torch_that_cannot_force_eager(monkeypatch):
    validate(compose_cfg("compile.backend=eager", "schedule.count_flops=true"))
    monkeypatch.delattr(torch.compiler, "set_stance")  # torch before 2.6
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg("compile.backend=eager", "schedule.count_flops=true"))
    assert "set schedule.count_flops=false" in str(e.value) and "\n" not in str(e.value)
    validate(compose_cfg("compile.backend=eager", "schedule.count_flops=false"))


@pytest.mark.parametrize(
    "precision, math",
    [
        ("fp32", "fp32"),
        ("tf32", "tf32"),
        ("fp16", "fp16"),
        ("mixed", "fp16"),
        ("fp16_modmom", "fp16"),
        ("amp", "fp16"),
        ("bf16", "bf16"),
        ("fp8", "fp8"),
        ("fp8_delayed", "fp8"),
        ("mxfp8", "mxfp8_e4m3"),
        ("mxfp4", "mxfp4"),
    ],
)
def test_each_mode_is_measured_against_the_peak_of_its_math(precision, math):
    assert math_of(compose_cfg(f"precision={precision}").precision) == math


def test_peaks_are_looked_up_by_device_name_most_specific_first():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp16")[0] == pytest.approx(989.5)
    assert peak_tflops("NVIDIA H100 PCIe", "fp16")[0] == pytest.approx(756.5)
    assert peak_tflops("NVIDIA H200", "fp32")[0] == 67
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32")[0] == 156
    assert peak_tflops("Tesla V100S-PCIE-32GB", "fp16")[0] == 130
    assert peak_tflops("Tesla V100-PCIE-16GB", "fp16")[0] == 112
    peak, why = peak_tflops("Tesla V100-SXM2-16GB", "bf16")
    assert peak is None and "bf16" in why
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp8")[0] == pytest.approx(1979)  # twice FP16's
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp8")[0] is None
    peak, why = peak_tflops("NVIDIA H100 80GB HBM3", "mxfp8_e4m3")
    assert peak is None and "mxfp8_e4m3" in why
    peak, why = peak_tflops("NVIDIA GeForce GTX 1080", "fp16")
    assert peak is None and "GTX 1080" in why


def test_mfu_is_flops_per_sample_times_throughput_over_the_peak_per_gpu():
    p = compose_cfg("precision=amp").precision
    flops, cuda = {"per_sample": 4e9}, torch.device("cuda")
    out = mfu(flops, {"pipeline": 1000.0}, p, cuda, "NVIDIA H100 80GB HBM3")
    assert out["value"] == pytest.approx(4e12 / 989.5e12) and out["math"] == "fp16"
    two = mfu(flops, {"pipeline": 2000.0, "processes": 2}, p, cuda, "NVIDIA H100 80GB HBM3")
    assert two["value"] == pytest.approx(out["value"])  # the job's throughput over two GPUs
    assert mfu(flops, {"pipeline": 1000.0}, p, torch.device("cpu"), "Xeon")["value"] is None
    assert "count_flops" in mfu(None, {"pipeline": 1000.0}, p, cuda, "NVIDIA H100 80GB HBM3")["why"]


def test_a_run_counts_its_first_steps_flops_as_torch_counts_the_same_model(tmp_path, in_process):
    assert (
        build_run(tmp_path, TINY, "schedule=smoke", "schedule.count_flops=true", "checkpoint=false").execute().status
        == "ok"
    )
    rec = read_record(tmp_path)
    cfg = rec["config"]
    batch, size = cfg["schedule"]["batch_size"], cfg["schedule"]["image_size"]
    # The oracle: the same architecture's forward, loss and backward under torch's own counter.
    model = torchvision.models.mobilenet_v3_small(num_classes=cfg["data"]["num_classes"])
    with FlopCounterMode(display=False) as oracle:
        nn.functional.cross_entropy(
            model(torch.randn(batch, 3, size, size)), torch.zeros(batch, dtype=torch.long)
        ).backward()
    assert rec["flops"]["per_step"] == oracle.get_total_flops()
    assert rec["flops"]["per_sample"] == oracle.get_total_flops() / batch
    assert rec["flops"]["counted_at_step"] == 0 and rec["flops"]["sample_unit"] == "images"
    assert rec["mfu"]["value"] is None and "cpu" in rec["mfu"]["why"]
    # What the command line prints once a GPU gives an MFU.
    from mpt.runner.cli import summary_lines

    rec["mfu"] = {"value": 0.25, "peak_tflops": 989.5, "math": "fp16"}
    assert any(
        line.strip().startswith("mfu:        25.0% of 989.5 TFLOP/s (fp16;")
        for line in summary_lines(RunRecord.from_dict(rec))
    )


def test_the_mfu_table_holds_the_median_per_mode_and_the_flops_per_sample(tmp_path):
    def record(precision: str, value: float) -> dict:
        return {
            "status": "ok",
            "choices": {
                "model": "resnet50",
                "precision": precision,
                "scale": "none",
                "data": "synthetic",
                "schedule": "bench",
            },
            "precision": {"name": precision},
            "throughput": {"pipeline": 100.0, "unit": "images/s"},
            "flops": {"per_sample": 12.3e9},
            "mfu": {"value": value, "math": "fp16" if precision == "amp" else "fp32"},
            "environment": {"device_name": "NVIDIA H100 80GB HBM3"},
            "config": {"schedule": {"batch_size": 256, "image_size": 224}},
        }

    text_model = {
        **record("fp32", 0.2),
        "choices": {"model": "gnmt", "precision": "fp32", "scale": "none", "data": "synthetic", "schedule": "bench"},
        "flops": {"per_sample": 4.5e9},
        "config": {"schedule": {"batch_size": 128, "image_size": None}},
    }
    rows = [
        record_row(RunRecord.from_dict(record(p, v)), tmp_path / p / "result.json")
        for p, v in [("fp32", 0.4), ("amp", 0.3), ("amp", 0.5)]
    ]
    runs = pd.DataFrame(rows + [record_row(RunRecord.from_dict(text_model), tmp_path / "gnmt" / "result.json")])
    runs["precision_order"], runs["scale_order"] = runs.precision.map({"fp32": 0, "amp": 1}), 0
    table = tables.mfu(runs)
    amp = table[(table.model == "resnet50") & (table.precision == "amp")]
    assert amp.mfu.item() == pytest.approx(0.4) and amp.runs.item() == 2
    text = tables.render_mfu(table)
    assert "12.3" in text and "40.0% (fp16)" in text and "40.0% (fp32)" in text
    gnmt_row = next(line for line in text.splitlines() if "gnmt" in line)
    assert "| 4.5 |" in gnmt_row and "20.0% (fp32)" in gnmt_row  # a model without an image size keeps its FLOPs
