"""deterministic=true: torch's deterministic kernels, and which ops ran without one."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Iterator

import torch

# torch's wording when warn_only lets an op without a deterministic kernel run (aten's alertNotDeterministic)
NONDETERMINISTIC = re.compile(r"(\S+) does not have a deterministic implementation")


def enable() -> None:
    # cuBLAS repeats its sums only with a fixed workspace; torch refuses its kernels without one. It is
    # read when cuBLAS starts: a process that has used cuBLAS already keeps its workspace.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # A few CUDA backwards (adaptive average pooling's among them) have no deterministic kernel:
    # warn_only lets them run, and `noting` names them in the record, rather than stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)


@contextlib.contextmanager
def noting(ops: list[str] | None) -> Iterator[None]:
    """Within it, each op torch warns has no deterministic kernel is added to `ops` and shown once;
    other warnings are shown as before. `ops` None: deterministic=false, nothing to note."""
    if ops is None:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=NONDETERMINISTIC.pattern)  # every call reaches `show`
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            found = NONDETERMINISTIC.match(str(message))
            if found is None:
                shown(message, category, filename, lineno, file, line)
            elif found.group(1) not in ops:
                ops.append(found.group(1))
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def reseed_cudnn_dropout(device: torch.device) -> None:
    """cuDNN's RNN dropout draws from a state of its own, cached per device, that no checkpoint
    holds: a resumed run would draw other masks. Setting torch's CUDA generator to its own state
    (CUDAGeneratorImpl::set_state clears its no_reset_rnn_state_ flag) makes the next dropout
    reseed that cache from the generator (get_dropout_state in ATen's cudnn/RNN.cpp), so that each
    step's masks follow from what a checkpoint holds; the reseed reads one number back from the GPU.
    Called before each step of a deterministic CUDA run. Without it bigLSTM's resume (dropout
    between its LSTM layers) differed on an H200 (results/gpu-suite); with it, it was bit for bit on
    an H100 (results/gpu-h100-loan2/suite)."""
    torch.cuda.set_rng_state(torch.cuda.get_rng_state(device), device)
