"""A CPU's autocast casts what CUDA's casts: the table against the installed torch's CUDA kernels,
each policy on an op, and one training step of each paper model, whose ops are checked against
CUDA's lists at the level the kernels see them."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpt.precision import cuda_autocast
from mpt.precision.cuda_autocast import POLICIES
from mpt.precision.cuda_autocast import cuda_autocast as cuda_autocast_ctx

from .conftest import build_run

LOW = [torch.float16, torch.bfloat16]


def test_the_table_is_the_installed_torchs_cuda_autocast():
    """Every op the installed torch's CUDA autocast has a kernel for, and no other, has a policy here."""
    cuda = {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
    }
    assert set(POLICIES) == cuda


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_each_policy_casts_as_cudas(dtype):
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(5, 6, requires_grad=True)
    with cuda_autocast_ctx(dtype):
        y = F.linear(x, w)  # lower precision
        assert y.dtype == dtype
        assert (
            torch.softmax(y, 1).dtype == torch.float32
        )  # fp32, through softmax's dtype (CPU's list: the input's dtype)
        assert torch.softmax(y, 1, dtype=torch.float64).dtype == torch.float64  # a dtype the caller set stays
        assert y.sum().dtype == torch.float32 and y.exp().dtype == torch.float32 and y.pow(2).dtype == torch.float32
        assert F.layer_norm(y, (5,)).dtype == torch.float32
        assert y.norm().dtype == torch.float32  # linalg_vector_norm: through its dtype
        aten = torch.ops.aten
        assert (
            aten.norm.Scalar(y).dtype == aten.norm.ScalarOpt_dim(y, 2, [1]).dtype == torch.float32
        )  # the overload that takes a dtype
        assert (
            torch.addcmul(y, y, y).dtype == dtype and torch.addcmul(y, y, y.float()).dtype == torch.float32
        )  # promote
        assert y.long().sum().dtype == torch.int64  # not eligible: untouched
        lstm = nn.LSTM(6, 3)
        out, (h, c) = lstm(x.unsqueeze(1))
        assert out.dtype == h.dtype == c.dtype == torch.float16  # cuDNN's RNNs: FP16 whatever the autocast dtype
        with pytest.raises(RuntimeError, match="binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(y), torch.rand(4, 5))
    (out.float().sum() + torch.softmax(y, 1).sum()).backward()
    assert x.grad.dtype == w.grad.dtype == lstm.weight_ih_l0.grad.dtype == torch.float32  # the casts are differentiable
    with torch.autocast("cpu", dtype=dtype):
        assert torch.softmax(F.linear(x, w), 1).dtype == dtype  # outside, torch's CPU lists are back


def test_ops_only_the_cpu_lists_run_uncast():
    """torch's CPU autocast runs max_pool3d and reflection padding in FP32; CUDA's leaves them in the input's dtype."""
    x = torch.randn(1, 2, 4, 4, 4).bfloat16()
    assert {"max_pool3d", "reflection_pad2d"} <= set(cuda_autocast.cpu_only_ops()) and "max_pool3d" not in POLICIES
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.max_pool3d(x, 2).dtype == F.pad(x[0], (1, 1, 1, 1), mode="reflect").dtype == torch.float32
    with cuda_autocast_ctx(torch.bfloat16):
        assert F.max_pool3d(x, 2).dtype == F.pad(x[0], (1, 1, 1, 1), mode="reflect").dtype == torch.bfloat16


# The aten ops, as a kernel sees them below autograd, that CUDA's autocast runs in FP32: a forward
# under autocast never runs them on FP16 or BF16 inputs. Not _log_softmax: cross_entropy is on no
# CUDA list and asks log_softmax for the logits' own dtype (test below).
FP32_AT_KERNELS = {
    "_softmax", "nll_loss_forward", "nll_loss2d_forward", "exp", "expm1", "log", "log1p", "log2", "log10",
    "pow", "rsqrt", "reciprocal", "sum", "prod", "cumsum", "cumprod", "native_layer_norm", "native_group_norm",
    "mse_loss",
    "smooth_l1_loss", "l1_loss", "huber_loss", "binary_cross_entropy_with_logits", "logsumexp", "linalg_vector_norm",
    "softplus", "kl_div", "erfinv", "acos", "asin", "cosh", "sinh", "tan", "cdist", "renorm",
}  # fmt: skip
PRODUCT_KERNELS = {"convolution", "mm", "addmm", "bmm", "baddbmm"}


class Kernels(TorchDispatchMode):
    """The aten ops run, with the dtypes of their floating inputs."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if (kwargs or {}).get("dtype") == torch.float32:  # a reduction of low-precision values in FP32
            self.seen.add((name, torch.float32))
        else:
            for t in [
                a for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor) and a.is_floating_point()
            ]:
                self.seen.add((name, t.dtype))
        return func(*args, **(kwargs or {}))

    def violations(self) -> set[tuple[str, str]]:
        return {(name, str(dtype)) for name, dtype in self.seen if name in FP32_AT_KERNELS and dtype in LOW}

    def low(self) -> set[str]:
        return {name for name, dtype in self.seen if dtype in LOW}


def attention_step(autocast):
    """GNMT's attention in miniature: a softmax over products, under `autocast`."""
    q, k = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    kernels = Kernels()
    with autocast, kernels:
        torch.bmm(F.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1), k)
    return kernels


