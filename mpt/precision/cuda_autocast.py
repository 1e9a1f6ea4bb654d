"""CUDA's autocast, on a CPU: torch's CPU autocast with CUDA's lists instead of its own.

torch's CPU autocast casts a different set of ops than CUDA's. It leaves softmax, log_softmax,
sum, exp, pow and layer_norm in the low dtype where CUDA runs them in FP32, and it lists oneDNN's
LSTM where CUDA lists cuDNN's. A CPU `amp` run would then not be the GPU's `amp` run. Inside
`cuda_autocast`, every op on CUDA's lists gets CUDA's cast policy (aten/src/ATen/autocast_mode.h,
and autocast's wrapper of cuDNN's RNNs in aten/src/ATen/cudnn/AutocastRNN.cpp), and every op only
the CPU lists runs uncast, as on CUDA. The kernels are registered at the AutocastCPU key for the
context's duration (torch.library), so the casts are differentiable, as CUDA's are.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

# CUDA's lists, by policy (torch 2.x; the AutocastCUDA kernels of the installed torch are checked
# against them in the tests). Names are aten's, with the overload where CUDA registers one.
LOWER_PRECISION = frozenset(
    """_convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input convolution cudnn_convolution
    cudnn_convolution_transpose prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear
    addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell
    lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
    scaled_dot_product_attention""".split()
)
FP32 = frozenset(
    """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
    pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm group_norm
    rms_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss
    cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
    huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
    logsumexp linalg_matrix_sqrth upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
    _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
    upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
    _upsample_bicubic2d_aa""".split()
)
# FP32 through the op's own dtype argument, unless the caller set one
FP32_SET_OPT_DTYPE = frozenset(
    """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
    linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList""".split()
)
# FP32 through the overload that takes a dtype
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# the widest floating dtype among the arguments
PROMOTE = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()
)
BANNED = frozenset({"binary_cross_entropy"})
# cuDNN's RNNs: CUDA's wrapper casts input, states and weights to FP16 whatever autocast's dtype.
# A CPU has no _cudnn_rnn; its stand-ins are the RNN ops that reach it on CUDA.
CUDNN_RNN = frozenset({"_cudnn_rnn"})
CPU_RNNS = (
    "lstm.input",
    "lstm.data",
    "gru.input",
    "gru.data",
    "rnn_tanh.input",
    "rnn_tanh.data",
    "rnn_relu.input",
    "rnn_relu.data",
)

POLICIES = {
    **{op: "lower_precision_fp" for op in LOWER_PRECISION},
    **{op: "fp32" for op in FP32},
    **{op: "fp32_set_opt_dtype" for op in FP32_SET_OPT_DTYPE},
    **{op: "fp32_append_dtype" for op in FP32_APPEND_DTYPE},
    **{op: "promote" for op in PROMOTE},
    **{op: "banned" for op in BANNED},
    **{op: "cudnn_rnn" for op in CUDNN_RNN},
}

_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(tree, dtype: torch.dtype):
    return tree_map(lambda t: t.to(dtype) if _eligible(t) else t, tree)


def _kernel(name: str, policy: str):
    op = _overload(name)

    def call(args, kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return op(*args, **kwargs)

    # The policies that cast every eligible argument to one dtype, and how each picks it.
    cast_to = {
        "lower_precision_fp": lambda args: torch.get_autocast_dtype("cpu"),
        "fp32": lambda args: torch.float32,
        # the widest: FP32 if any eligible argument is FP32, else the low dtype
        "promote": lambda args: (
            torch.float32
            if any(_eligible(t) and t.dtype == torch.float32 for t in tree_flatten(args)[0])
            else torch.get_autocast_dtype("cpu")
        ),
    }.get(policy)
    if cast_to is not None:

        def cast_all(keyset, *a, **k):
            return call(*_cast((a, k), cast_to((a, k))))

        return cast_all
    if policy == "fp32_set_opt_dtype":
        where = [arg.name for arg in op._schema.arguments].index("dtype")

        def set_dtype(keyset, *a, **k):
            if not _eligible(a[0]):  # as CUDA's: an ineligible input keeps torch's own promotion
                return call(a, k)
            if where < len(a):
                a = (*a[:where], torch.float32 if a[where] is None else a[where], *a[where + 1 :])
            elif k.get("dtype") is None:
                k = {**k, "dtype": torch.float32}
            return call(a, k)

        return set_dtype
    if policy == "fp32_append_dtype":
        target = _overload(FP32_APPEND_DTYPE[name])
        defaults = [arg.default_value for arg in op._schema.arguments]

        def append_dtype(keyset, *a, **k):
            full = [*a, *(k.get(arg.name, d) for arg, d in zip(op._schema.arguments[len(a) :], defaults[len(a) :]))]
            with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
                return target(*full, dtype=torch.float32 if _eligible(a[0]) else a[0].dtype)

        return append_dtype
    if policy == "banned":

        def banned(keyset, *a, **k):
            raise RuntimeError(
                f"torch.nn.functional.{name} and torch.nn.BCELoss are unsafe to autocast "
                "(CUDA's autocast refuses them); use binary_cross_entropy_with_logits or nn.BCEWithLogitsLoss"
            )

        return banned
    raise ValueError(f"unknown autocast policy {policy!r}")


def _rnn_kernel(name: str):
    op = _overload(name)
    packed = name.endswith(".data")

    def kernel(keyset, *a):
        params = a[3 if packed else 2]
        if _eligible(params[0]) and params[0].dtype != torch.float16:
            params = [p.to(torch.float16) for p in params]
        hx = _cast(a[2 if packed else 1], torch.float16)
        rest = (a[0] if not _eligible(a[0]) else a[0].to(torch.float16),)
        rest += (a[1], hx, params) if packed else (hx, params)
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return op(*rest, *a[len(rest) :])

    return kernel


@functools.lru_cache(maxsize=None)
def cpu_only_ops() -> tuple[str, ...]:
    """The ops torch's CPU autocast casts and CUDA's does not (read once, before any override)."""
    ops = []
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(full, "AutocastCPU"):
            name = full.removeprefix("aten::")
            if not torch._C._dispatch_has_kernel_for_dispatch_key(full, "AutocastCUDA") and name not in CPU_RNNS:
                ops.append(name)
    return tuple(sorted(ops))


def _register() -> torch.library.Library:
    skip = cpu_only_ops()  # read before the first override
    lib = torch.library.Library("aten", "IMPL")
    for name, policy in POLICIES.items():
        if policy != "cudnn_rnn":
            lib.impl(name, _kernel(name, policy), "AutocastCPU", with_keyset=True)
    for name in CPU_RNNS:
        lib.impl(name, _rnn_kernel(name), "AutocastCPU", with_keyset=True)
    for name in skip:
        lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    return lib


_lib: torch.library.Library | None = None
_depth = 0


@contextlib.contextmanager
def cuda_lists() -> Iterator[None]:
    """While inside, torch's CPU autocast casts what CUDA's casts, as CUDA casts it. Registering
    takes milliseconds, so a run holds this for its duration and each forward's `cuda_autocast`
    finds it in place; nested entries share one registration."""
    global _lib, _depth
    if _depth == 0:
        _lib = _register()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            assert _lib is not None  # registered when the depth left 0
            _lib._destroy()
            _lib = None


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """torch.autocast on a CPU, casting what CUDA's autocast casts, as CUDA casts it."""
    with cuda_lists(), torch.autocast("cpu", dtype=dtype):
        yield
