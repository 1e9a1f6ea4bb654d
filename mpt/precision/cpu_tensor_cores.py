"""A GPU's tensor-core arithmetic for the matrix products of FP16 and BF16 training, on a CPU.

A tensor core multiplies FP16 (or BF16) inputs, accumulates the products in FP32 and rounds the
result once to the output dtype. Inside `TensorCoreArithmetic`, every matrix product and
convolution whose floating inputs are all FP16 (or all BF16) runs as torch's own FP32 kernel on
those same rounded inputs, and its result is rounded once: the GPU's arithmetic up to summation
order, at the speed of the CPU's FP32 kernels. A convolution's bias is then added in the dtype, as
torch's cuDNN path adds it. An LSTM in FP16 or BF16 runs as cuDNN's does: each gate product
rounded to the dtype, then summed with the biases, the activations and the cell update in FP32,
its h and c stored in the dtype. On an H100, every product but `addmm` with a full matrix, biased
convolutions included, was as far from its exact sum on CUDA as here
(results/gpu-h100-loan2/arithmetic), and one forward step of that LSTM was cuDNN's except on
FP16's persistent kernels (results/gpu-h100-loan3/arithmetic; its backward was not probed:
docs/cpu-arithmetic.md).
Only torch's cuDNN path adds a bias after rounding: its depthwise and fallback CUDA kernels take it inside.

The products are replaced at the CPU kernels of the aten ops (torch.library, for the context's
duration), below autograd: so they catch what composite modules call inside (linear is an addmm,
matmul an mm or a bmm) and the ops of the backward pass, and every other op runs at full speed.
The LSTM is replaced at its autograd kernel, with its backward written out: the gradients autograd
would derive through the same stored values, with one recurrent product per step.
"""

from __future__ import annotations

import weakref

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


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory exactly once, in some order of its dimensions."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) != 1:
            if t.stride(d) != expected:
                return False
            expected *= t.size(d)
    return True


def _stale(held: tuple | None) -> bool:
    if held is None:
        return True
    whose = held[0]()
    return whose is None or whose._version != held[1]


class _Scratch:
    """FP32 buffers for the widened inputs of large products, reused from call to call.

    A fresh buffer that large is mapped from the OS and faulted in page by page, which costs more
    than the copy into it; a widened input lives only for the call, so a few buffers serve them
    all. A buffer also remembers whose widening it holds: a weight widened for the forward product
    is widened again, unchanged, for the backward's, and is then taken as it is. It is the same
    only while the same tensor lives at the same version, the test autograd applies to the tensors
    it saves for the backward."""

    LARGE = 1 << 20  # elements
    KEEP = 4

    def __init__(self):
        self.free: list[tuple[torch.Tensor, tuple | None]] = []  # (buffer, (whose, version)), oldest first

    def widen(self, t: torch.Tensor, taken: list) -> torch.Tensor:
        base = t if t._base is None else t._base  # a weight reaches a product as itself and as its transpose
        whole = base.numel() == t.numel() and _dense(base)
        src = base if whole else t
        if t.numel() < self.LARGE or t.device.type != "cpu" or not _dense(src):
            return t.float()  # .float() keeps a dense tensor's strides, so channels-last stays so
        held = None
        if whole:
            for k, (buf, h) in enumerate(self.free):
                if h is not None and h[0]() is base and h[1] == base._version:
                    taken.append(self.free.pop(k))
                    return buf.as_strided(t.size(), t.stride(), t.storage_offset() - base.storage_offset())
            held = (weakref.ref(base), base._version)
        # A buffer that still holds a live widening is kept for it; the oldest go when more are kept.
        fits = [k for k, (b, h) in enumerate(self.free) if b.numel() >= src.numel() and _stale(h)]
        buf = self.free.pop(min(fits, key=lambda k: self.free[k][0].numel()))[0] if fits else torch.empty(src.numel())
        taken.append((buf, held))
        buf.as_strided(src.size(), src.stride()).copy_(src)
        return buf.as_strided(t.size(), t.stride(), t.storage_offset() - src.storage_offset())

    def give_back(self, taken: list) -> None:
        self.free = (self.free + taken)[-self.KEEP :]


