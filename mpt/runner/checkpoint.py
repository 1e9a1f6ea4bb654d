"""Checkpoints: everything a run needs to continue as if it had never stopped.

Written through files.write_atomic, so a kill or a full disk mid-write leaves the previous
checkpoint whole (timm's habit). Whether a checkpoint belongs to this run is the loop's question
(it asks same_computation of the saved config on resume), not this module's.

A checkpoint is read with torch's weights-only unpickler: run folders are copied and shared between
people, and a full unpickler would run whatever a planted `checkpoint.pt` names. Everything a run
saves is tensors and plain Python values; numpy's RNG state is kept as a tensor for that reason.
A checkpoint is never deleted without being asked: one that will not be resumed is moved aside.
"""

from __future__ import annotations

import importlib
import pickle
import random
import re
import time
from pathlib import Path
from typing import cast

import numpy as np
import torch

from ..files import write_atomic
from . import upgrade

FILENAME = "checkpoint.pt"
STALE = ".stale-"  # checkpoint.pt.stale-<UTC time>: set aside, never resumed
# What every checkpoint a run writes holds; anything else is not an mpt checkpoint.
REQUIRED = {"config": dict, "step": int, "engines": dict, "rng": dict, "data": dict}
# Older checkpoints kept numpy's RNG state as an ndarray of uint32: these rebuild exactly that, and
# name no callable beyond numpy's own array constructor.
_NUMPY_GLOBALS = [
    importlib.import_module(
        "numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray"
    )._reconstruct,  # numpy 1: core
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]


def rng_state() -> dict:
    # legacy=True by default, a tuple: the stub's first overload says a dict
    kind, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        saved = (
            saved["kind"],
            saved["keys"].numpy().astype(np.uint32),
            saved["pos"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    np.random.set_state(saved)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, state: dict) -> Path:
    path = run_dir / FILENAME
    write_atomic(path, lambda f: torch.save(state, f))
    return path


class CorruptCheckpoint(Exception):
    """A checkpoint that cannot be read back; the message names it and how to start over."""


class UnsafeCheckpoint(CorruptCheckpoint):
    """A file whose unpickling would call something no checkpoint holds: refused, nothing run."""


def load(run_dir: Path) -> dict | None:
    """The folder's checkpoint, read without running any code it names; None if there is none."""
    path = run_dir / FILENAME
    if not path.exists():
        return None
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, MemoryError):  # the disk or the machine, not the file: a retry may read it
        raise
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        named = re.search(r"GLOBAL\s+([\w.]+)", str(e))
        if named:  # the weights-only unpickler stopped at a global before calling it
            what = named.group(1)
            raise UnsafeCheckpoint(
                f"{path} would call {what} when read, which no mpt checkpoint does: refused, nothing in it was run; "
                "remove it (or resume=false moves it aside) to start the run over"
            ) from None
        raise CorruptCheckpoint(
            f"{path} cannot be read ({type(e).__name__}: {first}); resume=false starts the run over"
        ) from e
    except Exception as e:  # torch.load raises whatever the unpickler or the zip reader met
        first = (str(e).strip().splitlines() or [""])[0]
        raise CorruptCheckpoint(
            f"{path} cannot be read ({type(e).__name__}: {first}); resume=false starts the run over"
        ) from e
    check(saved, path)
    return upgrade.checkpoint(saved)


def check(saved: object, path: Path) -> None:
    """Raises CorruptCheckpoint unless `saved` has the shape of a checkpoint a run wrote."""
    if not isinstance(saved, dict):
        raise CorruptCheckpoint(
            f"{path} holds a {type(saved).__name__}, not an mpt checkpoint; resume=false moves it aside"
        )
    missing = [k for k in REQUIRED if k not in saved]
    wrong = [k for k, kind in REQUIRED.items() if k in saved and not isinstance(saved[k], kind)]
    if missing or wrong:
        what = f"no {', '.join(missing)}" if missing else f"{', '.join(wrong)} of the wrong type"
        raise CorruptCheckpoint(f"{path} is not an mpt checkpoint ({what}); resume=false moves it aside")
    if saved["step"] < 0:
        raise CorruptCheckpoint(f"{path} is not an mpt checkpoint (step {saved['step']}); resume=false moves it aside")


def set_aside(run_dir: Path) -> Path | None:
    """Moves the folder's checkpoint to `checkpoint.pt.stale-<UTC time>`, where no run resumes it
    and nothing deletes it. Returns its new path (None: there was none)."""
    path = run_dir / FILENAME
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = run_dir / f"{FILENAME}{STALE}{stamp}", 1
    while target.exists():  # two in one second: neither overwrites the other
        target, n = run_dir / f"{FILENAME}{STALE}{stamp}-{n}", n + 1
    path.rename(target)
    return target
