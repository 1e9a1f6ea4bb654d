"""Updates that FP16 weights lose: the statistic behind the paper's case for an FP32 master copy
(its Section 3.1 and Figure 2a).

An FP16 weight w takes an update u as a fused FP16 solver kernel applies it: w + u in FP32
registers, rounded once to FP16. The update is lost when that rounding gives back w: roughly, when
|u| is below half an ulp of w. `would_be_lost` asks this of any weight and update, whatever the
run's mode: of an FP32 weight or master, about its FP16 rounding, the working copy `mixed` computes
with. `LostUpdates` counts, per layer, the elements with a non-zero update and how many of those
an FP16 weight would lose; of FP16 weights updated in place (fp16, fp16_modmom), `add_applied`
counts those they did lose, from the update's FP32 values and the stored weight. Counts accumulate
on the tensors' device, as the gradient histograms' do: nothing reaches the host until `summary()`.
"""

from __future__ import annotations

import torch

from .grad_histogram import CHUNK, flat_view


def would_be_lost(weight: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Where an update, added in FP32 to the weight's FP16 rounding and rounded once to FP16,
    leaves that FP16 weight as it was, and the update is not zero."""
    w16 = weight.to(torch.float16)
    return (update != 0) & ((w16.float() + update.float()).to(torch.float16) == w16)


class LostUpdates:
    """Counts over one set of weights (a layer's, or all of them), accumulated over steps: elements
    updated (a non-zero update) and, of those, updates lost in FP16."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # updated, lost in FP16

    def add(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """Count one step of one weight: its values before and after the update (the master's
        where there is one), the update being their difference."""
        for b, a in zip(flat_view(before.detach()).split(CHUNK), flat_view(after.detach()).split(CHUNK)):
            update = a.double() - b.double()  # exact: both are FP32 or narrower
            self.counts += torch.stack([(update != 0).sum(), would_be_lost(b, update).sum()])

    def add_applied(self, before: torch.Tensor, after: torch.Tensor, update: torch.Tensor) -> None:
        """Count one step of an FP16 weight updated in place, from what it did: an update is lost
        where it was not zero and the stored weight is unchanged."""
        changed = (update != 0).flatten()
        self.counts += torch.stack([changed.sum(), (changed & (after == before).flatten()).sum()])

    def merge(self, other: "LostUpdates") -> "LostUpdates":
        self.counts += other.counts.to(self.counts.device)
        return self

    def merge_all(self, others) -> "LostUpdates":
        for other in others:
            self.merge(other)
        return self

    def summary(self) -> dict:
        updated, lost = (int(c) for c in self.counts.cpu())
        return {"updated": updated, "lost_fp16": lost, "share_lost_fp16": lost / updated if updated else 0.0}
