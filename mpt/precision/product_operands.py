"""The operands of quantized matrix products (quantized_products.py): a mode's recipe for them, an
operand's round trip through its format, and the scales it takes there.

Scaling, per operand of each call:
- `tensor`: scale = max of the format / amax of the operand, in float64 rounded to FP32 (amax
  floored at 1e-12), the operand is multiplied by it in FP32, rounded to the format (saturating)
  and divided by it again: torchao's tensorwise dynamic scaling, Transformer Engine's current
  scaling;
- `delayed`: Transformer Engine's DelayedScaling. Each operand role of each layer keeps a history
  of the amax its calls saw, one slot per step (the largest over the step's calls); the step's
  products use the scale computed at the end of the last step, scale = (max / amax) / 2^margin,
  amax being the history's maximum (or its newest entry), the old scale kept where that amax is 0
  or not finite. The histories and scales are state, saved in checkpoints;
- `block`: the OCP Microscaling formats (formats.py): blocks of 32 along the product's reduction
  axis share a power-of-two scale, so each of the three products quantizes its operands along its
  own axis (the layout of Microsoft's microxcaling emulation: a convolution's channels for the
  output and the input gradient, the batch for the weight gradient).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, cast

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ..config import ConfigError
from .formats import FORMATS, BlockFormat, FloatFormat, _exp2, amax_exponents, get_format, quantize, round_nearest

EPS = 1e-12  # torchao's floor on an amax, so that an all-zero operand gets a finite scale
SCALINGS = ("tensor", "delayed", "block")
REDUCTIONS = ("max", "most_recent")
FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Recipe:
    forward: FloatFormat | BlockFormat
    backward: FloatFormat | BlockFormat
    scaling: str
    history: int
    margin: int
    reduction: str

    def format(self, role: str) -> FloatFormat | BlockFormat:
        return self.backward if role == "grad_output" else self.forward


def recipe(mode: DictConfig) -> Optional[Recipe]:
    """The mode's recipe for its products, or None where it leaves them alone."""
    p = mode.products
    if p.forward is None:
        return None
    return Recipe(get_format(p.forward), get_format(p.backward), p.scaling, p.amax_history, p.margin, p.amax_reduction)


def validate(mode: DictConfig) -> None:
    """Raises ConfigError naming the first bad setting of `precision.products`."""
    p = mode.products
    if p.forward is None:
        if p.backward is not None:
            raise ConfigError(f"precision.products.backward={p.backward}: needs precision.products.forward too")
        if p.fused_cell is not None:
            raise ConfigError(
                f"precision.products.fused_cell={p.fused_cell}: "
                "only the quantized LSTM of an FP8 or MX mode has a cell of its own; "
                "set precision.products.forward, or leave fused_cell null"
            )
        return
    if p.fused_cell is not None:
        from torch._dynamo import list_backends  # only when asked for

        known = list_backends(exclude_tags=())
        if p.fused_cell not in known:
            raise ConfigError(
                f"precision.products.fused_cell={p.fused_cell}: no such torch.compile backend; "
                f"choose one of {', '.join(known)}"
            )
    for key in ("forward", "backward"):
        name = p[key]
        if name is None or name not in FORMATS:
            raise ConfigError(f"precision.products.{key}={name}: choose a format from {', '.join(FORMATS)}")
    if p.scaling not in SCALINGS:
        raise ConfigError(f"precision.products.scaling={p.scaling}: choose one of {', '.join(SCALINGS)}")
    blocks = [isinstance(FORMATS[p[k]], BlockFormat) for k in ("forward", "backward")]
    if (p.scaling == "block") != all(blocks) or any(blocks) != all(blocks):
        kinds = "MX block formats" if p.scaling == "block" else "scalar formats"
        raise ConfigError(
            f"precision.products: scaling={p.scaling} needs {kinds} for both operands "
            f"(got forward={p.forward}, backward={p.backward}); block scaling goes with mx* formats only"
        )
    if p.amax_history < 1:
        raise ConfigError(f"precision.products.amax_history={p.amax_history}: must be at least 1")
    if p.amax_reduction not in REDUCTIONS:
        raise ConfigError(
            f"precision.products.amax_reduction={p.amax_reduction}: choose one of {', '.join(REDUCTIONS)}"
        )
    if mode.param_dtype.name != "float32":
        raise ConfigError(
            f"precision {mode.name}: quantized products need FP32 weights (the master copy); "
            f"got param_dtype={mode.param_dtype.name}"
        )


