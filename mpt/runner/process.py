"""What a run sets in its process before it builds anything: its device, seeds, math settings and, on a
CPU, the allocator's handling of freed memory."""

from __future__ import annotations

import random

import numpy as np
import torch
from omegaconf import DictConfig

from ..config import ConfigError
from ..distributed import Dist
from ..distributed import setup as setup_distributed
from ..host_memory import keep_freed
from ..precision.engine import check_device_support, set_fp32_math
from . import determinism


def resolve_device(name: str, dist: Dist = Dist()) -> torch.device:
    """`dist`: under torchrun or in a SLURM step, the process's place: its GPU is cuda:<local rank>."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and device.index is not None and dist.enabled:
        raise ConfigError(f"device={name}: under torchrun each process takes cuda:LOCAL_RANK; use device=cuda or auto")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        # Each process takes its node's local rank's GPU. A process that sees one GPU only was given
        # its own by the launcher (SLURM's --gpus-per-task or --gpu-bind): that one.
        count = torch.cuda.device_count()
        device = torch.device("cuda", dist.local_rank if count > 1 else 0)
        if dist.local_rank >= count > 1:
            raise ConfigError(
                f"device={name}: process {dist.local_rank} of its node sees {count} GPUs; "
                "start as many processes per node as it has GPUs"
            )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={name}: no CUDA device is available here (torch.cuda.is_available() is False); "
            "use device=cpu or auto"
        )
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={name}: expected auto, cpu, cuda or cuda:N")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare(cfg: DictConfig, dist: Dist) -> tuple[torch.device, dict]:
    """The run's device, with the process set for it: the process group, the seeds, determinism,
    cuDNN's benchmark and the FP32 math (returned as the engine set it)."""
    device = resolve_device(cfg.device, dist)
    check_device_support(cfg.precision, device)
    if cfg.schedule.batch_size % dist.world_size:
        raise ConfigError(
            f"schedule.batch_size={cfg.schedule.batch_size} is the global batch: "
            f"it does not divide among {dist.world_size} processes"
        )
    setup_distributed(dist, device)
    if device.type == "cpu":
        keep_freed()  # large temporaries reused, not faulted in afresh at every step
    seed_everything(cfg.seed)
    if cfg.deterministic:
        determinism.enable()
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not cfg.deterministic
    return device, set_fp32_math(cfg.precision.tf32)
