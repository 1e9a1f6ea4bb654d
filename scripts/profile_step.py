#!/usr/bin/env python3
"""Training steps under torch.profiler: which kernels a mode's step runs, and for how long.

    python scripts/profile_step.py --preset speed_norm --out results/profile
    python scripts/profile_step.py --preset speed_fp8_lstm --out DIR device=cpu schedule.batch_size=4

Each cell of each preset's sweep (the cartesian product of its `hydra.sweeper.params`; an extra
`key=a,b` sweeps that key instead, any other override applies to every cell) is built as the
runner's own Run, trained `--warmup` steps, then `--steps` more under torch.profiler with the device
synchronized at the edges. Into DIR/<preset>/<cell>/ it writes:

- `trace.json.gz`: the Chrome trace (Perfetto, chrome://tracing);
- `ops.csv`: per operator, kernel and labelled region: calls and device and host time per step,
  and the share of the steps' device time;
- `profile.json`: the cell's overrides and config, environment, code identity, the steps, their
  device time, the regions mpt labels (a quantized product's weight made into an operand:
  `mpt.weight_operand <layer>`) counted per step, and the batch-norm kernels by name, which say
  whether cuDNN or PyTorch's native kernel ran.
"""

from __future__ import annotations

import argparse
import csv
import functools
import gzip
import itertools
import shutil
import tempfile
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf
from torch import nn

from mpt.config import register_configs
from mpt.files import write_json_atomic
from mpt.precision.engine import held_for_the_run
from mpt.provenance import code_identity, environment, now_iso
from mpt.runner.instruments.throughput import synchronize
from mpt.runner.train import Run
from mpt.runner.validation import validate

ROOT = Path(__file__).resolve().parents[1]

LABEL = "mpt."  # regions mpt labels with torch.profiler.record_function


def cells(preset: str, extra: list[str]) -> list[tuple[str, list[str]]]:
    """Each cell of the preset's sweep, with `extra` applied: its label (the swept values) and overrides."""
    path = ROOT / "configs" / "experiment" / f"{preset}.yaml"
    if not path.exists():
        raise SystemExit(f"profile_step.py: --preset {preset}: no such preset ({path.relative_to(ROOT)})")
    sweep = (yaml.safe_load(path.read_text()) or {}).get("hydra", {}).get("sweeper", {}).get("params", {}) or {}
    params = {k: str(v) for k, v in sweep.items()}
    fixed = []
    for o in extra:
        key, _, value = o.partition("=")
        if key in params or ("," in value and not value.startswith("[")):
            params[key] = value  # a swept key set to one value stays in the cell's label
        else:
            fixed.append(o)
    keys = list(params)
    choices = [[v.strip() for v in params[k].split(",")] for k in keys]
    return [
        (
            "_".join(combo).replace("/", "-"),
            [f"experiment={preset}", *(f"{k}={v}" for k, v in zip(keys, combo)), *fixed],
        )
        for combo in itertools.product(*choices)
    ]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    register_configs()
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=[*overrides, "logger=none", "checkpoint=false"])
    validate(cfg)
    return cfg


def profile_cell(overrides: list[str], out: Path, warmup: int, steps: int) -> dict:
    cfg = compose(overrides)
    OmegaConf.set_struct(cfg, False)
    cfg.schedule.steps = max(cfg.schedule.steps or 0, warmup + steps)  # a bench schedule may be shorter
    cfg.schedule.epochs = None
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        run = Run(cfg, run_dir)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if run.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        backends: dict[str, dict] = {}
        with held_for_the_run(cfg, run.device):
            stepping = run.steps()
            for _ in range(warmup - 1):
                next(stepping)
            hooks = _asking_batch_norm_backends(run, backends)
            next(stepping)  # the last warm-up step: each batch-norm layer says which backend takes it
            for h in hooks:
                h.remove()
            synchronize(run.device)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(steps):
                    next(stepping)
                synchronize(run.device)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "trace.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(out / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    rows = []
    on_gpu = run.device.type == "cuda"
    for e in prof.key_averages():
        # the device's time: CUDA kernels' on a GPU; on a CPU, the host's own time is the device's
        device_us = (
            getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
            if on_gpu
            else e.self_cpu_time_total
        )
        rows.append(
            {
                "name": e.key,
                "calls_per_step": e.count / steps,
                "device_us_per_step": device_us / steps,
                "cpu_us_per_step": e.self_cpu_time_total / steps,
            }
        )
    total = sum(r["device_us_per_step"] for r in rows)
    for r in rows:
        r["device_share"] = r["device_us_per_step"] / total if total else 0.0
    rows.sort(key=lambda r: (-r["device_us_per_step"], -r["cpu_us_per_step"]))
    with open(out / "ops.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["name"])
        writer.writeheader()
        writer.writerows(rows)
    record = {
        "what": (
            "training steps under torch.profiler after a warm-up, the device synchronized at their edges;"
            " times per step"
        ),
        "overrides": overrides,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "environment": environment(run.device),
        "code": code_identity(),
        "finished_at": now_iso(),
        "warmup_steps": warmup,
        "profiled_steps": steps,
        "device_us_per_step": total,
        "labelled_per_step": {r["name"]: r["calls_per_step"] for r in rows if r["name"].startswith(LABEL)},
        "batch_norm_backends": _tally(backends),
        "batch_norm_kernels": {
            r["name"]: r["device_us_per_step"]
            for r in rows
            if "bn" in r["name"].lower() or "batch_norm" in r["name"].lower()
        },
    }
    write_json_atomic(out / "profile.json", record)
    return record


def _asking_batch_norm_backends(run: Run, found: dict[str, dict]) -> list:
    """Hooks that ask PyTorch, at each batch-norm layer's forward, which backend its inputs take:
    cuDNN's kernel or PyTorch's native one (torch._C._select_batch_norm_backend, the choice
    aten's batch norm makes)."""

    def ask(name: str, module: nn.modules.batchnorm._BatchNorm, args) -> None:
        x = args[0]
        backend = torch._C._select_batch_norm_backend(  # type: ignore[attr-defined]
            x, module.weight, module.bias, module.running_mean, module.running_var, module.training, module.eps
        )
        weight = module.weight.dtype if module.weight is not None else None
        found[name] = {
            "backend": backend.name,
            "input": str(x.dtype).removeprefix("torch."),
            "weight": str(weight).removeprefix("torch."),
        }

    return [
        m.register_forward_pre_hook(functools.partial(ask, f"{net}.{name}"))
        for net, engine in run.engines.items()
        for name, m in engine.model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def _tally(found: dict[str, dict]) -> dict:
    """Layers per (backend, input dtype, weight dtype)."""
    counts: dict[str, int] = {}
    for v in found.values():
        key = f"{v['backend']}: input {v['input']}, weight {v['weight']}"
        counts[key] = counts.get(key, 0) + 1
    return {"layers": counts, "per_layer": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", required=True, help="a preset in configs/experiment/ (repeatable)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="key=value for every cell; key=a,b sweeps that key instead")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit(f"profile_step.py: --warmup {args.warmup} --steps {args.steps}: both must be at least 1")
    for preset in args.preset:
        for label, overrides in cells(preset, args.overrides):
            rec = profile_cell(overrides, args.out / preset / label, args.warmup, args.steps)
            print(
                f"profile_step.py: {preset} {label}: {rec['device_us_per_step'] / 1e3:.1f} ms of device time per step",
                flush=True,
            )


if __name__ == "__main__":
    main()
