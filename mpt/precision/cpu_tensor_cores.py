"""A GPU's tensor-core arithmetic for the matrix products of FP16 and BF16 training, on a CPU.

A tensor core multiplies FP16 (or BF16) inputs, accumulates the products in FP32 and rounds the
result once to the output dtype. Inside `TensorCoreArithmetic`, every matrix product and
convolution whose floating inputs are all FP16 (or all BF16) runs as torch's own FP32 kernel on
those same rounded inputs, and its result is rounded once: the GPU's arithmetic up to summation
order, at the speed of the CPU's FP32 kernels. An LSTM in FP16 or BF16 runs as cuDNN's does: its
products so, its cell's sums, activations and update in FP32, its h and c stored in the dtype.

The products are replaced at the CPU kernels of the aten ops (torch.library, for the context's
duration), below autograd: so they catch what composite modules call inside (linear is an addmm,
matmul an mm or a bmm) and the ops of the backward pass, and every other op runs at full speed.
The LSTM is replaced at its autograd kernel, so its gradients are those of the computation above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

LOW_PRECISION = (torch.float16, torch.bfloat16)
# Every aten op a matrix product or a convolution of training reaches on a CPU, forward and backward.
PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "convolution", "convolution_backward")
LSTMS = ("lstm.input", "lstm.data")


def low_precision_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The op's low-precision dtype when all its floating tensors have it; None otherwise (an FP32
    op, or a mix, which is left to torch)."""
    dtypes = {t.dtype for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(dtypes) == 1:
        (dtype,) = dtypes
        if dtype in LOW_PRECISION:
            return dtype
    return None


def _product(original, name: str, counts: dict[str, int]):
    def kernel(keyset, *args, **kwargs):
        # Every FP32 product of the process passes here while the context is open: the first
        # argument's dtype (these ops' inputs share one) decides most calls cheaply.
        first = args[0]
        if not (isinstance(first, torch.Tensor) and first.dtype in LOW_PRECISION) or (dtype := low_precision_dtype(args, kwargs)) is None:
            return original.call_boxed(keyset, *args, **kwargs)
        counts[name] = counts.get(name, 0) + 1
        # .float() and .to() keep the memory format, so channels-last stays channels-last.
        widen = [a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args]
        out = original.call_boxed(keyset, *widen, **kwargs)
        if isinstance(out, torch.Tensor):
            return out.to(dtype)
        return tuple(o.to(dtype) if isinstance(o, torch.Tensor) else o for o in out)

    return kernel


def _lstm(original, packed: bool, emulate: bool, counts: dict[str, int]):
    def kernel(keyset, *args):
        x, params = args[0], args[3 if packed else 2]
        dtype = x.dtype if x.dtype in LOW_PRECISION and all(p.dtype == x.dtype for p in params) else None
        if dtype is None:
            return original.call_boxed(keyset, *args)
        counts["lstm"] = counts.get("lstm", 0) + 1
        if not emulate:  # torch's own kernel in the dtype: oneDNN has no FP16 LSTM, nor a BF16 one without AVX-512
            was = torch._C._get_mkldnn_enabled()
            torch._C._set_mkldnn_enabled(False)
            try:
                return original.call_boxed(keyset, *args)
            finally:
                torch._C._set_mkldnn_enabled(was)
        if packed:
            _, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional = args
            return emulated_lstm(x, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional, dtype)
        _, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
        out, h, c = emulated_lstm(x.transpose(0, 1) if batch_first else x, None, hx, params, has_biases, num_layers, dropout, train, bidirectional, dtype)
        return (out.transpose(0, 1) if batch_first else out), h, c

    return kernel


_active = 0  # nested contexts: only the outermost registers


class TensorCoreArithmetic:
    """Within it, on a CPU, FP16 and BF16 matrix products and convolutions accumulate in FP32 and
    round once, and FP16 and BF16 LSTMs run as cuDNN's. With emulate=False, torch's own kernels
    run, LSTMs on torch's native one (oneDNN off). `counts`: the ops replaced, by name."""

    def __init__(self, emulate: bool = True):
        self.emulate = emulate
        self.counts: dict[str, int] = {}
        self._lib = None

    def __enter__(self) -> "TensorCoreArithmetic":
        global _active
        _active += 1
        if _active == 1:
            self._lib = torch.library.Library("aten", "IMPL")
            for name in PRODUCTS if self.emulate else ():
                self._lib.impl(name, _product(torch.library.get_kernel(f"aten::{name}", "CPU"), name, self.counts), "CPU", with_keyset=True)
            for name in LSTMS:
                original = torch.library.get_kernel(f"aten::{name}", "AutogradCPU")
                self._lib.impl(name, _lstm(original, name == "lstm.data", self.emulate, self.counts), "AutogradCPU", with_keyset=True)
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active -= 1
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None


# --- LSTMs: the gate products as above, the cell's elementwise math as cuDNN does it ---------------


def _cell_steps(xw, h, c, w_hh, w_hr, batch_sizes, reverse, dtype, math):
    """One direction of one layer. `xw`: the input's gate products and biases for every step, in
    `math` ((T, B, 4H); packed: (N, 4H) with `batch_sizes`). h and c are stored in `dtype`; each
    step's sums, activations and cell update run in `math` (a GPU's FP32 registers)."""
    w_hh32, w_hr32 = w_hh.to(math), None if w_hr is None else w_hr.to(math)
    steps = batch_sizes.tolist() if batch_sizes is not None else [h.shape[0]] * xw.shape[0]
    starts = [0]
    for b in steps[:-1]:
        starts.append(starts[-1] + b)
    order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
    h0, c0 = h, c
    if reverse and batch_sizes is not None:  # the shortest sequences start first, from their initial state
        h, c = h0[: steps[-1]], c0[: steps[-1]]
    done_h, done_c = [], []  # final states of sequences that ended, for a packed batch (longest first)
    outputs = [None] * len(steps)
    for t in order:
        b = steps[t]
        if b < h.shape[0]:  # forward, packed: the shortest sequences have ended
            done_h.append(h[b:])
            done_c.append(c[b:])
            h, c = h[:b], c[:b]
        elif b > h.shape[0]:  # reverse, packed: longer sequences start here, from their initial state
            h = torch.cat([h, h0[h.shape[0] : b]])
            c = torch.cat([c, c0[c.shape[0] : b]])
        gates = torch.addmm(xw[starts[t] : starts[t] + b] if batch_sizes is not None else xw[t], h.to(math), w_hh32.t())
        i, f, g, o = gates.chunk(4, 1)
        c32 = torch.sigmoid(f) * c.to(math) + torch.sigmoid(i) * torch.tanh(g)
        h = (torch.sigmoid(o) * torch.tanh(c32)).to(dtype)
        if w_hr32 is not None:  # the projection is a product of the stored h
            h = (h.to(math) @ w_hr32.t()).to(dtype)
        c = c32.to(dtype)
        outputs[t] = h
    if done_h:
        h = torch.cat([h, *reversed(done_h)])
        c = torch.cat([c, *reversed(done_c)])
    return torch.cat(outputs) if batch_sizes is not None else torch.stack(outputs), h, c


def emulated_lstm(x, batch_sizes, hx, weights, has_biases, num_layers, dropout, train, bidirectional, dtype, math=torch.float32):
    """_VF.lstm's computation (time-major or packed input, all in `dtype`) with a GPU's arithmetic:
    every product of FP16/BF16 values accumulated in FP32, the gate sums, activations and cell update
    in FP32, h and c rounded to `dtype` at each step (cuDNN's FP32 math on FP16/BF16 storage). The
    input's products for all steps come first, in one product, as cuDNN does. `math=torch.float64`
    is the same computation in float64 registers: the tests' oracle. Returns (output, h_n, c_n)."""
    h0, c0 = hx
    directions = 2 if bidirectional else 1
    per = len(weights) // (num_layers * directions)
    hs, cs = [], []
    for layer in range(num_layers):
        outs = []
        x32 = x.to(math)  # once for both directions: the input's gradient sums in FP32 and is rounded once
        for d in range(directions):
            k = layer * directions + d
            w = weights[k * per : (k + 1) * per]
            w_ih, w_hh = w[0], w[1]
            bias = (w[2].to(math) + w[3].to(math)) if has_biases else None
            w_hr = w[4 if has_biases else 2] if len(w) > (4 if has_biases else 2) else None
            xw = x32 @ w_ih.to(math).t()
            if bias is not None:
                xw = xw + bias
            out, h, c = _cell_steps(xw, h0[k], c0[k], w_hh, w_hr, batch_sizes, reverse=d == 1, dtype=dtype, math=math)
            outs.append(out)
            hs.append(h)
            cs.append(c)
        x = torch.cat(outs, -1) if directions == 2 else outs[0]
        if dropout and train and layer < num_layers - 1:
            x = F.dropout(x, dropout, training=True)
    return x, torch.stack(hs), torch.stack(cs)
