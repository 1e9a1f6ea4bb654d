"""Which rounding points reproduce cuDNN's FP16/BF16 LSTM step: candidate computations in float64
from the same rounded weights, inputs and states, each compared with cuDNN's h and c.

    python scripts/probe_cuda_lstm.py --out results/gpu-arithmetic/lstm.json

The CPU emulation (mpt/precision/cpu_tensor_cores.py) sums the gate products and biases in FP32 and
rounds only h and c. A candidate that is cuDNN's computation matches it on nearly every element, up
to FP32 summation order: the figures are the share of elements equal and the worst distance in ulps
of the dtype.

torch picks cuDNN's algorithm by shape (get_algo in ATen's cudnn/RNN.cpp): an unpacked LSTM without
a projection and with at most 192 hidden units (128 in the backward) runs the persistent small-h
kernel, as GNMT's layers past the first do at gnmt_small's 128 units; an LSTM with a projection
(bigLSTM's) or packed input (GNMT's first layer) runs the standard algorithm; a larger unpacked one
runs the standard algorithm too, except in FP16 with input and hidden sizes divisible by 128 (hidden
at most 1024) and a batch of at most 128 divisible by 8 on most GPUs, which gets the persistent
static kernel (GNMT's layers at full size). On an H100
(results/gpu-h100-loan2) the small-h kernel in BF16 was exactly its gate products each rounded to
BF16 and summed with the biases in FP32, and in FP16 none of the candidates: hence one shape per
algorithm.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from torch import nn

from mpt.files import write_json_atomic
from mpt.precision.oracle import ulp
from mpt.provenance import environment, git_commit, now_iso

ROOT = Path(__file__).resolve().parents[1]


def candidates(x, h0, c0, w_ih, w_hh, b_ih, b_hh, dtype):
    """(name, h1, c1) for each candidate, in float64 (rounding points marked r)."""

    def r(t):
        return t.to(dtype).double()

    gi, gh = x @ w_ih.t(), h0 @ w_hh.t()  # exact: products of FP16/BF16 values summed in float64
    gates = {
        "gate products and biases summed, no rounding (the emulation)": gi + gh + b_ih + b_hh,
        "each gate product rounded, then summed with the biases": r(gi) + r(gh) + b_ih + b_hh,
        "each gate product with its bias rounded, then summed": r(gi + b_ih) + r(gh + b_hh),
        "the input's product with its bias rounded (computed for all steps first)": r(gi + b_ih) + gh + b_hh,
        "the summed gates rounded": r(gi + gh + b_ih + b_hh),
    }
    out = []
    for name, a in gates.items():
        i, f, g, o = a.chunk(4, 1)
        c1 = torch.sigmoid(f) * c0 + torch.sigmoid(i) * torch.tanh(g)
        for tanh_of in ("c before rounding", "c rounded"):
            h1 = torch.sigmoid(o) * torch.tanh(c1 if tanh_of == "c before rounding" else r(c1))
            out.append((f"{name}; h from {tanh_of}", r(h1), r(c1)))
        # Half-precision registers: every activation, product and sum of the cell rounded.
        i, f, g, o = r(a).chunk(4, 1)
        si, sf, tg, so = r(torch.sigmoid(i)), r(torch.sigmoid(f)), r(torch.tanh(g)), r(torch.sigmoid(o))
        c1 = r(r(sf * c0) + r(si * tg))
        out.append((f"{name}; the cell's math in the dtype", r(so * r(torch.tanh(c1))), c1))
    return out


# (input, hidden, batch) -> the algorithm torch's get_algo picks for an unpacked LSTM without a projection.
SHAPES = {
    (40, 24, 5): "persistent small-h (hidden <= 192)",
    (40, 256, 5): "standard",
    (1024, 1024, 128): "GNMT's layers at full size: persistent static in FP16, standard in BF16",
}


def step(dtype, size: int, hidden: int, batch: int, seed: int, cuda: torch.device):
    """cuDNN's h and c after one step, and the float64 inputs the candidates start from."""
    torch.manual_seed(seed)
    lstm = nn.LSTM(size, hidden).to(dtype)
    x, h0, c0 = (torch.randn(1, batch, n).to(dtype) for n in (size, hidden, hidden))
    gpu = lstm.to(cuda)
    with torch.no_grad():
        _, (h, c) = gpu(x.to(cuda), (h0.to(cuda), c0.to(cuda)))
    w = [p.detach().cpu().double() for p in (gpu.weight_ih_l0, gpu.weight_hh_l0, gpu.bias_ih_l0, gpu.bias_hh_l0)]
    return (h[0].cpu().double(), c[0].cpu().double()), (x[0].double(), h0[0].double(), c0[0].double(), *w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    cuda = torch.device("cuda")
    rows = []
    for ((size, hidden, batch), algorithm), dtype in itertools.product(SHAPES.items(), (torch.float16, torch.bfloat16)):
        tally: dict[str, dict] = {}
        for seed in range(args.seeds):
            (h, c), inputs = step(dtype, size, hidden, batch, seed, cuda)
            for name, h1, c1 in candidates(*inputs, dtype):
                t = tally.setdefault(name, {"equal": 0, "elements": 0, "worst_ulps": 0.0, "worst_ulps_of_largest": 0.0})
                for ours, theirs in ((h1, h), (c1, c)):
                    err = (ours - theirs).abs()
                    t["equal"] += int((err == 0).sum())
                    t["elements"] += ours.numel()
                    t["worst_ulps"] = max(t["worst_ulps"], (err / ulp(theirs, dtype)).max().item())
                    # Near zero one ulp is tiny: the error in ulps of the tensor's largest element too.
                    t["worst_ulps_of_largest"] = max(
                        t["worst_ulps_of_largest"], (err.max() / ulp(theirs.abs().max(), dtype)).item()
                    )
        for name, t in tally.items():
            rows.append(
                {"input": size, "hidden": hidden, "batch": batch, "algorithm": algorithm,
                 "dtype": str(dtype).removeprefix("torch."), "candidate": name,
                 "share_equal": t["equal"] / t["elements"], "worst_ulps": t["worst_ulps"],
                 "worst_ulps_of_largest": t["worst_ulps_of_largest"]}
            )  # fmt: skip
    record = {
        "what": __doc__.strip().splitlines()[0],
        "environment": environment(cuda),
        "commit": git_commit(ROOT),
        "finished_at": now_iso(),
        "setting": f"one step of nn.LSTM(input, hidden), seeds 0-{args.seeds - 1}, h and c compared",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, record)
    for r in rows:
        print(
            f"hidden {r['hidden']:4d} batch {r['batch']:3d} {r['dtype']:9s} equal {r['share_equal']:6.1%}"
            f"  worst {r['worst_ulps']:7.2f} ulps ({r['worst_ulps_of_largest']:5.2f} of the largest)  {r['candidate']}"
        )


if __name__ == "__main__":
    main()
