"""The tensor-core arithmetic on a CPU: every emulated product, forward and gradients, within one
FP16 (or BF16) ulp of a float64 evaluation of the same rounded inputs, plus what accumulating in
FP32 may add. That term matters only where the sum cancels to far below its terms (a result near
zero, whose ulp is tiny); accumulating in FP16 instead would exceed it some 8000 times over. The
oracle and its bound: mpt/precision/oracle.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpt.precision.cpu_tensor_cores import TensorCoreArithmetic, _Scratch
from mpt.precision.oracle import against_float64, bound_fraction, randn

LOW = [torch.float16, torch.bfloat16]


def assert_within_one_ulp(
    ours: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype, what: str
) -> None:
    """The oracle's bound (mpt.precision.oracle.bound_fraction) as a test's assertion."""
    assert ours.dtype == dtype, what
    worst = bound_fraction(ours, reference, magnitude, dtype)
    assert worst <= 1.0, f"{what}: {worst:.3f} of the bound"


def check(fn, inputs: list[torch.Tensor], dtype: torch.dtype, what: str, forward: bool = True) -> dict[str, int]:
    """fn on `inputs` rounded to dtype, inside the mode, against fn on the same values in float64:
    the output (unless `forward` is False), then each input's gradient for the same (rounded) output gradient."""
    mode = TensorCoreArithmetic()
    e = against_float64(fn, inputs, dtype, mode)
    if forward:
        assert_within_one_ulp(e.out, e.ref, e.bound, dtype, f"{what} forward")
    for i, (a, b, m) in enumerate(zip(e.low, e.exact, e.size)):
        assert_within_one_ulp(a.grad, b.grad, m.grad, dtype, f"{what} gradient of input {i}")
    return mode.counts


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_matrix_products_and_what_composite_modules_call(dtype):
    torch.manual_seed(0)
    counts = {}
    for name, fn, inputs in [
        ("mm", torch.mm, [randn(13, 37), randn(37, 9)]),
        ("mm of transposed inputs", lambda a, b: a.t() @ b.t(), [randn(37, 13), randn(9, 37)]),
        (
            "addmm",
            lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
            [randn(13, 9), randn(13, 37), randn(37, 9)],
        ),
        ("bmm", torch.bmm, [randn(3, 7, 21), randn(3, 21, 5)]),
        (
            "baddbmm",
            lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5),
            [randn(3, 7, 5), randn(3, 7, 21), randn(3, 21, 5)],
        ),
        ("matmul 3d x 2d", torch.matmul, [randn(2, 5, 33), randn(33, 6)]),
        ("linear", F.linear, [randn(4, 6, 31), randn(11, 31), randn(11)]),
        ("linear without bias", F.linear, [randn(17, 31), randn(11, 31)]),
    ]:
        for op, n in check(fn, inputs, dtype, name).items():
            counts[op] = counts.get(op, 0) + n
    assert {"mm", "addmm", "bmm", "baddbmm"} <= set(counts)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "name,fn,shapes",
    [
        ("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), [(2, 6, 11, 9), (8, 6, 3, 3), (8,)]),
        (
            "conv2d groups dilation no bias",
            lambda x, w: F.conv2d(x, w, None, padding=2, dilation=2, groups=3),
            [(2, 6, 10, 10), (9, 2, 3, 3)],
        ),
        (
            "conv2d channels-last",
            lambda x, w, b: F.conv2d(x.contiguous(memory_format=torch.channels_last), w, b),
            [(2, 5, 8, 8), (4, 5, 3, 3), (4,)],
        ),
        ("conv1d strided input", lambda x, w: F.conv1d(x[:, :, ::2], w), [(3, 4, 30), (6, 4, 5)]),
        (
            "conv_transpose2d",
            lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
            [(2, 6, 5, 5), (6, 4, 4, 4), (4,)],
        ),
    ],
)
def test_convolutions_forward_and_backward(dtype, name, fn, shapes):
    """A bias is added to the rounded product (the test below): the forward is one rounding without it."""
    torch.manual_seed(1)
    inputs = [randn(*s) for s in shapes]
    counts = check(fn, inputs, dtype, name, forward=len(shapes) == 2)
    if len(shapes) == 3:
        check(lambda x, w: fn(x, w, None), inputs[:2], dtype, f"{name} without its bias")
    assert counts.get("convolution") == 1 and counts.get("convolution_backward") == 1


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("conv", [F.conv2d, F.conv_transpose2d], ids=["conv2d", "conv_transpose2d"])
def test_a_convolutions_bias_is_added_to_its_rounded_product_as_cudas(dtype, conv):
    """torch's cuDNN path computes the product in the dtype, then output.add_(bias): on an H200 a
    biased FP16/BF16 convolution was up to 30 times the one-rounding bound off float64, the same one
    without its bias within it (results/gpu-arithmetic)."""
    torch.manual_seed(5)
    x, w, b = randn(2, 6, 7, 7).to(dtype), randn(6, 6, 3, 3).to(dtype), randn(6).to(dtype)
    with TensorCoreArithmetic() as mode:
        biased, product = conv(x, w, b), conv(x, w)
    assert mode.counts == {"convolution": 2}
    assert torch.equal(biased, product + b.view(1, -1, 1, 1))
    assert not torch.equal(biased, conv(x.float(), w.float(), b.float()).to(dtype))  # not one rounding of the whole


