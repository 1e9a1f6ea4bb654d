"""The float64 oracle the arithmetic is measured against: a product of FP16 (BF16) values computed
in float64 from the same rounded inputs, and the bound one rounding of an FP32 sum stays within,
one FP16 (BF16) ulp of the exact result plus what accumulating TERMS products in FP32 may add.

The tests of the CPU emulation (tests/test_cpu_tensor_cores.py, test_cpu_lstm.py, test_gpu.py)
and the probes of torch's and CUDA's kernels (scripts/probe_*.py) share it. The FP32 term matters
only where the sum cancels to far below its terms (a result near zero, whose ulp is tiny)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# (mantissa bits, smallest normal exponent)
FORMAT = {torch.float16: (10, -14), torch.bfloat16: (7, -126)}

TERMS = 256  # at most this many products are summed into one result in the tests and probes
FP32_ACCUMULATION = (
    TERMS * 2.0**-24
)  # the classic bound for summing TERMS terms in FP32, relative to the sum of |terms|


def ulp(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s values at each element's magnitude (subnormal spacing near zero)."""
    mantissa, emin = FORMAT[dtype]
    exponent = torch.floor(torch.log2(reference.abs().clamp_min(2.0**emin))).clamp_min(emin)
    return torch.exp2(exponent - mantissa)


def bound_fraction(ours: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype) -> float:
    """The worst error as a fraction of the bound. `magnitude`: the sum of the absolute values of
    the products that make each element."""
    err = (ours.double() - reference).abs()
    return (err / (ulp(reference, dtype) + FP32_ACCUMULATION * magnitude)).max().item()


@dataclasses.dataclass
class Evaluation:
    """fn on inputs rounded to a dtype (`low`, `out`), the output gradient it was given, and fn on
    the same values in float64 (`exact`, `ref`) and on their absolute values (`size`, `bound`)."""

    low: list[torch.Tensor]
    out: torch.Tensor
    grad: torch.Tensor
    exact: list[torch.Tensor]
    ref: torch.Tensor
    size: list[torch.Tensor]
    bound: torch.Tensor


def against_float64(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dtype: torch.dtype, arithmetic: Any
) -> Evaluation:
    """fn forward and backward on `inputs` rounded to dtype, inside `arithmetic` (a context
    manager: the emulation, or a null context for torch's own kernels), and in float64."""
    low = [x.to(dtype).requires_grad_() for x in inputs]
    exact = [x.detach().double().requires_grad_() for x in low]
    # Each op here is linear in each input, so on |inputs| and |gradient| it sums |products|.
    size = [x.detach().double().abs().requires_grad_() for x in low]
    with arithmetic:
        out = fn(*low)
        grad = torch.randn_like(out, dtype=torch.float32).to(dtype)
        out.backward(grad)
    ref = fn(*exact)
    ref.backward(grad.double())
    bound = fn(*size)
    bound.backward(grad.double().abs())
    return Evaluation(low, out.detach(), grad, exact, ref.detach(), size, bound.detach())


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    """Standard normal FP32 values of `shape`, times `scale`."""
    return torch.randn(*shape) * scale
