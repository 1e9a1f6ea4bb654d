"""ResNet-50 throughput side by side with NVIDIA DeepLearningExamples (DLE), on one GPU, in one call.

    python scripts/peer_resnet50.py --peer PATH/TO/DeepLearningExamples/PyTorch/Classification/ConvNets \
        --out results/gpu-peer [--batch 256] [--steps 120] [--warmup 20]

For each of AMP and TF32 it runs DLE's own `main.py` (its synthetic data backend, its
benchmark_training_short settings: --training-only --no-checkpoints --print-freq 1, and its
DGXA100 recipe: batch 256, AMP with loss scale 128 and NHWC, TF32 in NCHW), then ours
(`model=resnet50 schedule=bench`, the same batch and steps, `scale=dynamic` as DLE's GradScaler is),
and writes `comparison.json`: both throughputs, under one definition, and their ratio.

Both figures are images/s in steady state, the first `warmup` steps excluded, median; how each
side times a step differs, and both differences favour DLE. DLE times every iteration from the end
of its previous one (it reads the loss each step, a host sync) and logs it as train.total_ips, so
its own logging between iterations is outside the timing; we time windows of steps synchronized at
their edges, with everything in them (mpt/runner/instruments/throughput.py). And each side runs its own best
layout: DLE's TF32 recipe is NCHW, ours uses channels-last on CUDA. DLE's epoch figure (its mean
over all iterations, warm-up included) is kept beside it.

The peer's code is run from its own checkout, never copied here. It needs pynvml (the pip package
nvidia-ml-py) and a GPU driver: it initializes NVML even with --gpu-affinity none. Two things make it
start on a machine without network: dllogger (its one pip dependency outside torch, pure Python) is put on
PYTHONPATH with --pythonpath, and DLE's dataloaders.py, which subclasses DALI's `Pipeline` at
import time even when DALI is absent (a NameError), gets a placeholder name in builtins: DALI's
wheel does not fit the device's carry limit, and the synthetic backend never touches it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from mpt.runner.record import RunRecord

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {  # DLE's configs.yml, resnet50 on DGXA100
    "amp": ["--amp", "--static-loss-scale", "128", "--memory-format", "nhwc"],
    "tf32": ["--memory-format", "nchw"],
}
LAUNCH_PEER = (
    "import builtins, runpy, sys; builtins.Pipeline = object; sys.argv = ['main.py', *sys.argv[1:]];"
    " runpy.run_path('main.py', run_name='__main__')"
)


def run(name: str, cmd: list[str], cwd: Path, env: dict, log: Path) -> None:
    with log.open("w") as f:
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"peer_resnet50: {name} failed with exit {r.returncode}; see {log}")


def dle_ips(raport: Path, warmup: int) -> dict:
    """Per-iteration train.total_ips from DLE's dllogger JSON stream ("DLLL {...}" lines)."""
    per_step, epoch = [], None
    for line in raport.read_text().splitlines():
        if not line.startswith("DLLL "):
            continue
        entry = json.loads(line[5:])
        value = (entry.get("data") or {}).get("train.total_ips")
        if value is None:
            continue
        if isinstance(entry.get("step"), list) and len(entry["step"]) == 2:
            per_step.append(float(value))
        elif isinstance(entry.get("step"), list) and len(entry["step"]) == 1:
            epoch = float(value)
    steady = per_step[warmup:]
    if not steady:
        raise SystemExit(
            f"peer_resnet50: {raport} has {len(per_step)} per-iteration figures, none after {warmup} warm-up steps"
        )
    return {"images_per_s": statistics.median(steady), "steps_timed": len(steady), "dle_epoch_mean_ips": epoch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", type=Path, required=True, help="DLE's PyTorch/Classification/ConvNets folder")
    ap.add_argument("--peer-commit", default=None, help="the DLE commit the folder was exported from (recorded)")
    ap.add_argument("--pythonpath", default="", help="extra PYTHONPATH for the peer (dllogger)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument(
        "--modes",
        default=",".join(RECIPES),
        help=f"which of {', '.join(RECIPES)} to run, comma-separated (a short GPU loan may fit one)",
    )
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or set(modes) - set(RECIPES):
        raise SystemExit(
            f"peer_resnet50: --modes {args.modes}: expected a comma-separated subset of {', '.join(RECIPES)}"
        )
    if not (args.peer / "main.py").is_file():
        raise SystemExit(
            f"peer_resnet50: --peer {args.peer}: no main.py there (expected DLE's PyTorch/Classification/ConvNets)"
        )
    if importlib.util.find_spec("pynvml") is None:
        raise SystemExit(
            "peer_resnet50: DLE's main.py imports pynvml, which is not installed"
            " (pip install nvidia-ml-py, or carry its wheel)"
        )
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    extra = [str(Path(p).resolve()) for p in args.pythonpath.split(os.pathsep) if p]  # the peer runs in its own folder
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*extra, *filter(None, [os.environ.get("PYTHONPATH")])])}

    import torch

    comparison = {
        "batch_size": args.batch,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "definition": "images/s per training step, steady state (warm-up steps excluded), median; one GPU",
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "peer": {
            "repo": "NVIDIA/DeepLearningExamples",
            "path": "PyTorch/Classification/ConvNets",
            "commit": args.peer_commit,
        },
        "modes": {},
    }
    for mode in modes:
        recipe = RECIPES[mode]
        raport = out / f"dle_{mode}.json"
        run(
            f"DLE main.py ({mode})",
            [
                sys.executable,
                "-c",
                LAUNCH_PEER,
                "--arch",
                "resnet50",
                "--data-backend",
                "synthetic",
                "-b",
                str(args.batch),
                "--epochs",
                "1",
                "--prof",
                str(args.steps),
                "--training-only",
                "--no-checkpoints",
                "--print-freq",
                "1",
                "--workspace",
                str(out / f"dle_{mode}_workspace"),
                "--raport-file",
                str(raport),
                *recipe,
                str(out / "no-data"),
            ],
            cwd=args.peer,
            env=env,
            log=out / f"dle_{mode}.log",
        )
        peer = dle_ips(raport, args.warmup)
        ours_dir = out / f"mpt_{mode}"
        run(
            f"mpt-run ({mode})",
            [
                sys.executable,
                "-m",
                "mpt.runner.cli",
                "model=resnet50",
                "schedule=bench",
                f"precision={mode}",
                f"scale={'dynamic' if mode == 'amp' else 'none'}",
                f"schedule.batch_size={args.batch}",
                f"schedule.steps={args.steps}",
                f"schedule.throughput_warmup={args.warmup}",
                "checkpoint=false",
                "force=true",
                f"hydra.run.dir={ours_dir}",
            ],
            cwd=ROOT,
            env=env,
            log=out / f"mpt_{mode}.log",
        )
        rec = RunRecord.load(ours_dir / "result.json")
        ours = (rec.throughput or {}).get("pipeline")  # none for a run that failed before measuring
        comparison["modes"][mode] = {
            "dle": {**peer, "args": recipe},
            "mpt": {"images_per_s": ours, "record": f"mpt_{mode}/result.json", "git": rec.git, "status": rec.status},
            "ratio_mpt_over_dle": ours / peer["images_per_s"] if ours else None,
        }
        # After each mode: a later failure keeps what was measured.
        (out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
        print(f"{mode}: DLE {peer['images_per_s']:.1f} images/s, mpt {ours} images/s ({rec.status})", flush=True)


if __name__ == "__main__":
    main()