def test_the_check_below_finds_torchs_own_cpu_lists_wrong():
    """The per-model check can fail: torch's CPU lists run the softmax in BF16, CUDA's in FP32."""
    assert ("_softmax", "torch.bfloat16") in attention_step(torch.autocast("cpu", dtype=torch.bfloat16)).violations()
    assert attention_step(cuda_autocast_ctx(torch.bfloat16)).violations() == set()


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_cross_entropy_takes_the_log_softmax_in_the_logits_dtype_as_on_cuda(dtype):
    """torch's CPU lists put cross_entropy in FP32; CUDA's do not list it, and cross_entropy asks for
    log_softmax in the logits' dtype, which autocast respects; only nll_loss is cast to FP32."""
    logits, target = torch.randn(4, 10), torch.randint(0, 10, (4,))
    w = torch.randn(10, 10)
    for autocast, log_softmax_dtype in [
        (torch.autocast("cpu", dtype=dtype), torch.float32),
        (cuda_autocast_ctx(dtype), dtype),
    ]:
        kernels = Kernels()
        with autocast, kernels:
            loss = F.cross_entropy(F.linear(logits, w), target)
        assert loss.dtype == torch.float32
        assert ("_log_softmax", log_softmax_dtype) in kernels.seen and ("nll_loss_forward", dtype) not in kernels.seen


MODELS = {
    "alexnet": ["model=alexnet"],
    "resnet50": ["model=resnet50"],
    "ssd": ["model=ssd", "schedule.batch_size=2"],
    "gnmt": ["model=gnmt", "model.hidden_size=16", "model.encoder_layers=3", "model.decoder_layers=3"],
    "biglstm": [
        "model=biglstm_tiny",
        "model.hidden_size=32",
        "model.proj_size=8",
        "model.num_sampled=64",
        "model.bptt=5",
    ],
    "dcgan": [
        "model=dcgan64",
        "model.ngf=4",
        "model.ndf=4",
        "model.sample_grid=4",
        "data.train_samples=16",
        "data.val_samples=8",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("model", list(MODELS))
def test_a_training_step_of_each_model_casts_what_cuda_casts(model, precision, tmp_path, in_process):
    """One step and an evaluation of the model in amp or bf16 on a CPU: the products ran in low
    precision, and no op CUDA's lists run in FP32 saw a low-precision input."""
    run = build_run(tmp_path, *MODELS[model], f"precision={precision}", "schedule=smoke", "schedule.steps=1",
                    "schedule.eval_batches=1", "checkpoint=false", "device=cpu")  # fmt: skip
    kernels = Kernels()
    forward = run.forward_context

    def observed():
        with forward(), kernels:
            yield

    # every forward the run takes: its steps', its evaluations' and its sample grids'
    wrapped = contextlib.contextmanager(observed)
    run.forward_context = run.stepper.forward_context = run.evaluation.forward_context = wrapped
    rec = run.execute()
    assert rec.status == "ok", rec.message
    assert kernels.violations() == set()
    assert kernels.low() & PRODUCT_KERNELS, kernels.low()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_on_a_gpu_cudas_autocast_casts_as_the_table_says(dtype):
    """What the CPU copies, checked on CUDA itself: cuDNN's LSTM in FP16 whatever autocast's dtype
    (read in AutocastRNN.cpp, unconfirmed until a GPU runs this), softmax and sum in FP32, and
    cross_entropy's log_softmax in the logits' dtype."""
    cuda = torch.device("cuda")
    x = torch.randn(4, 6, device=cuda)
    w = torch.randn(10, 6, device=cuda)
    lstm = nn.LSTM(6, 3).to(cuda)
    kernels = Kernels()
    with torch.autocast("cuda", dtype=dtype):
        y = F.linear(x, w)
        assert y.dtype == dtype and torch.softmax(y, 1).dtype == torch.float32 and y.sum().dtype == torch.float32
        out, (h, c) = lstm(x.unsqueeze(1))
        assert out.dtype == h.dtype == c.dtype == torch.float16
        with kernels:
            F.cross_entropy(y, torch.randint(0, 10, (4,), device=cuda))
    assert ("_log_softmax", dtype) in kernels.seen
