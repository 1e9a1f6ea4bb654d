"""FP16 and BF16 LSTMs on a CPU, as one step of an H100's cuDNN LSTM runs: products of the rounded
values accumulated in FP32, each gate product stored in the dtype, the cell's sums, activations and
update in FP32, h and c stored in the dtype. Checked against torch's own LSTM in float64 (the
computation's structure: packed, bidirectional, projected, layered) and against the same roundings
written out with autograd's gradients (the rounding)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mpt.precision.cpu_tensor_cores import TensorCoreArithmetic, emulated_lstm
from mpt.precision.engine import arithmetic
from mpt.precision.oracle import FP32_ACCUMULATION, ulp

from .conftest import ROOT, compose_cfg, mpt_run, read_record

LOW = [torch.float16, torch.bfloat16]


def lstm_call(lstm: nn.LSTM, x: torch.Tensor, lengths: list[int] | None, h0, c0):
    """_VF.lstm's arguments for this module, time-major, packed when `lengths` are given."""
    if lengths is None:
        return (x, None, (h0, c0), lstm._flat_weights, lstm.bias, lstm.num_layers, 0.0, False, lstm.bidirectional)
    p = nn.utils.rnn.pack_padded_sequence(x, lengths)
    return (
        p.data,
        p.batch_sizes,
        (h0, c0),
        lstm._flat_weights,
        lstm.bias,
        lstm.num_layers,
        0.0,
        False,
        lstm.bidirectional,
    )


