"""FP16 convolutions on a CPU, computed as a GPU computes them, at FP32 speed.

torch's CPU kernels for FP16 convolutions are reference loops: SSD300 takes about 100 s per image
for a forward and backward pass on a 2-core machine, against under 2 s in FP32. A GPU's FP16
convolution multiplies FP16 values, accumulates in FP32 and rounds the result to FP16 once. The
product of two FP16 numbers is exact in FP32 (11 + 11 significant bits), so an FP32 convolution of
the FP16 values, rounded once to FP16, is that arithmetic; only the order of the FP32 additions can
differ, as it differs between cuDNN's own algorithms. Gradients are formed the same way: FP16
inputs, FP32 accumulation, one rounding to FP16.

`emulate_half_convs` swaps a model's Conv2d and ConvTranspose2d modules to these classes in place (state dicts unchanged).
It applies to FP16 weights and to FP16 autocast: under autocast, inputs and weights are first
rounded to FP16, as autocast's casts would.
"""

from __future__ import annotations

import torch
from torch import nn


class _HalfConvFn(torch.autograd.Function):
    """A convolution or transposed convolution (aten.convolution's arguments) in FP16 arithmetic."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        half = torch.float16
        x16, w16 = x.to(half), weight.to(half)
        b16 = None if bias is None else bias.to(half)
        with torch.autocast("cpu", enabled=False):
            y = torch.ops.aten.convolution(
                x16.float(), w16.float(), None if b16 is None else b16.float(), stride, padding, dilation, transposed, output_padding, groups
            )
        ctx.save_for_backward(x16, w16)
        ctx.conv = (stride, padding, dilation, transposed, output_padding, groups)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(half)

    @staticmethod
    def backward(ctx, grad_y):
        x16, w16 = ctx.saved_tensors
        stride, padding, dilation, transposed, output_padding, groups = ctx.conv
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        out_channels = w16.shape[1] * groups if transposed else w16.shape[0]
        gy = grad_y.float()  # an FP16 tensor: the gradient of an FP16 output
        gx, gw, gb = torch.ops.aten.convolution_backward(
            gy,
            x16.float(),
            w16.float(),
            [out_channels] if b_dtype is not None else None,
            list(stride),
            list(padding),
            list(dilation),
            transposed,
            list(output_padding),
            groups,
            [needs[0], needs[1], needs[2] and b_dtype is not None],
        )

        def rounded(g, dtype):  # one rounding to FP16, then the dtype the caller's tensor has
            return None if g is None else g.to(torch.float16).to(dtype)

        return rounded(gx, x_dtype), rounded(gw, w_dtype), rounded(gb, b_dtype), None, None, None, None, None, None


class HalfConv2d(nn.Conv2d):
    """nn.Conv2d whose FP16 arithmetic runs as FP32 convolutions of FP16 values (see the module doc)."""

    def _conv_forward(self, input, weight, bias):
        if self.padding_mode != "zeros" or isinstance(self.padding, str):
            return super()._conv_forward(input, weight, bias)
        return _HalfConvFn.apply(input, weight, bias, self.stride, self.padding, self.dilation, False, (0, 0), self.groups)


class HalfConvTranspose2d(nn.ConvTranspose2d):
    """nn.ConvTranspose2d (a DCGAN generator's layers) in the same arithmetic."""

    def forward(self, input, output_size=None):
        if output_size is not None or self.padding_mode != "zeros":
            return super().forward(input, output_size)
        return _HalfConvFn.apply(input, self.weight, self.bias, self.stride, self.padding, self.dilation, True, self.output_padding, self.groups)


EMULATED = {nn.Conv2d: HalfConv2d, nn.ConvTranspose2d: HalfConvTranspose2d}


def emulate_half_convs(model: nn.Module) -> int:
    """Swap every plain Conv2d and ConvTranspose2d of `model` to its emulating class. Returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) in EMULATED:
            module.__class__ = EMULATED[type(module)]
            swapped += 1
    return swapped