def test_fp32_ops_and_mixed_dtypes_are_left_to_torch():
    torch.manual_seed(2)
    a, b = randn(8, 16), randn(16, 4)
    with TensorCoreArithmetic() as mode:
        same = a @ b
        mixed = torch.addmm(torch.zeros(8, 4), a.half().float(), b)  # FP32 throughout
    # Against the same op outside: addmm with beta=1 need not sum as mm does
    assert torch.equal(same, a @ b) and mode.counts == {}
    assert torch.equal(mixed, torch.addmm(torch.zeros(8, 4), a.half().float(), b))


def test_a_module_keeps_its_memory_format_and_is_caught_inside():
    torch.manual_seed(3)
    conv = nn.Conv2d(4, 8, 3).half().to(memory_format=torch.channels_last)
    x = randn(2, 4, 9, 9).half().contiguous(memory_format=torch.channels_last)
    with TensorCoreArithmetic() as mode:
        y = conv(x)
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=torch.channels_last)
    assert mode.counts == {"convolution": 1}


def test_large_inputs_widen_into_reused_buffers_to_the_same_result():
    """Inputs of a million elements or more are widened into buffers kept from call to call: the
    results are those of widening each afresh, bit for bit, in every layout, and a buffer is reused.
    Each product is compared with torch's FP32 kernel on the same layout (`.float()` keeps strides):
    MKL's GEMM may sum a column-major A in another order than a row-major one (issue 45: 87
    elements one FP16 ulp apart on an AVX-512 Xeon), so across layouts only the one-ulp bound above."""
    torch.manual_seed(4)
    a, b = randn(1100, 1000).half(), randn(1000, 30).half()
    a_cols = a.t().contiguous().t()  # column-major: the buffer must take its strides
    x = randn(1, 16, 300, 300).half().contiguous(memory_format=torch.channels_last)
    w = randn(8, 16, 3, 3).half()
    with TensorCoreArithmetic() as mode:
        products = [a @ b, a_cols @ b, a[:, :999] @ b[:999], a @ b]
        conv = F.conv2d(x, w)
    assert a_cols.stride() == (1, 1100) and a_cols.float().stride() == (1, 1100)
    whole = a.float() @ b.float()
    fresh = [whole, a_cols.float() @ b.float(), a[:, :999].float() @ b[:999].float(), whole]
    for ours, theirs in zip(products, fresh):
        assert torch.equal(ours, theirs.half())
    magnitude = a.double().abs() @ b.double().abs()
    assert_within_one_ulp(products[1], products[0].double(), magnitude, torch.float16, "column-major A vs row-major")
    assert torch.equal(conv, F.conv2d(x.float(), w.float()).half()) and conv.is_contiguous(
        memory_format=torch.channels_last
    )
    assert mode.counts == {"mm": 4, "convolution": 1}
    scratch = _Scratch()
    taken: list = []
    first = scratch.widen(a, taken)
    scratch.give_back(taken)
    assert scratch.widen(a.t(), []).data_ptr() == first.data_ptr()


def test_a_large_weight_widened_for_the_forward_is_taken_again_only_while_unchanged():
    """The backward takes the forward's widening of a large weight; a weight changed in place since
    is widened anew."""
    torch.manual_seed(5)
    lin = nn.Linear(1000, 1100, bias=False).half()
    x, g = randn(3, 1000).half().requires_grad_(), randn(3, 1100).half()
    w = lin.weight.detach().clone()
    with TensorCoreArithmetic():
        lin(x).backward(g)
        with torch.no_grad():
            lin.weight.mul_(0.5)
            changed = lin(x)
    assert torch.equal(x.grad, (g.float() @ w.float()).half())
    assert torch.equal(lin.weight.grad, (g.float().t() @ x.detach().float()).half())
    assert torch.equal(changed, (x.detach().float() @ lin.weight.detach().float().t()).half())


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "name,fn,shapes,gradients",
    [
        ("mm", torch.mm, [(13, 37), (37, 9)], True),
        ("addmm", lambda c, a, b: torch.addmm(c, a, b), [(13, 9), (13, 37), (37, 9)], True),
        ("bmm", torch.bmm, [(3, 7, 21), (3, 21, 5)], True),
        # torch's own FP16/BF16 convolution backward on a CPU is not one rounding of an FP32 sum:
        # its gradients were many times this bound off float64 (results/cpu-fp16-conv/
        # native_conv_accuracy.json). The emulation's are within it (test above); only forwards compare.
        (
            "conv2d",
            lambda x, w: F.conv2d(x, w, padding=1),
            [(2, 6, 7, 7), (4, 6, 3, 3)],
            False,
        ),  # the CPU's kernel adds a bias before rounding
    ],
)
def test_within_one_ulp_of_torchs_native_kernel(dtype, name, fn, shapes, gradients):
    """torch's own FP16/BF16 matrix products on a CPU also accumulate in FP32 and round once: the
    emulation and the native kernel agree within the same bound."""
    torch.manual_seed(4)
    mode = TensorCoreArithmetic()
    e = against_float64(fn, [randn(*s) for s in shapes], dtype, mode)
    native = [x.detach().clone().requires_grad_() for x in e.low]
    ref = fn(*native)
    ref.backward(e.grad)
    assert mode.counts, "the emulation ran"
    assert_within_one_ulp(e.out, ref.detach().double(), e.bound, dtype, f"{name} forward")
    for i, (a, b, m) in enumerate(zip(e.low, native, e.size) if gradients else []):
        assert_within_one_ulp(a.grad, b.grad.double(), m.grad, dtype, f"{name} gradient of input {i}")
