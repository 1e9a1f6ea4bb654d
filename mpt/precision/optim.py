"""Optimizers: torch's own for FP32 tensors, and the two FP16 SGD updates of the seeds.

The FP16 updates keep weights and momentum in FP16 memory. Each element's update is computed in
FP32 registers and rounded once when stored, as a fused FP16 solver kernel (NVCaffe's) does; what
FP16 storage loses (an update below half an ulp of its weight, a momentum below 2^-24) is lost here
too. Gradients arrive still multiplied by the loss scale S: the scale is divided out inside the
update instead of in FP16 memory, where small unscaled gradients would flush to zero.
"""

from __future__ import annotations

import functools
import math

import torch
from omegaconf import DictConfig

from .lost_updates import LostUpdates


class FP16MomentumSGD(torch.optim.Optimizer):
    """SGD for FP16 weights without a master copy (and for the FP32 batch-norm of Naruse's arrangement,
    by the same rule, stored in FP32).

    classic (NVCaffe):      v = m*v - lr*(g + wd*w);   w = w + v        (v in weight units)
    modified (Naruse 2017): G = m*G + (g + wd*w);      w = w - lr*G     (G in gradient units)

    With nesterov, the step looks ahead along the momentum, as torch's SGD(nesterov=True) does:
    classic w = w + m*v - lr*(g + wd*w), modified w = w - lr*((g + wd*w) + m*G).

    With loss scaling, G is kept multiplied by h*S, so it stays as far from underflow as the scaled
    gradients are, and rescaled when S changes. h = 2^-ceil(log2(1/(1-m))) is headroom: G sums
    gradients with weights up to 1/(1-m) (10x at m = 0.9), so held at S alone it would overflow FP16
    wherever a gradient keeps its sign under a scale that merely keeps the gradients themselves
    finite (a dynamic scale settles just there). Held at h*S it stays below the largest scaled
    gradient. h is a power of two, so the rescaling is exact.
    """

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, modified: bool, nesterov: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.modified, self.nesterov = modified, nesterov
        self.lost: dict[torch.nn.Parameter, LostUpdates] | None = (
            None  # while a dict, steps count the updates each weight lost
        )
        for group in self.param_groups:
            for p in group["params"]:
                # FP32 ones: batch-norm kept in FP32 (precision.norm_fp32, Naruse's arrangement), updated
                # by the same rule and stored in FP32
                if p.dtype not in (torch.float16, torch.float32):
                    raise TypeError(
                        f"FP16MomentumSGD updates FP16 (and FP32) weights; "
                        f"got a {p.dtype} parameter of shape {tuple(p.shape)}"
                    )

    @torch.no_grad()
    def step(
        self,
        closure=None,
        grad_scale: float = 1.0,
        grad_coef: float | torch.Tensor = 1.0,
        clipped: set[int] | None = None,
    ):
        """grad_scale: the loss scale the gradients carry. grad_coef: a clipping factor for the unscaled
        gradient, applied to the parameters whose ids are in `clipped` (None: all)."""
        for group in self.param_groups:
            lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
            held = momentum_headroom(m) * grad_scale  # the scale G is held at
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                    state["scale"] = held
                coef = grad_coef if clipped is None or id(p) in clipped else 1.0
                # updates lost by FP16 weights only: an FP32 one keeps what FP32 keeps
                lost = (
                    None
                    if self.lost is None or p.dtype != torch.float16
                    else self.lost.setdefault(p, LostUpdates(p.device))
                )
                for w16, g16, buf in _pieces(p, p.grad, state["momentum"]):
                    w = w16.float()
                    before = None if lost is None else w16.clone()
                    if self.modified:
                        # G/held = m*(G/held) + coef*g + wd*w, where the gradient arrives as S*g.
                        g = g16.float().mul_(coef * held / grad_scale).add_(w, alpha=wd * held)
                        G = buf.float().mul_(m * held / state["scale"]).add_(g)
                        buf.copy_(G)
                        step = g.add_(G, alpha=m) if self.nesterov else G  # in gradient units, times held
                        w16.copy_(w.sub_(step, alpha=lr / held))
                        applied = step.mul_(-lr / held) if lost is not None else None
                    else:
                        g = g16.float().mul_(coef / grad_scale).add_(w, alpha=wd)
                        v = buf.float().mul_(m).sub_(g, alpha=lr)
                        buf.copy_(v)
                        applied = v.mul(m).sub_(g, alpha=lr) if self.nesterov else v  # in weight units
                        w16.copy_(w.add_(applied))
                    if lost is not None:
                        assert before is not None and applied is not None  # set above whenever lost is
                        lost.add_applied(before, w16, applied)
                state["scale"] = held
        return None


