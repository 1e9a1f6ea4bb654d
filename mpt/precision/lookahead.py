"""Jordan 2024's lookahead averaging (airbench94): a running average of the weights that, every few
steps, replaces them, so the weights move fast early and are averaged strongly at the end.

From epoch `start_epoch` on, at every step whose count (1, 2, ...) is a multiple of `every`: the first
such step copies the weights into the average; each later one moves the average toward them,
ema += (1 - rho) * (w - ema) with rho = decay_base^every * (step / total_steps)^decay_pow, and writes
it back into the weights. At the end of each epoch (and of the run) the weights become the average.

Averaged are the tensors the update writes (an FP32 master where the mode keeps one, else the weight
in its own dtype, as airbench averages its FP16 weights in FP16) and the network's floating buffers
(batch-norm's running statistics), each in its own dtype.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig


class Lookahead:
    def __init__(self, cfg: DictConfig, total_steps: int):
        self.start_epoch, self.every = int(cfg.start_epoch), int(cfg.every)
        self.decay_base, self.decay_pow = float(cfg.decay_base), float(cfg.decay_pow)
        self.total_steps = total_steps
        self.ema: list[torch.Tensor] | None = None

    def decay(self, step: int) -> float:
        return self.decay_base**self.every * (step / self.total_steps) ** self.decay_pow

    @torch.no_grad()
    def after_step(self, step: int, epoch: int, tensors: list[torch.Tensor]) -> bool:
        """After the update of step count `step` in epoch `epoch` (from 0): whether the weights changed."""
        if epoch < self.start_epoch or step % self.every:
            return False
        if self.ema is None:
            self.ema = [t.detach().clone() for t in tensors]
            return False
        rho = self.decay(step)
        torch._foreach_lerp_(self.ema, tensors, 1.0 - rho)
        torch._foreach_copy_(tensors, self.ema)
        return True

    @torch.no_grad()
    def settle(self, tensors: list[torch.Tensor]) -> bool:
        """The weights become the average (an epoch's end); whether there was one."""
        if self.ema is None:
            return False
        torch._foreach_copy_(tensors, self.ema)
        return True

    def state_dict(self) -> dict:
        return {"ema": None if self.ema is None else [t.clone() for t in self.ema]}

    def load_state_dict(self, state: dict, like: list[torch.Tensor]) -> None:
        """The saved average, into tensors of the device and dtype of `like` (the averaged tensors)."""
        saved = state.get("ema")
        self.ema = None if saved is None else [t.detach().clone().copy_(s) for t, s in zip(like, saved)]