@pytest.mark.parametrize(
    "packed,bidirectional,proj_size,layers,bias",
    [
        case
        for case in itertools.product([False, True], [False, True], [0, 3], [1, 2], [True])
        if case[2] == 0 or case[3] == 2
    ]
    + [(True, True, 0, 2, False)],
)
def test_the_computation_is_torchs_lstm(packed, bidirectional, proj_size, layers, bias):
    """In float64 throughout, the emulation is torch's own LSTM, outputs and every gradient."""
    torch.manual_seed(0)
    lstm = nn.LSTM(5, 6, num_layers=layers, bidirectional=bidirectional, proj_size=proj_size, bias=bias).double()
    d = 2 if bidirectional else 1
    x = torch.randn(7, 4, 5, dtype=torch.double, requires_grad=True)
    h0 = torch.randn(layers * d, 4, proj_size or 6, dtype=torch.double, requires_grad=True)
    c0 = torch.randn(layers * d, 4, 6, dtype=torch.double, requires_grad=True)
    lengths = [7, 5, 5, 2] if packed else None
    args = lstm_call(lstm, x, lengths, h0, c0)
    if packed:
        ref = torch._VF.lstm(args[0], args[1], *args[2:])
    else:
        ref = torch._VF.lstm(args[0], *args[2:], False)
    ours = emulated_lstm(*lstm_call(lstm, x, lengths, h0, c0), dtype=torch.double, math=torch.double)
    inputs = [x, h0, c0, *lstm.parameters()]
    weights = [torch.randn_like(t) for t in ref]  # one random cotangent for all three outputs
    grads_ref = torch.autograd.grad(sum((t * w).sum() for t, w in zip(ref, weights)), inputs)
    grads_ours = torch.autograd.grad(sum((t * w).sum() for t, w in zip(ours, weights)), inputs)
    for a, b in zip([*ours, *grads_ours], [*ref, *grads_ref]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def within_one_ulp(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """One ulp of the dtype, plus what FP32 arithmetic may add (relative to the tensor's largest value)."""
    assert ours.dtype == dtype, what
    err = (ours.double() - reference).abs()
    bound = ulp(reference, dtype) + FP32_ACCUMULATION * reference.abs().max()
    assert (err <= bound).all(), f"{what}: {(err / bound).max().item():.3f} of the bound"


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_one_step_is_within_one_ulp_of_float64(dtype):
    """One step from rounded inputs and states, as the module runs it (FP32 registers): h, c and
    every gradient within one ulp of cuDNN's computation in float64 registers on the same values,
    written out with its gradients left to autograd. (With a projection, h is stored before it is
    projected: a second rounding, in the tests below.)"""
    torch.manual_seed(1)
    lstm = nn.LSTM(24, 16, batch_first=True).to(dtype)
    x = torch.randn(6, 1, 24).to(dtype).requires_grad_()
    h0 = torch.randn(1, 6, 16).to(dtype).requires_grad_()
    c0 = (2 * torch.randn(1, 6, 16)).to(dtype).requires_grad_()
    g_out, g_c = torch.randn(6, 1, 16).to(dtype), torch.randn(1, 6, 16).to(dtype)
    with TensorCoreArithmetic() as mode:
        out, (h, c) = lstm(x, (h0, c0))
        torch.autograd.backward([out, c], [g_out, g_c])
    assert mode.counts == {"lstm": 1}
    leaves = [t.detach().requires_grad_() for t in (x.transpose(0, 1), h0[0], c0[0], *lstm._flat_weights)]
    r_out, _, r_c = stored_roundings_by_autograd(*leaves[:7], None, dtype, torch.float64)
    torch.autograd.backward([r_out, r_c], [g_out.transpose(0, 1), g_c[0]])
    within_one_ulp(out.detach(), r_out.detach().transpose(0, 1).double(), dtype, "h")
    within_one_ulp(c.detach()[0], r_c.detach().double(), dtype, "c")
    for name, a, b in [
        ("x", x, leaves[0].grad.transpose(0, 1)),
        ("h0", h0, leaves[1].grad[None]),
        ("c0", c0, leaves[2].grad[None]),
    ]:
        within_one_ulp(a.grad, b.double(), dtype, f"gradient of {name}")
    for (name, p), q in zip(lstm.named_parameters(), leaves[3:]):
        within_one_ulp(p.grad, q.grad.double(), dtype, f"gradient of {name}")


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_sequences_keep_fp32_registers_and_round_storage_each_step(dtype):
    """Over a sequence the only roundings are of the gate products, of h and c at each step (and of
    h before its projection): the emulation equals itself in float64 registers with the same
    storage rounding to within one ulp."""
    torch.manual_seed(2)
    lstm = nn.LSTM(16, 32, num_layers=2, bidirectional=True, batch_first=True, proj_size=12).to(dtype)
    x = torch.randn(5, 9, 16).to(dtype)
    hx = (torch.zeros(4, 5, 12, dtype=dtype), torch.zeros(4, 5, 32, dtype=dtype))
    args = (x.transpose(0, 1), None, hx, lstm._flat_weights, True, 2, 0.0, False, True)
    with torch.no_grad(), TensorCoreArithmetic():
        ours = lstm(x)[0]
    with torch.no_grad():
        f64 = emulated_lstm(*args, dtype=dtype, math=torch.float64)[0].transpose(0, 1)
    assert ours.dtype == dtype
    assert ((ours.double() - f64.double()).abs() <= ulp(f64.double(), dtype)).all()


class Stored(torch.autograd.Function):
    """x rounded to `dtype` and kept in x's dtype; its gradient, once summed, rounded the same way."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


class GateProduct(torch.autograd.Function):
    """A gate product rounded to `dtype` as cuDNN stores it, its gradient passed on as it is."""

    @staticmethod
    def forward(ctx, x, dtype):
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def stored_roundings_by_autograd(x, h, c, w_ih, w_hh, b_ih, b_hh, w_hr, dtype, math, round_gates=True):
    """The emulation's forward written out for one layer and direction, its gradients left to
    autograd: each gate product rounded to `dtype` (cuDNN's, results/gpu-h100-loan3/arithmetic),
    every value the emulation stores (h, c, h before its projection) rounded to `dtype`, and the
    gradient that reaches a stored value rounded once. round_gates=False: the products unrounded."""
    gate = GateProduct.apply if round_gates else lambda t, dtype: t
    x, h, c, w_ih, w_hh, b_ih, b_hh = (t.to(math) for t in (x, h, c, w_ih, w_hh, b_ih, b_hh))
    w_hr = None if w_hr is None else w_hr.to(math)
    xw = gate(x @ w_ih.t(), dtype) + b_ih + b_hh
    outs = []
    for t in range(x.shape[0]):
        i, f, g, o = (xw[t] + gate(h @ w_hh.t(), dtype)).chunk(4, 1)
        c32 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = Stored.apply(torch.sigmoid(o) * torch.tanh(c32), dtype)
        if w_hr is not None:
            h = Stored.apply(h @ w_hr.t(), dtype)
        c = Stored.apply(c32, dtype)
        outs.append(h)
    return torch.stack(outs).to(dtype), h.to(dtype), c.to(dtype)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("proj_size", [0, 5])
@pytest.mark.parametrize("round_gates", [True, False], ids=["gates-rounded", "gates-unrounded"])
def test_the_written_out_backward_is_autograds_through_the_stored_values(dtype, proj_size, round_gates):
    """In float64 registers (so that no FP32 summation order can flip a rounding), the emulation's
    outputs and gradients over a sequence are bit for bit those autograd derives from the same
    forward with the same values stored in the dtype."""
    torch.manual_seed(5)
    lstm = nn.LSTM(8, 12, proj_size=proj_size).to(dtype)
    x = torch.randn(9, 3, 8).to(dtype)
    h0, c0 = torch.randn(1, 3, proj_size or 12).to(dtype), torch.randn(1, 3, 12).to(dtype)
    cotangents = [
        torch.randn(9, 3, proj_size or 12).to(dtype),
        torch.randn(3, proj_size or 12).to(dtype),
        torch.randn(3, 12).to(dtype),
    ]
    results = []
    for ours in (True, False):
        leaves = [t.detach().requires_grad_() for t in (x, h0, c0, *lstm._flat_weights)]
        xx, hh, cc, *w = leaves
        if ours:
            out, hn, cn = emulated_lstm(
                xx,
                None,
                (hh, cc),
                w,
                True,
                1,
                0.0,
                False,
                False,
                dtype=dtype,
                math=torch.float64,
                round_gates=round_gates,
            )
            hn, cn = hn[0], cn[0]
        else:
            out, hn, cn = stored_roundings_by_autograd(
                xx, hh[0], cc[0], *w[:4], w[4] if proj_size else None, dtype, torch.float64, round_gates
            )
        torch.autograd.backward([out, hn, cn], cotangents)
        results.append([out, hn, cn, *(t.grad for t in leaves)])
    for name, a, b in zip(["out", "h_n", "c_n", "x", "h0", "c0", *(n for n, _ in lstm.named_parameters())], *results):
        assert a.dtype == dtype and torch.equal(a, b), name


@pytest.mark.parametrize("round_gates", [True, False])
def test_emulate_lstm_gate_rounding_picks_the_runs_lstm_arithmetic(round_gates):
    cfg = compose_cfg("precision=mixed", f"emulate_lstm_gate_rounding={round_gates}")
    torch.manual_seed(3)
    lstm = nn.LSTM(8, 12).half()
    x, hx = torch.randn(7, 3, 8).half(), (torch.zeros(1, 3, 12).half(), torch.zeros(1, 3, 12).half())
    with torch.no_grad():
        with arithmetic(cfg, torch.device("cpu")):
            out = lstm(x, hx)[0]
        chosen, other = (
            emulated_lstm(x, None, hx, lstm._flat_weights, True, 1, 0.0, False, False, torch.float16, round_gates=r)[0]
            for r in (round_gates, not round_gates)
        )
    assert torch.equal(out, chosen) and not torch.equal(out, other)


def test_packed_sequences_in_any_order_match_each_sequence_alone():
    """GNMT packs unsorted batches: each sequence's output and final state are those it has alone."""
    torch.manual_seed(3)
    lstm = nn.LSTM(8, 8, batch_first=True, bidirectional=True).half()
    x = torch.randn(3, 6, 8).half()
    lengths = [4, 6, 2]
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    with torch.no_grad(), TensorCoreArithmetic():
        out, (h, c) = lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        for i, n in enumerate(lengths):
            alone, (h1, c1) = lstm(x[i : i + 1, :n])
            torch.testing.assert_close(out[i, :n], alone[0], rtol=0, atol=float(torch.finfo(torch.half).eps))
            torch.testing.assert_close(h[:, i], h1[:, 0], rtol=0, atol=float(torch.finfo(torch.half).eps))


def test_fp32_lstms_and_the_native_switch_are_torchs_own():
    torch.manual_seed(4)
    lstm = nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        ref = lstm(x)[0]
        with TensorCoreArithmetic() as mode:
            assert torch.equal(lstm(x)[0], ref) and mode.counts == {}
        half = lstm.half()
        native = half(x.half())[0]  # torch's choice of kernel, outside the mechanism
        with TensorCoreArithmetic(emulate=False) as mode:
            ours = half(x.half())[0]
        assert mode.counts == {"lstm": 1} and torch._C._get_mkldnn_enabled()
        torch.testing.assert_close(ours, native, rtol=0, atol=4 * float(torch.finfo(torch.half).eps))


@pytest.mark.slow
def test_bf16_lstms_train_on_a_cpu_whose_onednn_has_no_bf16_lstm(tmp_path):
    """The failure of issue 18: oneDNN capped at AVX2 has no BF16 LSTM primitive, which torch's CPU
    autocast asks it for. CUDA's lists cast the LSTM before oneDNN is asked, with or without emulation."""
    for emulate in ("true", "false"):
        r = mpt_run("model=gnmt", "model.hidden_size=16", "model.encoder_layers=2", "model.decoder_layers=2",
                    "schedule=smoke", "schedule.batch_size=8", "schedule.steps=2", "schedule.eval_batches=1",
                    "checkpoint=false", "device=cpu", "precision=bf16", f"emulate_tensor_cores={emulate}",
                    f"hydra.run.dir={tmp_path / emulate}", cwd=ROOT, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        rec = read_record(tmp_path / emulate)
        assert rec["status"] == "ok", rec.get("message")
        assert rec["precision"]["cpu_arithmetic"] == ("emulated" if emulate == "true" else "native")
        assert rec["precision"]["autocast_lists"] == "cuda"