# On a CPU an unfused update is a dozen passes over memory; in pieces of this many elements the FP32
# temporaries of each piece stay in the cache (several times faster on AlexNet's fc6). Every op is
# elementwise, so the result is the same bit for bit.
CPU_PIECE = 1 << 16


def _pieces(*tensors: torch.Tensor):
    """The tensors (of one shape and layout) whole, or on a CPU in aligned contiguous pieces."""
    n = tensors[0].numel()
    if tensors[0].device.type != "cpu" or n <= CPU_PIECE or not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    for i in range(0, n, CPU_PIECE):
        yield [f[i : i + CPU_PIECE] for f in flat]


def momentum_headroom(m: float) -> float:
    """The largest power of two h with h / (1 - m) <= 1."""
    return 2.0 ** -math.ceil(math.log2(1.0 / (1.0 - m))) if 0 < m < 1 else 1.0


def build_torch_optimizer(params, cfg: DictConfig, lr: float) -> torch.optim.Optimizer:
    o = cfg.optim
    # torch's three implementations compute the same update; they differ in kernel launches.
    how = (
        {}
        if o.implementation == "default"
        else {"foreach": o.implementation == "foreach", "fused": o.implementation == "fused"}
    )
    if o.name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov, **how
        )
    if o.name == "adagrad":
        return torch.optim.Adagrad(
            params,
            lr=lr,
            initial_accumulator_value=o.initial_accumulator,
            eps=o.eps,
            weight_decay=o.weight_decay,
            **how,
        )
    if o.name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **how)
    raise ValueError(f"optim.name={o.name}: expected sgd, adam or adagrad")


def param_groups(tensors: list, scaled: list[bool], o: DictConfig, lr: float) -> list:
    """The tensors as one group, or, under optim.norm_bias_lr_scale != 1, two: the others, then those
    flagged `scaled` (batch-norm biases) at lr times the scale and weight decay divided by it, so
    that the decay each step applies, lr times weight decay, stays the others' (Jordan 2024)."""
    k = o.norm_bias_lr_scale
    chosen = [t for t, f in zip(tensors, scaled) if f]
    if k == 1 or not chosen:
        return list(tensors)  # one group: an optimizer state as earlier runs' checkpoints hold it
    rest = [t for t, f in zip(tensors, scaled) if not f]
    return [{"params": rest}, {"params": chosen, "lr": lr * k, "weight_decay": o.weight_decay / k}]


def triangle_factor(step: int, total_steps: int, triangle: tuple[float, float, float]) -> float:
    """Jordan 2024's schedule: the lr's multiple at step `step`, linear from `start` at step 0 to 1 at
    step floor(peak * total_steps), then to `end` at total_steps."""
    start, peak, end = triangle
    top = int(peak * total_steps)
    if step <= top:
        return start + (1.0 - start) * step / top if top > 0 else 1.0
    return 1.0 + (end - 1.0) * min(step - top, total_steps - top) / (total_steps - top)


def effective_lr(cfg: DictConfig) -> float:
    """optim.lr at a batch of optim.lr_batch samples, scaled linearly (the rule of the paper's SGD
    recipes); with lr_batch null (Adam recipes, which were tuned at their own batch) as given."""
    if cfg.optim.lr_batch is None:
        return float(cfg.optim.lr)
    return float(cfg.optim.lr) * cfg.schedule.batch_size / cfg.optim.lr_batch


def lr_factor(step: int, milestones: list[int], gamma: float, warmup_steps: int) -> float:
    """The multiple of the base lr at optimizer step `step`: GNMT's exponential warm-up from 1% over
    `warmup_steps` (NVIDIA's WarmupMultiStepLR), then a factor `gamma` at each milestone passed."""
    warm = 0.01 ** ((warmup_steps - step) / warmup_steps) if step < warmup_steps else 1.0
    return warm * gamma ** sum(step >= m for m in milestones)


def build_lr_schedule(
    optimizer: torch.optim.Optimizer,
    milestones: list[int],
    gamma: float,
    warmup_steps: int,
    shape: str = "step",
    triangle: list[float] | None = None,
    total_steps: int | None = None,
):
    if shape == "triangle":
        assert triangle is not None and total_steps is not None  # checked by the engine and the config
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            functools.partial(
                triangle_factor, total_steps=total_steps, triangle=(triangle[0], triangle[1], triangle[2])
            ),
        )
    if warmup_steps == 0:  # the schedule earlier checkpoints hold
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=gamma)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, milestones=milestones, gamma=gamma, warmup_steps=warmup_steps)
    )
