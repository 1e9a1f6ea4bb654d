"""Optimizers: torch's own for FP32 tensors, and the two FP16 SGD updates of the seeds.

The FP16 updates keep weights and momentum in FP16 memory. Each element's update is computed in
FP32 registers and rounded once when stored, as a fused FP16 solver kernel (NVCaffe's) does; what
FP16 storage loses (an update below half an ulp of its weight, a momentum below 2^-24) is lost here
too. Gradients arrive still multiplied by the loss scale S: the scale is divided out inside the
update instead of in FP16 memory, where small unscaled gradients would flush to zero.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig


class FP16MomentumSGD(torch.optim.Optimizer):
    """SGD for FP16 weights without a master copy.

    classic (NVCaffe):      v = m*v - lr*(g + wd*w);   w = w + v        (v in weight units)
    modified (Naruse 2017): G = m*G + (g + wd*w);      w = w - lr*G     (G in gradient units)

    With loss scaling, G is kept multiplied by S (so it stays as far from underflow as the scaled
    gradients are) and is rescaled when S changes.
    """

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, modified: bool):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.modified = modified
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float16:
                    raise TypeError(f"FP16MomentumSGD updates FP16 weights; got a {p.dtype} parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0, grad_coef: float = 1.0):
        """grad_scale: the loss scale the gradients carry. grad_coef: a clipping factor for the unscaled gradient."""
        for group in self.param_groups:
            lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                    state["scale"] = grad_scale
                buf = state["momentum"]
                w = p.float()
                if self.modified:
                    # G/S = m*(G/S) + coef*g + wd*w, held as G in units of the current scale.
                    g = p.grad.float().mul_(grad_coef).add_(w, alpha=wd * grad_scale)
                    G = buf.float().mul_(m * grad_scale / state["scale"]).add_(g)
                    buf.copy_(G)
                    state["scale"] = grad_scale
                    p.copy_(w.sub_(G, alpha=lr / grad_scale))
                else:
                    g = p.grad.float().mul_(grad_coef / grad_scale).add_(w, alpha=wd)
                    v = buf.float().mul_(m).sub_(g, alpha=lr)
                    buf.copy_(v)
                    p.copy_(w.add_(v))
        return None


def build_torch_optimizer(params, cfg: DictConfig, lr: float) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)
    raise ValueError(f"optim.name={o.name}: expected sgd")


def effective_lr(cfg: DictConfig) -> float:
    """optim.lr is per 256 samples (the linear scaling rule of the paper's recipes)."""
    return float(cfg.optim.lr) * cfg.schedule.batch_size / 256
