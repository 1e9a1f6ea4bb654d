"""nn.LSTM under FP16 autocast on a CPU.

Autocast's rule for an LSTM (CUDA's: `lstm` is on its FP16 list) is to cast the input, the states and
the weights to FP16 and run the FP16 kernel. On a CPU, autocast sends the LSTM to oneDNN, which has
no FP16 LSTM and fails ("could not create a primitive descriptor"), while torch's own FP16 LSTM
kernel runs (pure FP16 weights use it). This applies the rule by hand and calls that kernel; the
casts are differentiable, so the FP32 weights get their gradients as under CUDA autocast.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.rnn import PackedSequence


class AutocastHalfLSTM(nn.LSTM):
    def forward(self, input, hx=None):
        if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16):
            return super().forward(input, hx)
        with torch.autocast("cpu", enabled=False):  # so the call below takes the branch above
            half = {name: p.half() for name, p in self.named_parameters()}
            input = input._replace(data=input.data.half()) if isinstance(input, PackedSequence) else input.half()
            hx = None if hx is None else tuple(h.half() for h in hx)
            return functional_call(self, half, (input, hx))


def autocast_half_lstms(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is nn.LSTM:
            module.__class__ = AutocastHalfLSTM