def _product(original, name: str, counts: dict[str, int], scratch: _Scratch):
    def kernel(keyset, *args, **kwargs):
        # Every FP32 product of the process passes here while the context is open: the first
        # argument's dtype (these ops' inputs share one) decides most calls cheaply.
        first = args[0]
        if (
            not (isinstance(first, torch.Tensor) and first.dtype in LOW_PRECISION)
            or (dtype := low_precision_dtype(args, kwargs)) is None
        ):
            return original.call_boxed(keyset, *args, **kwargs)
        counts[name] = counts.get(name, 0) + 1
        bias = None
        if name == "convolution" and args[2] is not None:
            # torch's cuDNN path adds a convolution's bias to the product already in the dtype
            # (output.add_(bias) in ATen's Convolution.cpp): two roundings, as results/gpu-arithmetic measured.
            bias, args = args[2], (*args[:2], None, *args[3:])
        taken: list = []  # the buffers this call widened into, given back when it returns
        try:
            widen = [scratch.widen(a, taken) if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args]
            out = original.call_boxed(keyset, *widen, **kwargs)
        finally:
            scratch.give_back(taken)
        if isinstance(out, torch.Tensor):
            out = out.to(dtype)
            return out if bias is None else out.add_(bias.reshape(1, -1, *[1] * (out.dim() - 2)))
        return tuple(o.to(dtype) if isinstance(o, torch.Tensor) else o for o in out)

    return kernel


def _lstm(original, packed: bool, emulate: bool, round_gates: bool, counts: dict[str, int]):
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
            return emulated_lstm(
                x,
                batch_sizes,
                hx,
                params,
                has_biases,
                num_layers,
                dropout,
                train,
                bidirectional,
                dtype,
                round_gates=round_gates,
            )
        _, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
        xt = x.transpose(0, 1) if batch_first else x
        out, h, c = emulated_lstm(
            xt, None, hx, params, has_biases, num_layers, dropout, train, bidirectional, dtype, round_gates=round_gates
        )
        return (out.transpose(0, 1) if batch_first else out), h, c

    return kernel


_active = 0  # nested contexts: only the outermost registers


class TensorCoreArithmetic:
    """Within it, on a CPU, FP16 and BF16 matrix products and convolutions accumulate in FP32 and
    round once, and FP16 and BF16 LSTMs run one step as an H100's cuDNN does (the module docstring
    says where not; lstm_gate_rounding=False sums their gate products unrounded, as before). With
    emulate=False, torch's own kernels run, LSTMs on torch's native one (oneDNN off). `counts`: the
    ops replaced, by name."""

    def __init__(self, emulate: bool = True, lstm_gate_rounding: bool = True):
        self.emulate = emulate
        self.lstm_gate_rounding = lstm_gate_rounding
        self.counts: dict[str, int] = {}
        self._lib: torch.library.Library | None = None

    def __enter__(self) -> "TensorCoreArithmetic":
        global _active
        _active += 1
        if _active == 1:
            self._lib = torch.library.Library("aten", "IMPL")
            scratch = _Scratch()
            for name in PRODUCTS if self.emulate else ():
                kernel = _product(torch.library.get_kernel(f"aten::{name}", "CPU"), name, self.counts, scratch)
                self._lib.impl(name, kernel, "CPU", with_keyset=True)
            for name in LSTMS:
                original = torch.library.get_kernel(f"aten::{name}", "AutogradCPU")
                kernel = _lstm(original, name == "lstm.data", self.emulate, self.lstm_gate_rounding, self.counts)
                self._lib.impl(name, kernel, "AutogradCPU", with_keyset=True)
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active -= 1
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None


# --- LSTMs: the gate products as above, the cell's elementwise math in FP32 registers -------------


