"""Matrix products with FP8 or MX operands: the paper's recipe one format generation on.

In a network `install` has prepared, every convolution, transposed convolution, linear layer, LSTM
(quantized_lstm.py) and `BatchMatmul` quantizes the operands of its products and nothing else:
each of a layer's three products (the output, the input's gradient, the weight's gradient) takes
its two operands in the recipe's formats, the forward's inputs and weights in the forward format
and the gradient flowing into the layer in the backward format. What a product computes from them
is FP32 arithmetic on their exact values, rounded once to the output dtype (autocast's, else the
input's): a GPU's scaled FP8 GEMM (FP32 accumulation) up to the order of summation, and what
torchao's `emulate=True` computes. Biases are added, and their gradients summed, in high precision,
as in Transformer Engine and torchao.

Each operand's format and scale (per tensor, delayed or per block) are product_operands.py's.

Evaluation forwards (a module in eval mode) use the scales but do not add to the histories, so how
often a run evaluates does not change how it trains.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from .formats import FloatFormat
from .product_operands import TORCH_FP8, ReusedWeight, Site, to_fp8


class BatchMatmul(nn.Module):
    """`a @ b` over batches, as a module so that a mode quantizing products sees it (attention)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


def out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product's result is rounded to: autocast's where it is on, as torchao's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _through(grad: torch.Tensor, dtype: torch.dtype, operand: torch.Tensor) -> torch.Tensor:
    """An operand's gradient as autocast gives it: computed in the product's dtype (autocast's casts
    are differentiable, so an FP32 operand receives the gradient of its low-precision copy), then
    in the operand's own."""
    return grad.to(dtype).to(operand.dtype)


def _fp32(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, enabled=False)


def _on_scaled_mm(site: Site, device: torch.device, *dims: int) -> bool:
    """Whether a linear layer's products run on torch._scaled_mm: FP8 per-tensor scaling on a GPU
    with FP8 tensor cores (compute capability 8.9 and up), every dimension a multiple of 16 (its
    kernels' requirement). Convolutions have no FP8 kernel in PyTorch and stay emulated."""
    r = site.recipe
    return (
        device.type == "cuda"
        and r.scaling != "block"
        and {r.forward.name, r.backward.name} <= set(TORCH_FP8)
        and r.forward.name == "e4m3"  # every product pairs a gradient with a forward operand; E5M2 x E5M2 has no kernel
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(device) >= (8, 9)
        and all(d % 16 == 0 for d in dims)
    )


def _fp8_mm(
    qa: torch.Tensor, sa: torch.Tensor, qb_t: torch.Tensor, sb: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """qa (M, K) @ qb_t (N, K)^T on torch._scaled_mm, both already FP8 under scales sa and sb:
    products accumulated in FP32, the scales divided out of the result."""
    return torch._scaled_mm(
        qa, qb_t.t(), scale_a=sa.reciprocal().float(), scale_b=sb.reciprocal().float(), out_dtype=dtype
    )


def _scaled_gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    fa: FloatFormat,
    b_t: torch.Tensor,
    sb: torch.Tensor,
    fb: FloatFormat,
    dtype: torch.dtype,
) -> torch.Tensor:
    """a (M, K) @ b_t (N, K)^T on torch._scaled_mm: each operand cast to FP8 under its scale (as
    `scaled` rounds it), products accumulated in FP32, the scales divided out of the result."""
    qa = to_fp8(a.float() * sa, fa).contiguous()
    qb = to_fp8(b_t.float() * sb, fb).contiguous()
    return _fp8_mm(qa, sa, qb, sb, dtype)


class SequenceWeightGrad:
    """One recurrent weight's gradient over a layer's pass, as one product over all T·B rows, as
    cuDNN computes it: each step's backward leaves its gradient and input here instead of writing
    a weight-sized gradient that autograd would then add up, step by step.

    The product quantizes its operands as one product does: a per-tensor scale over all the rows
    (`tensor`: their amax; `delayed`: the role's scale of this step, the same one each step's
    product took), or blocks of 32 along each step's own rows (MX, as each step's product made them)."""

    def __init__(self, site: Site):
        self.site = site
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gradient (B, out), input (B, in)) per step
        self.dtype: Optional[torch.dtype] = None  # the steps' output dtype

    def weight_grad(self, w: torch.Tensor) -> Optional[torch.Tensor]:
        rows, self.rows = self.rows, []
        if not rows:
            return None
        site, dtype = self.site, cast(torch.dtype, self.dtype)
        g, x = torch.cat([g for g, _ in rows]), torch.cat([x for _, x in rows])
        with _fp32(g.device):
            if site.recipe.scaling == "block":
                steps = [len(r) for r, _ in rows]
                qg = torch.cat([site.operand(p, "grad_output", 0)[0] for p in g.split(steps)])
                qx = torch.cat([site.operand(p, "input", 0)[0] for p in x.split(steps)])
                gw = qg.t() @ qx
            else:
                sg, sx = site.scale(g, "grad_output"), site.scale(x, "input")
                fast = _on_scaled_mm(site, g.device, g.shape[1], g.shape[0], x.shape[1])
                site.paths.add("scaled_mm" if fast else "emulated")  # T·B rows may take another path than B
                if fast:
                    qg8, _ = site.fp8(g, "grad_output", transposed=True, scale=sg)
                    qx8, _ = site.fp8(x, "input", transposed=True, scale=sx)
                    gw = _fp8_mm(qg8, sg, qx8, sx, dtype)
                else:
                    gw = site.operand(g, "grad_output", 0, scale=sg)[0].t() @ site.operand(x, "input", 0, scale=sx)[0]
        return _through(gw, dtype, w)


