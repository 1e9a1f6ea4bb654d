"""Model FLOPs per sample, and model FLOPs utilization (MFU) against the GPU's dense peak.

FLOPs are counted once, on the first training step a process runs (`schedule.count_flops`), with
`torch.utils.flop_counter`: the matmuls and convolutions of the forward and the backward as they
were executed (autograd skips gradients nobody needs, such as the input images'), every network of
the step included (a GAN step runs the generator three times). Elementwise work and the optimizer
are not counted, as in every MFU figure. RNNs run unfused on that step: cuDNN's and oneDNN's fused
RNN kernels are single ops that the counter cannot see into, while the unfused path is matmuls.

MFU = FLOPs per sample x samples/s / the peak of the math the mode's matmuls run in, per GPU. The
peaks are dense (no 2:4 sparsity) tensor-core figures from NVIDIA's datasheets, keyed by the name
torch reports for the device; a device not in the table gets no MFU, and the record says why.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ...config import DType
from ...precision.formats import BlockFormat, get_format
from ...precision.product_operands import TORCH_FP8
from . import Instrument, RunEnd, StepDone

# (a substring of torch.cuda.get_device_name(), dense peak TFLOP/s per math), most specific first.
# Sources: NVIDIA's H100 and H200 datasheets (their tensor-core figures are "with sparsity", halved
# here, as written), the A100 datasheet (dense figures), the V100 and V100S datasheets (no TF32 or BF16).
# GH200 matches "H200": its GPU's figures are the H100/H200 SXM ones.
PEAK_TFLOPS: list[tuple[str, dict[str, Optional[float]]]] = [
    ("H100 PCIe", {"fp32": 51, "tf32": 756 / 2, "fp16": 1513 / 2, "bf16": 1513 / 2, "fp8": 3026 / 2}),
    ("H100 NVL", {"fp32": 60, "tf32": 835 / 2, "fp16": 1671 / 2, "bf16": 1671 / 2, "fp8": 3341 / 2}),
    (
        "H100",
        {"fp32": 67, "tf32": 989 / 2, "fp16": 1979 / 2, "bf16": 1979 / 2, "fp8": 3958 / 2},
    ),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", {"fp32": 60, "tf32": 835 / 2, "fp16": 1671 / 2, "bf16": 1671 / 2, "fp8": 3341 / 2}),
    ("H200", {"fp32": 67, "tf32": 989 / 2, "fp16": 1979 / 2, "bf16": 1979 / 2, "fp8": 3958 / 2}),  # SXM
    ("A100", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312, "fp8": None}),
    ("V100S", {"fp32": 16.4, "tf32": None, "fp16": 130, "bf16": None, "fp8": None}),
    ("V100-PCIE", {"fp32": 14, "tf32": None, "fp16": 112, "bf16": None, "fp8": None}),
    ("V100", {"fp32": 15.7, "tf32": None, "fp16": 125, "bf16": None, "fp8": None}),  # SXM2
]
PEAK_SOURCE = "NVIDIA datasheets, dense (no sparsity), per GPU (mpt/runner/instruments/flops.py)"


def math_of(p: DictConfig) -> str:
    """What the mode's matmuls and convolutions compute in, from the precision fields (not the name).
    Quantized products are measured against what they ask of the hardware, even where they run
    emulated: FP8 operands against the FP8 peak, MX operands against their format's (none here has one)."""
    if p.products.forward is not None:
        fmt = get_format(p.products.forward)
        return "fp8" if not isinstance(fmt, BlockFormat) and fmt.name in TORCH_FP8 else fmt.name
    if p.autocast is not None:
        return {DType.float16: "fp16", DType.bfloat16: "bf16"}[DType(p.autocast)]
    dtype = DType(p.param_dtype)
    if dtype != DType.float32:
        return {DType.float16: "fp16", DType.bfloat16: "bf16"}[dtype]
    return "tf32" if p.tf32 else "fp32"


