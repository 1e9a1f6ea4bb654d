"""The precision engine: every precision decision of a run, in one place.

It decides which dtype the weights live in, whether an FP32 master copy exists, the autocast
context, when gradients are unscaled, the overflow check, the skip and the copy back. The training
loop calls `backward(loss)` and `step()` and knows nothing else. The engine is built from the
fields of the precision config (param_dtype, master_weights, norm_fp32, autocast, update, tf32),
never from the mode's name, so a new mode is a new YAML file.

The FP8 and MX modes quantize the operands of the network's matrix products
(quantized_products.py) and are otherwise `bf16`: their weights are FP32 and are the master copy.

The modes (configs/precision/*.yaml) map onto two update paths:
- the optimizer on FP32 tensors (`fp32`, `tf32`, `amp`, `bf16`: the weights themselves; `mixed`:
  the master copy, which is then cast back to the FP16 weights). Gradients are unscaled in place,
  in FP32, before clipping, weight decay and the update;
- an FP16 update of FP16 weights (`fp16`, `fp16_modmom`): gradients stay scaled in FP16 memory and
  the scale is divided out inside the update's FP32 arithmetic (see optim.FP16MomentumSGD).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, cast

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils._pytree import tree_map

from ..config import ConfigError, DType, Update
from . import quantized_model
from .cpu_tensor_cores import TensorCoreArithmetic
from .cuda_autocast import cuda_autocast, cuda_lists
from .lookahead import Lookahead
from .lost_updates import LostUpdates
from .optim import FP16MomentumSGD, build_lr_schedule, build_torch_optimizer, effective_lr, param_groups
from .resident_scale import ResidentScale, by_dtype, resolve
from .scaler import LossScaler

TORCH_DTYPES = {DType.float32: torch.float32, DType.float16: torch.float16, DType.bfloat16: torch.bfloat16}


def validate(cfg: DictConfig) -> None:
    """Raises ConfigError naming the first bad combination of `precision` with the optimizer."""
    if cfg.optim.implementation != "default" and Update(cfg.precision.update_rule) != Update.optimizer:
        raise ConfigError(
            f"optim.implementation={cfg.optim.implementation}: precision={cfg.precision.name} updates FP16 weights "
            "with this project's own FP16 update, not torch's optimizers; leave it at default"
        )
    p = cfg.precision
    if p.master_weights and p.param_dtype == DType.float32:
        raise ConfigError(f"precision {p.name}: master_weights needs param_dtype float16 or bfloat16, got float32")
    if p.update_rule != Update.optimizer and (p.param_dtype != DType.float16 or p.master_weights):
        raise ConfigError(
            f"precision {p.name}: update_rule={p.update_rule.name} updates FP16 weights in place; "
            "needs param_dtype=float16 and no master weights"
        )
    if p.update_rule != Update.optimizer and cfg.optim.name != "sgd":
        raise ConfigError(
            f"precision {p.name}: its FP16 update is momentum SGD and cannot run optim.name={cfg.optim.name}; "
            "use optim.name=sgd, or precision=mixed"
        )
    if p.autocast is not None and p.param_dtype != DType.float32:
        raise ConfigError(f"precision {p.name}: autocast works on FP32 weights; got param_dtype={p.param_dtype.name}")


def torch_dtype(d: DType | str) -> torch.dtype:
    return TORCH_DTYPES[DType(d) if isinstance(d, str) else d]


def set_fp32_math(tf32: bool) -> dict:
    """Switch TF32 for FP32 matmuls and convolutions on or off, and report the resulting flags."""
    mode = "tf32" if tf32 else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = mode
        # The ignores: torch >= 2.9's per-backend precision is absent from its stubs.
        torch.backends.cudnn.conv.fp32_precision = mode  # type: ignore[attr-defined]
        torch.backends.cudnn.rnn.fp32_precision = mode  # type: ignore[attr-defined]
        return {
            "matmul": torch.backends.cuda.matmul.fp32_precision,
            "cudnn_conv": torch.backends.cudnn.conv.fp32_precision,  # type: ignore[attr-defined]
            "cudnn_rnn": torch.backends.cudnn.rnn.fp32_precision,  # type: ignore[attr-defined]
        }
    torch.backends.cuda.matmul.allow_tf32 = tf32  # torch < 2.9
    torch.backends.cudnn.allow_tf32 = tf32
    return {"matmul": mode, "cudnn_conv": mode, "cudnn_rnn": mode}


@contextlib.contextmanager
def fp32_math(tf32: bool) -> Iterator[None]:
    """set_fp32_math(tf32) inside, the caller's flags again after."""
    new_api = hasattr(torch.backends.cuda.matmul, "fp32_precision")
    flags = (
        [
            (torch.backends.cuda.matmul, "fp32_precision"),
            (torch.backends.cudnn.conv, "fp32_precision"),  # type: ignore[attr-defined]
            (torch.backends.cudnn.rnn, "fp32_precision"),
        ]
        if new_api
        else [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]
    )
    saved = [getattr(obj, name) for obj, name in flags]
    set_fp32_math(tf32)
    try:
        yield
    finally:
        for (obj, name), value in zip(flags, saved):
            setattr(obj, name, value)


