"""Under torchrun: each network in DistributedDataParallel, and per-stream state held per rank.

A network that carries per-stream state between batches in buffers (bigLSTM's LSTM state) holds
each rank's own slice of the global batch; a checkpoint holds the whole batch's, gathered, so it
resumes with any number of processes.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel

from ..config import ConfigError
from ..distributed import Dist, allreduce_in
from ..models import Task
from ..precision.engine import PrecisionEngine, torch_dtype


def wrap(cfg: DictConfig, task: Task, engines: dict[str, PrecisionEngine], device: torch.device) -> None:
    """The task trains through each wrapper, whose backward all-reduces (averages) the gradients;
    the engine keeps the network itself."""
    if cfg.distributed.sync_batchnorm and device.type != "cuda":
        raise ConfigError(
            "distributed.sync_batchnorm=true: torch's SyncBatchNorm runs on CUDA only; "
            "on CPU processes each rank normalizes its own slice"
        )
    allreduce = cfg.precision.allreduce_dtype
    for name, engine in engines.items():
        if cfg.distributed.sync_batchnorm:  # BN modules swapped in place: the parameters stay the engine's
            engine.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(engine.model)
        # Broadcasting rank 0's per-stream buffers would overwrite each rank's own.
        rank_local: dict[str, Any] = {"broadcast_buffers": False} if task.stream_buffers(name) else {}
        # No device_ids: batches are already on the device, and DDP would move every tensor
        # argument there, GNMT's CPU sequence lengths included.
        ddp = DistributedDataParallel(engine.model, **rank_local)
        if allreduce is not None:
            ddp.register_comm_hook(None, allreduce_in(torch_dtype(allreduce)))
        task.set_network(name, ddp)


def model_state(task: Task, dist: Dist, network: str, model: torch.nn.Module) -> dict:
    """The network's state dict, with per-stream buffers gathered from every rank (collective)."""
    state = model.state_dict()
    for name, dim in task.stream_buffers(network).items():
        state[name] = dist.gather(state[name], dim)
    return state


def own_rows(task: Task, dist: Dist, network: str, model: torch.nn.Module, state: dict) -> dict:
    """A saved state dict with this rank's slice of each per-stream buffer."""
    own = model.state_dict()
    state = dict(state)
    for name, dim in task.stream_buffers(network).items():
        rows, saved_rows = own[name].shape[dim], state[name].shape[dim]
        if saved_rows != rows and saved_rows == rows * dist.world_size:
            start, _ = dist.shard(0, saved_rows)
            state[name] = state[name].narrow(dim, start, rows)
    return state
