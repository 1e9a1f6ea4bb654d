#!/usr/bin/env python3
r"""Runner overhead: the same model, precision and batch through `mpt`'s runner and through a minimal
hand-written PyTorch loop, in one process, alternating A/B to cancel drift.

Both sides train the same model from the same initial weights on the same synthetic batches,
resident on the device. Both are alive at once and advance one window of steps at a time, in ABBA
order, so that whatever else the machine is doing falls on both alike. Each window is timed with
the device synchronized at its edges; warm-up steps are excluded. The figure is the ratio of the
median step times, runner/hand; the goal is <= 1.03.

    python scripts/bench_overhead.py --model resnet50 --precision fp32 --batch-size 16 --image-size 64 \
        --out results/overhead
    python scripts/bench_overhead.py --precision amp --batch-size 256 --image-size 224 \
        --out results/overhead   # on a GPU

Hand-written loops exist for fp32, tf32, amp, bf16 (torch.autocast, torch.amp.GradScaler for amp)
and mixed (FP16 model, FP32 batch-norm, an FP32 master copy, a static loss scale).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from omegaconf import DictConfig

from mpt.config import register_configs
from mpt.datasets.synthetic import SyntheticImages
from mpt.files import write_json_atomic
from mpt.precision.engine import set_fp32_math
from mpt.provenance import code_identity, environment, now_iso
from mpt.runner.instruments.throughput import synchronize
from mpt.runner.process import resolve_device
from mpt.runner.train import Run
from mpt.runner.validation import validate

SCALE_FOR = {"fp32": "none", "tf32": "none", "bf16": "none", "amp": "dynamic", "mixed": "static"}


def compose(args) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    register_configs()
    overrides = [
        f"model={args.model}",
        f"precision={args.precision}",
        f"scale={SCALE_FOR[args.precision]}",
        "schedule=bench",
        f"schedule.batch_size={args.batch_size}",
        f"schedule.image_size={args.image_size}",
        f"schedule.steps={args.warmup + args.windows * args.window + 1}",
        f"schedule.throughput_warmup={args.warmup}",
        f"schedule.throughput_window={args.window}",
        f"data.train_samples={2 * args.batch_size}",
        f"data.val_samples={args.batch_size}",
        f"device={args.device}",
        "logger=none",  # the runner's own work, not an event file's
    ]
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    validate(cfg)
    return cfg


def runner_stepper(cfg, run_dir: Path):
    """One call, one training step of the runner's own loop."""
    steps = Run(cfg, run_dir).steps()
    return lambda: next(steps)


def hand_stepper(cfg, device: torch.device):
    """What a researcher writes by hand for this precision, with nothing else in the loop."""
    torch.manual_seed(cfg.seed)
    p, b = cfg.precision.name, cfg.schedule.batch_size
    set_fp32_math(p == "tf32")
    model = torchvision.models.get_model(cfg.model.arch, weights=None, num_classes=cfg.data.num_classes).to(device)
    channels_last = device.type == "cuda" or p == "mixed"
    data = SyntheticImages(cfg.data, cfg.schedule, seed=cfg.seed, device=device)  # the runner's data, batch for batch
    lr = cfg.optim.lr * b / 256
    sgd = dict(lr=lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    if p == "mixed":
        model.half()
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.float()
        params = list(model.parameters())
        masters = [q.detach().float() if q.dtype == torch.float16 else q for q in params]
        opt = torch.optim.SGD(masters, **sgd)
        S = float(cfg.model.static_scale)
    else:
        opt = torch.optim.SGD(model.parameters(), **sgd)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    scaler = torch.amp.GradScaler(device.type) if p == "amp" else None
    autocast_dtype = {"amp": torch.float16, "bf16": torch.bfloat16}.get(p)

    def batches():
        epoch = 0
        while True:
            yield from data.epoch(epoch)
            epoch += 1

    stream = batches()

    def step():
        x, y = next(stream)
        if p == "mixed":
            x = x.half()
            loss = F.cross_entropy(model(x).float(), y)
            (loss * S).backward()
            grads = []
            for q, m in zip(params, masters):
                if m is not q:
                    m.grad = q.grad.float()
                grads.append(m.grad)
            found = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 1 / S, device=device))
            if not found.item():
                opt.step()
                with torch.no_grad():
                    for q, m in zip(params, masters):
                        if m is not q:
                            q.copy_(m)
            for q in params:
                q.grad = None
            return
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_window(step, n: int, device: torch.device) -> float:
    """Seconds per step over n steps, the device synchronized at both edges."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    synchronize(device)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--precision", default="fp32", choices=sorted(SCALE_FOR))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5, help="steps of each side before timing")
    ap.add_argument("--window", type=int, default=5, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=12, help="timed windows per side")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON record")
    args = ap.parse_args()

    cfg = compose(args)
    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory() as run_dir:
        sides = {"runner": runner_stepper(cfg, Path(run_dir)), "hand": hand_stepper(cfg, device)}
        for _ in range(args.warmup):
            for step in sides.values():
                step()
        times: dict[str, list[float]] = {"runner": [], "hand": []}
        for i in range(args.windows):
            for name in ("runner", "hand") if i % 2 == 0 else ("hand", "runner"):
                times[name].append(time_window(sides[name], args.window, device))
            print(
                f"window {i + 1}/{args.windows}: runner {times['runner'][-1] * 1e3:.1f} ms/step,"
                f" hand {times['hand'][-1] * 1e3:.1f} ms/step",
                flush=True,
            )
    runner, hand = times["runner"], times["hand"]
    pair_ratios = [r / h for r, h in zip(runner, hand)]
    ratio = statistics.median(runner) / statistics.median(hand)
    record = {
        "benchmark": "runner_overhead",
        "model": args.model,
        "precision": args.precision,
        "scale": SCALE_FOR[args.precision],
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "warmup_steps": args.warmup,
        "window_steps": args.window,
        "windows": args.windows,
        "runner_step_s": runner,
        "hand_step_s": hand,
        "runner_median_step_s": statistics.median(runner),
        "hand_median_step_s": statistics.median(hand),
        "ratio": ratio,
        "pair_ratios": pair_ratios,
        "goal": 1.03,
        "median_pair_ratio": statistics.median(pair_ratios),
        "method": (
            "median step time over windows of window_steps steps, warm-up excluded, device synchronized at window"
            " edges; runner and hand loop alive in one process, windows interleaved ABBA"
        ),
        "environment": environment(device),
        "git": code_identity(),
        "finished_at": now_iso(),
    }
    print(f"runner/hand step time ratio: {ratio:.3f} (goal <= 1.03) on {record['environment']['device_name']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        device_type = record["environment"]["device_type"]
        name = f"{device_type}_{args.model}_{args.precision}_b{args.batch_size}_s{args.image_size}.json"
        write_json_atomic(args.out / name, record)
        print(f"record: {args.out / name}")


if __name__ == "__main__":
    main()
