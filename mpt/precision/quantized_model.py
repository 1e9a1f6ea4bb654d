"""A network made to quantize its products: which module class each layer becomes, one Site per
layer (per weight of an LSTM), and the network's products as one object with their state
(QuantizedProducts), for the engine. Above both kinds of quantized module, so that neither
imports the other's."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from ..config import ConfigError
from .product_operands import Recipe, Site, recipe
from .quantized_lstm import QuantizedLSTM, fresh_cells
from .quantized_products import CONVOLUTIONS, BatchMatmul, QuantizedBatchMatmul, QuantizedLinear, _QuantizedConv


@functools.cache
def _quantized_class(cls: type) -> type:
    """The class a module of class `cls` becomes: the same module, its products quantized. A
    subclass with a forward of its own is refused: replacing it would change what it computes."""
    for base, quantized in (
        (nn.Linear, QuantizedLinear),
        (BatchMatmul, QuantizedBatchMatmul),
        (nn.LSTM, QuantizedLSTM),
        *((c, None) for c in CONVOLUTIONS),
    ):
        if not issubclass(cls, base):
            continue
        own = next(c for c in cls.__mro__ if "forward" in vars(c))
        if own not in (base, nn.modules.conv._ConvNd) and not (base is nn.LSTM and own is nn.RNNBase):
            raise ConfigError(
                f"quantized products: {cls.__name__} has a forward of its own; "
                f"only {base.__name__} itself can be quantized"
            )
        if quantized is None:
            return type(f"Quantized{cls.__name__}", (_QuantizedConv, cls), {})
        return quantized if cls is base else type(f"Quantized{cls.__name__}", (quantized, cls), {})
    raise TypeError(cls)


QUANTIZED_MODULES = (nn.Linear, *CONVOLUTIONS, BatchMatmul, nn.LSTM)


class QuantizedProducts:
    """One network's quantized products: its sites by module name, their state and their path."""

    def __init__(self, model: nn.Module, recipe: Recipe, fused_cell: Optional[str] = None):
        if (
            fused_cell is not None
        ):  # before this run's networks compile anything (the runner resets again for compile.backend)
            fresh_cells()
        self.recipe = recipe
        self.sites: dict[str, Site] = {}
        self.device = next(model.parameters(), torch.empty(0)).device  # where delayed scales live
        for name, module in model.named_modules():
            if not isinstance(module, QUANTIZED_MODULES):
                continue
            if isinstance(module, CONVOLUTIONS) and (module.padding_mode != "zeros" or isinstance(module.padding, str)):
                raise ConfigError(
                    f"quantized products: convolution {name or 'model'} "
                    f"pads with {module.padding_mode}/{module.padding}; only explicit zero padding is supported"
                )
            cls = _quantized_class(type(module))  # type: ignore[arg-type]  # mypy: a union of classes is not Hashable
            if isinstance(module, nn.LSTM):  # a site per weight: ih_l0, hh_l0, hr_l0, ih_l0_reverse, ...
                keys = [n.removeprefix("weight_") for n in module._flat_weights_names if n.startswith("weight_")]
                module.products_sites = {k: self._site(f"{name}.{k}") for k in keys}
                module.fused_cell = fused_cell  # type: ignore[assignment]  # a torch.compile backend, or None: eager
            else:
                module.products_site = self._site(name)  # type: ignore[assignment]  # nn.Module's stub: Tensor | Module
            module.__class__ = cls

    def _site(self, name: str) -> Site:
        site = self.sites[name] = Site(name, self.recipe, self.device)
        return site

    def end_step(self, reduce_max: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        """Delayed scaling: this step's amax into the histories, and the next step's scales. Under
        torchrun `reduce_max` takes each amax's maximum over the ranks (Transformer Engine's
        reduce_amax), in one collective, so that every rank quantizes alike."""
        states = [s for site in self.sites.values() for s in site.delayed.values()]
        if not states:
            return
        current = reduce_max(torch.stack([s.history[0] for s in states]))
        for state, amax in zip(states, current):
            state.history[0] = amax
        for site in self.sites.values():
            site.end_step()

    @contextlib.contextmanager
    def replaying(self, stepped: bool) -> Iterator[None]:
        """A step run again (the overflow trace) runs with the scales it ran with, those before the
        step's update if it `stepped`, and adds no amax."""
        states = [s for site in self.sites.values() for s in site.delayed.values()] if stepped else []
        for site in self.sites.values():
            site.observing = False
        for s in states:
            s.scale, s.last_scale = s.last_scale, s.scale
        try:
            yield
        finally:
            for s in states:
                s.scale, s.last_scale = s.last_scale, s.scale
            for site in self.sites.values():
                site.observing = True

    def paths(self) -> dict[str, str]:
        """Which arithmetic each layer's products took, of those that have run."""
        return {name: "+".join(sorted(site.paths)) for name, site in self.sites.items() if site.paths}

    def state_dict(self) -> dict:
        return {
            name: {role: s.state_dict() for role, s in site.delayed.items()}
            for name, site in self.sites.items()
            if site.delayed
        }

    def load_state_dict(self, state: dict) -> None:
        for name, roles in state.items():
            for role, saved in roles.items():
                self.sites[name].delayed[role].load_state_dict(saved)


def install(model: nn.Module, mode: DictConfig) -> Optional[QuantizedProducts]:
    r = recipe(mode)
    return None if r is None else QuantizedProducts(model, r, mode.products.fused_cell)
