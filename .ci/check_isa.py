"""Checks that each CPU library torch dispatches through runs on AVX2 in this environment: ATen's own
kernels (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA) and MKL (MKL_ENABLE_INSTRUCTIONS). One
line each; exit 1 naming any that did not take effect.

.ci/run runs the numerics tests a second time under these variables, as a CPU of another vendor
would. A library that ignored its variable would fail nothing: the tests would pass on this CPU's
own instruction set and the step would claim a run it never made. Each library is asked what it
dispatched, in a child process, since the variables are read once, when the library loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys

PROBE = """
import torch
print("aten:", torch.backends.cpu.get_cpu_capability(), flush=True)
a = torch.randn(64, 64)
a @ a  # an FP32 GEMM: MKL's sgemm
torch.nn.functional.conv2d(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))  # a batch of 2 takes torch's oneDNN path
"""


def intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read()
    except OSError:
        return False


def main() -> int:
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
    child = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    out = child.stdout + child.stderr
    if child.returncode != 0:
        print(f"check_isa: the probe failed:\n{out[-3000:]}", file=sys.stderr)
        return 1
    aten = re.search(r"^aten: (\S+)$", out, re.M)
    onednn = re.search(r"^onednn_verbose,.*,cpu,isa:(.*)$", out, re.M)
    mkl = re.search(r"^MKL_VERBOSE oneMKL .*? architecture (.*?)(?:, Lnx|, Win|, Mac|$)", out, re.M)
    # What each prints when it runs AVX2 and nothing wider (oneDNN's "with Intel DL Boost" is AVX2-VNNI).
    checks = [
        ("ATEN_CPU_CAPABILITY", "ATen kernels", aten, lambda s: s == "AVX2"),
        ("ONEDNN_MAX_CPU_ISA", "oneDNN", onednn, lambda s: s == "Intel AVX2"),
        ("MKL_ENABLE_INSTRUCTIONS", "MKL", mkl, lambda s: "(Intel(R) AVX2)" in s and "512" not in s),
    ]
    failed = False
    for var, lib, found, is_avx2 in checks:
        said = found.group(1).strip() if found else None
        if lib == "MKL" and said == "Intel(R) Architecture processors" and not intel_cpu():
            # On another vendor's CPU MKL skips the Intel dispatch its variable caps and runs a path that names
            # no instruction set; there is nothing to check, so the line says so and does not fail the run.
            print(
                f"unverifiable: {var}={os.environ.get(var, '(unset)')}: MKL names no instruction set "
                f"on a non-Intel CPU (its Intel dispatch, which the variable caps, does not run)",
                flush=True,
            )
            continue
        ok = said is not None and is_avx2(said)
        failed |= not ok
        setting = f"{var}={os.environ.get(var, '(unset)')}"
        print(f"{'ok' if ok else 'NOT AVX2'}: {setting}: {lib} dispatch {said or 'not reported'}", flush=True)
    if failed:
        print("check_isa: a library is not capped at AVX2; its variable was ignored or misspelled", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
