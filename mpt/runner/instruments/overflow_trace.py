"""Which module's tensor became non-finite first, when a step overflows and is skipped.

Steps that do not overflow pay nothing but a copy of the random-number generators' states. When a
network's gradients overflow, the runner runs that network's part of the step again from the same
state (the same batch, weights, loss scale and random numbers) with hooks on every leaf module:
in the forward, the first module whose output holds a non-finite value (of any network: a GAN's
generator loss flows through its discriminator, whose modules are then named with the network); failing that, the loss;
in the backward, the first module (in the backward's order) whose output gradient does; failing
that, the first weight gradient. Batch-norm statistics and the generators are put back after it,
and a traced run trains bit for bit as an untraced one.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..checkpoint import rng_state, set_rng_state
from . import Instrument, RunEnd

KEPT = 20  # the first overflows kept in full in the record; the counts cover all of them


def _nonfinite(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())


class _Watch:
    """Hooks on one network's leaf modules for one re-run; `found` is the first non-finite tensor."""

    def __init__(self, networks: dict[str, nn.Module]):
        self.found: dict | None = None
        # Every network's leaves: a GAN's generator loss overflows in the discriminator it flows through.
        prefix = (lambda net: f"{net}.") if len(networks) > 1 else (lambda net: "")
        self.leaves = [
            (prefix(net) + (name or "(root)"), m)
            for net, model in networks.items()
            for name, m in model.named_modules()
            if next(m.children(), None) is None
        ]
        self.handles = [m.register_forward_hook(functools.partial(self._on_forward, name)) for name, m in self.leaves]

    def _note(self, module: str, role: str) -> None:
        if self.found is None:
            self.found = {"module": module, "role": role}

    def _on_forward(self, name: str, _module, _args, output) -> None:
        for t in tree_leaves(output):
            if _nonfinite(t):
                self._note(name, "output")
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(self._on_grad, name))

    def _on_grad(self, name: str, grad: torch.Tensor) -> None:
        if _nonfinite(grad):
            self._note(name, "activation_grad")

    def after_backward(self) -> None:
        for name, m in reversed(self.leaves):
            for p in m.parameters(recurse=False):
                if _nonfinite(p.grad):
                    self._note(name, "weight_grad")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class OverflowTracer(Instrument):
    """One per run. `trace` re-runs one network's overflowing step through `rerun(loss_hook)`,
    which must recompute the loss from the saved state, pass it to `loss_hook`, and run the
    backward at the step's scale."""

    key, field = "overflow_trace", "overflow_origins"

    def __init__(self, networks: dict[str, nn.Module], enabled: bool, sampled_only: bool = False):
        self.networks, self.enabled = networks, enabled
        # A scale kept on the device: only the steps the statistics sample (stats.every) are traced
        self.sampled_only = sampled_only
        self.counts: dict[str, dict[str, int]] = {net: {} for net in networks}  # "module role" -> skips
        self.first: dict[str, list[dict]] = {net: [] for net in networks}
        self.seconds = 0.0  # spent re-running, left out of throughput
        self.step_seconds = 0.0  # the current step's share of it

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        self.step_seconds = 0.0
        yield

    def spent(self, seconds: float) -> None:
        """Time spent tracing the current step's overflow."""
        self.seconds += seconds
        self.step_seconds += seconds

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Keeps what a re-run would change besides the gradients: the generators, and every buffer.
        The re-run gets copies of the buffers, so the originals are neither changed nor marked as
        changed (a GAN's next term backpropagates through a graph that saved them)."""
        rng = rng_state()
        originals = [
            (m, name, b)
            for net in self.networks.values()
            for m in net.modules()
            for name, b in m._buffers.items()
            if b is not None
        ]
        for m, name, b in originals:
            m._buffers[name] = b.clone()
        try:
            yield
        finally:
            for m, name, b in originals:
                m._buffers[name] = b
            set_rng_state(rng)

    def trace(
        self, step: int, network: str, scale: float, rerun: Callable[[Callable[[torch.Tensor], None]], None]
    ) -> dict:
        watch = _Watch(self.networks)

        def on_loss(loss: torch.Tensor) -> None:
            if watch.found is None and _nonfinite(loss):
                watch._note("(loss)", "loss")

        try:
            rerun(on_loss)
            watch.after_backward()
        finally:
            watch.remove()
        found = watch.found or {
            "module": "(not found)",
            "role": "none",
        }  # e.g. a compiled network: its leaves run inside its graph
        entry = {"step": step, "scale": scale, **found}
        key = f"{found['module']} {found['role']}"
        self.counts[network][key] = self.counts[network].get(key, 0) + 1
        if len(self.first[network]) < KEPT:
            self.first[network].append(entry)
        return entry

    def summary(self, end: RunEnd | None = None) -> dict | None:
        if not self.enabled or not any(self.counts.values()):
            return None
        return {
            "what": "docs/record.md#overflow-origins",
            "steps_traced": "the skipped steps among those stats.every samples (the scale lived on the device)"
            if self.sampled_only
            else "every skipped step",
            "networks": {
                net: {
                    "skips_traced": sum(counts.values()),
                    "by_module": [
                        {"module": k.rpartition(" ")[0], "role": k.rpartition(" ")[2], "skips": n}
                        for k, n in sorted(counts.items(), key=lambda kv: -kv[1])
                    ],
                    "first": list(self.first[net]),
                }
                for net, counts in self.counts.items()
                if counts
            },
        }

    def state_dict(self) -> dict:
        return {
            "counts": {n: dict(c) for n, c in self.counts.items()},
            "first": {n: list(f) for n, f in self.first.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.counts.update({n: dict(c) for n, c in state["counts"].items()})
        self.first.update({n: list(f) for n, f in state["first"].items()})
