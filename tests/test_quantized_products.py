"""FP8 and MX products: their operands against the formats module and torchao, the delayed-scaling
recurrence against Transformer Engine's, the LSTM written out against nn.LSTM, and the modes in runs."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mpt.config import ConfigError
from mpt.precision import product_operands as ops
from mpt.precision import quantized_model as qm
from mpt.precision import quantized_products as qp
from mpt.precision.formats import E4M3, E5M2, get_format, quantize
from mpt.runner.validation import validate

from .conftest import TINY, build_run, compose_cfg, read_record
from .test_resume import SMALL_LM, SMALL_NMT

FP8 = ops.Recipe(E4M3, E5M2, "tensor", 1, 0, "max")
MXFP8 = ops.Recipe(get_format("mxfp8_e4m3"), get_format("mxfp8_e5m2"), "block", 1, 0, "max")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN, and the sign of every zero."""
    return bool((((a == b) & (torch.signbit(a) == torch.signbit(b))) | (a.isnan() & b.isnan())).all())


def every_fp32_exponent(n_per: int = 64) -> torch.Tensor:
    """Random mantissas at every biased exponent (0: subnormals, 255: infinities and NaNs), both signs."""
    g = torch.Generator().manual_seed(0)
    exps = torch.arange(256, dtype=torch.int64).repeat_interleave(n_per)
    mant = torch.randint(0, 1 << 23, (len(exps),), generator=g)
    sign = torch.randint(0, 2, (len(exps),), generator=g) << 31
    return (sign | (exps << 23) | mant).to(torch.int32).view(torch.float32)


def every_tie(fmt) -> torch.Tensor:
    """The midpoint of each pair of neighbouring values of `fmt`, both signs, and a step either side."""
    values = fmt.decode(torch.arange(1 << (fmt.bits - 1))).double()
    values = values[torch.isfinite(values)]
    mids = ((values[1:] + values[:-1]) / 2).float()  # exact in FP32: one bit more than the format
    near = torch.cat([mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(0.0))])
    return torch.cat([near, -near])


SCALAR_FORMATS = [E4M3, E5M2, *(get_format(n) for n in ("e3m2", "e2m3", "e2m1"))]


@pytest.mark.parametrize("fmt", SCALAR_FORMATS, ids=lambda f: f.name)
def test_the_fast_rounding_rounds_as_the_formats_module(fmt, device="cpu"):
    edges = torch.tensor(
        [
            fmt.max * 1.03,
            -fmt.max * 1.1,
            fmt.min_subnormal / 2,
            fmt.min_subnormal * 1.5,
            fmt.min_subnormal * 2.5,
            0.0,
            -0.0,
        ]
    )
    x = torch.cat([every_fp32_exponent(512), every_tie(fmt), edges]).to(device)
    assert same(ops.round_to(x, fmt), quantize(x, fmt))
    if fmt.name in ops.TORCH_FP8:  # torch's own cast after a clamp, which the GPU path takes, too
        assert same(ops.to_fp8(x, fmt).float(), quantize(x, fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", SCALAR_FORMATS, ids=lambda f: f.name)
def test_the_fast_rounding_rounds_as_the_formats_module_on_cuda(fmt):
    """Emulated products round on the GPU too (all but linear layers on torch._scaled_mm)."""
    test_the_fast_rounding_rounds_as_the_formats_module(fmt, device="cuda")


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4"])
@pytest.mark.parametrize("axis", [0, 1])
def test_the_block_fast_path_rounds_as_the_formats_module(name, axis):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 70, generator=g) * torch.exp2(torch.randint(-150, 120, (40, 1), generator=g).float())
    x[3, 5], x[10, 40], x[20] = math.nan, math.inf, 0.0
    assert same(ops.round_blocks(x, get_format(name), axis), quantize(x, get_format(name), axis=axis))


def test_an_fp8_linear_layer_computes_what_torchaos_emulated_float8linear_computes():
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 48))
    ours = copy.deepcopy(ref)
    float8.convert_to_float8_training(ref, config=float8.Float8LinearConfig(emulate=True))
    qm.QuantizedProducts(ours, FP8)
    x = torch.randn(16, 64) * 3
    g = torch.randn(16, 48) * 1e-3
    for autocast in (False, True):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y1, y2 = ref(x1), ours(x2)
        assert y1.dtype == y2.dtype == (torch.bfloat16 if autocast else torch.float32)
        y1.backward(g.to(y1.dtype))
        y2.backward(g.to(y2.dtype))
        # torchao's tensorwise scales and casts, the same FP32 products: equal up to the order in
        # which the CPU's kernels (mm here, addmm there) sum, which differs between CPUs
        tol = dict(rtol=2**-7, atol=1e-6) if autocast else dict(rtol=1e-5, atol=1e-8)
        for a, b in (
            (y1, y2),
            (x1.grad, x2.grad),
            (ref[0].weight.grad, ours[0].weight.grad),
            (ref[0].bias.grad, ours[0].bias.grad),
        ):
            torch.testing.assert_close(a, b, **tol)
        ref.zero_grad()
        ours.zero_grad()


