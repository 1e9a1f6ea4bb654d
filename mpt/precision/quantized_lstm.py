"""nn.LSTM with quantized gate products (quantized_products.py), written out step by step.

Each layer and direction makes three kinds of product: the input's (all steps in one), the
recurrent state's (one per step) and, with a projection, the cell output's (one per step). Each is
a quantized linear product with its own site, so a delayed scale is kept per weight. Each product's
result is rounded to the output dtype and the cell sums them and runs its gates, activations and
update in FP32, h and c stored in the output dtype: what an H100's cuDNN was found to do in BF16
(docs/cpu-arithmetic.md), and what cpu_tensor_cores.py emulates for the 16-bit modes.
The recurrent weights' operands are quantized once per pass (ReusedWeight), and their gradients
are each one product over all the steps' rows (SequenceWeightGrad), as cuDNN computes them: the
steps' gradients and inputs, quantized as one product's operands, summed in one FP32 product and
rounded once. Packed sequences run padded, each sequence's state held past its end (and, in the reverse
direction, at its initial value until its last element), which is what packing computes.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from .product_operands import Site
from .quantized_products import SequenceWeightGrad, linear, observing, out_dtype, sequence_weight


def _repack(out: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """out (B, T, F) in the original batch order, as a PackedSequence laid out as `like`."""
    ordered = out if like.sorted_indices is None else out.index_select(0, like.sorted_indices)
    data = torch.cat([ordered[: int(n), t] for t, n in enumerate(like.batch_sizes)])
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


def _cell(
    pre: torch.Tensor, rec: torch.Tensor, c: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's cell from its two products' results: the gates, activations and update in FP32,
    h and c stored in `dtype`."""
    gates = pre.float() + rec.float()
    i, f, g, o = gates.chunk(4, 1)
    c_new = torch.sigmoid(f) * c.float() + torch.sigmoid(i) * torch.tanh(g)
    h_new = (torch.sigmoid(o) * torch.tanh(c_new)).to(dtype)
    return h_new, c_new.to(dtype)


@functools.cache
def fused_cell(backend: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """_cell compiled by `backend` (precision.products.fused_cell): its forward and backward each
    a few fused kernels instead of a dozen per step. Its shapes are symbolic from the start, so
    that GNMT's batches of every size share a graph; training and evaluation (no gradients) and
    each dtype compile their own."""
    return torch.compile(_cell, backend=backend, fullgraph=True, dynamic=True)


def fresh_cells() -> None:
    """Forget the cells compiled so far: dynamo's graphs of a code object are shared by every
    compile of it, and the runs of a sweep (one process) would add theirs up to its recompile limit."""
    import torch._dynamo

    torch._dynamo.reset()
    fused_cell.cache_clear()


class QuantizedLSTM(nn.LSTM):
    products_sites: dict[str, Site]
    fused_cell: Optional[str] = None  # a torch.compile backend for the cell, or None: eager

    def forward(self, input, hx: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        packed = isinstance(input, PackedSequence)
        lengths = None
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)
        else:
            x = input if self.batch_first or input.dim() == 2 else input.transpose(0, 1)
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
            hx = None if hx is None else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
        dirs = 2 if self.bidirectional else 1
        batch, steps = x.shape[:2]
        out_size = self.proj_size or self.hidden_size
        dtype = out_dtype(x)
        if hx is None:
            h0 = x.new_zeros(self.num_layers * dirs, batch, out_size, dtype=dtype)
            c0 = x.new_zeros(self.num_layers * dirs, batch, self.hidden_size, dtype=dtype)
        else:
            h0, c0 = hx
        valid = None
        if lengths is not None:  # (T, B, 1); the lengths copied without waiting for the device
            valid = (
                torch.arange(steps, device=x.device).unsqueeze(1) < lengths.to(x.device, non_blocking=True).unsqueeze(0)
            ).unsqueeze(-1)
        observe = observing(self)
        layer_input, hs, cs = x, [], []
        for layer in range(self.num_layers):
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                out, h, c = self._direction(layer_input, h0[k], c0[k], layer, d, valid, observe, dtype)
                outs.append(out)
                hs.append(h)
                cs.append(c)
            layer_input = torch.cat(outs, -1) if dirs == 2 else outs[0]
            if self.dropout and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout, self.training)
        out, h_n, c_n = layer_input, torch.stack(hs), torch.stack(cs)
        if unbatched:
            return out.squeeze(0), (h_n.squeeze(1), c_n.squeeze(1))
        if packed:
            return _repack(out, input), (h_n, c_n)
        return (out if self.batch_first else out.transpose(0, 1)), (h_n, c_n)

    def _direction(self, x, h, c, layer, d, valid, observe, dtype):
        """One layer's pass in one direction over x (B, T, F): its outputs (B, T, out) and last h, c."""
        sfx = f"_l{layer}" + ("_reverse" if d else "")
        w = lambda name: getattr(self, f"{name}{sfx}")  # noqa: E731
        sites = self.products_sites
        bias = (w("bias_ih") + w("bias_hh")) if self.bias else None
        pre = linear(
            x, w("weight_ih"), bias, sites[f"ih{sfx}"], observe
        )  # (B, T, 4H): every step's input product at once
        h, c = h.to(dtype), c.to(dtype)
        # The recurrent weights' operands, quantized once for all the steps' products, and their
        # gradients, each one product over all the steps' rows
        hh = sites[f"hh{sfx}"]
        w_hh, g_hh = hh.reused(), SequenceWeightGrad(hh)
        weight_hh = sequence_weight(w("weight_hh"), g_hh)
        if self.proj_size:
            hr = sites[f"hr{sfx}"]
            w_hr, g_hr = hr.reused(), SequenceWeightGrad(hr)
            weight_hr = sequence_weight(w("weight_hr"), g_hr)
        outs: list[torch.Tensor] = [None] * x.shape[1]  # type: ignore[list-item]
        order = range(x.shape[1] - 1, -1, -1) if d else range(x.shape[1])
        cell = _cell if self.fused_cell is None else fused_cell(self.fused_cell)
        for t in order:
            h_new, c_new = cell(pre[:, t], linear(h, weight_hh, None, hh, observe, w_hh, g_hh), c, dtype)
            if self.proj_size:
                h_new = linear(h_new, weight_hr, None, hr, observe, w_hr, g_hr)
            if valid is None:
                h, c, outs[t] = h_new, c_new, h_new
            else:
                keep = valid[t]
                h, c = torch.where(keep, h_new, h), torch.where(keep, c_new, c)
                outs[t] = torch.where(keep, h_new, torch.zeros_like(h_new))
        return torch.stack(outs, 1), h, c
