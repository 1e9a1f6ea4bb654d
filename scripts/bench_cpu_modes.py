#!/usr/bin/env python3
"""What each precision mode costs on a CPU: the step time of fp16, mixed, fp16_modmom, amp and bf16
(or the modes --modes names, issue 24's FP8 and MX ones among them) as a ratio to fp32, for one
model, all the runs alive in one process.

Each run is the runner's own (`Run.steps()`), on synthetic data, from the same seed. After the
warm-up steps, the runs advance one window at a time in rotating order, so that whatever else the
machine is doing falls on all of them alike; a window is timed between two synchronizations, with
what the run holds in `Run.train()` held around it (on a CPU: autocast's CUDA lists and the mode's
arithmetic, cpu_tensor_cores.py). mpt's CPU allocator settings apply (mpt/__init__.py). The
figure per mode is its median seconds per step over the windows, and its ratio to fp32's median.
The goal (issue 20) is every ratio at most 1.5.

    python scripts/bench_cpu_modes.py --model resnet50 --out results/cpu-modes
    python scripts/bench_cpu_modes.py --all --out results/cpu-modes
    python scripts/bench_cpu_modes.py --model gnmt --override schedule.batch_size=32 --out results/cpu-modes-batch32
    python scripts/bench_cpu_modes.py --model resnet50 --modes fp32 bf16 fp8 mxfp8 mxfp4 --out results/cpu-modes-fp8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from mpt.config import register_configs
from mpt.files import write_json_atomic
from mpt.precision.engine import held_for_the_run
from mpt.provenance import code_identity, environment, now_iso
from mpt.runner.instruments.throughput import synchronize
from mpt.runner.process import resolve_device
from mpt.runner.train import Run
from mpt.runner.validation import validate

MODES = {"fp32": "none", "fp16": "static", "mixed": "static", "fp16_modmom": "static", "amp": "dynamic", "bf16": "none"}
# Issue 24's modes (--modes): quantized products, everything else in BF16, no loss scaling.
MODES.update({m: "none" for m in ("fp8", "fp8_delayed", "mxfp8", "mxfp6", "mxfp4")})
PAPER_MODES = ("fp32", "fp16", "mixed", "fp16_modmom", "amp", "bf16")
# The paper's six models at the sizes of this project's reduced-scale runs (schedule=smoke's batch).
# The FP16 updates are momentum SGD, so the models trained with Adam or Adagrad (GNMT, bigLSTM,
# DCGAN) take SGD here in every mode: each model's six runs differ in their precision only.
MODELS = {
    "alexnet": ["model=alexnet"],
    "resnet50": ["model=resnet50"],
    "ssd": ["model=ssd", "schedule.batch_size=2"],
    "gnmt": ["model=gnmt_small", "optim.name=sgd"],
    "biglstm": ["model=biglstm_tiny", "optim.name=sgd"],
    "dcgan": ["model=dcgan64", "optim.name=sgd"],
}


def compose(model: str, mode: str, steps: int, extra: tuple[str, ...] = ()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    register_configs()
    overrides = [*MODELS[model], f"precision={mode}", f"scale={MODES[mode]}", "schedule=smoke",
                 f"schedule.steps={steps}", "schedule.log_every=1000", "checkpoint=false", "logger=none", "device=cpu",
                 *extra]  # fmt: skip
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    validate(cfg)
    return cfg, overrides


def time_window(steps, n: int, device, held) -> float:
    """Seconds per step over n steps, with what the run holds while it trains held around them (as
    Run.train() holds it, and only for this run: an FP32 run never sees another mode's). One step
    runs untimed first: a run holds this for all its steps, the window only from its start."""
    with held:
        next(steps)
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            next(steps)
        synchronize(device)
        return (time.perf_counter() - t0) / n


def bench(model: str, args) -> dict:
    total = args.warmup + args.windows * (args.window + 1) + 1
    device = resolve_device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        runs, overrides, held = {}, {}, {}
        for mode in args.modes:
            cfg, overrides[mode] = compose(model, mode, total, tuple(args.override))
            (Path(tmp) / mode).mkdir()
            runs[mode] = Run(cfg, Path(tmp) / mode).steps()
            held[mode] = lambda cfg=cfg: held_for_the_run(cfg, device)
        for mode, steps in runs.items():
            time_window(steps, args.warmup, device, held[mode]())
        times: dict[str, list[float]] = {mode: [] for mode in args.modes}
        order = list(args.modes)
        for i in range(args.windows):
            for mode in order[i % len(order) :] + order[: i % len(order)]:
                times[mode].append(time_window(runs[mode], args.window, device, held[mode]()))
            print(
                f"{model} window {i + 1}/{args.windows}: "
                + ", ".join(f"{m} {t[-1] * 1e3:.0f}" for m, t in times.items())
                + " ms/step",
                flush=True,
            )
    median = {mode: statistics.median(t) for mode, t in times.items()}
    return {
        "benchmark": "cpu_modes",
        "model": model,
        "overrides": overrides,
        "warmup_steps": args.warmup,
        "window_steps": args.window,
        "windows": args.windows,
        "unit": "seconds per training step (median over windows)",
        "step_s": times,
        "median_step_s": median,
        "ratio_to_fp32": {mode: median[mode] / median["fp32"] for mode in args.modes},
        "environment": environment(resolve_device("cpu")),
        "commit": code_identity(),
        "finished_at": now_iso(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), nargs="+")
    ap.add_argument("--all", action="store_true", help="every model, one after another")
    ap.add_argument("--warmup", type=int, default=2, help="steps of each run before timing")
    ap.add_argument("--window", type=int, default=2, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=9, help="timed windows per run")
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(PAPER_MODES),
        help="precision modes to time (fp32 among them: the ratios are to it)",
    )
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON records")
    ap.add_argument(
        "--override",
        nargs="*",
        default=[],
        help="Hydra overrides for every run, after the model's (e.g. schedule.batch_size=32)",
    )
    args = ap.parse_args()
    if not args.all and args.model is None:
        ap.error("give --model or --all")
    if "fp32" not in args.modes:
        ap.error(f"--modes {' '.join(args.modes)}: include fp32, which the ratios are to")
    for model in MODELS if args.all else args.model:
        record = bench(model, args)
        print(model, " ".join(f"{m} {r:.2f}" for m, r in record["ratio_to_fp32"].items()), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.out / f"{model}.json", record)


if __name__ == "__main__":
    main()