def test_each_product_of_an_mx_linear_layer_takes_its_blocks_along_its_own_reduction():
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    w = layer.weight.detach().clone()
    qm.QuantizedProducts(layer, MXFP8)
    x = torch.randn(2, 8, 64, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    f, b = MXFP8.forward, MXFP8.backward
    assert torch.equal(y, F.linear(quantize(x, f, axis=-1), quantize(w, f, axis=1)) + layer.bias)
    assert torch.allclose(x.grad, quantize(g, b, axis=-1) @ quantize(w, f, axis=0), rtol=1e-6, atol=0)
    g2, x2 = g.reshape(-1, 96), x.detach().reshape(-1, 64)
    assert torch.allclose(
        layer.weight.grad, quantize(g2, b, axis=0).t() @ quantize(x2, f, axis=0), rtol=1e-6, atol=1e-7
    )
    assert torch.allclose(layer.bias.grad, g2.sum(0))


@pytest.mark.parametrize("transposed", [False, True])
def test_each_product_of_an_mx_convolution_takes_its_blocks_along_its_own_reduction(transposed):
    """Channels for the output and the input gradient, the batch for the weight gradient."""
    torch.manual_seed(0)
    conv = (
        nn.ConvTranspose2d(40, 36, 4, stride=2, padding=1) if transposed else nn.Conv2d(40, 36, 3, stride=2, padding=1)
    )
    w = conv.weight.detach().clone()
    qm.QuantizedProducts(conv, MXFP8)
    x = torch.randn(34, 40, 6, 6, requires_grad=True)
    y = conv(x)
    g = torch.randn_like(y)
    y.backward(g)
    f, b = MXFP8.forward, MXFP8.backward
    w_in, w_out = (0, 1) if transposed else (1, 0)  # the weight's input- and output-channel axes
    op = F.conv_transpose2d if transposed else F.conv2d
    kw = dict(stride=2, padding=1)
    assert torch.allclose(
        y, op(quantize(x, f, axis=1), quantize(w, f, axis=w_in), conv.bias, **kw), rtol=1e-6, atol=1e-6
    )
    # the input gradient as autograd derives it from the quantized operands of its own product
    xq = quantize(x, f, axis=1).requires_grad_()
    (gx,) = torch.autograd.grad(op(xq, quantize(w, f, axis=w_out), None, **kw), xq, quantize(g, b, axis=1))
    assert torch.allclose(x.grad, gx, rtol=1e-5, atol=1e-6)
    wq = quantize(w, f, axis=w_in).requires_grad_()
    (gw,) = torch.autograd.grad(op(quantize(x.detach(), f, axis=0), wq, None, **kw), wq, quantize(g, b, axis=0))
    assert torch.allclose(conv.weight.grad, gw, rtol=1e-5, atol=1e-6)
    assert torch.allclose(conv.bias.grad, g.sum((0, 2, 3)), rtol=1e-6)


def test_delayed_scaling_follows_transformer_engines_recurrence():
    """scale = (max / amax) / 2^margin, amax the maximum of the last `length` steps' amaxes; a zero or
    non-finite amax keeps the old scale (transformer_engine/pytorch/quantization.py, _default_sf_compute)."""
    length, margin = 3, 1
    state = ops.DelayedScale(length, torch.device("cpu"))
    amaxes = [2.0, 0.5, 0.25, 0.125, 0.0, 8.0, math.inf, 0.0, 0.0, 0.0]
    seen, expected = [], 1.0
    for a in amaxes:
        state.observe(torch.tensor([a, -a / 2]))
        seen.append(a)
        window = max(seen[-length:])
        if 0 < window < math.inf:
            expected = (E4M3.max / window) / 2**margin
        state.update(E4M3, margin, "max")
        assert state.scale.item() == pytest.approx(expected, rel=1e-7), seen
    assert torch.equal(state.history, torch.zeros(length))  # the inf left the window: its slots were zeroed in turn


def test_a_delayed_layer_quantizes_with_the_last_steps_scale_and_keeps_the_largest_amax_of_a_step():
    layer = nn.Linear(8, 4, bias=False)
    products = qm.QuantizedProducts(layer, ops.Recipe(E4M3, E5M2, "delayed", 16, 0, "max"))
    x = torch.randn(5, 8) * 1000  # beyond E4M3's 448: unscaled at step 0, it saturates
    w = layer.weight.detach()
    assert torch.equal(layer(x).detach(), F.linear(ops.round_to(x, E4M3), ops.round_to(w, E4M3)))
    layer(x / 4)  # a second call in the step: the step's amax is the larger
    products.end_step()
    site = products.sites[""]
    for role, t in (("input", x), ("weight", w)):
        assert site.delayed[role].scale.item() == pytest.approx(E4M3.max / t.abs().max().item(), rel=1e-6)
    s = site.delayed["input"].scale
    assert torch.equal(
        layer(x).detach(), F.linear(ops.round_to(x * s, E4M3) / s, ops.scaled(w, E4M3, site.delayed["weight"].scale))
    )
    layer.eval()  # an evaluation adds nothing to the history
    before = site.delayed["input"].history.clone()
    layer(x * 10)
    assert torch.equal(site.delayed["input"].history, before)


def test_a_step_run_again_quantizes_with_the_scales_it_ran_with_and_adds_no_amax():
    layer = nn.Linear(8, 4, bias=False)
    products = qm.QuantizedProducts(layer, ops.Recipe(E4M3, E5M2, "delayed", 16, 0, "max"))
    x = torch.randn(5, 8) * 1000
    first = layer(x).detach()
    products.end_step()
    after = layer(x).detach()
    history = products.sites[""].delayed["input"].history.clone()
    assert not torch.equal(first, after)  # the update changed the scale
    with products.replaying(stepped=True):
        assert torch.equal(layer(x).detach(), first)
    with products.replaying(stepped=False):  # a network that has not stepped yet runs as it will
        assert torch.equal(layer(x).detach(), after)
    assert torch.equal(products.sites[""].delayed["input"].history, history)
    assert torch.equal(layer(x).detach(), after)


def test_delayed_state_saved_and_loaded_continues_as_if_never_stopped():
    torch.manual_seed(0)
    recipe = ops.Recipe(E4M3, E5M2, "delayed", 3, 0, "max")
    layers = [nn.Linear(8, 4), nn.Linear(8, 4)]
    layers[1].load_state_dict(layers[0].state_dict())
    a, b = (qm.QuantizedProducts(layer, recipe) for layer in layers)
    xs = [torch.randn(5, 8) * 10**k for k in range(6)]
    for x in xs[:4]:  # the history of 3 wraps
        layers[0](x).sum().backward()
        a.end_step()
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for x in xs[4:]:
        outs = [layer(x) for layer in layers]
        assert torch.equal(outs[0], outs[1])
        for out, p in zip(outs, (a, b)):
            out.sum().backward()
            p.end_step()
    for name, site in a.sites.items():
        for role, state in site.delayed.items():
            assert torch.equal(state.history, b.sites[name].delayed[role].history) and torch.equal(
                state.scale, b.sites[name].delayed[role].scale
            )


def test_under_torchrun_each_amax_is_the_largest_over_the_ranks():
    layer = nn.Linear(8, 4, bias=False)
    products = qm.QuantizedProducts(layer, ops.Recipe(E4M3, E5M2, "delayed", 16, 0, "max"))
    x = torch.randn(5, 8)
    layer(x)
    products.end_step(reduce_max=lambda t: t * 4)  # another rank saw four times this one's amax
    assert products.sites[""].delayed["input"].scale.item() == pytest.approx(
        E4M3.max / (4 * x.abs().max().item()), rel=1e-6
    )


def test_a_subclass_with_its_own_forward_is_refused_and_one_without_is_quantized():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Plain(nn.LSTM):
        pass

    with pytest.raises(ConfigError, match="Scaled has a forward of its own; only Linear itself can be quantized"):
        qm.QuantizedProducts(Scaled(4, 4), FP8)
    lstm = Plain(4, 4)
    qm.QuantizedProducts(lstm, FP8)
    assert isinstance(lstm, Plain) and lstm(torch.randn(3, 2, 4))[0].shape == (3, 2, 4)


def test_a_batched_product_and_an_fp8_convolution_take_their_operands_as_quantized():
    torch.manual_seed(0)
    mm = qp.BatchMatmul()
    qm.QuantizedProducts(mm, MXFP8)
    a, b = torch.randn(3, 5, 64, requires_grad=True), torch.randn(3, 64, 40, requires_grad=True)
    y = mm(a, b)
    g = torch.randn_like(y)
    y.backward(g)
    f, bw = MXFP8.forward, MXFP8.backward
    assert torch.allclose(y, quantize(a, f, axis=-1) @ quantize(b, f, axis=-2), rtol=1e-6, atol=1e-6)
    assert torch.allclose(
        a.grad, quantize(g, bw, axis=-1) @ quantize(b, f, axis=-1).transpose(1, 2), rtol=1e-5, atol=1e-6
    )
    assert torch.allclose(
        b.grad, quantize(a, f, axis=-2).transpose(1, 2) @ quantize(g, bw, axis=-2), rtol=1e-5, atol=1e-6
    )

    conv = nn.Conv2d(6, 8, 3, padding=1, bias=False)
    w = conv.weight.detach().clone()
    qm.QuantizedProducts(conv, FP8)
    x = (torch.randn(2, 6, 5, 5) * 50).requires_grad_()
    y = conv(x)
    g = torch.randn_like(y)
    y.backward(g)
    # Autograd's convolution of the quantized operands, given the quantized gradient: the output
    # and both gradients.
    qx, qw = (ops.scaled(t, E4M3, ops.tensor_scale(t, E4M3)).requires_grad_() for t in (x.detach(), w))
    ref = F.conv2d(qx, qw, padding=1)
    ref.backward(ops.scaled(g, E5M2, ops.tensor_scale(g, E5M2)))
    for ours, theirs in ((y, ref), (x.grad, qx.grad), (conv.weight.grad, qw.grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)


def test_the_written_out_lstm_computes_what_nn_lstm_computes(monkeypatch):
    """With the quantization taken out, every product and the cell as torch's own (packed, bidirectional, projected)."""
    monkeypatch.setattr(ops.Site, "operand", lambda self, t, role, axis, scale=None, observe=False: (t.float(), None))
    torch.manual_seed(0)
    for kw in (
        dict(num_layers=2, batch_first=True, bidirectional=True),
        dict(num_layers=2, proj_size=3, batch_first=True),
        dict(num_layers=1),
    ):
        ref = nn.LSTM(5, 6, **kw)
        ours = copy.deepcopy(ref)
        qm.QuantizedProducts(ours, FP8)
        batch_first = kw.get("batch_first", False)
        x = torch.randn(4, 7, 5) if batch_first else torch.randn(7, 4, 5)
        for packed in (False, True):
            inp = (
                pack_padded_sequence(x, torch.tensor([7, 3, 5, 1]), batch_first=batch_first, enforce_sorted=False)
                if packed
                else x
            )
            results = []
            for lstm in (ref, ours):
                out, (h, c) = lstm(inp)
                if packed:
                    assert isinstance(out, type(inp))
                    out = pad_packed_sequence(out, batch_first=True)[0]
                loss = out.square().sum() + h.sum() + 2 * c.sum()
                results.append([out, h, c, *torch.autograd.grad(loss, list(lstm.parameters()))])
            for a, b in zip(*results):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_an_fp8_lstm_quantizes_every_gate_product():
    lstm = nn.LSTM(6, 8, num_layers=2, proj_size=4, bidirectional=True)
    products = qm.QuantizedProducts(lstm, ops.Recipe(E4M3, E5M2, "delayed", 4, 0, "max"))
    out, _ = lstm(torch.randn(5, 3, 6))
    out.sum().backward()
    assert sorted(products.sites) == sorted(
        f".{k}_l{i}{d}" for k in ("ih", "hh", "hr") for i in (0, 1) for d in ("", "_reverse")
    )
    for name, site in products.sites.items():
        assert sorted(site.delayed) == ["grad_output", "input", "weight"], name
        assert all(s.history[0] > 0 for s in site.delayed.values()), name


@pytest.mark.parametrize(
    "recipe",
    [ops.Recipe(E4M3, E5M2, "tensor", 1, 0, "max"), ops.Recipe(E4M3, E5M2, "delayed", 4, 0, "max"),
     ops.Recipe(get_format("mxfp8_e4m3"), get_format("mxfp8_e5m2"), "block", 1, 0, "max"),
     ops.Recipe(get_format("mxfp4"), get_format("mxfp6_e3m2"), "block", 1, 0, "max")],
    ids=["tensor", "delayed", "mxfp8", "mxfp4"],
)  # fmt: skip
def test_recurrent_weights_quantized_once_per_forward_give_each_steps_own_values(monkeypatch, recipe):
    """The LSTM's recurrent weights' operands made once per forward (ReusedWeight) against each
    step's product quantizing them anew: outputs, gradients and delayed histories bit for bit,
    over two training steps (the second with the scales the first's histories gave)."""

    def run(reuse: bool):
        torch.manual_seed(0)
        lstm = nn.LSTM(40, 48, num_layers=2, proj_size=36, bidirectional=True)
        products = qm.QuantizedProducts(lstm, recipe)
        results = []
        with monkeypatch.context() as m:
            if not reuse:
                m.setattr(ops.Site, "reused", lambda self: self)  # every call quantizes its weight itself
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out, (h, c) = lstm(torch.randn(6, 3, 40))
                (out.float().square().sum() + h.float().sum()).backward()
                results += [out, h, c, *(p.grad.clone() for p in lstm.parameters())]
                products.end_step()
        results += [s.history for site in products.sites.values() for s in site.delayed.values()]
        return results

    for ours, theirs in zip(run(reuse=True), run(reuse=False), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(
    "override,message",
    [("precision.products.scaling=block", "scaling=block needs MX block formats for both operands"),
     ("precision.products.backward=mxfp8_e5m2", "scaling=tensor needs scalar formats for both operands"),
     ("precision.products.forward=e3m4", "precision.products.forward=e3m4: choose a format from fp16, bf16"),
     ("precision.products.amax_history=0", "amax_history=0: must be at least 1"),
     ("precision.products.amax_reduction=mean", "amax_reduction=mean: choose one of max, most_recent")],
)  # fmt: skip
def test_a_bad_products_setting_is_named(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose_cfg("precision=fp8", override))


@pytest.mark.parametrize(
    "mode,message",
    [("fp8", "precision.products.fused_cell=nope: no such torch.compile backend; choose one of "),
     ("bf16", "precision.products.fused_cell=nope: only the quantized LSTM of an FP8 or MX mode"
              " has a cell of its own")],
)  # fmt: skip
def test_a_fused_cell_needs_a_quantized_lstm_and_a_known_backend(mode, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose_cfg(f"precision={mode}", "precision.products.fused_cell=nope"))


# The fast tier runs the mode whose state the engine steps (fp8_delayed); the others differ in
# formats, scaling and block axes, tested above, and their runs are slow-tier.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("fp8", marks=SLOW),
        "fp8_delayed",
        pytest.param("mxfp8", marks=SLOW),
        pytest.param("mxfp6", marks=SLOW),
        pytest.param("mxfp4", marks=SLOW),
    ],
)
def test_each_fp8_and_mx_mode_trains_and_records_its_products(tmp_path, in_process, mode):
    rec = build_run(
        tmp_path, TINY, "schedule=smoke", "schedule.steps=2", f"precision={mode}", "logger=none", "checkpoint=false"
    ).execute()
    assert rec.status == "ok" and math.isfinite(rec.final_train_loss)
    p = read_record(tmp_path)["precision"]
    assert p["products"]["forward"] == compose_cfg(f"precision={mode}").precision.products.forward
    # every convolution and linear layer of the network, emulated on a CPU
    layers = sum(
        isinstance(m, (nn.Conv2d, nn.Linear)) for m in torchvision.models.mobilenet_v3_small(num_classes=10).modules()
    )
    assert p["products"]["paths"] == {"emulated": layers}


@pytest.mark.parametrize(
    "model,extra",
    [("gnmt", SMALL_NMT), ("biglstm_tiny", SMALL_LM), ("biglstm_tiny", [*SMALL_LM, "model.true_logit=product"])],
)
def test_an_lstm_model_trains_with_every_gate_attention_and_softmax_product_quantized(
    tmp_path, in_process, model, extra
):
    job = build_run(
        tmp_path,
        f"model={model}",
        *extra,
        "schedule=smoke",
        "schedule.steps=2",
        "precision=fp8_delayed",
        "logger=none",
        "checkpoint=false",
    )
    (engine,) = job.engines.values()
    # a layer per linear layer and batched product (GNMT's attention context, bigLSTM's softmax), one per LSTM
    # weight matrix
    expected = 0
    for m in engine.model.modules():
        if isinstance(m, nn.LSTM):
            expected += sum(n.startswith("weight_") for n in m._flat_weights_names)
        elif isinstance(m, (nn.Linear, qp.BatchMatmul)):
            expected += 1
    assert expected > (10 if model == "gnmt" else 3)
    rec = job.execute()
    assert rec.status == "ok" and math.isfinite(rec.final_train_loss)
    assert read_record(tmp_path)["precision"]["products"]["paths"] == {"emulated": expected}  # each of them ran


@pytest.mark.gpu
def test_on_fp8_tensor_cores_a_linear_layer_runs_on_scaled_mm_and_agrees_with_the_emulation(monkeypatch):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores (compute capability below 8.9)")
    torch.manual_seed(0)
    fast = nn.Linear(64, 48).cuda()
    emulated = copy.deepcopy(fast)
    products = qm.QuantizedProducts(fast, FP8)
    qm.QuantizedProducts(emulated, FP8)
    x = torch.randn(32, 64, device="cuda") * 3
    g = torch.randn(32, 48, device="cuda") * 1e-3
    results = []
    for layer, on_gpu_kernels in ((fast, True), (emulated, False)):
        with monkeypatch.context() as m:
            if not on_gpu_kernels:
                m.setattr(qp, "_on_scaled_mm", lambda *a: False)
            xi = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(xi)
            y.backward(g.to(y.dtype))
            results.append([y.float(), xi.grad, layer.weight.grad])
    assert products.paths() == {"": "scaled_mm"}
    # The same quantized operands, summed in another order and rounded to BF16 at other points (the
    # bias is added before or after the output's rounding): within a BF16 rounding of the sum of
    # the terms' magnitudes, element by element. (Relative to the result, a sum that cancels fails that.)
    w, b = fast.weight.detach().abs(), fast.bias.detach().abs()
    magnitudes = [x.abs() @ w.t() + b, g.abs() @ w, g.abs().t() @ x.abs()]
    for what, ours, emulated, m in zip(["output", "input gradient", "weight gradient"], *results, magnitudes):
        worst = ((ours.float() - emulated.float()).abs() / (2**-7 * m)).max().item()
        assert worst <= 1.0, f"{what}: {worst:.3f} of a BF16 rounding of the terms' magnitudes"
