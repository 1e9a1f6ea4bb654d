"""A loss scale kept on the device (scale.on_device): the same training as the host path, the same
scale sequence as torch.amp.GradScaler, and no read of the device inside a step."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mpt.config import ConfigError
from mpt.precision.engine import PrecisionEngine
from mpt.precision.scaler import Diverged, build_scaler

from .conftest import CPU, Vector, build_run, cifar_mini_run, compose_cfg, read_record
from .test_resume import SMALL_GAN

# Steps whose gradients overflow: the first (before any update, where torch's fused SGD would
# leave its momentum unwritten), a run of three, and single ones between growths.
OVERFLOWS = [True, False, False, True, False, False, False, True, True, True,
             False, False, False, False, True, False, False, False]  # fmt: skip


class Net(nn.Module):
    """Two layers and a bias: more than one tensor per dtype group, a nonlinearity between them."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(8, 16, generator=gen) * 0.3)
        self.b = nn.Parameter(torch.randn(4, 8, generator=gen) * 0.3)
        self.c = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.a.t()) @ self.b.t() + self.c


def engine_for(
    on_device: bool, optim: str = "sgd", precision: str = "fp32", scale: str = "dynamic", *extra: str
) -> PrecisionEngine:
    cfg = compose_cfg(
        f"precision={precision}",
        f"scale={scale}",
        f"scale.on_device={str(on_device).lower()}",
        f"optim.name={optim}",
        "optim.implementation=fused",
        "optim.momentum=0.9",
        "optim.weight_decay=1e-3",
        "optim.lr=0.05",
        "schedule.batch_size=256",
        "schedule.log_every=4",  # a read-back window shorter than the run: the engine reads back on its own too
        *extra,
    )
    # the lr drops after 4 and 9 applied steps: a schedule moved by skipped steps would show
    return PrecisionEngine(Net(), cfg, build_scaler(cfg), [4, 9], CPU, total_steps=len(OVERFLOWS))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)


def train(engine: PrecisionEngine, overflows=OVERFLOWS, on_step=None) -> list:
    results = []
    for i, bad in enumerate(overflows):
        x, y = batch(i)
        with torch.autocast("cpu", enabled=False):
            out = engine.model(x.to(next(engine.model.parameters()).dtype)).float()
        loss = ((out - y) ** 2).mean() * (float("inf") if bad else 1.0)
        engine.backward(loss)
        results.append(engine.step(at=i) if on_step is None else on_step(engine, i))
    return results


def state(engine: PrecisionEngine) -> dict:
    engine.read_back()
    opt = engine.optimizer.state_dict()
    return {
        "weights": [p.detach().clone() for p in engine.model.parameters()],
        "masters": [m.detach().clone() for m in engine.master_weights()],
        "optimizer": [{k: v for k, v in s.items()} for s in opt["state"].values()],
        "scales": list(engine.scaler.history.scales),
        "overflows": list(engine.scaler.history.overflows),
        "scale": engine.scaler.scale,
        "schedule_steps": engine.scheduler.last_epoch,
        "lr": engine.lr,
    }


def assert_same(a: dict, b: dict) -> None:
    for key in ("scales", "overflows", "scale", "schedule_steps", "lr"):
        assert a[key] == b[key], key
    for key in ("weights", "masters"):
        assert len(a[key]) == len(b[key])
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), key
    assert len(a["optimizer"]) == len(b["optimizer"])
    for sa, sb in zip(a["optimizer"], b["optimizer"]):
        assert sa.keys() == sb.keys()
        assert all(torch.equal(torch.as_tensor(sa[k]).float(), torch.as_tensor(sb[k]).float()) for k in sa)


@pytest.mark.parametrize(
    "optim,precision",
    [("sgd", "fp32"), ("sgd", "mixed"), ("adam", "fp32"), ("adam", "bf16"), ("adagrad", "fp32")],
)
def test_the_device_path_trains_as_the_host_path(optim, precision):
    """The same fused kernel either way: on the host path it is not called on a skipped step, on
    the device path it is called and skips itself. Weights, optimizer state, scale history and
    schedule end equal, bit for bit."""
    host, device = engine_for(False, optim, precision), engine_for(True, optim, precision)
    assert not host.on_device and device.on_device
    assert train(host) == [not o for o in OVERFLOWS]
    assert train(device) == [None] * len(OVERFLOWS)  # known only at a read-back
    a, b = state(host), state(device)
    assert_same(a, b)
    assert a["schedule_steps"] == OVERFLOWS.count(False)  # the control: the skips did not move the schedule
    assert a["lr"] == pytest.approx(0.05 * 0.1**2)