# torch's own FP8 dtypes, for torch._scaled_mm on a GPU. On a CPU their casts are slow (decoding
# FP8 back to FP32 takes 30 times a multiplication), so rounding there is round_to's.
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def to_fp8(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """x in torch's FP8 dtype for `fmt`, saturating."""
    return x.float().clamp(-fmt.max, fmt.max).to(TORCH_FP8[fmt.name])


def round_to(x: torch.Tensor, fmt: FloatFormat, inplace: bool = False) -> torch.Tensor:
    """formats.quantize(x, fmt), the values only, and for a format that saturates in a few FP32
    operations (formats.round_nearest clamped at the largest value; `inplace` as there)."""
    if fmt.overflow != "saturate":
        return quantize(x, fmt)
    return round_nearest(x.float(), fmt, limit=fmt.max, inplace=inplace and x.dtype == torch.float32)


def round_blocks(x: torch.Tensor, fmt: BlockFormat, axis: int) -> torch.Tensor:
    """formats.quantize(x, fmt, axis=axis) for an MX format, through round_to on v / X: v / X is
    exact (X a power of two) wherever it matters, the quotient being an FP32 subnormal only far
    below the element's smallest subnormal, where both round to zero."""
    moved = x.float().movedim(axis, -1)
    n, pad = moved.shape[-1], (-moved.shape[-1]) % fmt.block
    # Contiguous along the axis: the result keeps that layout (channels-last for a convolution's
    # channels), which the product's kernel sums in.
    blocks = (F.pad(moved, (0, pad)) if pad else moved).contiguous().unflatten(-1, (-1, fmt.block))
    amax = _amax(blocks, -1)  # NaN where a block holds one
    exps = amax_exponents(amax, fmt)
    # Every step but the first in place: on a CPU each fresh temporary costs more than its arithmetic.
    values = round_to(blocks * _exp2(-exps), fmt.element, inplace=True).mul_(_exp2(exps))
    values.masked_fill_(~torch.isfinite(amax), torch.nan)  # a NaN scale: the block is NaN
    return values.flatten(-2)[..., :n].movedim(-1, axis)


def _amax(t: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """t.abs().amax(dim) (kept), NaN included, without a temporary of t's size."""
    lo, hi = torch.aminmax(t, dim=dim, keepdim=dim is not None)
    return torch.maximum(-lo, hi)


def tensor_scale(t: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """torchao's tensorwise scale: max / amax, in float64, rounded to FP32."""
    amax = _amax(t.detach()).double()
    return (fmt.max / amax.clamp(min=EPS)).float()


def scaled(t: torch.Tensor, fmt: FloatFormat, scale: torch.Tensor) -> torch.Tensor:
    """t's value after a round trip through `fmt` under a per-tensor scale: q(t * s) / s in FP32."""
    return round_to(t.float() * scale, fmt, inplace=True).div_(scale)


class DelayedScale:
    """One operand role's delayed scaling: Transformer Engine's amax history and scale recurrence."""

    def __init__(self, length: int, device: torch.device):
        self.history = torch.zeros(length, device=device)  # slot 0: this step's amax
        self.scale = torch.ones((), device=device)
        self.last_scale = self.scale  # the step before's: a step run again runs with it

    def observe(self, t: torch.Tensor) -> None:
        amax = t.detach().abs().amax().float() if t.numel() else torch.zeros((), device=t.device)
        self.history[0] = torch.maximum(self.history[0], amax)

    def update(self, fmt: FloatFormat, margin: int, reduction: str) -> None:
        amax = self.history.max() if reduction == "max" else self.history[0].clone()
        sf = (fmt.max / amax) / 2.0**margin
        sf = torch.where(amax > 0.0, sf, self.scale)
        sf = torch.where(torch.isfinite(amax), sf, self.scale)
        self.last_scale, self.scale = self.scale, torch.where(torch.isinf(sf), torch.full_like(sf, FP32_MAX), sf)
        if len(self.history) > 1:
            self.history = torch.roll(self.history, -1, 0)
        self.history[0] = 0.0

    def state_dict(self) -> dict:
        return {"history": self.history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.history = state["history"].to(self.history.device).clone()
        self.scale = self.last_scale = state["scale"].to(self.scale.device).clone()


def _labelled(layer: str, role: str) -> contextlib.AbstractContextManager:
    """A weight made into an operand, as a region of a torch.profiler trace (scripts/profile_step.py
    counts them per step); other operands are not labelled."""
    if role != "weight":
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"mpt.weight_operand {layer}")


class Site:
    """The operands of one layer's products: how they are quantized, and their delayed scales."""

    ROLES = ("input", "weight", "grad_output")  # a batched product's second operand is its "weight"

    def __init__(self, name: str, recipe: Recipe, device: torch.device):
        self.name = name
        self.recipe = recipe
        self.delayed = (
            {role: DelayedScale(recipe.history, device) for role in self.ROLES} if recipe.scaling == "delayed" else {}
        )
        self.observing = True  # off while a step is run again (the overflow trace)
        self.paths: set[str] = set()  # the arithmetic its products took, as they ran

    def operand(
        self, t: torch.Tensor, role: str, axis: int, scale: Optional[torch.Tensor] = None, observe: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """t's FP32 values as this product's operand `role`, reduced along `axis`, and the
        per-tensor scale they took (None for block formats). `scale`: reuse that one (the
        backward's products take the forward's)."""
        with _labelled(self.name, role):
            fmt = self.recipe.format(role)
            if isinstance(fmt, BlockFormat):
                return round_blocks(t, fmt, axis), None
            if t.numel() == 0:
                return t.float(), torch.ones((), device=t.device)
            scale = self.scale(t, role, observe) if scale is None else scale
            return scaled(t, fmt, scale), scale

    def reused(self) -> "ReusedWeight":
        return ReusedWeight(self)

    def fp8(
        self, t: torch.Tensor, role: str, transposed: bool, scale: Optional[torch.Tensor] = None, observe: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """t (or its transpose) in torch's FP8 dtype under its per-tensor scale, contiguous: an
        operand of torch._scaled_mm, and the scale it took (`scale`: reuse that one)."""
        with _labelled(self.name, role):
            fmt = cast(FloatFormat, self.recipe.format(role))  # the scaled_mm path: per-tensor scales, scalar formats
            scale = self.scale(t, role, observe) if scale is None else scale
            return to_fp8((t.t() if transposed else t).float() * scale, fmt).contiguous(), scale

    def scale(self, t: torch.Tensor, role: str, observe: bool = False) -> torch.Tensor:
        """The per-tensor scale of t as operand `role`: its own (tensor) or its role's (delayed)."""
        r = self.recipe
        if r.scaling == "tensor":
            return tensor_scale(t, cast(FloatFormat, r.format(role)))  # validated: per-tensor scales, scalar formats
        state = self.delayed[role]
        if observe and self.observing:
            state.observe(t)
        return state.scale

    def end_step(self) -> None:
        for role, state in self.delayed.items():
            fmt = cast(FloatFormat, self.recipe.format(role))  # validated: delayed scales, scalar formats
            state.update(fmt, self.recipe.margin, self.recipe.reduction)


class ReusedWeight:
    """One weight's operands for a series of products that all take it unchanged: an LSTM's
    recurrent products, one per time step of a forward, and their backwards. Each form (the weight
    along each reduction axis, as the products quantize it) is made once, at its first use, and
    reused. The values are each call's own: a weight's scale and blocks depend on the weight alone,
    a backward reuses its forward's scale, and a delayed history keeps the largest amax its step saw,
    which repeating the same weight does not change."""

    def __init__(self, site: Site):
        self.site = site
        self.forms: dict[tuple, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self.fp8_forms: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # torch._scaled_mm's operands

    def operand(
        self, t: torch.Tensor, role: str, axis: int, scale: Optional[torch.Tensor] = None, observe: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        # A per-tensor scale makes one form for every axis; blocks lie along the axis.
        key = (role, axis % t.dim() if isinstance(self.site.recipe.format(role), BlockFormat) else None)
        if key not in self.forms:
            self.forms[key] = self.site.operand(t, role, axis, scale=scale, observe=observe)
        return self.forms[key]

    def fp8(
        self, t: torch.Tensor, role: str, transposed: bool, scale: Optional[torch.Tensor] = None, observe: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Site.fp8, made once: the forward's form, and its transpose at the first backward."""
        key = ("fp8", role, transposed)
        if key not in self.fp8_forms:
            self.fp8_forms[key] = self.site.fp8(t, role, transposed, scale=scale, observe=observe)
        return self.fp8_forms[key]
