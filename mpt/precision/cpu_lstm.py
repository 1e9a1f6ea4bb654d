"""LSTMs in FP16 or BF16 on a CPU, on any x86-64 machine torch supports.

Two of torch's CPU paths fail on some machines:
- Under CPU autocast, `lstm` is not on autocast's list but its oneDNN kernel (`mkldnn_rnn_layer`)
  is, so an FP32 LSTM under autocast asks oneDNN for an LSTM in the autocast dtype whether or not
  oneDNN has one: none in FP16 anywhere, none in BF16 on a CPU without AVX-512 ("could not create
  a primitive descriptor for the LSTM forward propagation primitive").
- With FP16 or BF16 tensors torch chooses oneDNN where its device check passes, and a check is not
  a kernel.

So an LSTM that computes in FP16 or BF16 on a CPU applies CUDA autocast's rule by hand (`lstm` is
on CUDA's lower-precision list: input, states and weights cast to the dtype; the casts are
differentiable, so FP32 weights get their gradients) and lets torch choose its kernel for tensors
of that dtype, unless a probe of that choice (forward and backward, once per process and dtype)
failed: then it runs torch's own kernel, matmuls in the dtype, with oneDNN switched off for the
call. The record says which kernels ran (`describe`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.nn.utils.stateless import _reparametrize_module  # functional_call's own, without the module's hooks
from torch.utils._python_dispatch import TorchDispatchMode

LOW = (torch.float16, torch.bfloat16)


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _try_onednn(dtype: torch.dtype) -> tuple[dict[str, bool], str | None]:
    """Whether torch's choice for an LSTM of this dtype is oneDNN's kernel, with and without
    gradients, and the error it raised if it could not run."""
    used = {}
    try:
        # fork_rng: the probe's random weights and inputs must not move the run's random stream
        with torch.random.fork_rng(devices=[]), torch.autocast("cpu", enabled=False):
            lstm = nn.LSTM(8, 8, batch_first=True, bidirectional=True).to(dtype)
            x = torch.randn(2, 3, 8, dtype=dtype, requires_grad=True)
            for training in (True, False):
                seen = _SeenOps()
                with torch.set_grad_enabled(training), seen:
                    out, _ = lstm(x)
                    if training:
                        out.float().sum().backward()
                used["training" if training else "evaluation"] = "mkldnn_rnn_layer" in seen.names
    except RuntimeError as e:
        return {"training": False, "evaluation": False}, str(e).strip().splitlines()[0]
    return used, None


@functools.lru_cache(maxsize=None)
def kernels(dtype: torch.dtype) -> dict:
    """The kernel an LSTM of `dtype` runs on this CPU in training and in evaluation."""
    used, error = _try_onednn(dtype)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "training": "onednn" if used["training"] else "native",
        "evaluation": "onednn" if used["evaluation"] else "native",
        "onednn_error": error,  # set: oneDNN failed the probe, so every call runs the native kernel
    }


@contextlib.contextmanager
def _onednn_off() -> Iterator[None]:
    # torch.backends.mkldnn.flags() would also reset the deterministic flag; this touches one switch.
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def _compute_dtype(input) -> torch.dtype | None:
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in LOW:
        return torch.get_autocast_dtype("cpu")
    data = input.data if isinstance(input, PackedSequence) else input
    return data.dtype if data.dtype in LOW else None


# The kernels low-precision CPU LSTMs ran, by phase, since the last reset (a run's, for its record).
_used: dict[str, set[str]] = {"training": set(), "evaluation": set()}
# Which kernel torch chose, by the kind of call: seen once, on the first call of its kind. torch's
# choice depends on more than the dtype (projections never go to oneDNN; a packed sequence does
# when unidirectional), so it is observed rather than predicted.
_chosen: dict[tuple, str] = {}


def reset_usage() -> None:
    for kinds in _used.values():
        kinds.clear()


class CpuLowPrecisionLSTM(nn.LSTM):
    def forward(self, input, hx=None):
        dtype = _compute_dtype(input)
        if dtype is None:
            return super().forward(input, hx)
        native = kernels(dtype)["onednn_error"] is not None
        phase = "training" if torch.is_grad_enabled() else "evaluation"
        packed = isinstance(input, PackedSequence)
        kind = (dtype, phase, packed, self.bidirectional, self.proj_size, native or not torch._C._get_mkldnn_enabled())
        with torch.autocast("cpu", enabled=False), _onednn_off() if native else contextlib.nullcontext():
            input = input._replace(data=input.data.to(dtype)) if packed else input.to(dtype)
            hx = None if hx is None else tuple(h.to(dtype) for h in hx)
            seen = _SeenOps() if kind not in _chosen else contextlib.nullcontext()
            with seen:
                if all(p.dtype == dtype for p in self.parameters()):
                    out = super().forward(input, hx)
                else:  # the weights cast for this call only, without re-entering the module (its hooks ran once)
                    with _reparametrize_module(self, {name: p.to(dtype) for name, p in self.named_parameters()}):
                        out = super().forward(input, hx)
        if kind not in _chosen:
            _chosen[kind] = "onednn" if "mkldnn_rnn_layer" in seen.names else "native"
        _used[phase].add(_chosen[kind])
        return out


def low_precision_lstms(model: nn.Module, dtype: torch.dtype) -> None:
    """Every nn.LSTM of a CPU model that computes in `dtype` (FP16 or BF16) takes the path above."""
    for module in model.modules():
        if type(module) is nn.LSTM:
            module.__class__ = CpuLowPrecisionLSTM
            module.low_precision_dtype = dtype


def describe(models: list[nn.Module]) -> dict | None:
    """For the record: the kernels the models' low-precision CPU LSTMs ran since reset_usage(), by
    phase, and the probe's error if oneDNN failed it; None if the models have no such LSTM."""
    dtypes = {m.low_precision_dtype for model in models for m in model.modules() if isinstance(m, CpuLowPrecisionLSTM)}
    if not dtypes:
        return None
    (dtype,) = dtypes  # one mode, one dtype
    probe = kernels(dtype)
    return {"dtype": probe["dtype"], "training": sorted(_used["training"]), "evaluation": sorted(_used["evaluation"]), "onednn_error": probe["onednn_error"]}
