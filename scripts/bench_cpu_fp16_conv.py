#!/usr/bin/env python3
"""CPU FP16 networks: torch's own kernels against mpt's tensor-core arithmetic (cpu_tensor_cores.py), and FP32.

One forward and backward pass of a model's network on one batch, FP16 weights (or FP32), on the
CPU. Each variant runs `--warmup` untimed passes, then `--passes` timed ones; the figure is the
median seconds per pass. Writes one JSON record per call.

    python scripts/bench_cpu_fp16_conv.py --model ssd --out results/cpu-fp16-conv
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from pathlib import Path

import torch

from mpt.files import write_json_atomic
from mpt.precision.cpu_tensor_cores import TensorCoreArithmetic
from mpt.provenance import environment, git_commit, now_iso

ROOT = Path(__file__).resolve().parents[1]


def build(model: str, image_size: int) -> torch.nn.Module:
    if model == "ssd":
        from mpt.models.detection import SSD300Network, build_ssd300

        detector = build_ssd300(21, None)
        return SSD300Network(detector.backbone, detector.head)
    import torchvision

    return torchvision.models.get_model(model, weights=None, num_classes=1000)


def time_passes(net: torch.nn.Module, x: torch.Tensor, warmup: int, passes: int, emulate: bool) -> list[float]:
    def one():
        with TensorCoreArithmetic() if emulate else contextlib.nullcontext():
            out = net(x)
            sum(o.float().sum() for o in (out if isinstance(out, tuple) else (out,))).backward()

    for _ in range(warmup):
        one()
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ssd")
    ap.add_argument("--image-size", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--native-passes", type=int, default=1, help="timed passes of torch's FP16 kernels (slow)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = build(args.model, args.image_size)
    x = torch.rand(args.batch_size, 3, args.image_size, args.image_size)
    variants = {}
    for name, dtype, emulate, passes in [
        ("fp32", torch.float32, False, args.passes),
        ("fp16_emulated", torch.float16, True, args.passes),
        ("fp16_native", torch.float16, False, args.native_passes),
    ]:
        net = copy.deepcopy(base).to(dtype=dtype, memory_format=torch.channels_last)
        times = time_passes(
            net, x.to(dtype).contiguous(memory_format=torch.channels_last), args.warmup, passes, emulate
        )
        variants[name] = {"seconds_per_pass": statistics.median(times), "passes": times}
        print(f"{name}: {statistics.median(times):.3f} s per forward+backward pass (median of {passes})", flush=True)
    record = {
        "kind": "cpu_fp16_conv",
        "model": args.model,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "memory_format": "channels_last",
        "warmup_passes": args.warmup,
        "unit": "seconds per forward+backward pass, median of the timed passes",
        "variants": variants,
        "speedup_emulated_over_native": variants["fp16_native"]["seconds_per_pass"]
        / variants["fp16_emulated"]["seconds_per_pass"],
        "environment": environment(torch.device("cpu")),
        "git": git_commit(ROOT),
        "finished_at": now_iso(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.model}_b{args.batch_size}_{args.image_size}px.json"
    write_json_atomic(path, record)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