class _SequenceWeight(torch.autograd.Function):
    """The weight as a layer's steps take it: the same tensor forward; backward, after every step's
    backward has run (they all take it), the gradient they left in `grads`."""

    @staticmethod
    def forward(ctx, w, grads: SequenceWeightGrad):
        ctx.grads = grads
        ctx.save_for_backward(w)
        ctx.set_materialize_grads(False)  # the steps give it no gradient: no weight-sized zeros
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        gw = ctx.grads.weight_grad(w)
        if g is not None:  # another use of it than the steps' (none in this project)
            gw = g if gw is None else gw + g
        return gw, None


def sequence_weight(w: torch.Tensor, grads: SequenceWeightGrad) -> torch.Tensor:
    """w for a series of `linear` calls given `sequence=grads`: its gradient is theirs, as one product."""
    return _SequenceWeight.apply(w, grads)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, w, b, site: Site, observe: bool, weights: Optional[ReusedWeight], sequence: Optional[SequenceWeightGrad]
    ):
        dtype = out_dtype(x)
        operands = weights or site
        x2 = x.reshape(-1, x.shape[-1])
        fast = _on_scaled_mm(site, x.device, *x2.shape, w.shape[0])
        site.paths.add("scaled_mm" if fast else "emulated")
        with _fp32(x.device):
            sx: Optional[torch.Tensor]
            sw: Optional[torch.Tensor]
            if fast:
                qx8, sx = site.fp8(x2, "input", transposed=False, observe=observe)
                qw8, sw = operands.fp8(w, "weight", transposed=False, observe=observe)  # a reused weight: once per pass
                out = _fp8_mm(qx8, sx, qw8, sw, dtype).reshape(*x.shape[:-1], -1)
            else:
                qx, sx = site.operand(x, "input", -1, observe=observe)
                qw, sw = operands.operand(w, "weight", 1, observe=observe)
                out = F.linear(qx, qw).to(dtype)
            if b is not None:
                out = out + b.to(dtype)
        ctx.save_for_backward(x, w)
        ctx.site, ctx.weights, ctx.scales, ctx.has_bias, ctx.dtype, ctx.fast = (
            site,
            operands,
            (sx, sw),
            b is not None,
            dtype,
            fast,
        )
        ctx.sequence = sequence
        if sequence is not None:
            sequence.dtype = dtype
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        site, (sx, sw) = ctx.site, ctx.scales
        gx = gw = gb = None
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if (
            ctx.sequence is not None and ctx.needs_input_grad[1]
        ):  # the weight's gradient: one product after the last step
            ctx.sequence.rows.append((g2, x2))
        own_weight_grad = ctx.sequence is None and ctx.needs_input_grad[1]
        with _fp32(g.device):
            if ctx.fast:
                f, fg = site.recipe.forward, site.recipe.backward
                sg = site.scale(g, "grad_output", observe=True)
                if ctx.needs_input_grad[0]:
                    qw8_t, _ = ctx.weights.fp8(w, "weight", transposed=True, scale=sw)  # a reused weight: once per pass
                    gx = _through(
                        _fp8_mm(
                            site.fp8(g2, "grad_output", transposed=False, scale=sg)[0], sg, qw8_t, sw, ctx.dtype
                        ).reshape(x.shape),
                        ctx.dtype,
                        x,
                    )
                if own_weight_grad:
                    gw = _through(_scaled_gemm(g2.t(), sg, fg, x2.t(), sx, f, ctx.dtype), ctx.dtype, w)
            else:
                qg, sg = site.operand(g, "grad_output", -1, observe=True)  # the input gradient reduces over outputs
                if ctx.needs_input_grad[0]:
                    gx = _through(qg @ ctx.weights.operand(w, "weight", 0, scale=sw)[0], ctx.dtype, x)
                if own_weight_grad:
                    qg2 = site.operand(g2, "grad_output", 0, scale=sg)[0] if sg is None else qg.reshape(g2.shape)
                    gw = _through(
                        qg2.t() @ site.operand(x2, "input", 0, scale=sx)[0], ctx.dtype, w
                    )  # the weight gradient reduces over rows
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = _through(g2.float().sum(0), ctx.dtype, w)
        return gx, gw, gb, None, None, None, None


