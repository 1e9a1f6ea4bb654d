"""How a run ends when it does not end `ok`: the checks that find a divergence, and the status and
message of a failure."""

from __future__ import annotations

import torch

from ..distributed import Dist
from ..precision.engine import PrecisionEngine
from ..precision.scaler import Diverged


def failure(e: BaseException, batch_size: int) -> tuple[str, str]:
    """A record's status and message for an exception: `oom` naming the batch size, else `error`."""
    text = str(e).strip()
    if "Original Traceback" in text:  # raised in a data-loader worker: the last line is the error itself
        text = text.splitlines()[-1]
    first = text.splitlines()[0] if text else ""
    # torch's CPU allocator raises a RuntimeError, not torch.OutOfMemoryError
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "DefaultCPUAllocator: can't allocate memory" in first:
        return (
            "oom",
            f"out of memory at schedule.batch_size={batch_size}; try a smaller batch ({type(e).__name__}: {first})",
        )
    return "error", first if "Original Traceback" in str(e) else f"{type(e).__name__}: {first}"


def check_weights(engines: dict[str, PrecisionEngine], dist: Dist, step: int) -> None:
    """Raises Diverged if a network's weights, masters or floating-point buffers are not finite."""
    for name, engine in engines.items():
        # Buffers too: a forward overflow on a skipped step still updates batch-norm statistics.
        tensors = [
            *engine.model.parameters(),
            *engine.master_weights(),
            *(b for b in engine.model.buffers() if b.is_floating_point()),
        ]
        finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all()
        # Buffers can differ between ranks (batch-norm statistics, per-stream state): one decision for all.
        if dist.reduce_max((~finite).float().reshape(1)).item():
            raise Diverged(
                f"non-finite weights or batch-norm statistics in {name} by step {step} ({non_finite(engine)})",
                step=step,
            )


def non_finite(engine: PrecisionEngine) -> str:
    """Which of a network's tensors are not finite, named, for a divergence's message."""
    named = [
        *((n, "weight") for n, t in engine.model.named_parameters() if not torch.isfinite(t).all()),
        *(
            (n, "buffer")
            for n, t in engine.model.named_buffers()
            if t.is_floating_point() and not torch.isfinite(t).all()
        ),
    ]
    masters = sum(not torch.isfinite(m).all() for m in engine.master_weights())
    if not named and not masters:
        return "all finite on this process: another process's"
    parts = (
        [f"{named[0][0]} ({named[0][1]})" + (f" and {len(named) - 1} more" if len(named) > 1 else "")] if named else []
    )
    return "; ".join(parts + ([f"{masters} FP32 master weight{'s' * (masters != 1)}"] if masters else []))


def check_trained(engines: dict[str, PrecisionEngine], step: int) -> None:
    """A run whose every step was skipped trained nothing: it ends `diverged`, never `ok`."""
    for name, engine in engines.items():
        why = engine.scaler.untrained()
        if why is not None:
            raise Diverged((f"{name}: " if len(engines) > 1 else "") + why, step=step)


def earliest(a: Diverged | None, b: Diverged | None) -> Diverged | None:
    """Of two divergences, the one at the earlier step (a step known before one that is not)."""
    if a is None or b is None:
        return a or b
    if b.step is not None and (a.step is None or b.step < a.step):
        return b
    return a
