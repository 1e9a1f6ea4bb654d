"""A GPU's tensor-core arithmetic for the matrix products of FP16 and BF16 training, on a CPU.

A tensor core multiplies FP16 (or BF16) inputs, accumulates the products in FP32 and rounds the
result once to the output dtype. Inside `TensorCoreArithmetic`, every matrix product and
convolution whose floating inputs are all FP16 (or all BF16) runs as the FP32 op of those same
rounded inputs, and its result is rounded once: the GPU's arithmetic up to summation order, at the
speed of the CPU's FP32 kernels.

It works on aten ops, below autograd, so it sees what composite modules call inside (linear is an
addmm, matmul an mm or a bmm, an FP16 LSTM's gates addmm and mm) and the ops of the backward pass,
as long as the backward runs inside the mode too.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

LOW_PRECISION = (torch.float16, torch.bfloat16)
# Every aten op a matrix product or a convolution of training reaches on a CPU, forward and backward.
PRODUCTS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.convolution.default,
        aten.convolution_backward.default,
    }
)


def low_precision_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The op's low-precision dtype when all its floating tensors have it; None otherwise (an FP32
    op, or a mix, which is left to torch)."""
    dtypes = {t.dtype for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(dtypes) == 1:
        (dtype,) = dtypes
        if dtype in LOW_PRECISION:
            return dtype
    return None


class TensorCoreArithmetic(TorchDispatchMode):
    """Within it, FP16 and BF16 matrix products and convolutions accumulate in FP32 and round once."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}  # ops emulated, by name: what ran, for the record and the tests

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in PRODUCTS:
            return func(*args, **kwargs)
        dtype = low_precision_dtype(args, kwargs)
        if dtype is None:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1

        def widen(t):
            return t.float() if isinstance(t, torch.Tensor) and t.dtype == dtype else t

        def round_once(t):
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t

        # .float() and .to() keep the memory format, so channels-last stays channels-last.
        return tree_map(round_once, func(*tree_map(widen, args), **tree_map(widen, kwargs)))