def _per_step(steps: list[int], *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each tensor's rows of each step, as views made once: the step loops below are a few ops per
    step, and a Python slice costs about as much as one of them."""
    return list(zip(*(t.split(steps) for t in tensors)))


class _Recurrence(torch.autograd.Function):
    """One direction of one layer, from the input's gate products and biases `xw` ((N, 4H) in `math`,
    N the rows of every step: T*B, or a packed batch's total). h and c are stored in `dtype` at each
    step, and so is each step's recurrent product; each step's sums, activations and cell update run
    in `math` (a GPU's FP32 registers).

    The backward is written out, as cuDNN's is, because autograd through a Python step loop costs
    several times the FP32 LSTM: per step, the elementwise gradients and one recurrent product; each
    weight's gradient one product over all steps. The gradients of the stored values (h, c, h before
    its projection) are stored in `dtype`, each rounded once when it is complete.

    A step reads its first b rows of the state (a packed batch's sizes fall with t): rows past b are
    the final state of sequences that have ended (forward) or the initial state of those yet to
    start (reverse)."""

    @staticmethod
    def forward(ctx, xw, h0, c0, w_hh, w_hr, steps: list[int], reverse: bool, dtype, math, round_gates: bool):
        n, hidden, size = xw.shape[0], c0.shape[1], h0.shape[1]
        order = list(range(len(steps) - 1, -1, -1) if reverse else range(len(steps)))
        starts = [0]
        for b in steps[:-1]:
            starts.append(starts[-1] + b)
        w_hh_t = w_hh.to(math).t()
        w_hr_t = None if w_hr is None else w_hr.to(math).t()
        h_prev = xw.new_empty(n, size)  # what each step read, in `math`
        c_prev = xw.new_empty(n, hidden)
        gates = xw.new_empty(n, 4 * hidden)  # after their activations
        tanh_c = xw.new_empty(n, hidden)
        c_all = c0.new_empty(n, hidden)  # stored
        out = h0.new_empty(n, size)
        h_pre = None if w_hr is None else h0.new_empty(n, hidden)  # h before its projection, stored
        c32 = xw.new_empty(c0.shape)
        c32_rows = {b: c32[:b] for b in set(steps)}
        i, f, g, o = gates.view(n, 4, hidden).unbind(1)
        views = _per_step(steps, xw, h_prev, c_prev, gates, gates[:, : 2 * hidden], i, f, g, o, tanh_c, c_all, out)
        pre = None if h_pre is None else _per_step(steps, h_pre)
        # What each step reads, copied to h_prev and c_prev: the previous step's h and c, and where a
        # packed batch's reverse direction starts sequences, rows of the initial state.
        reads = []
        for k, t in enumerate(order):
            b, hp, cp = steps[t], views[t][1], views[t][2]
            if k == 0:
                reads.append([(hp, h0[:b]), (cp, c0[:b])])
                continue
            p = order[k - 1]
            h_p, c_p = views[p][-1], views[p][-2]
            if b == steps[p]:
                reads.append([(hp, h_p), (cp, c_p)])
            elif b < steps[p]:
                reads.append([(hp, h_p[:b]), (cp, c_p[:b])])
            else:
                e = steps[p]
                reads.append([(hp[:e], h_p), (cp[:e], c_p), (hp[e:], h0[e:b]), (cp[e:], c0[e:b])])
        for t, copies in zip(order, reads):
            xw_t, hp, cp, a, sig_if, i_t, f_t, g_t, o_t, tc, c_t, out_t = views[t]
            for dst, src in copies:
                dst.copy_(src)
            if round_gates:
                torch.mm(hp, w_hh_t, out=a)
                a.copy_(a.to(dtype)).add_(xw_t)  # the recurrent product stored in the dtype, as cuDNN's
            else:
                torch.addmm(xw_t, hp, w_hh_t, out=a)
            sig_if.sigmoid_()
            g_t.tanh_()
            o_t.sigmoid_()
            cc = torch.mul(f_t, cp, out=c32_rows[steps[t]]).addcmul_(i_t, g_t)
            torch.tanh(cc, out=tc)
            c_t.copy_(cc)
            if pre is None:
                torch.mul(o_t, tc, out=out_t)  # rounded as it is written
            else:  # the projection is a product of the stored h
                assert w_hr_t is not None  # pre is there only with a projection
                out_t.copy_(torch.mul(o_t, tc, out=pre[t][0]).to(math) @ w_hr_t)
        # Each sequence's final state: from the last step (in the loop's order) that has its row.
        last_rows = [0] * steps[0]
        for t in order:
            for r in range(steps[t]):
                last_rows[r] = starts[t] + r
        last = torch.tensor(last_rows)
        ctx.save_for_backward(w_hh, w_hr, h_prev, c_prev, gates, tanh_c, h_pre)
        ctx.steps, ctx.order, ctx.math = steps, order, math
        return out, out.index_select(0, last), c_all.index_select(0, last)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_hn, d_cn):
        w_hh, w_hr, h_prev, c_prev, gates, tanh_c, h_pre = ctx.saved_tensors
        steps, math, dtype = ctx.steps, ctx.math, w_hh.dtype
        n, hidden = c_prev.shape
        i, f, g, o = gates.view(n, 4, hidden).unbind(1)
        # Every factor that does not depend on the gradients flowing back, for all steps at once:
        # times dh, o(1 - tanh(c)^2) for dc and tanh(c) o(1 - o) for o; times dc, g i(1 - i) for i,
        # c' f(1 - f) for f and i(1 - g^2) for g.
        o_tc, g_i, c_f = o * tanh_c, g * i, c_prev * f
        dc_from_h = torch.addcmul(o, o_tc, tanh_c, value=-1)
        d_o = torch.addcmul(o_tc, o_tc, o, value=-1)
        d_ifg = gates.new_empty(n, 3, hidden)
        torch.addcmul(g_i, g_i, i, value=-1, out=d_ifg[:, 0])
        torch.addcmul(c_f, c_f, f, value=-1, out=d_ifg[:, 1])
        torch.addcmul(i, g_i, g, value=-1, out=d_ifg[:, 2])
        w_hh32 = w_hh.to(math)
        w_hr32 = None if w_hr is None else w_hr.to(math)
        dh = d_hn.to(math)  # the gradient of the h each step reads, as the recurrent product leaves it
        dc = d_cn.clone()  # of the c each step reads, stored
        dct = gates.new_empty(dc.shape)
        rows = {b: (dh[:b], dc[:b], dct[:b], dct[:b].unsqueeze(1)) for b in set(steps)}
        d_gates = torch.empty_like(gates)
        dh_stored = torch.empty_like(d_out)  # each step's h gradient, stored
        dg4 = d_gates.view(n, 4, hidden)
        views = _per_step(steps, d_out, dh_stored, dc_from_h, d_o, d_ifg, f, d_gates, dg4[:, 3], dg4[:, :3])
        dh_pre = None if w_hr is None else _per_step(steps, torch.empty(n, hidden, dtype=dtype))
        for t in reversed(ctx.order):
            d_out_t, dh_t, dc_from_h_t, d_o_t, d_ifg_t, f_t, dg, dg_o, dg_ifg = views[t]
            dh_b, dc_b, dct_b, dct_bu = rows[steps[t]]
            dh_pre_t = torch.add(d_out_t, dh_b, out=dh_t)
            if dh_pre is not None:
                dh_pre_t = dh_pre[t][0].copy_(dh_t.to(math) @ w_hr32)
            torch.addcmul(dc_b, dh_pre_t, dc_from_h_t, out=dct_b)
            torch.mul(dh_pre_t, d_o_t, out=dg_o)
            torch.mul(d_ifg_t, dct_bu, out=dg_ifg)
            torch.mul(dct_b, f_t, out=dc_b)
            torch.mm(dg, w_hh32, out=dh_b)
        d_w_hh = (d_gates.t() @ h_prev).to(dtype)
        d_w_hr = None if w_hr is None else (dh_stored.to(math).t() @ h_pre.to(math)).to(dtype)
        return d_gates, dh.to(dtype), dc, d_w_hh, d_w_hr, None, None, None, None, None


def emulated_lstm(
    x,
    batch_sizes,
    hx,
    weights,
    has_biases,
    num_layers,
    dropout,
    train,
    bidirectional,
    dtype,
    math=torch.float32,
    round_gates=True,
):
    """_VF.lstm's computation (time-major or packed input, all in `dtype`) with cuDNN's arithmetic:
    every product of FP16/BF16 values accumulated in FP32 and rounded to `dtype` (the input's and
    the recurrent state's gate products apart), the gate sums, activations and cell update in FP32,
    h computed from c before c is rounded, h and c rounded to `dtype` at each step. The input's
    products for all steps come first, in one product, as cuDNN does. Only the forward rounds the
    gate products: cuDNN's backward was not probed, and it passes their gradients on as they are.
    round_gates=False sums the gate products unrounded (the emulation before commit 7fba77d). `math=torch.float64`
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
            w_hr = w[4 if has_biases else 2] if len(w) > (4 if has_biases else 2) else None
            x2 = x32.reshape(-1, x32.shape[-1])
            bias = (w[2].to(math) + w[3].to(math)) if has_biases else None
            if round_gates:
                xw = x2 @ w_ih.to(math).t()
                xw = xw + (xw.to(dtype).to(math) - xw).detach()  # stored in the dtype; its gradient as it is
                xw = xw if bias is None else xw + bias
            else:
                xw = x2 @ w_ih.to(math).t() if bias is None else torch.addmm(bias, x2, w_ih.to(math).t())
            steps = batch_sizes.tolist() if batch_sizes is not None else [x.shape[1]] * x.shape[0]
            out, h, c = _Recurrence.apply(xw, h0[k], c0[k], w_hh, w_hr, steps, d == 1, dtype, math, round_gates)
            if batch_sizes is None:
                out = out.view(x.shape[0], x.shape[1], -1)
            outs.append(out)
            hs.append(h)
            cs.append(c)
        x = torch.cat(outs, -1) if directions == 2 else outs[0]
        if dropout and train and layer < num_layers - 1:
            x = F.dropout(x, dropout, training=True)
    return x, torch.stack(hs), torch.stack(cs)