def peak_tflops(device_name: str, math: str) -> tuple[Optional[float], str]:
    """The dense peak for `math` on the named device, or None and why."""
    for key, peaks in PEAK_TFLOPS:
        if key in device_name:
            if peaks.get(math) is None:
                return None, f"{device_name} has no {math} tensor-core peak"
            return peaks[math], f"{key} {math}: {PEAK_SOURCE}"
    known = ", ".join(k for k, _ in PEAK_TFLOPS)
    return None, f"no peak for {device_name!r} in the table of mpt/runner/instruments/flops.py (known: {known})"


@contextlib.contextmanager
def counting_flops(networks: list[nn.Module]) -> Iterator[FlopCounterMode]:
    """Count the FLOPs of what runs inside. If a network has an RNN, cuDNN and oneDNN are off meanwhile."""
    has_rnn = any(isinstance(m, nn.RNNBase) for net in networks for m in net.modules())
    saved = torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled
    counter = FlopCounterMode(display=False)
    # torch.compile'd networks run eager in the counted step. Dynamo skips a frame it meets under a
    # dispatch mode such as this counter; torch 2.14 skips only that call, older releases may mark the
    # code skipped for good (on an H100 with torch 2.11, runs that counted FLOPs compiled no graph:
    # results/gpu-h100-loan3/options). force_eager keeps dynamo out of the step; set_stance switches
    # when called, so it is called inside the with (torch >= 2.6, which config.py requires with compile).
    set_stance = getattr(torch.compiler, "set_stance", None)
    try:
        if has_rnn:
            # ContextProp attributes to the stubs; the modules' setters take a bool
            torch.backends.cudnn.enabled = torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
        with counter, set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
            yield counter
    finally:
        torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled = saved


class FlopCount(Instrument):
    """Counts the FLOPs of this process's first step (`enabled`), or of the first after it if a
    trace ran that step twice."""

    key = field = "flops"

    def __init__(self, networks: list[nn.Module], enabled: bool, unit: str):
        self.networks, self.enabled, self.unit = networks, enabled, unit
        self.record: dict | None = None
        self._counter: FlopCounterMode | None = None

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        if not self.enabled or self.record is not None:
            yield
            return
        with counting_flops(self.networks) as counter:
            self._counter = counter
            yield

    def after_step(self, done: StepDone) -> None:
        counter, self._counter = self._counter, None
        if counter is not None and not done.traced_s:
            self.record = flops_record(counter, done.samples, done.step, self.unit)

    def summary(self, end: RunEnd | None = None) -> dict | None:
        return self.record


def flops_record(counter: FlopCounterMode, samples: int, step: int, unit: str) -> dict:
    total = counter.get_total_flops()
    by_op = {str(op).removeprefix("aten."): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return {
        "per_step": int(total),
        "per_sample": total / samples if samples else None,
        "sample_unit": unit,
        "counted_at_step": step,
        "by_op": by_op,
        "method": "torch.utils.flop_counter over one training step's forward and backward, every network; "
        "optimizer and elementwise work not counted; RNNs unfused on that step",
    }


def mfu(flops: Optional[dict], throughput: dict, p: DictConfig, device: torch.device, device_name: str) -> dict:
    """Model FLOPs utilization of the run's steady-state throughput, per GPU."""
    math = math_of(p)
    out: dict = {"value": None, "math": math, "peak_tflops": None}
    if not flops or not flops.get("per_sample"):
        return {**out, "why": "no FLOP count (schedule.count_flops=false)"}
    if throughput.get("pipeline") is None:
        return {**out, "why": "no throughput: " + throughput.get("note", "no timing window")}
    if device.type != "cuda":
        return {**out, "why": f"{device.type}: MFU is computed against GPU tensor-core peaks only"}
    peak, source = peak_tflops(device_name, math)
    if peak is None:
        return {**out, "why": source}
    processes = throughput.get("processes", 1)
    achieved = flops["per_sample"] * throughput["pipeline"] / processes
    return {
        **out,
        "value": achieved / (peak * 1e12),
        "peak_tflops": peak,
        "peak_source": source,
        "achieved_tflops": achieved / 1e12,
        "per": "GPU" if processes == 1 else f"GPU (the job's throughput over {processes} processes)",
    }