class _Convolution(torch.autograd.Function):
    """aten.convolution (any rank, transposed or not) with quantized operands."""

    @staticmethod
    def forward(ctx, x, w, b, site: Site, observe: bool, stride, padding, dilation, transposed, output_padding, groups):
        site.paths.add("emulated")
        dtype = out_dtype(x)
        # A convolution reduces over input channels: axis 1 of a weight, axis 0 of a transposed one's.
        qx, sx = site.operand(x, "input", 1, observe=observe)
        qw, sw = site.operand(w, "weight", 0 if transposed else 1, observe=observe)
        args = (stride, padding, dilation, transposed, output_padding, groups)
        with _fp32(x.device):
            out = torch.ops.aten.convolution(qx, qw, None, *args).to(dtype)
            if b is not None:
                out = out + b.to(dtype).reshape(1, -1, *[1] * (out.dim() - 2))
        ctx.save_for_backward(x, w)
        ctx.site, ctx.scales, ctx.args, ctx.has_bias, ctx.dtype = site, (sx, sw), args, b is not None, dtype
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        site, (sx, sw), args = ctx.site, ctx.scales, ctx.args
        transposed = args[3]
        gx = gw = gb = None
        with _fp32(g.device):
            # The input gradient reduces over output channels; the weight gradient over the batch.
            qg, sg = site.operand(g, "grad_output", 1, observe=True)
            if ctx.needs_input_grad[0]:
                qw = site.operand(w, "weight", 1 if transposed else 0, scale=sw)[0]
                gx = torch.ops.aten.convolution_backward(qg, x.float(), qw, None, *args, [True, False, False])[0]
                gx = _through(gx, ctx.dtype, x)
            if ctx.needs_input_grad[1]:
                qg0 = site.operand(g, "grad_output", 0, scale=sg)[0] if sg is None else qg
                qx = site.operand(x, "input", 0, scale=sx)[0]
                gw = torch.ops.aten.convolution_backward(qg0, qx, w.float(), None, *args, [False, True, False])[1]
                gw = _through(gw, ctx.dtype, w)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = _through(g.float().sum([d for d in range(g.dim()) if d != 1]), ctx.dtype, w)
        return gx, gw, gb, None, None, None, None, None, None, None, None


class _Matmul(torch.autograd.Function):
    """a (..., M, K) @ b (..., K, N), batch dimensions equal, with quantized operands."""

    @staticmethod
    def forward(ctx, a, b, site: Site, observe: bool):
        site.paths.add("emulated")
        dtype = out_dtype(a)
        qa, sa = site.operand(a, "input", -1, observe=observe)
        qb, sb = site.operand(b, "weight", -2, observe=observe)
        with _fp32(a.device):
            out = torch.matmul(qa, qb).to(dtype)
        ctx.save_for_backward(a, b)
        ctx.site, ctx.scales, ctx.dtype = site, (sa, sb), dtype
        return out

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        site, (sa, sb) = ctx.site, ctx.scales
        ga = gb = None
        with _fp32(g.device):
            qg, sg = site.operand(g, "grad_output", -1, observe=True)
            if ctx.needs_input_grad[0]:
                ga = _through(qg @ site.operand(b, "weight", -1, scale=sb)[0].transpose(-1, -2), ctx.dtype, a)
            if ctx.needs_input_grad[1]:
                qg1 = site.operand(g, "grad_output", -2, scale=sg)[0] if sg is None else qg
                gb = _through(site.operand(a, "input", -2, scale=sa)[0].transpose(-1, -2) @ qg1, ctx.dtype, b)
        return ga, gb, None, None


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: Optional[torch.Tensor],
    site: Site,
    observe: bool,
    weights: Optional[ReusedWeight] = None,
    sequence: Optional[SequenceWeightGrad] = None,
) -> torch.Tensor:
    """x @ w.T + b with quantized operands. `weights`: w's operands made once for a series of calls;
    `sequence`: the series' weight gradient, computed once (w then comes from `sequence_weight`)."""
    return _Linear.apply(x, w, b, site, observe, weights, sequence)


def observing(module: nn.Module) -> bool:
    """Whether a module's products add to the delayed histories: in training forwards only."""
    return module.training and torch.is_grad_enabled()


class QuantizedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias, self.products_site, observing(self), None, None)


class _QuantizedConv:
    """A convolution's or a transposed convolution's forward with quantized products (zero padding)."""

    # self: Any, as the mixin is only ever a base of an nn.Conv*/ConvTranspose* class (_quantized_class)
    def forward(self: Any, x: torch.Tensor, output_size: Optional[list[int]] = None) -> torch.Tensor:
        transposed = isinstance(self, nn.modules.conv._ConvTransposeNd)
        dims = x.dim() - 2
        if transposed:
            output_padding = self._output_padding(
                x, output_size, self.stride, self.padding, self.kernel_size, dims, self.dilation
            )
        else:
            output_padding = (0,) * dims
        return _Convolution.apply(
            x,
            self.weight,
            self.bias,
            self.products_site,
            observing(self),
            self.stride,
            self.padding,
            self.dilation,
            transposed,
            output_padding,
            self.groups,
        )


class QuantizedBatchMatmul(BatchMatmul):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _Matmul.apply(a, b, self.products_site, observing(self))


CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
