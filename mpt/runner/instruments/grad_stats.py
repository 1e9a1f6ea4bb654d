"""Gradient statistics sampled during training: where activation and weight gradients lie
against FP16's range (the paper's Figures 3 and 2b), per layer and in total.

On a sampled step, a forward hook on every module that owns parameters puts a tensor hook on
each of its outputs; in backward that hook sees the gradient of the loss with respect to the
layer's output (the activation gradient). After the backward, before the update, each layer's
weight gradients are counted. Every value is counted unscaled: divided by the loss scale the
backward ran with, so runs in any precision and with any scale are comparable with FP32's. On
other steps no hook is installed at all, so they cost nothing; a sampled step's cost is timed
against the step before it, and sampled steps are left out of throughput.

With stats.formats, the numerics atlas: on the same sampled steps, each matrix product's module
(convolutions, transposed convolutions, linear layers, LSTMs) has its input, weights, activation
gradients and weight gradients counted against every format listed (precision/atlas.py), per
layer and in total; block formats are blocked along the axis the product reduces over.

With stats.lost_updates, a sampled step's update is counted by the precision engine
(`counting_lost`): per weight, the updates an FP16 weight would lose, asked of the FP32 values it
writes, or for FP16 weights updated in place (fp16, fp16_modmom) the updates they did lose (the
paper's Section 3.1). The collector sums them per layer, with each step's total and learning rate.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
from typing import Callable, Iterator

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils._pytree import tree_leaves

from ...precision.atlas import FormatAtlas
from ...precision.engine import PrecisionEngine
from ...precision.formats import get_format
from ...precision.grad_histogram import CHUNK, GradHistogram
from ...precision.lost_updates import LostUpdates
from ...precision.quantized_products import BatchMatmul
from . import Instrument, RunEnd
from .throughput import synchronize

log = logging.getLogger("mpt")
ATLAS_PROBE = 1 << 18  # values quantized once at the start to time the atlas on this device

KINDS = ("activation", "weight")
ROLES = {
    "input": "the input of the layer's matrix product (an LSTM's input sequence; its recurrent state is not seen)",
    "weight": (
        "the layer's weights (an LSTM's input, recurrent and projection weights), after the backward, before the update"
    ),
    "activation_grad": "the gradient of the loss with respect to the layer's output, unscaled",
    "weight_grad": "the gradient of the loss with respect to the layer's weights, unscaled",
}
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_T = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# BatchMatmul: a product of two activations (attention's scores and mix, a softmax over sampled words)
MATMULS = (nn.Linear, *_CONV, *_CONV_T, nn.RNNBase, nn.RNNCellBase, BatchMatmul)


def matmul_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose work is a matrix product, by qualified name."""
    return [(name or "(root)", m) for name, m in model.named_modules() if isinstance(m, MATMULS)]


def block_axes(module: nn.Module) -> dict[str, int]:
    """Per role, the axis the module's product reduces over, along which MX blocks run: channels
    for convolutions (a transposed convolution's weight holds its input channels first), features
    for linear layers and LSTMs."""
    conv = isinstance(module, _CONV + _CONV_T)
    weight = (0 if isinstance(module, _CONV_T) else 1) if conv else -1
    return {"input": 1 if conv else -1, "weight": weight, "activation_grad": 1 if conv else -1, "weight_grad": weight}


