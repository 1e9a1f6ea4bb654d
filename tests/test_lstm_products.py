"""The quantized LSTM's recurrent products at a GPU's pace: each recurrent weight quantized once per
pass, not once per step, and its gradient one product over all the steps' rows (cuDNN's way),
against a float64 evaluation of that product from the operands' formats."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpt.precision import product_operands as ops
from mpt.precision import quantized_model as qm
from mpt.precision import quantized_products as qp
from mpt.precision.formats import E4M3, E5M2, BlockFormat, get_format, quantize

RECIPES = {
    "tensor": ops.Recipe(E4M3, E5M2, "tensor", 1, 0, "max"),
    "delayed": ops.Recipe(E4M3, E5M2, "delayed", 4, 0, "max"),
    "mxfp8": ops.Recipe(get_format("mxfp8_e4m3"), get_format("mxfp8_e5m2"), "block", 1, 0, "max"),
}
STEPS, BATCH = 5, 16


def lstm_with(
    recipe: ops.Recipe, proj_size: int = 0, fused_cell: str | None = None
) -> tuple[nn.LSTM, qm.QuantizedProducts]:
    torch.manual_seed(0)
    lstm = nn.LSTM(32, 32, num_layers=2, proj_size=proj_size, bidirectional=True)
    return lstm, qm.QuantizedProducts(lstm, recipe, fused_cell)


def train_step(lstm: nn.LSTM, products: qm.QuantizedProducts, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS, BATCH, 32, generator=gen).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, (h, c) = lstm(x)
    (out.float().square().sum() + h.float().sum()).backward()
    products.end_step()
    return [out, h, c, x.grad]


def oracle_operand(t: torch.Tensor, fmt, scale: torch.Tensor | None) -> torch.Tensor:
    """formats.quantize, the bit-level reference, in float64: per tensor under `scale`, or in blocks
    of 32 along the rows (axis 0)."""
    if isinstance(fmt, BlockFormat):
        return quantize(t.float(), fmt, axis=0).double()
    s = scale.double()
    return quantize((t.float() * scale).float(), fmt).double() / s


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recurrent_weights_gradient_is_one_product_over_all_steps_rows(monkeypatch, name):
    recipe = RECIPES[name]
    lstm, products = lstm_with(recipe, proj_size=16)
    seen: list[tuple[str, list, torch.Tensor]] = []
    weight_grad = qp.SequenceWeightGrad.weight_grad

    def spy(self, w):
        rows = list(self.rows)
        gw = weight_grad(self, w)
        seen.append((self.site.name, rows, gw))
        return gw

    monkeypatch.setattr(qp.SequenceWeightGrad, "weight_grad", spy)
    train_step(lstm, products)
    # every layer and direction's recurrent weight and projection, once, from every step
    assert sorted(n for n, _, _ in seen) == sorted(
        f".{w}_l{i}{d}" for w in ("hh", "hr") for i in (0, 1) for d in ("", "_reverse")
    )
    for name_, rows, gw in seen:
        shape = (128, 16) if ".hh" in name_ else (16, 32)  # (out, in): the recurrent state is the projection's output
        assert len(rows) == STEPS and all(
            g.shape == (BATCH, shape[0]) and x.shape == (BATCH, shape[1]) for g, x in rows
        )
        assert gw.shape == shape
        g = torch.cat([g for g, _ in rows]).float()
        x = torch.cat([x for _, x in rows]).float()
        if isinstance(recipe.forward, BlockFormat):
            qg = torch.cat([oracle_operand(p, recipe.backward, None) for p in g.split(BATCH)])
            qx = torch.cat([oracle_operand(p, recipe.forward, None) for p in x.split(BATCH)])
        else:
            site = products.sites[name_]
            if recipe.scaling == "tensor":  # one scale over all the rows: the product's own amax
                sg, sx = (
                    (fmt.max / t.abs().amax().double()).float()
                    for fmt, t in ((recipe.backward, g), (recipe.forward, x))
                )
            else:  # the role's scale of the step, which end_step has since moved on from
                sg, sx = site.delayed["grad_output"].last_scale, site.delayed["input"].last_scale
            qg, qx = oracle_operand(g, recipe.backward, sg), oracle_operand(x, recipe.forward, sx)
        exact = qg.t() @ qx
        magnitude = qg.abs().t() @ qx.abs()
        # one FP32 product, rounded once to BF16 (the autocast dtype) and stored in FP32
        assert gw.dtype == torch.float32
        assert ((gw.double() - exact).abs() <= exact.abs() * 2.0**-8 + magnitude * 2.0**-20).all(), name_


def _on_cpu_scaled_mm(site, device, *dims):
    """The scaled_mm path on a CPU: torch's own CPU kernel of torch._scaled_mm stands in for cuBLAS's."""
    return site.recipe.scaling != "block" and all(d % 16 == 0 for d in dims)


@pytest.mark.parametrize("name", ["tensor", "delayed"])
def test_on_scaled_mm_each_recurrent_weight_is_quantized_once_per_pass(monkeypatch, name):
    """Counted where the FP8 weight is made: the forward's form and its transpose, once each per
    layer and direction, against twice per step when every step quantizes it (the control)."""
    made: list[tuple[str, bool]] = []
    fp8 = ops.Site.fp8

    def counting(self, t, role, transposed, scale=None, observe=False):
        if role == "weight":
            made.append((self.name, transposed))
        return fp8(self, t, role, transposed, scale=scale, observe=observe)

    monkeypatch.setattr(qp, "_on_scaled_mm", _on_cpu_scaled_mm)
    monkeypatch.setattr(ops.Site, "fp8", counting)
    counts = {}
    for reuse in (True, False):
        made.clear()
        with monkeypatch.context() as m:
            if not reuse:
                m.setattr(ops.Site, "reused", lambda self: self)
            lstm, products = lstm_with(RECIPES[name], proj_size=16)
            train_step(lstm, products)
        assert set(products.paths().values()) == {"scaled_mm"}
        counts[reuse] = {k: made.count(k) for k in set(made)}
    recurrent = [f".{w}_l{i}{d}" for w in ("hh", "hr") for i in (0, 1) for d in ("", "_reverse")]
    for site in recurrent:
        assert counts[True][(site, False)] == counts[True][(site, True)] == 1, site
        # each step's forward, and each step's input gradient (none for the first step's zero state)
        assert counts[False][(site, False)] == STEPS and counts[False][(site, True)] == (
            STEPS - 1 if "hh" in site else STEPS
        ), site
    for site in (f".ih_l{i}{d}" for i in (0, 1) for d in ("", "_reverse")):  # one product for all steps already
        assert counts[True][(site, False)] == counts[True][(site, True)] == 1


@pytest.mark.parametrize("name", ["tensor", "delayed"])
def test_the_scaled_mm_path_computes_each_product_of_the_emulations_operands(monkeypatch, name):
    """Every product the quantized LSTM runs on torch._scaled_mm (its CPU kernel standing in for
    cuBLAS's) over two training steps: its FP8 operands are the bit-level reference's, and its result
    is their float64 product within BF16 rounding. Product by product, not the LSTM's outputs: each
    time step's state is quantized again for the next, so a last-bit difference of one kernel's sums
    moves a later operand by a whole FP8 ulp, on one CPU and not on another."""
    recipe = RECIPES[name]
    operands, products_run = [], []
    fp8, fp8_mm = ops.Site.fp8, qp._fp8_mm

    def spy_fp8(self, t, role, transposed, scale=None, observe=False):
        q, s = fp8(self, t, role, transposed, scale=scale, observe=observe)
        operands.append((t.t() if transposed else t, recipe.format(role), s, q))
        return q, s

    def spy_mm(qa, sa, qb_t, sb, dtype):
        out = fp8_mm(qa, sa, qb_t, sb, dtype)
        products_run.append((qa, sa, qb_t, sb, out))
        return out

    monkeypatch.setattr(ops.Site, "fp8", spy_fp8)
    monkeypatch.setattr(qp, "_fp8_mm", spy_mm)
    monkeypatch.setattr(qp, "_on_scaled_mm", _on_cpu_scaled_mm)
    lstm, products = lstm_with(recipe, proj_size=16)
    train_step(lstm, products)
    train_step(lstm, products, seed=2)
    assert set(products.paths().values()) == {"scaled_mm"} and operands and products_run
    for t, fmt, scale, q in operands:
        assert torch.equal(q.double() / scale.double(), oracle_operand(t, fmt, scale))
    for qa, sa, qb_t, sb, out in products_run:
        a, b = qa.double() / sa.double(), qb_t.double() / sb.double()
        exact, magnitude = a @ b.t(), a.abs() @ b.abs().t()
        # the result's rounding to BF16, and FP32 sums of at most a few hundred terms
        assert ((out.double() - exact).abs() <= exact.abs() * 2.0**-8 + magnitude * 2.0**-16).all()


@pytest.mark.parametrize("name", list(RECIPES))
def test_only_the_recurrent_weights_gradients_change_from_the_step_by_step_sum(monkeypatch, name):
    """Against the LSTM whose steps each write their own recurrent weight gradient (autograd adding
    them up): outputs, states, input gradients and every other weight's gradient bit for bit. The
    recurrent weights' gradients are one product instead of five per-step ones rounded to BF16
    each: with the same operands (delayed, MX) within those roundings (2^-9 of each of 5 shares);
    with `tensor`, whose one product takes one scale where each step had its own, within E5M2's
    rounding of the gradients besides (2^-3)."""
    from mpt.precision import quantized_lstm

    def grads(one_product: bool):
        with monkeypatch.context() as m:
            if not one_product:
                m.setattr(quantized_lstm, "SequenceWeightGrad", lambda site: None)
                m.setattr(quantized_lstm, "sequence_weight", lambda w, grads: w)
            lstm, products = lstm_with(RECIPES[name], proj_size=16)
            results = train_step(lstm, products)
        return results, dict(lstm.named_parameters())

    (ours, params), (theirs, step_params) = grads(True), grads(False)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    for key, p in params.items():
        q = step_params[key]
        if key.startswith(("weight_hh", "weight_hr")):
            bound = (2**-3 if name == "tensor" else 2**-6) * q.grad.abs().max()
            assert (p.grad - q.grad).abs().max() <= bound, key
            assert not torch.equal(p.grad, q.grad)  # the control: the step-by-step sum is another computation
        else:
            assert torch.equal(p.grad, q.grad), key


def test_a_fused_cell_trains_as_the_eager_cell():
    """precision.products.fused_cell: the cell compiled (here by dynamo's aot_eager, which needs no
    compiler; inductor on a GPU) is the same computation: outputs, states and every gradient over
    two steps, the second with the scales the first's histories gave."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    results = {}
    for backend in (None, "aot_eager"):
        lstm, products = lstm_with(RECIPES["delayed"], proj_size=16, fused_cell=backend)
        first = train_step(lstm, products)
        results[backend] = [*first, *train_step(lstm, products, seed=2), *(p.grad for p in lstm.parameters())]
    assert counters["stats"]["unique_graphs"] >= 1  # the cell did go through dynamo
    for a, b in zip(results["aot_eager"], results[None], strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
