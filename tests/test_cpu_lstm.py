"""FP16 and BF16 LSTMs on a CPU: autocast's rule applied by hand, torch's own kernel where oneDNN
cannot run the dtype (forced here, so a CPU whose oneDNN can still tests the fallback), and the
record naming the kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpt.precision import cpu_lstm

from .conftest import ROOT, build_run, mpt_run, read_record


@pytest.fixture
def onednn_fails(monkeypatch):
    """This process's oneDNN 'cannot' run a low-precision LSTM, as on a CPU without AVX-512 BF16."""
    cpu_lstm.kernels.cache_clear()
    monkeypatch.setattr(
        cpu_lstm, "_try_onednn", lambda dtype: ({"training": False, "evaluation": False}, "could not create a primitive descriptor (forced by the test)")
    )
    yield
    cpu_lstm.kernels.cache_clear()


def ops_of(fn) -> set[str]:
    seen = cpu_lstm._SeenOps()
    with seen:
        fn()
    return seen.names


def lstm_pair(dtype: torch.dtype) -> tuple[nn.LSTM, nn.LSTM]:
    """An FP32 LSTM prepared as a run prepares it, and a plain copy with its weights in `dtype`."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True, bidirectional=True)
    low = nn.LSTM(8, 8, batch_first=True, bidirectional=True)
    low.load_state_dict(lstm.state_dict())
    low.to(dtype)
    cpu_lstm.low_precision_lstms(lstm, dtype)
    return lstm, low


def float64_lstm(lstm: nn.LSTM, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The oracle: the LSTM in float64 on the inputs and weights rounded to `dtype`."""
    ref = nn.LSTM(8, 8, batch_first=True, bidirectional=True).double()
    ref.load_state_dict({k: v.to(dtype).double() for k, v in lstm.state_dict().items()})
    return ref(x.to(dtype).double())[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_an_lstm_under_cpu_autocast_is_the_low_precision_lstm_on_the_cast_weights(dtype):
    lstm, low = lstm_pair(dtype)
    x = torch.randn(3, 5, 8)
    with torch.autocast("cpu", dtype=dtype):
        out, (h, c) = lstm(x)
    ref, (rh, rc) = low(x.to(dtype))
    assert out.dtype == dtype and torch.equal(out, ref) and torch.equal(h, rh) and torch.equal(c, rc)
    out.float().sum().backward()
    ref.float().sum().backward()
    assert lstm.weight_hh_l0.grad.dtype == torch.float32  # the casts are differentiable: FP32 weights get gradients
    assert torch.equal(lstm.weight_hh_l0.grad, low.weight_hh_l0.grad.float())
    assert torch.equal(lstm(x)[0], nn.LSTM.forward(lstm, x)[0])  # outside autocast: the plain LSTM


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_where_onednn_cannot_the_lstm_runs_torchs_own_kernel_in_the_dtype(onednn_fails, dtype):
    lstm, low = lstm_pair(dtype)
    x = torch.randn(3, 5, 8)
    with torch.autocast("cpu", dtype=dtype):
        ops = ops_of(lambda: lstm(x)[0].float().sum().backward())
    assert "mkldnn_rnn_layer" not in ops and "mkldnn_rnn_layer_backward" not in ops
    with torch.autocast("cpu", dtype=dtype):
        out = lstm(x)[0]
    assert out.dtype == dtype
    torch._C._set_mkldnn_enabled(False)
    try:
        ref = low(x.to(dtype))[0]  # torch's own kernel on the same tensors
    finally:
        torch._C._set_mkldnn_enabled(True)
    assert torch.equal(out, ref)
    assert torch._C._get_mkldnn_enabled()  # switched off for the call only
    # Numerics: within the dtype's rounding of a float64 evaluation (outputs are in (-1, 1)).
    eps = torch.finfo(dtype).eps
    assert (out.double() - float64_lstm(lstm, x, dtype)).abs().max() < 16 * eps
    assert lstm.weight_ih_l0.grad is not None and torch.isfinite(lstm.weight_ih_l0.grad).all()
    # Weights already in the dtype (fp16 / mixed runs) take the same path.
    low2 = nn.LSTM(8, 8, batch_first=True, bidirectional=True).to(dtype)
    cpu_lstm.low_precision_lstms(low2, dtype)
    with torch.no_grad():
        assert "mkldnn_rnn_layer" not in ops_of(lambda: low2(x.to(dtype)))


def test_the_record_names_the_kernels_that_ran(onednn_fails, tmp_path, in_process):
    small = ["model=gnmt", "model.hidden_size=16", "model.encoder_layers=2", "model.decoder_layers=2", "schedule=smoke",
             "schedule.batch_size=8", "schedule.steps=2", "schedule.eval_batches=1", "checkpoint=false", "device=cpu"]  # fmt: skip
    rec = build_run(tmp_path / "bf16", *small, "precision=bf16").execute()
    assert rec.status == "ok", rec.message
    assert rec.precision["cpu_lstm"] == {"dtype": "bfloat16", "training": ["native"], "evaluation": ["native"],
                                            "onednn_error": "could not create a primitive descriptor (forced by the test)"}  # fmt: skip
    assert build_run(tmp_path / "fp32", *small, "precision=fp32").record.precision["cpu_lstm"] is None


@pytest.mark.parametrize("packed,bidirectional,proj_size", [(False, False, 0), (True, False, 0), (True, True, 0), (False, False, 4)],
                         ids=["plain", "packed", "packed-bidirectional", "projected"])  # fmt: skip
def test_the_recorded_kernel_is_the_one_torch_dispatched(packed, bidirectional, proj_size):
    """torch's choice depends on more than the dtype (it never gives oneDNN an LSTM with projections):
    the record must say what ran, here read off the dispatched ops."""
    cpu_lstm.reset_usage()
    lstm = nn.LSTM(8, 8, batch_first=True, bidirectional=bidirectional, proj_size=proj_size)
    cpu_lstm.low_precision_lstms(lstm, torch.bfloat16)
    x = torch.randn(3, 5, 8)
    inputs = nn.utils.rnn.pack_padded_sequence(x, [5, 4, 2], batch_first=True) if packed else x
    for _ in range(2):  # the first call of its kind is observed, the second reuses what was seen
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ran = ops_of(lambda: (lstm(inputs)[0].data if packed else lstm(inputs)[0]).float().sum().backward())
        assert cpu_lstm.describe([lstm])["training"] == ["onednn" if "mkldnn_rnn_layer" in ran else "native"]
    if proj_size:
        assert "mkldnn_rnn_layer" not in ran


def test_the_lstms_hooks_run_once_per_call():
    """Activation-gradient statistics hook layer outputs: a cast that re-entered the module would count them twice."""
    lstm, _ = lstm_pair(torch.bfloat16)
    calls = []
    lstm.register_forward_hook(lambda *args: calls.append(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lstm(torch.randn(3, 5, 8))
    assert calls == [1]


def test_bf16_lstms_train_on_a_cpu_whose_onednn_has_no_bf16_lstm(tmp_path):
    """The failure of issue 18, for real: oneDNN capped at AVX2 has no BF16 LSTM primitive, which
    torch's CPU autocast asked it for ("could not create a primitive descriptor")."""
    r = mpt_run("model=gnmt", "model.hidden_size=16", "model.encoder_layers=2", "model.decoder_layers=2", "schedule=smoke",
                "schedule.batch_size=8", "schedule.steps=2", "schedule.eval_batches=1", "checkpoint=false", "device=cpu",
                "precision=bf16", f"hydra.run.dir={tmp_path}", cwd=ROOT, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rec = read_record(tmp_path)
    assert rec["status"] == "ok" and rec["precision"]["cpu_lstm"]["dtype"] == "bfloat16"
    # Capped at AVX2, oneDNN has no BF16 LSTM: torch's own kernel ran, by torch's choice or by the fallback.
    assert rec["precision"]["cpu_lstm"]["training"] == rec["precision"]["cpu_lstm"]["evaluation"] == ["native"]
