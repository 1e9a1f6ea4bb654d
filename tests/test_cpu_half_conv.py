"""CPU FP16 convolutions: FP16 values, FP32 accumulation, one rounding, checked against float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpt.precision.cpu_half_conv import HalfConv2d, HalfConvTranspose2d, emulate_half_convs

F16 = torch.float16


def within_one_ulp(a: torch.Tensor, exact: torch.Tensor) -> tuple[bool, float]:
    """(every element within one FP16 ulp of the float64 value, share of elements equal to its rounding).

    Plus FP32's own accumulation error where terms cancel: about 2^-24 per term of a sum of a few
    hundred, bounded here by 2^-16 of the largest value (far below the 2^-11 of an FP16 rounding)."""
    rounded = exact.to(F16)
    ulp = (torch.nextafter(rounded.abs(), torch.tensor(float("inf"), dtype=F16)) - rounded.abs()).double()
    close = ((a.double() - exact).abs() <= ulp + 2**-16 * exact.abs().max()).all().item()
    return close, (a == rounded).double().mean().item()


def conv_pair(in_ch=32, out_ch=24, bias=True):
    torch.manual_seed(0)
    conv = nn.Conv2d(in_ch, out_ch, 3, padding=1, stride=1, bias=bias)
    emulated = nn.Conv2d(in_ch, out_ch, 3, padding=1, stride=1, bias=bias)
    emulated.load_state_dict(conv.state_dict())
    assert emulate_half_convs(emulated) == 1 and isinstance(emulated, HalfConv2d)
    return conv, emulated


def test_fp16_forward_and_gradients_are_the_float64_results_rounded_once():
    conv, emulated = conv_pair()
    emulated.half()
    x = torch.randn(2, 32, 12, 12).half().requires_grad_()
    y = emulated(x)
    assert y.dtype == F16
    w, b = emulated.weight, emulated.bias
    exact = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    ok, equal = within_one_ulp(y, exact)
    assert ok and equal > 0.99

    gy = torch.randn_like(y)
    y.backward(gy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    F.conv2d(x64, w64, b64, padding=1).backward(gy.double())
    for mine, oracle in [(x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)]:
        assert mine.dtype == F16
        ok, equal = within_one_ulp(mine, oracle)
        assert ok and equal > 0.99


def test_fp16_autocast_rounds_inputs_and_weights_first():
    conv, emulated = conv_pair(64, 16, bias=False)
    x = torch.randn(2, 64, 10, 10, requires_grad=True)  # FP32 values most of which FP16 cannot hold
    with torch.autocast("cpu", dtype=F16):
        y = emulated(x)
        native = conv(x)
    assert y.dtype == native.dtype == F16
    rounded_inputs = F.conv2d(x.detach().half().double(), conv.weight.detach().half().double(), padding=1)
    unrounded_inputs = F.conv2d(x.detach().double(), conv.weight.detach().double(), padding=1)
    ok, equal = within_one_ulp(y, rounded_inputs)
    assert ok and equal > 0.99
    assert within_one_ulp(y, unrounded_inputs)[1] < 0.9  # the test can tell the two apart
    y.float().sum().backward()
    # Gradients reach the FP32 leaves as FP32 tensors holding FP16 values, as autocast's casts give.
    assert x.grad.dtype == emulated.weight.grad.dtype == torch.float32
    assert torch.equal(x.grad.half().float(), x.grad) and torch.equal(emulated.weight.grad.half().float(), emulated.weight.grad)


def test_matches_torchs_own_cpu_fp16_kernel_within_an_ulp():
    conv, emulated = conv_pair()
    conv.half(), emulated.half()
    x = torch.randn(2, 32, 12, 12).half()
    ours, theirs = emulated(x), conv(x)
    exact = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert within_one_ulp(ours, exact)[0] and within_one_ulp(theirs, exact)[0]
    assert (ours.double() - theirs.double()).abs().max() <= 2 * (exact.abs().max() * 2**-10)


def test_transposed_fp16_forward_and_gradients_are_the_float64_results_rounded_once():
    torch.manual_seed(0)
    deconv = nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1, bias=True)  # a DCGAN generator layer
    assert emulate_half_convs(deconv) == 1 and isinstance(deconv, HalfConvTranspose2d)
    deconv.half()
    x = torch.randn(2, 32, 6, 6).half().requires_grad_()
    y = deconv(x)
    assert y.dtype == F16 and y.shape == (2, 16, 12, 12)
    w, b = deconv.weight, deconv.bias
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    exact = F.conv_transpose2d(x64, w64, b64, stride=2, padding=1)
    ok, equal = within_one_ulp(y, exact.detach())
    assert ok and equal > 0.99
    gy = torch.randn_like(y)
    y.backward(gy)
    exact.backward(gy.double())
    for mine, oracle in [(x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)]:
        assert mine.dtype == F16 and mine.shape == oracle.shape
        ok, equal = within_one_ulp(mine, oracle)
        assert ok and equal > 0.99
