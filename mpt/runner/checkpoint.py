"""Checkpoints: everything a run needs to continue as if it had never stopped.

Written through files.write_atomic, so a kill or a full disk mid-write leaves the previous
checkpoint whole (timm's habit). Whether a checkpoint belongs to this run is the loop's question
(it asks same_computation of the saved config on resume), not this module's.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from ..files import write_atomic

FILENAME = "checkpoint.pt"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, state: dict) -> Path:
    path = run_dir / FILENAME
    write_atomic(path, lambda f: torch.save(state, f))
    return path


class CorruptCheckpoint(Exception):
    """A checkpoint that cannot be read back; the message names it and how to start over."""


def load(run_dir: Path) -> dict | None:
    path = run_dir / FILENAME
    if not path.exists():
        return None
    try:
        # Our own file, written by save(): RNG states and plain Python objects need the full unpickler.
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, MemoryError):  # the disk or the machine, not the file: a retry may read it
        raise
    except Exception as e:  # torch.load raises whatever the unpickler or the zip reader met
        first = (str(e).strip().splitlines() or [""])[0]
        raise CorruptCheckpoint(f"{path} cannot be read ({type(e).__name__}: {first}); resume=false starts the run over") from e
