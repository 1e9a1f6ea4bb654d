"""The precision engine's numerics against oracles: float64 evaluations of the update formulas,
torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_ and torch.optim.SGD."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mpt.precision import optim
from mpt.precision.engine import PrecisionEngine, set_fp32_math
from mpt.precision.scaler import Diverged, build_scaler

from .conftest import CPU, Vector, compose_cfg

F16 = torch.float16


def make_engine(
    w: torch.Tensor,
    precision: str,
    scale: str = "none",
    lr: float = 0.01,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    milestones=(),
    extra=(),
):
    # batch_size 256 makes the effective lr equal optim.lr (which is per 256 samples).
    cfg = compose_cfg(
        f"precision={precision}",
        f"scale={scale}",
        "schedule.batch_size=256",
        f"optim.lr={lr}",
        f"optim.momentum={momentum}",
        f"optim.weight_decay={weight_decay}",
        *extra,
    )
    engine = PrecisionEngine(Vector(w), cfg, build_scaler(cfg), list(milestones), CPU)
    return engine.model, engine


def train_step(model, engine, G: torch.Tensor) -> bool:
    out = model(torch.ones_like(G))
    engine.backward((out.float() * G).sum())
    return engine.step()


def test_update_below_half_an_fp16_ulp_is_lost_by_fp16_and_kept_by_mixed():
    # ulp(1.0) in FP16 is 2^-10; lr * g = 1e-4 is below half of it (2^-11 = 4.9e-4).
    w = torch.ones(8)
    G = torch.full((8,), 0.01)
    fp16_model, fp16_engine = make_engine(w, "fp16", lr=0.01)
    mixed_model, mixed_engine = make_engine(w, "mixed", lr=0.01)
    for _ in range(10):
        train_step(fp16_model, fp16_engine, G)
        train_step(mixed_model, mixed_engine, G)
    assert fp16_model.w.dtype == F16 and torch.all(fp16_model.w == 1.0)  # every update rounded away
    master = mixed_engine.master_weights()[0]
    g16 = torch.tensor(0.01, dtype=F16).double()  # the FP16 gradient the master receives
    assert master.dtype == torch.float32
    torch.testing.assert_close(
        master.double(), torch.full((8,), 1 - 10 * 0.01 * float(g16), dtype=torch.float64), rtol=0, atol=1e-6
    )
    assert (
        torch.all(mixed_model.w < 1.0) and mixed_model.w.dtype == F16
    )  # the accumulated update reaches the FP16 weights


def fp16_oracle(w0, grads, scales, lr, m, wd, modified, clip=None, rescale=True):
    """float64 evaluation of the FP16 update formulas, rounding to FP16 where the engine stores.

    scales: the loss scale of each step. Modified momentum holds G at h*S (h: momentum_headroom).
    """
    r = lambda x: x.to(F16).double()  # noqa: E731
    h = 2.0 ** -math.ceil(math.log2(1 / (1 - m))) if 0 < m < 1 else 1.0
    w, buf, held_before = r(w0), torch.zeros_like(w0, dtype=torch.float64), None
    for G, S in zip(grads, scales):
        gs = r(G.double() * S)  # the scaled FP16 gradient backward produces
        coef = 1.0 if clip is None else min(1.0, clip / (float(torch.linalg.vector_norm(gs)) / S + 1e-6))
        if modified:
            held = h * S
            ratio = held / held_before if rescale and held_before else 1.0
            Gnew = buf * (m * ratio) + gs * (coef * held / S) + w * (wd * held)
            buf, w, held_before = r(Gnew), r(w - Gnew * (lr / held)), held
        else:
            v = buf * m - (gs * coef / S + w * wd) * lr
            buf, w = r(v), r(w + v)
    return w


@pytest.mark.parametrize("precision,modified", [("fp16", False), ("fp16_modmom", True)])
@pytest.mark.parametrize("scale,S", [("none", 1.0), ("static", 1024.0)])
@pytest.mark.parametrize("piece", [None, 96], ids=["whole", "in-pieces"])
def test_fp16_updates_match_float64_evaluation_of_their_formulas(precision, modified, scale, S, piece, monkeypatch):
    if piece is not None:  # the CPU's cache-sized pieces (the last one short), here of a small tensor
        monkeypatch.setattr(optim, "CPU_PIECE", piece)
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(256, generator=gen).to(F16).float()
    grads = [torch.randn(256, generator=gen) * 10.0 ** torch.randint(-6, 0, (256,), generator=gen) for _ in range(6)]
    lr, m, wd = 0.1, 0.9, 5e-4
    model, engine = make_engine(
        w0,
        precision,
        scale,
        lr=lr,
        momentum=m,
        weight_decay=wd,
        extra=[f"scale.value={S}"] if scale == "static" else [],
    )
    for G in grads:
        assert train_step(model, engine, G)
    expected = fp16_oracle(w0, grads, [S] * len(grads), lr, m, wd, modified)
    assert torch.equal(model.w.double(), expected)
    # ...and the two formulas really differ in FP16, so this comparison can tell them apart.
    assert not torch.equal(expected, fp16_oracle(w0, grads, [S] * len(grads), lr, m, wd, not modified))


def test_modified_momentum_is_rescaled_when_the_scale_changes():
    # Dynamic scale with interval 1: the scale doubles every step and G must follow it exactly.
    gen = torch.Generator().manual_seed(2)
    w0 = (torch.randn(64, generator=gen) * 1e-2).to(F16).float()  # small weights: fine FP16 spacing
    grads = [torch.randn(64, generator=gen) * 1e-2 for _ in range(5)]
    model, engine = make_engine(
        w0, "fp16_modmom", "dynamic", lr=0.1, momentum=0.9, extra=["scale.init=64", "scale.interval=1", "scale.max=1e6"]
    )
    for G in grads:
        assert train_step(model, engine, G)
    scales = [64.0 * 2**i for i in range(5)]
    expected = fp16_oracle(w0, grads, scales, 0.1, 0.9, 0.0, modified=True)
    assert torch.equal(model.w.double(), expected)
    # Rescaled, the update does not depend on the scale; forgetting the rescale gives other weights.
    assert torch.equal(expected, fp16_oracle(w0, grads, [64.0] * 5, 0.1, 0.9, 0.0, modified=True))
    assert not torch.equal(expected, fp16_oracle(w0, grads, scales, 0.1, 0.9, 0.0, modified=True, rescale=False))


def test_modified_momentum_does_not_overflow_where_the_gradients_do_not():
    # Scaled gradients near 30000 with a constant sign: m = 0.9 sums them up to 10x, past FP16's
    # 65504, unless G is held with headroom.
    w0 = torch.full((16,), 0.5)
    model, engine = make_engine(w0, "fp16_modmom", "static", lr=1e-6, momentum=0.9, extra=["scale.value=1024"])
    G = torch.full((16,), 30.0)  # S*g = 30720
    for _ in range(20):
        assert train_step(model, engine, G)
    buf = engine.optimizer.state[model.w]["momentum"]
    assert torch.isfinite(buf).all() and torch.isfinite(model.w).all()
    expected = fp16_oracle(w0, [G] * 20, [1024.0] * 20, 1e-6, 0.9, 0.0, modified=True)
    assert torch.equal(model.w.double(), expected)


@pytest.mark.parametrize("precision,modified", [("fp16", False), ("fp16_modmom", True)])
def test_fp16_updates_clip_the_unscaled_gradient(precision, modified):
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(128, generator=gen).to(F16).float()
    grads = [torch.randn(128, generator=gen) * 0.1 for _ in range(4)]  # norm about 1.1, clipped to 0.5
    model, engine = make_engine(
        w0, precision, "static", lr=0.1, momentum=0.9, extra=["scale.value=512", "optim.clip_grad_norm=0.5"]
    )
    for G in grads:
        assert train_step(model, engine, G)
    expected = fp16_oracle(w0, grads, [512.0] * 4, 0.1, 0.9, 0.0, modified, clip=0.5)
    assert torch.equal(model.w.double(), expected)
    assert not torch.equal(
        expected, fp16_oracle(w0, grads, [512.0] * 4, 0.1, 0.9, 0.0, modified)
    )  # clipping was active


@pytest.mark.parametrize("precision", ["fp16", "fp16_modmom", "mixed"])
def test_a_skipped_step_changes_no_weight_momentum_or_master(precision):
    model, engine = make_engine(
        torch.linspace(-1, 1, 8), precision, "static", lr=0.1, momentum=0.9, extra=["scale.value=8"]
    )
    train_step(model, engine, torch.full((8,), 0.5))
    snapshot = [t.clone() for t in [model.w.detach(), *engine.master_weights(), *_momenta(engine)]]
    bad = torch.full((8,), 0.5)
    bad[2] = float("inf")
    assert not train_step(model, engine, bad)
    after = [model.w.detach(), *engine.master_weights(), *_momenta(engine)]
    assert len(after) == len(snapshot) >= 2
    assert all(torch.equal(a, b) for a, b in zip(after, snapshot))


def _momenta(engine) -> list[torch.Tensor]:
    return [t for state in engine.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def test_dynamic_scaler_matches_torch_gradscaler_on_a_scripted_sequence():
    overflow = [False, False, True, False, False, False, False, True, True, False, False, False, False, False]
    w0 = torch.linspace(-1, 1, 16)
    model, engine = make_engine(
        w0, "fp32", "dynamic", lr=0.1, momentum=0.9, extra=["scale.init=1024", "scale.interval=3", "scale.min=1"]
    )
    ref = Vector(w0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler(
        "cpu", init_scale=1024.0, growth_interval=3, growth_factor=2.0, backoff_factor=0.5
    )
    ours, theirs = [], []
    for i, bad in enumerate(overflow):
        G = torch.full((16,), 0.01 * (i + 1))
        if bad:
            G[3] = float("inf")
        ours.append((engine.scaler.scale, train_step(model, engine, G)))
        before = ref_scaler.get_scale()
        w_before = ref.w.detach().clone()
        opt.zero_grad()
        ref_scaler.scale((ref(torch.ones(16)) * G).sum()).backward()
        ref_scaler.step(opt)
        ref_scaler.update()
        theirs.append((before, not torch.equal(w_before, ref.w.detach())))
    assert ours == theirs
    assert engine.scaler.scale == ref_scaler.get_scale()
    assert torch.equal(model.w.detach(), ref.w.detach())
    assert engine.scaler.summary()["skipped_steps"] == sum(overflow)


def test_dynamic_scaler_gives_up_at_its_minimum():
    model, engine = make_engine(torch.ones(4), "fp32", "dynamic", extra=["scale.init=4", "scale.min=2"])
    G = torch.full((4,), float("inf"))
    assert not train_step(model, engine, G)  # 4 -> 2
    with pytest.raises(Diverged, match="minimum loss scale 2"):
        train_step(model, engine, G)


@pytest.mark.parametrize("scale,extra", [("static", ["scale.value=1024"]), ("dynamic", ["scale.init=4096"])])
def test_gradients_are_unscaled_before_clipping(scale, extra):
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(32, generator=gen)
    grads = [torch.randn(32, generator=gen) for _ in range(3)]
    model, engine = make_engine(
        w0, "fp32", scale, lr=0.1, momentum=0.9, weight_decay=1e-4, extra=["optim.clip_grad_norm=0.5", *extra]
    )
    ref = Vector(w0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for G in grads:
        assert train_step(model, engine, G)
        opt.zero_grad()
        (ref(torch.ones(32)) * G).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        assert norm > 0.5  # clipping is active in every step
        torch.testing.assert_close(engine.last_grad_norm, norm, rtol=1e-6, atol=0)
    assert torch.equal(model.w.detach(), ref.w.detach())


def test_fp32_engine_matches_torch_sgd_on_a_network():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    ref = nn.Sequential(*[m for m in __import__("copy").deepcopy(net)])
    cfg = compose_cfg("precision=fp32", "schedule.batch_size=256", "optim.lr=0.05")
    engine = PrecisionEngine(net, cfg, build_scaler(cfg), [], CPU)
    model = engine.model
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    for _ in range(4):
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
        engine.backward(nn.functional.cross_entropy(model(x), y))
        engine.step()
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_a_skipped_step_does_not_advance_the_lr_schedule():
    model, engine = make_engine(torch.ones(4), "fp32", "static", lr=0.1, milestones=[2], extra=["scale.value=8"])
    lrs = []
    for G in [torch.ones(4), torch.full((4,), float("nan")), torch.ones(4), torch.ones(4)]:
        lrs.append(engine.lr)
        train_step(model, engine, G)
    # The second step overflows and is skipped: the milestone (2 applied updates) is reached after the third
    # step, not after the second as it would be if skipped steps counted.
    assert lrs == pytest.approx([0.1, 0.1, 0.1, 0.01])


def test_mixed_matches_torch_sgd_on_fp32_masters_of_an_fp16_network():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)  # values FP16 cannot hold: they must reach the run unrounded
    fp32 = copy.deepcopy(net)
    # The paper's algorithm by hand: the FP32 masters start from the FP32 initialization and only the
    # working copy is rounded to FP16; batch-norm stays in FP32 with its exact values.
    ref = copy.deepcopy(net)
    ref[0].half(), ref[4].half()
    S = 256.0
    # The reference's convolution is torch's own FP16 kernel: the run's must be too.
    cfg = compose_cfg(
        "precision=mixed",
        "scale=static",
        f"scale.value={S}",
        "schedule.batch_size=256",
        "optim.lr=0.05",
        "emulate_tensor_cores=false",
    )
    engine = PrecisionEngine(net, cfg, build_scaler(cfg), [], CPU)
    model = engine.model
    params = list(ref.parameters())
    masters = [f.detach().clone() if p.dtype == F16 else p for p, f in zip(params, fp32.parameters())]
    opt = torch.optim.SGD(masters, lr=0.05, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    for _ in range(4):
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
        engine.backward(nn.functional.cross_entropy(model(x), y))
        assert engine.step()
        (nn.functional.cross_entropy(ref(x.half()).float(), y) * S).backward()
        for p, m in zip(params, masters):
            g = p.grad.float() / S
            p.grad = None
            m.grad = g  # batch-norm weights are FP32 and their own masters (m is p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                if m is not p:
                    p.copy_(m)
    assert all(
        torch.equal(a, b) for a, b in zip(engine.master_weights(), [m for p, m in zip(params, masters) if m is not p])
    )
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))


def test_mixed_keeps_fp16_weights_fp32_batchnorm_and_fp32_masters():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    cfg = compose_cfg("precision=mixed")
    engine = PrecisionEngine(net, cfg, build_scaler(cfg), [], CPU)
    model = engine.model
    assert model[0].weight.dtype == F16 and model[3].weight.dtype == F16
    assert model[1].weight.dtype == torch.float32 and model[1].running_var.dtype == torch.float32
    masters = engine.master_weights()
    assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)  # conv and linear weight + bias
    out = model(torch.randn(2, 3, 6, 6))
    assert out.dtype == torch.float32  # the loss is computed in FP32


def test_fp32_switches_tf32_off_and_tf32_on():
    assert set(set_fp32_math(False).values()) == {"ieee"}
    assert set(set_fp32_math(True).values()) == {"tf32"}
    set_fp32_math(False)


def test_a_parameter_without_gradient_keeps_its_master_after_an_overflow():
    # Step 1 overflows through both halves; step 2 uses only the first half. The second half's
    # master must not be updated with the stale, non-finite gradient of step 1.
    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Vector(torch.ones(4)), Vector(torch.ones(4))

        def forward(self, x, use_b: bool):
            return self.a(x) + (self.b(x) if use_b else 0)

    cfg = compose_cfg("precision=mixed", "scale=static", "scale.value=8", "schedule.batch_size=256", "optim.lr=0.1")
    engine = PrecisionEngine(Halves(), cfg, build_scaler(cfg), [], CPU)
    model = engine.model
    bad = torch.tensor([1.0, float("inf"), 1.0, 1.0])
    engine.backward((model(torch.ones(4), use_b=True).float() * bad).sum())
    assert not engine.step()
    engine.backward(model(torch.ones(4), use_b=False).float().sum())
    assert engine.step()
    master_a, master_b = engine.master_weights()
    assert torch.all(master_a < 1) and torch.equal(master_b, torch.ones(4))


@pytest.mark.parametrize("mode", ["mixed", "fp16"])
def test_a_network_starts_from_its_fp32_initialization(mode):
    """Every tensor starts from its FP32 initialization, rounded at most once: under mixed,
    batch-norm (kept in FP32) and the masters hold the exact FP32 values and only the FP16 working
    weights are rounded; under fp16 everything is rounded once, from FP32."""
    from mpt.models.dcgan import Generator

    torch.manual_seed(0)
    net = Generator(compose_cfg("model=dcgan64", "model.ngf=4", "model.nz=8").model)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.running_var.fill_(1.0001)  # FP16 holds it as 1.0
                m.running_mean.uniform_(-0.1, 0.1)
    fp32 = copy.deepcopy(net)
    cfg = compose_cfg(f"precision={mode}", "scale=static", "optim.name=sgd")
    engine = PrecisionEngine(net, cfg, build_scaler(cfg), [], CPU)
    norm_dtype = torch.float32 if mode == "mixed" else F16
    norms = [
        (a.state_dict(), b.state_dict())
        for a, b in zip(engine.model.modules(), fp32.modules())
        if isinstance(a, nn.BatchNorm2d)
    ]
    assert norms
    for ours, init in norms:
        for key, value in init.items():
            expected = value.to(norm_dtype) if value.is_floating_point() else value
            assert ours[key].dtype == expected.dtype and torch.equal(ours[key], expected), key
    low = [(p, f) for p, f in zip(engine.model.parameters(), fp32.parameters()) if p.dtype == F16]
    assert low and all(torch.equal(p, f.half()) for p, f in low)
    masters = engine.master_weights()
    if mode == "mixed":
        assert len(masters) == len(low) and all(
            torch.equal(m, f) and m.dtype == torch.float32 for m, (_, f) in zip(masters, low)
        )
        assert any(
            not torch.equal(m, p.float()) for m, (p, _) in zip(masters, low)
        )  # the FP32 values, not their FP16 rounding
    else:
        assert masters == []


def _trained(shift: int, precision: str = "fp32", scale: str = "none") -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    cfg = compose_cfg(
        f"precision={precision}",
        f"scale={scale}",
        "schedule.batch_size=256",
        "optim.lr=0.05",
        f"scale.shift_down={shift}",
    )
    engine = PrecisionEngine(net, cfg, build_scaler(cfg), [], CPU)
    data = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(4, 3, 8, 8, generator=data), torch.randint(0, 5, (4,), generator=data)
        engine.backward(nn.functional.cross_entropy(engine.model(x).float(), y))
        engine.step()
    return [p.detach().clone() for p in engine.model.parameters()]


@pytest.mark.parametrize("scale", ["none", "dynamic"])
def test_shifting_the_loss_down_by_a_power_of_two_leaves_an_fp32_run_unchanged_bit_for_bit(scale):
    # The same kernels on the same layout, each gradient 2^-k times its unshifted value exactly:
    # powers of two commute with every rounding until a value leaves FP32's normal range.
    reference = _trained(0, scale=scale)
    for shift in (12, 24):
        assert all(torch.equal(a, b) for a, b in zip(_trained(shift, scale=scale), reference))


@pytest.mark.parametrize("shift", [0, 12, 24])
def test_a_shifted_fp16_gradient_is_rounded_there_and_shifted_back_in_fp32(shift):
    # Oracle in float64: the FP16 gradient is round_fp16(g * 2^-k); the master receives it times 2^k.
    G = torch.tensor([1e-2, 1e-3, 3e-5, 2e-6, 1e-7, 1.5e-8])
    oracle = torch.tensor(
        [float(torch.tensor(g * 2.0**-shift).half()) * 2.0**shift for g in G.double().tolist()], dtype=torch.float64
    )
    model, engine = make_engine(torch.ones(6), "mixed", lr=1.0, extra=[f"scale.shift_down={shift}"])
    train_step(model, engine, G)
    torch.testing.assert_close(engine.master_weights()[0].double(), 1 - oracle, rtol=0, atol=1e-7)
    if shift == 24:  # 1e-2 * 2^-24 = 6e-10 is below half of FP16's smallest subnormal, 2^-25: every one flushed
        assert engine.master_weights()[0].eq(1.0).all()
    if shift == 12:  # 1e-3 * 2^-12 = 2.4e-7 is an FP16 subnormal; 3e-5 * 2^-12 = 7e-9 and below flush
        assert engine.master_weights()[0][:2].lt(1.0).all() and engine.master_weights()[0][2:].eq(1.0).all()


def test_a_scale_as_large_as_the_shift_recovers_what_it_pushed_below_fp16():
    G = torch.tensor([1e-3, 3e-5])
    unscaled, unscaled_engine = make_engine(torch.ones(2), "mixed", lr=1.0, extra=["scale.shift_down=24"])
    reference, reference_engine = make_engine(torch.ones(2), "mixed", lr=1.0)  # no shift, no scale
    # a dynamic scaler whose range moved with k (as the shift preset's does): its first scale 2^24
    # undoes the shift, and the run is the unshifted one's
    scaled, scaled_engine = make_engine(
        torch.ones(2),
        "mixed",
        "dynamic",
        lr=1.0,
        extra=["scale.shift_down=24", f"scale.init={2.0**24}", f"scale.max={2.0**32}"],
    )
    for model, engine in ((unscaled, unscaled_engine), (reference, reference_engine), (scaled, scaled_engine)):
        train_step(model, engine, G)
    assert unscaled_engine.master_weights()[0].eq(1.0).all() and reference_engine.master_weights()[0].lt(1.0).all()
    assert torch.equal(scaled_engine.master_weights()[0], reference_engine.master_weights()[0])


def test_fp16_weights_divide_the_shift_out_inside_their_update():
    # Gradients exact in FP16 at any of these shifts: the FP16 update must come out the same.
    G = torch.tensor([0.25, 0.5, 2.0**-6])
    runs = []
    for shift in (0, 8, 14):
        model, engine = make_engine(torch.ones(3), "fp16", lr=0.5, extra=[f"scale.shift_down={shift}"])
        train_step(model, engine, G)
        runs.append(model.w.detach().clone())
    assert all(torch.equal(r, runs[0]) for r in runs) and not runs[0].eq(1.0).all()


def test_a_shift_beyond_fp32s_normal_range_is_refused():
    from mpt.config import ConfigError
    from mpt.runner.validation import validate

    with pytest.raises(ConfigError, match=r"^scale.shift_down=127: must be an integer from 0 to 126"):
        validate(compose_cfg("scale.shift_down=127"))


@pytest.mark.parametrize("precision", ["fp16", "fp16_modmom"])
def test_fp16_weights_with_fp32_batch_norm_update_it_by_their_rule_in_fp32(precision):
    # Naruse's arrangement: convolutions and their weights FP16, batch-norm's parameters and
    # statistics FP32, every weight updated by the FP16 solver's rule (float64 oracle, first step:
    # v = -lr*(g/S + wd*w) for both rules), the FP32 ones stored in FP32: had they been stored in
    # FP16, they would be 1e-4 off or more, far outside the FP32 tolerance below.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    cfg = compose_cfg(
        f"precision={precision}",
        "scale=static",
        "scale.value=64",
        "precision.norm_fp32=true",
        "schedule.batch_size=256",
        "optim.lr=0.05",
        "optim.weight_decay=1e-3",
    )
    engine = PrecisionEngine(net, cfg, build_scaler(cfg), [], CPU)
    model = engine.model
    assert model[0].weight.dtype == F16 and model[4].weight.dtype == F16
    assert model[1].weight.dtype == model[1].running_var.dtype == torch.float32
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    engine.backward(nn.functional.cross_entropy(model(x.half()).float(), y))
    before = {n: (p.detach().double().clone(), p.grad.double().clone()) for n, p in model.named_parameters()}
    assert engine.step()
    for name, p in model.named_parameters():
        w, g = before[name]
        expected = (w - 0.05 * (g / 64 + 1e-3 * w)).to(p.dtype)
        # FP32: within the FP32 update arithmetic's few roundings; FP16: a few FP16 ulps of these weights
        torch.testing.assert_close(
            p.detach(),
            expected,
            rtol=1e-6 if p.dtype == torch.float32 else 0,
            atol=1e-9 if p.dtype == torch.float32 else 1e-3,
        )
