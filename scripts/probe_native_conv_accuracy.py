#!/usr/bin/env python3
"""How far torch's own FP16 and BF16 CPU convolution is from one rounding of an exact sum, forward
and backward, beside the tensor-core emulation: each output and gradient's worst error against a
float64 evaluation of the same rounded inputs, in units of the tests' bound (one ulp of the dtype
plus the FP32 accumulation term; mpt/precision/oracle.py). 1.0 or less is within it.

    python scripts/probe_native_conv_accuracy.py --out results/cpu-fp16-conv
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from mpt.files import write_json_atomic
from mpt.precision.cpu_tensor_cores import TensorCoreArithmetic
from mpt.precision.oracle import against_float64, bound_fraction
from mpt.provenance import environment, git_commit, now_iso

ROOT = Path(__file__).resolve().parents[1]

SHAPES = [(2, 6, 7, 7), (4, 6, 3, 3), (4,)]  # input, weight, bias; padding 1


def worst_errors(dtype: torch.dtype, emulate: bool, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    fn = lambda x, w, b: F.conv2d(x, w, b, padding=1)  # noqa: E731
    e = against_float64(
        fn, [torch.randn(*s) for s in SHAPES], dtype, TensorCoreArithmetic() if emulate else contextlib.nullcontext()
    )
    result = {"forward": bound_fraction(e.out, e.ref, e.bound, dtype)}
    for name, a, b, m in zip(["input", "weight", "bias"], e.low, e.exact, e.size):
        result[f"gradient of {name}"] = bound_fraction(a.grad, b.grad, m.grad, dtype)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for kernel in ("native", "emulated"):
            per_seed = [worst_errors(dtype, kernel == "emulated", seed) for seed in range(args.seeds)]
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "kernel": kernel,
                **{k: max(r[k] for r in per_seed) for k in per_seed[0]},
            }
            rows.append(row)
            print(row, flush=True)
    record = {
        "probe": "native_conv_accuracy",
        "what": (
            "worst error over seeds, in units of one ulp plus the FP32 accumulation term,"
            " against float64 on the same rounded inputs"
        ),
        "conv2d": {"input": SHAPES[0], "weight": SHAPES[1], "bias": SHAPES[2], "padding": 1},
        "seeds": args.seeds,
        "rows": rows,
        "environment": environment(torch.device("cpu")),
        "commit": git_commit(ROOT),
        "finished_at": now_iso(),
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.out / "native_conv_accuracy.json", record)


if __name__ == "__main__":
    main()