def test_a_static_scale_on_the_device_skips_as_the_host_path_does():
    host, device = (engine_for(d, "sgd", "fp32", "static", "scale.value=1024") for d in (False, True))
    train(host)
    train(device)
    assert_same(state(host), state(device))


def test_the_scale_sequence_is_gradscalers():
    """torch.amp.GradScaler with torch's fused SGD, on the same gradients: the scale each step ran
    with, which steps it skipped, and the weights."""
    overflows = OVERFLOWS[1:]  # GradScaler's own fused SGD would add garbage after a skipped first step
    engine = engine_for(True, "sgd", "fp32", "dynamic", "scale.init=1024", "scale.interval=3", "optim.weight_decay=0")
    engine.scheduler.milestones.clear()  # GradScaler's loop below has no schedule
    engine.resident.sync_from_host()
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3, growth_factor=2.0, backoff_factor=0.5)
    theirs = []
    for i, bad in enumerate(overflows):
        x, y = batch(i)
        theirs.append(scaler.get_scale())
        opt.zero_grad()
        scaler.scale(((ref(x) - y) ** 2).mean() * (float("inf") if bad else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    train(engine, overflows)
    engine.read_back()
    assert engine.scaler.history.scales == theirs
    assert engine.scaler.history.overflows == overflows
    assert engine.scaler.scale == scaler.get_scale()
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(engine.model.parameters(), ref.parameters()))


class ReadsOfTheDevice(TorchFunctionMode):
    """Counts what brings a tensor's value to the host: on a GPU each is a synchronization."""

    READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "nonzero", "equal"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _counted(engine: PrecisionEngine, i: int) -> list[str]:
    with ReadsOfTheDevice() as mode:
        engine.step(at=i)
    return mode.reads


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_no_step_on_the_device_reads_the_device(optim):
    """Within the read-back window, steps that overflow and steps that do not read nothing back;
    the host path, the control, reads on every step."""
    window = 4
    overflows = OVERFLOWS[:window]
    device = engine_for(True, optim)
    assert train(device, overflows, _counted) == [[]] * window
    host = engine_for(False, optim)
    assert all(reads for reads in train(host, overflows, _counted))
    with ReadsOfTheDevice() as mode:  # the read-back is where the host learns, in one read
        device.read_back()
    assert mode.reads == ["tolist"]


def test_the_window_bounds_the_steps_between_read_backs():
    """A run that flushes its log less often than the window still trains right: the engine reads
    back on its own once the lr table runs out (the equality test above passes through it)."""
    device = engine_for(True)
    reads = train(device, OVERFLOWS, _counted)
    assert [i for i, r in enumerate(reads) if r] == [4, 8, 12, 16]


def test_a_divergence_found_at_a_read_back_names_its_step():
    engine = engine_for(True, "sgd", "fp32", "dynamic", "scale.init=4", "scale.min=2")
    train(engine, [False, True, True, True])  # 4 -> 2 at step 1; step 2 overflows at the minimum
    with pytest.raises(Diverged, match="minimum loss scale 2") as e:
        engine.read_back()
    assert e.value.step == 2
    assert engine.scaler.history.overflows == [False, True, True]  # the replay stops where it gave up


def test_a_checkpoint_of_the_device_path_resumes_it_and_the_host_path():
    """state_dict reads back first; loading it on either path continues the same training."""
    whole = engine_for(True)
    train(whole)
    first = engine_for(True)
    train(first, OVERFLOWS[:7])
    saved = first.state_dict()
    for on_device in (True, False):
        resumed = engine_for(on_device)
        resumed.model.load_state_dict(first.model.state_dict())  # the runner checkpoints the network beside the engine
        resumed.load_state_dict(copy.deepcopy(saved))  # loading shares the tensors, which training then moves
        for i, bad in enumerate(OVERFLOWS[7:], start=7):
            x, y = batch(i)
            resumed.backward(((resumed.model(x) - y) ** 2).mean() * (float("inf") if bad else 1.0))
            resumed.step(at=i)
        a, b = state(whole), state(resumed)
        assert a["scales"] == b["scales"] and a["schedule_steps"] == b["schedule_steps"]
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


@pytest.mark.parametrize(
    "overrides,named",
    [
        (("optim.implementation=foreach",), "optim.implementation=foreach"),
        (("precision=fp16", "optim.implementation=default"), "precision=fp16"),
        (("optim.lookahead.start_epoch=1",), "optim.lookahead"),
        (("scale=auto",), "scale=auto"),
        (("scale.growth=3",), "scale.growth=3.0 is not a power of two"),
        (("scale=static", "scale.value=1000.1"), "scale.value=1000.1 has no exact FP32 value"),
    ],
)
def test_a_device_scale_the_run_cannot_keep_is_refused_naming_why(overrides, named):
    cfg = compose_cfg(
        "scale=dynamic", "scale.on_device=true", "optim.implementation=fused", "optim.momentum=0.9", *overrides
    )
    with pytest.raises(ConfigError, match=f"scale.on_device=true: .*{re.escape(named)}"):
        PrecisionEngine(Vector(torch.ones(4)), cfg, build_scaler(cfg), [], CPU, total_steps=10)


def test_on_a_cpu_the_host_path_is_the_default():
    cfg = compose_cfg("scale=dynamic", "optim.implementation=fused")
    assert not PrecisionEngine(Vector(torch.ones(4)), cfg, build_scaler(cfg), [], CPU, total_steps=10).on_device


@pytest.mark.gpu
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_no_step_on_the_device_synchronizes_a_gpu(optim):
    """CUDA's own count: a synchronizing call inside a step raises under sync debug mode "error"."""
    cuda = torch.device("cuda")
    cfg = compose_cfg(
        "scale=dynamic",
        "optim.implementation=fused",
        f"optim.name={optim}",
        "optim.momentum=0.9",
        "schedule.log_every=8",
    )
    engine = PrecisionEngine(Net(), cfg, build_scaler(cfg), [4], cuda, total_steps=8)
    assert engine.on_device  # null: on a GPU, wherever the run allows it
    for i, bad in enumerate(OVERFLOWS[:8]):
        x, y = (t.to(cuda) for t in batch(i))
        loss = ((engine.model(x) - y) ** 2).mean() * (float("inf") if bad else 1.0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.backward(loss)
            engine.step(at=i)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.read_back()
    assert engine.scaler.history.overflows == OVERFLOWS[:8]


def test_a_run_on_the_device_path_logs_and_records_what_the_host_path_does(tmp_path, in_process):
    """The whole runner: each step's loss, lr, scale and overflow flag in the log, the record's
    scale summary and metrics. A start scale FP16 cannot hold makes the first steps overflow."""
    args = [
        *cifar_mini_run("precision=mixed", "scale=dynamic", "scale.init=1048576", "scale.interval=3"),
        "optim.implementation=fused",
        "schedule.steps=9",
        "schedule.log_every=4",
        "schedule.checkpoint_every=4",
        "stats.trace_overflow=false",
        "deterministic=true",
        "device=cpu",
    ]
    runs = {d: tmp_path / str(d) for d in (False, True)}
    for on_device, run_dir in runs.items():
        assert build_run(run_dir, *args, f"scale.on_device={str(on_device).lower()}").execute().status == "ok"
    logs = {d: [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for d, r in runs.items()}
    assert logs[True] == logs[False]
    train_rows = [r for r in logs[True] if r["kind"] == "train"]
    assert [r["overflow"] for r in train_rows][:2] == [True, True]  # booleans, as the host path logs them
    assert any(r["overflow"] is False for r in train_rows)
    host, device = (read_record(r) for r in runs.values())
    assert device["loss_scale"]["model"].pop("on_device") and not host["loss_scale"]["model"].pop("on_device")
    assert device["loss_scale"] == host["loss_scale"] and device["loss_scale"]["model"]["initial_skips"] >= 2
    assert device["metrics"] == host["metrics"]


def test_a_gan_that_diverges_on_the_device_path_ends_as_on_the_host_path(tmp_path, in_process):
    """Both networks overflow at their minimum scale from the first step. The host path stops
    there; the device path finds it at the next flush, in both networks' read-backs, and records
    the same: `diverged` at step 0, no training row logged."""
    args = [
        "model=dcgan64",
        *SMALL_GAN,
        "precision=mixed",
        "scale=dynamic",
        *(f"scale.{k}=16777216" for k in ("init", "min", "max")),
        "optim.implementation=fused",
        "schedule=smoke",
        "schedule.steps=6",
        "schedule.log_every=4",
        "stats.trace_overflow=false",
        "device=cpu",
    ]
    records, logs = {}, {}
    for on_device in (False, True):
        run_dir = tmp_path / str(on_device)
        rec = build_run(run_dir, *args, f"scale.on_device={str(on_device).lower()}").execute()
        assert rec.status == "diverged", rec.message
        records[on_device], logs[on_device] = read_record(run_dir), (run_dir / "metrics.jsonl").read_text()
    for key in ("status", "diverged_at_step", "message"):
        assert records[True][key] == records[False][key], key
    assert records[True]["diverged_at_step"] == 0 and "minimum loss scale" in records[True]["message"]
    assert '"kind": "train"' not in logs[True] and '"kind": "train"' not in logs[False]