def ieee_fp32() -> contextlib.AbstractContextManager[None]:
    """IEEE FP32 matmuls and convolutions inside, whatever the run set outside: a measurement
    (FID's Inception) must not run in TF32 because the mode under test does."""
    return fp32_math(False)


def check_device_support(mode: DictConfig, device: torch.device) -> None:
    """A mode the device cannot run fails here, naming the mode and the device."""
    wants_bf16 = DType.bfloat16 in (mode.param_dtype, mode.autocast)
    if device.type == "cuda" and wants_bf16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision={mode.name}: {torch.cuda.get_device_name(device)} has no bfloat16 support; "
            "use fp16, mixed or amp"
        )


def default_channels_last(mode: DictConfig, device: torch.device) -> bool:
    """The tensor-core layout on CUDA; on a CPU, FP16 convolutions were markedly faster channels-last."""
    return device.type == "cuda" or mode.param_dtype == DType.float16


def _cast_floating(tree, dtype: torch.dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def computes_low_precision_on_cpu(mode: DictConfig, device: torch.device) -> bool:
    """Whether the mode multiplies in FP16 or BF16 (its weights or its autocast) on a CPU."""
    return device.type == "cpu" and any(d in (DType.float16, DType.bfloat16) for d in (mode.param_dtype, mode.autocast))


def arithmetic(cfg: DictConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """How the network's FP16 and BF16 ops run: on a CPU, as a GPU's (emulated, as the run's
    emulate_* settings say) or on torch's own kernels, LSTMs on CUDA's path either way
    (cpu_tensor_cores.py); on a GPU, as they do."""
    if not computes_low_precision_on_cpu(cfg.precision, device):
        return contextlib.nullcontext()
    return TensorCoreArithmetic(cfg.emulate_tensor_cores, cfg.emulate_lstm_gate_rounding)


def prepare_model(model: nn.Module, mode: DictConfig, device: torch.device, channels_last: bool) -> nn.Module:
    """Put the model's weights where the mode says, on the device.

    FP16 (or BF16) weights get apex O2's casts at the model's boundary: floating inputs are cast to
    the weights' dtype on the way in, floating outputs to FP32 on the way out, so the loss is always
    computed in FP32 and no task needs to know the mode. On a CPU, the arithmetic of FP16 and BF16
    ops is `arithmetic`'s.
    """
    dtype = torch_dtype(mode.param_dtype)
    model.to(device=device)
    # Batch-norm kept in FP32 keeps its exact FP32 values: a cast through FP16 and back would round
    # its scales and running statistics (a running_var of 1.0001 would become 1.0), which apex O2 never does.
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] if mode.norm_fp32 else []
    exact = [{k: v.clone() for k, v in m.state_dict().items()} for m in norms] if dtype != torch.float32 else []
    model.to(dtype=dtype)
    for module, state in zip(norms, exact):
        module.float()
        module.load_state_dict(state)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    if dtype != torch.float32:
        model.register_forward_pre_hook(
            lambda _m, args, kwargs: (_cast_floating(args, dtype), _cast_floating(kwargs, dtype)), with_kwargs=True
        )
        model.register_forward_hook(lambda _m, _args, out: _cast_floating(out, torch.float32))
    return model


def autocast(mode: DictConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The mode's autocast; on a CPU, casting what CUDA's autocast casts (cuda_autocast.py)."""
    if mode.autocast is None:
        return contextlib.nullcontext()
    if device.type == "cpu":
        return cuda_autocast(torch_dtype(mode.autocast))
    return torch.autocast(device.type, dtype=torch_dtype(mode.autocast))


@contextlib.contextmanager
def held_for_the_run(cfg: DictConfig, device: torch.device) -> Iterator[None]:
    """What a run holds while it trains: on a CPU, autocast's CUDA lists and the mode's arithmetic,
    registered once rather than at every forward and backward (and the arithmetic's widened
    weights kept from a forward to its backward)."""
    with contextlib.ExitStack() as held:
        if device.type == "cpu" and cfg.precision.autocast is not None:
            held.enter_context(cuda_lists())
        held.enter_context(arithmetic(cfg, device))
        yield


@contextlib.contextmanager
def forward_context(cfg: DictConfig, device: torch.device) -> Iterator[None]:
    """What a network's forward runs under: the mode's autocast, in the mode's arithmetic."""
    with arithmetic(cfg, device), autocast(cfg.precision, device):
        yield


class _TorchUpdate:
    """The optimizer on FP32 tensors: the weights, or an FP32 master copy of FP16 weights."""

    carries_scale = False  # gradients are unscaled in place before the update
    in_place_fp16 = False  # lost updates are those FP16 weights would lose

    def __init__(
        self,
        params: list[nn.Parameter],
        cfg: DictConfig,
        lr: float,
        fp32_values: dict[nn.Parameter, torch.Tensor],
        scaled: list[bool],
    ):
        self.params = params
        # Only low-precision weights get a master; FP32 ones (batch-norm under mixed) are updated directly.
        # A master starts from the weight's FP32 value, as the paper keeps it; only the working copy is rounded.
        keep_master = cfg.precision.master_weights
        self.masters = [fp32_values[p] if keep_master and p.dtype != torch.float32 else p for p in params]
        self.low_pairs = [(p, m) for p, m in zip(params, self.masters) if m is not p]
        self.optimizer = build_torch_optimizer(param_groups(self.masters, scaled, cfg.optim, lr), cfg, lr)

    def written(self) -> list[torch.Tensor]:
        """The tensors the update writes: the masters, and the weights that have none."""
        return self.masters

    def copy_back(self) -> None:
        if self.low_pairs:
            torch._foreach_copy_([p for p, _ in self.low_pairs], [m for _, m in self.low_pairs])

    def grads(self) -> list[torch.Tensor]:
        for p, m in self.low_pairs:
            if p.grad is None:
                m.grad = None  # no stale gradient may reach the optimizer
            else:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                m.grad.copy_(p.grad)
        # set above wherever the parameter has one (a FP32 parameter is its own master)
        return cast("list[torch.Tensor]", [m.grad for m, p in zip(self.masters, self.params) if p.grad is not None])

    def apply(self, grads: list[torch.Tensor], scale: float, coef: torch.Tensor | None, clipped: list[bool]) -> None:
        if coef is not None:
            torch._foreach_mul_([g for g, c in zip(grads, clipped) if c], coef)
        self.optimizer.step()
        self.copy_back()

    def master_weights(self) -> list[torch.Tensor]:
        return [m for _, m in self.low_pairs]

    @contextlib.contextmanager
    def counting_lost(self) -> Iterator[dict[nn.Parameter, LostUpdates]]:
        # The values the optimizer writes are FP32: what an FP16 weight would lose is asked of
        # their FP16 rounding. A low-precision weight updated without a master lost what it lost
        # without trace (before and after are equal, as for no update at all): it is not counted.
        written = [(p, m) for p, m in zip(self.params, self.masters) if m.dtype == torch.float32]
        before = [m.detach().clone() for _, m in written]
        counts: dict[nn.Parameter, LostUpdates] = {}
        yield counts
        for (p, after), b in zip(written, before):
            counts[p] = LostUpdates(after.device)
            counts[p].add(b, after)


class _FP16Update:
    """FP16 weights updated in place by FP16 momentum SGD; the loss scale is divided out inside the update."""

    carries_scale = True
    in_place_fp16 = True  # lost updates are those the FP16 weights did lose

    def __init__(
        self,
        params: list[nn.Parameter],
        cfg: DictConfig,
        lr: float,
        fp32_values: dict[nn.Parameter, torch.Tensor],
        scaled: list[bool],
    ):
        self.params = params
        modified = cfg.precision.update_rule == Update.fp16_modified_momentum
        o = cfg.optim
        groups = param_groups(params, scaled, o, lr)
        self.optimizer = FP16MomentumSGD(
            groups, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay, modified=modified, nesterov=o.nesterov
        )

    def written(self) -> list[torch.Tensor]:
        return list(self.params)

    def copy_back(self) -> None:
        """Nothing to copy: the weights are what the update writes."""

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def apply(self, grads: list[torch.Tensor], scale: float, coef: torch.Tensor | None, clipped: list[bool]) -> None:
        with_grads = [p for p in self.params if p.grad is not None]
        self.optimizer.step(
            grad_scale=scale,
            grad_coef=1.0 if coef is None else coef,
            clipped={id(p) for p, c in zip(with_grads, clipped) if c},
        )

    def master_weights(self) -> list[torch.Tensor]:
        return []

    @contextlib.contextmanager
    def counting_lost(self) -> Iterator[dict[nn.Parameter, LostUpdates]]:
        # An update an FP16 weight lost leaves no trace in it: the optimizer counts, inside the
        # step, where its FP32 update was not zero and the stored weight did not change.
        counts: dict[nn.Parameter, LostUpdates] = {}
        self.optimizer.lost = counts
        try:
            yield counts
        finally:
            self.optimizer.lost = None


class PrecisionEngine:
    """The dtype a network's weights live in, and backward, overflow check, unscale, clip, update,
    copy back, LR schedule: for one network, given in FP32 as the task built it."""

    def __init__(
        self,
        model: nn.Module,
        cfg: DictConfig,
        scaler: LossScaler,
        lr_milestones: list[int],
        device: torch.device,
        reduce_max: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        clipped: list[nn.Parameter] | None = None,
        channels_last: bool = False,
        total_steps: int | None = None,
    ):
        model.to(device=device)
        # The FP32 values of the weights prepare_model will round: their masters start from these.
        mode = cfg.precision
        kept_fp32 = {
            id(q)
            for m in model.modules()
            if mode.norm_fp32 and isinstance(m, nn.modules.batchnorm._BatchNorm)
            for q in m.parameters()
        }
        fp32_values = {
            q: q.detach().clone()
            for q in model.parameters()
            if mode.master_weights and mode.param_dtype != DType.float32 and q.requires_grad and id(q) not in kept_fp32
        }
        self.model = prepare_model(model, cfg.precision, device, channels_last)
        # FP8 and MX modes: the network's products quantize their operands (None: they do not)
        self.products = quantized_model.install(self.model, cfg.precision)
        self.arithmetic = lambda: arithmetic(cfg, device)
        # Under torchrun: the maximum over processes, so that every rank skips the same steps and
        # keeps the same scale even where the gradients it holds are not averaged yet.
        self.reduce_max = reduce_max
        self.scaler = scaler
        # The loss-scaling control (scale.shift_down = k): the loss times 2^-k before the backward,
        # the gradients times 2^k before the update. A power of two, so FP32 runs are unchanged bit
        # for bit while FP16 gradients fall toward and past FP16's subnormals.
        self.shift = 2.0**-cfg.scale.shift_down
        self.device = device
        self.clip = cfg.optim.clip_grad_norm
        params = [q for q in model.parameters() if q.requires_grad]
        # What optim.clip_grad_norm covers: every weight, or those the task names (bigLSTM: its LSTM's)
        self.clip_ids = {id(q) for q in (params if clipped is None else clipped)}
        # optim.norm_bias_lr_scale's weights: batch-norm biases (Jordan 2024's "bias scaler")
        norm_biases = {
            id(m.bias) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.bias is not None
        }
        update_cls = _TorchUpdate if cfg.precision.update_rule == Update.optimizer else _FP16Update
        self.update = update_cls(params, cfg, effective_lr(cfg), fp32_values, [id(q) in norm_biases for q in params])
        self.optimizer = self.update.optimizer
        s = cfg.schedule
        if s.lr_shape == "triangle" and total_steps is None:
            raise ValueError("schedule.lr_shape=triangle: the engine needs the run's total_steps")
        on_device = resolve(cfg, device)
        # On the device path the schedule drives a host-only copy of the groups: the optimizer's own
        # lr are device tensors that the steps set from it (resident_scale.py)
        scheduled = _host_copy(self.optimizer) if on_device else self.optimizer
        self.scheduler = build_lr_schedule(
            scheduled, lr_milestones, s.lr_gamma, s.lr_warmup_steps, s.lr_shape, list(s.lr_triangle), total_steps
        )
        self.resident = (
            ResidentScale(scaler, self.optimizer, self.scheduler, device, s.log_every) if on_device else None
        )
        self._zero_momentum()
        self.lookahead: Lookahead | None = None
        if cfg.optim.lookahead.start_epoch is not None:
            if total_steps is None:
                raise ValueError("optim.lookahead: the engine needs the run's total_steps")
            self.lookahead = Lookahead(cfg.optim.lookahead, total_steps)
        self.last_grad_norm: torch.Tensor | None = None
        self.steps_taken = 0  # calls of step(), applied or skipped
        self.frozen: set[int] = set()  # ids of weights whose gradients step() drops (Task.frozen_parameters)

    @property
    def lr(self) -> float:
        """The lr of the next step (on the device path, read back: a sync)."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def backward_scale(self) -> float:
        """What the loss is multiplied by before its backward: the loss scale, and the control's 2^-k
        (on the device path, read back: a sync)."""
        if self.resident is not None:
            return float(self.resident.scale) * self.shift
        return self.scaler.scale * self.shift

    @property
    def on_device(self) -> bool:
        """Whether the scale, the overflow flag and the schedule's position live on the device."""
        return self.resident is not None

    def logged(self) -> dict[str, float | torch.Tensor]:
        """The lr and scale of the step about to run, for the log: device tensors on the device path,
        brought to the host with the rest of the log at its flush."""
        if self.resident is not None:
            return {"lr": self.resident.lrs[0].clone(), "scale": self.resident.scale.clone()}
        return {"lr": self.lr, "scale": self.scaler.scale}

    def logged_overflow(self, applied: bool | None) -> bool | torch.Tensor | None:
        """Whether the last step overflowed, for the log (None: no scaler checks)."""
        if not self.scaler.checks_overflow:
            return None
        if applied is None:
            assert (
                self.resident is not None and self.resident.last_found is not None
            )  # only the device path leaves it unknown
            return self.resident.last_found > 0
        return not applied

    def read_back(self) -> None:
        """On the device path, bring the steps since the last read-back to the host scaler and
        schedule (one sync); raises Diverged where the host scaler gives up. Elsewhere nothing."""
        if self.resident is not None:
            self.resident.read_back()

    def backward(self, loss: torch.Tensor, scale: float | None = None) -> None:
        """The backward of `loss` times the loss scale (`scale`: another, for a step run again) and
        the control's 2^-k."""
        # Start from clean gradients: another network's backward (a GAN's generator loss flows
        # through the discriminator) may have written into this one's since its last step.
        self._zero_grad()
        if scale is None and self.resident is not None:
            factor: float | torch.Tensor = self.resident.backward_factor(self.shift)
        else:
            factor = (self.scaler.scale if scale is None else scale) * self.shift
        with self.arithmetic():  # the backward's products are the GPU's too
            (loss * factor).backward()

    def zero_grad(self) -> None:
        self._zero_grad()

    def replaying(self, stepped: bool) -> contextlib.AbstractContextManager:
        """Around a step run again: its products quantize as they did (with the scales before the
        step's update, if `stepped`) and add no amax."""
        return self.products.replaying(stepped) if self.products is not None else contextlib.nullcontext()

    @torch.no_grad()
    def step(self, at: int | None = None, know: bool = False) -> bool | None:
        """Apply the update unless the gradients overflowed. Returns whether the update was applied;
        on the device path None (known at the next read-back), unless `know`, which reads back now.
        `at`: the run's step, which a divergence found at a read-back names."""
        self.steps_taken += 1
        if self.products is not None:  # a skipped step's amax counts too, as in Transformer Engine
            self.products.end_step(self.reduce_max)
        for p in self.update.params:
            if id(p) in self.frozen:
                p.grad = None
        grads = self.update.grads()
        if self.resident is not None:
            return self._step_on_device(grads, at, know)
        scale = self.backward_scale  # what the gradients carry
        unscale = 1.0 if self.update.carries_scale else 1.0 / scale
        overflow, grad_max = False, None
        if self.scaler.checks_overflow:
            overflow, grad_max = self._check_and_unscale(
                grads, unscale, scale * unscale if self.scaler.observes_grad_max else None
            )
        elif unscale != 1.0:
            torch._foreach_mul_(grads, unscale)
        self.scaler.update(overflow, grad_max)  # the scale for the next step; raises Diverged when it gives up
        if overflow:
            self._zero_grad()
            return False
        coef, clipped = self._clipping(grads, scale if self.update.carries_scale else 1.0)
        self.update.apply(grads, scale, coef, clipped)
        self.scheduler.step()  # a skipped step does not advance the schedule
        self._zero_grad()
        return True

    def _step_on_device(self, grads: list[torch.Tensor], at: int | None, know: bool) -> bool | None:
        """step() with no read of the device: the fused optimizer skips an overflowing step itself."""
        r = self.resident
        assert r is not None and isinstance(self.update, _TorchUpdate)  # resident_scale.why_not
        if r.full():  # the lr table covers no more steps: read back first (schedule.log_every keeps it rare)
            r.read_back()
        found = r.check_and_unscale(grads, self.shift, self.reduce_max)
        # On an overflowing step the factor is not finite and the update is skipped anyway
        coef, clipped = self._clipping(grads, 1.0)
        with r.skipping(found):
            self.update.apply(grads, 1.0, coef, clipped)
        r.advance(found, at)
        self._zero_grad()
        if not know:
            return None
        return not r.read_back()[-1][1]

    def _zero_momentum(self) -> None:
        # torch's fused SGD (2.14 here) allocates its momentum buffers with empty_like on its first
        # call and leaves them unwritten when that call skips (found_inf): the next step would add
        # garbage. Zero buffers give its first applied step m*0 + g = g, the value it would have set.
        if self.resident is None or not isinstance(self.optimizer, torch.optim.SGD):
            return
        for group in self.optimizer.param_groups:
            if group["momentum"] != 0:
                for p in group["params"]:
                    if self.optimizer.state[p].get("momentum_buffer") is None:
                        self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format
                        )

    def _averaged(self) -> list[torch.Tensor]:
        return [*self.update.written(), *(b for b in self.model.buffers() if b.is_floating_point())]

    @torch.no_grad()
    def average(self, step: int, epoch: int) -> None:
        """optim.lookahead's averaging after the update of step count `step` (from 1), in `epoch`."""
        if self.lookahead is not None and self.lookahead.after_step(step, epoch, self._averaged()):
            self.update.copy_back()

    @torch.no_grad()
    def settle(self) -> None:
        """An epoch's end: under optim.lookahead the weights become the average."""
        if self.lookahead is not None and self.lookahead.settle(self._averaged()):
            self.update.copy_back()

    def _check_and_unscale(
        self, grads: list[torch.Tensor], unscale: float, left_scale: float | None
    ) -> tuple[bool, float | None]:
        """Whether any gradient is non-finite, after unscaling them by `unscale`. With `left_scale`
        (the scale the gradients still carry afterwards), also the largest |gradient| unscaled,
        brought to the host in the same sync."""
        found_inf = torch.zeros(1, device=self.device)
        inv_scale = torch.full((1,), unscale, dtype=torch.float32, device=self.device)
        for same_dtype in by_dtype(grads):
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)
        if left_scale is None or not grads:
            return bool(self.reduce_max(found_inf).item()), None
        largest = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32)).max() / left_scale
        found, grad_max = self.reduce_max(torch.cat([found_inf, largest.reshape(1)])).tolist()
        return bool(found), grad_max

    def _clipping(self, grads: list[torch.Tensor], scale: float) -> tuple[torch.Tensor | None, list[bool]]:
        """optim.clip_grad_norm's factor for the gradients it covers (None: no clipping), and which
        of `grads` those are; `scale`: what the gradients still carry."""
        clipped = [id(p) in self.clip_ids for p in self.update.params if p.grad is not None]  # aligned with grads
        to_clip = [g for g, c in zip(grads, clipped) if c]
        return (self._clip_coef(to_clip, scale) if self.clip and to_clip else None), clipped

    def _clip_coef(self, grads: list[torch.Tensor], scale: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_'s factor, on the norm of the unscaled gradients."""
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms)) / scale
        self.last_grad_norm = total
        return torch.clamp(self.clip / (total + 1e-6), max=1.0)

    def _zero_grad(self) -> None:
        for p in self.update.params:
            p.grad = None

    def master_weights(self) -> list[torch.Tensor]:
        return self.update.master_weights()

    @property
    def lost_counted(self) -> str:
        """What `counting_lost` counts as lost: "lost" (FP16 weights updated in place) or "would_be_lost"."""
        return "lost" if self.update.in_place_fp16 else "would_be_lost"

    def counting_lost(self) -> contextlib.AbstractContextManager[dict[nn.Parameter, LostUpdates]]:
        """Around one `step()`: per weight, the updates it made and those FP16 lost. Of FP16
        weights updated in place (fp16, fp16_modmom), the updates they lost; of FP32 tensors (the
        masters, or FP32 weights), the updates an FP16 weight would have lost. The dict is filled
        when the context exits (a skipped step leaves it empty)."""
        return self.update.counting_lost()

    def state_dict(self) -> dict:
        self.read_back()  # the host scaler and schedule are the checkpoint's
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.full_state_dict(),
            "masters": [m.detach().clone() for m in self.master_weights()],
            "products": self.products.state_dict() if self.products is not None else {},
            **({"lookahead": self.lookahead.state_dict()} if self.lookahead is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_full_state_dict(state["scaler"])
        with torch.no_grad():
            for m, saved in zip(self.master_weights(), state["masters"]):
                m.copy_(saved)
        if self.products is not None:
            self.products.load_state_dict(state.get("products", {}))
        if self.lookahead is not None:
            self.lookahead.load_state_dict(state.get("lookahead", {}), like=self._averaged())
        if self.resident is not None:
            self.resident.sync_from_host()
            self._zero_momentum()
        else:  # a checkpoint of the device path holds lr tensors (FP32 on a GPU): the schedule's own floats
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"] = float(lr)


def _host_copy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer of one empty weight per group, with the groups' settings: what a schedule on the
    host writes its lr into, on the device path."""
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [torch.zeros(0, requires_grad=True)]}
        for g in optimizer.param_groups
    ]
    copy = torch.optim.SGD(groups, lr=float(groups[0]["lr"]))
    # Never stepped: torch's scheduler would warn at its first step that the optimizer was not
    copy._opt_called = True  # type: ignore[attr-defined]
    return copy
