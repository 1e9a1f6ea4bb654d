"""How far CUDA's FP16/BF16 products (cuBLAS, cuDNN) are from one rounding of their exact sum, beside
the CPU emulation's (mpt/precision/cpu_tensor_cores.py), forward and every gradient.

    python scripts/probe_cuda_arithmetic.py --out results/gpu-arithmetic/arithmetic.json

Each figure is the worst element's error against float64 on the same rounded inputs, as a fraction
of the bound the CPU tests use: one ulp of the dtype plus what FP32 accumulation may add
(mpt/precision/oracle.py). 1.0 or less: one rounding of an FP32 sum. Measured under
torch's defaults, then with cuBLAS's reduced-precision split-K reductions off, then with cuDNN
restricted to deterministic algorithms (which excludes some Winograd and FFT kernels).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from mpt.files import write_json_atomic
from mpt.precision.cpu_tensor_cores import TensorCoreArithmetic
from mpt.precision.oracle import against_float64, bound_fraction, randn
from mpt.provenance import environment, git_commit, now_iso

ROOT = Path(__file__).resolve().parents[1]

OPS = {
    "mm": (torch.mm, [(64, 256), (256, 48)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b), [(64, 48), (64, 256), (256, 48)]),
    "bmm": (torch.bmm, [(4, 32, 200), (4, 200, 24)]),
    "linear": (F.linear, [(3, 16, 250), (40, 250), (40,)]),
    "conv2d 3x3 stride 2": (
        lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
        [(4, 16, 15, 13), (32, 16, 3, 3), (32,)],
    ),
    "conv2d 3x3": (lambda x, w: F.conv2d(x, w, padding=1), [(4, 16, 14, 14), (32, 16, 3, 3)]),
    "conv2d 1x1 channels-last": (
        lambda x, w: F.conv2d(x.contiguous(memory_format=torch.channels_last), w),
        [(4, 64, 8, 8), (48, 64, 1, 1)],
    ),
    "conv_transpose2d 4x4 stride 2": (
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1),
        [(2, 24, 7, 7), (24, 16, 4, 4), (16,)],
    ),
}
SETTINGS = {
    "torch defaults": {},
    "reduced-precision reductions off": {"reduced": False},
    "reduced-precision reductions off, cuDNN deterministic": {"reduced": False, "deterministic": True},
}


@contextlib.contextmanager
def settings(reduced: bool = True, deterministic: bool = False):
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (
        m.allow_fp16_reduced_precision_reduction,
        m.allow_bf16_reduced_precision_reduction,
        c.deterministic,
        c.benchmark,
    )
    m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = reduced
    c.deterministic, c.benchmark = deterministic, False
    try:
        yield
    finally:
        (
            m.allow_fp16_reduced_precision_reduction,
            m.allow_bf16_reduced_precision_reduction,
            c.deterministic,
            c.benchmark,
        ) = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cuda = torch.device("cuda")
    rows = []
    for name, (fn, shapes) in OPS.items():
        for dtype in (torch.float16, torch.bfloat16):
            torch.manual_seed(0)
            e = against_float64(fn, [randn(*s) for s in shapes], dtype, TensorCoreArithmetic())
            parts = ["forward", *(f"gradient of input {i}" for i in range(len(shapes)))]
            cpu = [e.out, *(x.grad for x in e.low)]
            exact = [e.ref, *(x.grad for x in e.exact)]
            size = [e.bound, *(x.grad for x in e.size)]
            for setting, kw in SETTINGS.items():
                with settings(**kw):
                    xs = [x.detach().to(cuda).requires_grad_() for x in e.low]
                    out = fn(*xs)
                    out.backward(e.grad.to(cuda))
                    gpu = [out.detach().cpu(), *(x.grad.cpu() for x in xs)]
                for part, c, g, r, m in zip(parts, cpu, gpu, exact, size):
                    rows.append({
                        "op": name, "dtype": str(dtype).removeprefix("torch."), "setting": setting, "part": part,
                        "cuda_over_bound": bound_fraction(g, r, m, dtype),
                        "cpu_emulation_over_bound": bound_fraction(c, r, m, dtype),
                    })  # fmt: skip
    record = {
        "what": __doc__.strip().splitlines()[0],
        "unit": "worst element's |result - float64| / (one ulp + FP32 accumulation bound)",
        "environment": environment(cuda),
        "commit": git_commit(ROOT),
        "finished_at": now_iso(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, record)
    for r in rows:
        print(
            f"{r['op']:32s} {r['dtype']:8s} {r['setting']:55s} {r['part']:20s}"
            f" cuda {r['cuda_over_bound']:7.3f} cpu {r['cpu_emulation_over_bound']:6.3f}"
        )


if __name__ == "__main__":
    main()