def parameterized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that own parameters directly, by qualified name (the root as "(root)")."""
    return [
        (name or "(root)", m)
        for name, m in model.named_modules()
        if next(m.parameters(recurse=False), None) is not None
    ]


class GradStatsCollector(Instrument):
    """One per run, over every network of the task. Disabled (stats.grad_hist and
    stats.lost_updates false), every method returns at once and `summary()` is None."""

    MEMORY_NOTE = (
        f"includes the sampled steps' histogram temporaries: {CHUNK} values at a time, some tens of bytes each"
    )

    key = field = "grad_stats"

    def __init__(
        self,
        stats: DictConfig,
        networks: dict[str, nn.Module],
        device: torch.device,
        warmup: int = 0,
        total_steps: int | None = None,
    ):
        self.hist_on, self.updates_on = bool(stats.grad_hist), bool(stats.get("lost_updates", False))
        self.formats = [get_format(name) for name in stats.get("formats", [])]
        self.atlas_on = bool(self.formats)
        self.enabled, self.every, self.keep = (
            self.hist_on or self.updates_on or self.atlas_on,
            int(stats.every),
            float(stats.keep),
        )
        self.device = device
        self.total_steps = total_steps  # the run's length, to say what the atlas's sampled steps will cost
        self.warmup = warmup  # steps of this process not timed: the first ones are slow for reasons of their own
        self._steps_seen = 0  # in this process: a resumed run warms up again
        self.layers = {net: parameterized_layers(model) for net, model in networks.items()}
        self.matmuls = {net: matmul_layers(model) for net, model in networks.items()}
        self.atlas: dict[str, dict[str, dict[str, FormatAtlas]]] = {
            net: {} for net in networks
        }  # network -> layer -> role
        self.hists: dict[str, dict[str, dict[str, GradHistogram]]] = {net: {k: {} for k in KINDS} for net in networks}
        # The sampled step's own counts, per layer, merged into `hists` when it ends; and each
        # sampled step's total per network and kind, so the record shows how the gradients move.
        self._this_step: dict[str, dict[str, dict[str, GradHistogram]]] = {
            net: {k: {} for k in KINDS} for net in networks
        }
        self.step_hists: dict[str, dict[str, list[tuple[int, GradHistogram]]]] = {
            net: {k: [] for k in KINDS} for net in networks
        }
        self.layer_of = {
            net: {id(p): name for name, m in layers for p in m.parameters(recurse=False)}
            for net, layers in self.layers.items()
        }
        self.lost: dict[str, dict[str, LostUpdates]] = {net: {} for net in networks}
        self.lost_steps: dict[str, list[dict]] = {net: [] for net in networks}  # per sampled step: step, lr, counts
        self.lost_counted: dict[str, str] = {}  # per network: "lost" (FP16 weights updated in place) or "would_be_lost"
        self._sampled_step: int | None = None  # the step being sampled, while it runs
        self.sampled_steps: list[int] = []
        self.loss_scales: dict[str, list[float]] = {net: [] for net in networks}
        self.step_seconds: dict[str, list[float]] = {"sampled": [], "plain": []}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._backward_of: tuple[str, float] | None = None  # the network whose loss is in backward, and its scale
        self._paused = False
        self._atlas_timed = False  # the first timed sampled step's cost has been logged
        self.current: dict = {
            "sampled": False,
            "seconds": None,
            "overhead": None,
        }  # the last step's, as step() yields it

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hooks of a sampled step ignore what runs inside (a step run again to trace an overflow)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def sampling(self, step: int) -> bool:
        return self.enabled and (step + 1) % self.every == 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[dict]:
        """Around one training step: hooks on for a sampled step; a sampled step and the one
        before it are timed with the device synchronized. Yields {"sampled": bool, "seconds":
        the sampled step's synchronized wall time, or None, "overhead": that time less the plain step
        before it's, or None}, filled in on exit."""
        sampled = self.sampling(step)
        timed = (sampled or self.sampling(step + 1)) and self._steps_seen >= self.warmup
        self._steps_seen += 1
        info: dict[str, bool | float | None] = {"sampled": sampled, "seconds": None, "overhead": None}
        self.current = info
        if not (sampled or timed):
            yield info
            return
        if timed:
            synchronize(self.device)
        t0 = time.perf_counter()
        if sampled:
            self._install()
            self._sampled_step = step
        try:
            yield info
        finally:
            self._remove()
            self._sampled_step = None
            if sampled:  # also when the step failed: its counts are in
                self.sampled_steps.append(step)
                self._close_step(step)
        if timed:
            synchronize(self.device)
            seconds = time.perf_counter() - t0
            self.step_seconds["sampled" if sampled else "plain"].append(seconds)
            info["seconds"] = seconds if sampled else None
            if sampled and self.step_seconds["plain"]:  # against the plain step timed just before it
                info["overhead"] = max(seconds - self.step_seconds["plain"][-1], 0.0)

    def around_step(self, step: int) -> contextlib.AbstractContextManager[dict]:
        return self.step(step)

    def start(self) -> None:
        # The atlas quantizes every product's tensors into each format on a sampled step, which can
        # cost minutes a step: say so before the run spends them.
        if self.atlas_on:
            log.info(self.atlas_cost())

    def after_step(self, done) -> None:
        if self.atlas_on and done.sampled and done.sampled_s is not None and not self._atlas_timed:
            self._atlas_timed = True
            plain = self.step_seconds["plain"][-1] if self.step_seconds["plain"] else None
            against = f", against {plain:.3g} s for the plain step before it" if plain is not None else ""
            to_come = ""
            if self.total_steps is not None:
                more = sum(self.sampling(s) for s in range(done.step + 1, self.total_steps))
                to_come = f"; {more} more sampled step(s) to come: about {more * done.sampled_s / 60:.3g} min"
            log.info(f"stats.formats: the first timed sampled step took {done.sampled_s:.3g} s{against}{to_come}")

    def atlas_cost(self) -> str:
        """The atlas's cost per sampled step as far as it is known before one: each format timed on
        ATLAS_PROBE values here, times the products' weights and weight gradients."""
        weights = sum(
            p.numel()
            for layers in self.matmuls.values()
            for _, module in layers
            for name, p in module.named_parameters(recurse=False)
            if name.startswith("weight")
        )
        probe = torch.randn(ATLAS_PROBE, device=self.device)
        FormatAtlas(self.formats, self.device).add(probe[:1024])  # first calls pay for their own set-up
        synchronize(self.device)
        t0 = time.perf_counter()
        FormatAtlas(self.formats, self.device).add(probe)
        synchronize(self.device)
        per_million = (time.perf_counter() - t0) / ATLAS_PROBE * 1e6
        names, values = ", ".join(f.name for f in self.formats), 2 * weights / 1e6
        return (
            f"stats.formats: {len(self.formats)} format(s) ({names}) cost about {per_million:.3g} s per million "
            f"values on this device; every {self.every} steps a sampled step passes through them each product's "
            f"weights and weight gradients ({values:.3g} M values: about {values * per_million:.3g} s) and, on "
            f"top of that, its inputs and activation gradients, which grow with the batch"
        )

    @contextlib.contextmanager
    def backward(self, network: str, scale_of: Callable[[], float]) -> Iterator[None]:
        """Around one network's backward: its activation gradients are counted as they pass, its
        weight gradients once they are complete. `scale_of`: the loss scale the backward runs with,
        asked only on a sampled step (a scale kept on the device is read back to answer)."""
        if not self._handles:
            yield
            return
        scale = scale_of()
        self._backward_of = (network, scale)
        try:
            yield
        finally:
            self._backward_of = None
        self.loss_scales[network].append(scale)
        if self.hist_on:
            for name, module in self.layers[network]:
                for p in module.parameters(recurse=False):
                    if p.grad is not None:
                        self._hist(network, "weight", name).add(p.grad, scale)
        if self.atlas_on:
            for name, module in self.matmuls[network]:
                axes = block_axes(module)
                for pname, p in module.named_parameters(recurse=False):
                    if pname.startswith("weight"):
                        self._atlas(network, name, "weight").add(p, 1.0, axes["weight"])
                        if p.grad is not None:
                            self._atlas(network, name, "weight_grad").add(p.grad, scale, axes["weight_grad"])

    @contextlib.contextmanager
    def update(self, network: str, engine: PrecisionEngine) -> Iterator[None]:
        """Around one network's update: on a sampled step, the engine counts per weight the
        updates made and lost (a skipped step makes none), summed here per layer."""
        if not (self.updates_on and self._sampled_step is not None):
            yield
            return
        self.lost_counted[network] = engine.lost_counted
        lr = float(engine.lr)  # the step's own: its update advances the schedule
        with engine.counting_lost() as counts:
            yield
        step = LostUpdates(self.device)
        for p, c in counts.items():
            self.lost[network].setdefault(self.layer_of[network].get(id(p), "(other)"), LostUpdates(self.device)).merge(
                c
            )
            step.merge(c)
        self.lost_steps[network].append({"step": self._sampled_step, "lr": lr, **step.summary()})

    def _install(self) -> None:
        # First among the hooks: a network's boundary hook casts FP16 outputs to FP32 (precision.py).
        if self.hist_on:
            for net, layers in self.layers.items():
                for name, module in layers:
                    self._handles.append(
                        module.register_forward_hook(functools.partial(self._on_forward, net, name), prepend=True)
                    )
        if self.atlas_on:
            for net, layers in self.matmuls.items():
                for name, module in layers:
                    self._handles.append(
                        module.register_forward_hook(
                            functools.partial(self._on_atlas_forward, net, name, block_axes(module)), prepend=True
                        )
                    )

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_forward(self, net: str, name: str, _module: nn.Module, _args, output) -> None:
        if self._paused:
            return
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(self._on_activation_grad, net, name))

    def _on_activation_grad(self, net: str, name: str, grad: torch.Tensor) -> None:
        # A network's layers also pass gradients of another network's loss (a GAN's generator
        # loss flows through the frozen discriminator): each network counts its own loss only.
        if self._backward_of is not None and self._backward_of[0] == net:
            self._hist(net, "activation", name).add(grad, self._backward_of[1])

    def _on_atlas_forward(self, net: str, name: str, axes: dict[str, int], module: nn.Module, args, output) -> None:
        if self._paused:
            return
        inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if inputs:  # an LSTM given a PackedSequence: its data is the first floating-point leaf
            self._atlas(net, name, "input").add(inputs[0], 1.0, axes["input"] if inputs[0].dim() > 1 else -1)
        if isinstance(module, BatchMatmul) and len(inputs) > 1:  # a @ b: b, reduced over its rows, is its "weight"
            self._atlas(net, name, "weight").add(inputs[1], 1.0, -2)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(
                    functools.partial(self._on_atlas_grad, net, name, axes["activation_grad"] if t.dim() > 1 else -1)
                )

    def _on_atlas_grad(self, net: str, name: str, axis: int, grad: torch.Tensor) -> None:
        if self._backward_of is not None and self._backward_of[0] == net:
            self._atlas(net, name, "activation_grad").add(grad, self._backward_of[1], axis)

    def _atlas(self, net: str, layer: str, role: str) -> FormatAtlas:
        roles = self.atlas[net].setdefault(layer, {})
        if role not in roles:
            roles[role] = FormatAtlas(self.formats, self.device)
        return roles[role]

    def _close_step(self, step: int) -> None:
        for net, kinds in self._this_step.items():
            for kind, layers in kinds.items():
                if layers:
                    total = GradHistogram(self.device)
                    for name, h in layers.items():
                        self._layer_total(net, kind, name).merge(h)
                        total.merge(h)
                    self.step_hists[net][kind].append((step, total))
                    layers.clear()

    def _layer_total(self, net: str, kind: str, layer: str) -> GradHistogram:
        return self._histogram_in(self.hists[net][kind], layer)

    def _hist(self, net: str, kind: str, layer: str) -> GradHistogram:
        """The sampled step's own histogram of one layer's gradients."""
        return self._histogram_in(self._this_step[net][kind], layer)

    def _histogram_in(self, layers: dict[str, GradHistogram], layer: str) -> GradHistogram:
        if layer not in layers:  # made once, not on every hook call
            layers[layer] = GradHistogram(self.device)
        return layers[layer]

    def summary(self, end: RunEnd | None = None) -> dict | None:
        if not self.enabled:
            return None
        networks: dict[str, dict] = {}
        for net, kinds in self.hists.items():
            networks[net] = {}
            for kind, layers in kinds.items():
                total = GradHistogram(self.device)
                for h in layers.values():
                    total.merge(h)
                networks[net][kind] = {
                    "total": total.summary(self.keep),
                    "layers": {name: h.summary(self.keep) for name, h in layers.items()},
                    "steps": [{"step": step, **h.summary(self.keep)} for step, h in self.step_hists[net][kind]],
                }
        updates = None
        if self.updates_on:
            updates = {
                "what": "docs/record.md#lost-updates",
                "networks": {
                    net: {
                        "counted": self.lost_counted[net],
                        "total": LostUpdates().merge_all(layers.values()).summary(),
                        "layers": {name: c.summary() for name, c in layers.items()},
                        "steps": list(self.lost_steps[net]),
                    }
                    if self.lost_steps[net]
                    else None  # no sampled step
                    for net, layers in self.lost.items()
                },
            }
        return {
            "every": self.every,
            "keep": self.keep,
            "grad_hist": self.hist_on,
            "lost_updates": updates,
            "atlas": self._atlas_summary() if self.atlas_on else None,
            "sampled_steps": list(self.sampled_steps),
            "loss_scales": {net: list(v) for net, v in self.loss_scales.items()},
            "values": (
                "unscaled: divided by the loss scale of their step's backward; "
                "values a scaled FP16 backward had already flushed count as zeros"
            ),
            "activation": "gradient of the loss with respect to the output of each module that owns parameters",
            "cost": self._cost(),
            "networks": networks if self.hist_on else {},
        }

    def _atlas_summary(self) -> dict:
        networks = {}
        for net, layers in self.atlas.items():
            totals: dict[str, FormatAtlas] = {}
            for roles in layers.values():
                for role, a in roles.items():
                    totals.setdefault(role, FormatAtlas(self.formats, self.device)).merge(a)
            networks[net] = {
                "total": {role: totals[role].summary(self.keep, with_bins=True) for role in ROLES if role in totals},
                "layers": {
                    layer: {role: roles[role].summary(self.keep) for role in ROLES if role in roles}
                    for layer, roles in layers.items()
                },
            }
        return {
            "formats": [f.name for f in self.formats],
            "roles": dict(ROLES),
            "what": "docs/record.md#the-numerics-atlas",
            "networks": networks,
        }

    def _cost(self) -> dict:
        sampled, plain = self.step_seconds["sampled"], self.step_seconds["plain"]
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {
            "sampled_step_s": med(sampled),
            "plain_step_s": med(plain),
            "ratio": med(sampled) / med(plain) if sampled and plain else None,  # type: ignore[operator]  # both non-empty
            "sampled_steps_timed": len(sampled),
            "plain_steps_timed": len(plain),
            "method": "docs/record.md#what-the-statistics-cost",
            **(
                {
                    "note": (
                        "every step was sampled (stats.every=1): "
                        "no plain step to compare with, and no step left for throughput"
                    )
                }
                if self.every == 1
                else {}
            ),
        }

    def state_dict(self) -> dict:
        return {
            "hists": {
                net: {kind: {name: h.state_dict() for name, h in layers.items()} for kind, layers in kinds.items()}
                for net, kinds in self.hists.items()
            },
            "sampled_steps": list(self.sampled_steps),
            "loss_scales": {net: list(v) for net, v in self.loss_scales.items()},
            "step_seconds": {k: list(v) for k, v in self.step_seconds.items()},
            "lost": {net: {name: c.counts.cpu() for name, c in layers.items()} for net, layers in self.lost.items()},
            "lost_steps": {net: list(v) for net, v in self.lost_steps.items()},
            "lost_counted": dict(self.lost_counted),
            "atlas": {
                net: {layer: {role: a.state_dict() for role, a in roles.items()} for layer, roles in layers.items()}
                for net, layers in self.atlas.items()
            },
            "step_hists": {
                net: {kind: [(step, h.state_dict()) for step, h in steps] for kind, steps in kinds.items()}
                for net, kinds in self.step_hists.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        for net, kinds in state["hists"].items():
            for kind, layers in kinds.items():
                for name, saved in layers.items():
                    self._layer_total(net, kind, name).load_state_dict(saved)
        for net, kinds in state["step_hists"].items():
            for kind, steps in kinds.items():
                self.step_hists[net][kind] = [(step, GradHistogram(self.device)) for step, _ in steps]
                for (_, h), (_, saved) in zip(self.step_hists[net][kind], steps):
                    h.load_state_dict(saved)
        self.sampled_steps = list(state["sampled_steps"])
        self.loss_scales = {net: list(v) for net, v in state["loss_scales"].items()}
        self.step_seconds = {k: list(v) for k, v in state["step_seconds"].items()}
        for net, layers in state["lost"].items():
            for name, counts in layers.items():
                self.lost[net].setdefault(name, LostUpdates(self.device)).counts = counts.to(self.device)
        self.lost_steps.update({net: list(v) for net, v in state["lost_steps"].items()})
        self.lost_counted.update(state["lost_counted"])
        for net, layers in state["atlas"].items():
            for layer, roles in layers.items():
                for role, saved in roles.items():
                    self._atlas(net, layer, role).load_state_dict(saved)
