"""Under torchrun: each network in DistributedDataParallel, and per-stream state held per rank.

A network that carries per-stream state between batches in buffers (bigLSTM's LSTM state) holds
each rank's own slice of the global batch; a checkpoint holds the whole batch's, gathered, so it
resumes with any number of processes.
"""

from __future__ import annotations

import inspect
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
    d = cfg.distributed
    if d.sync_batchnorm and device.type != "cuda":
        raise ConfigError(
            "distributed.sync_batchnorm=true: torch's SyncBatchNorm runs on CUDA only; "
            "on CPU processes each rank normalizes its own slice"
        )
    if d.static_graph and len(engines) > 1:
        raise ConfigError(
            f"distributed.static_graph=true: model={cfg.model.name} trains {len(engines)} networks whose "
            "forwards are not one per backward; set it false"
        )
    allreduce = cfg.precision.allreduce_dtype
    for name, engine in engines.items():
        if d.sync_batchnorm:  # BN modules swapped in place: the parameters stay the engine's
            engine.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(engine.model)
        # Broadcasting rank 0's per-stream buffers would overwrite each rank's own.
        broadcast = d.broadcast_buffers and not task.stream_buffers(name)
        # No device_ids: batches are already on the device, and DDP would move every tensor
        # argument there, GNMT's CPU sequence lengths included.
        ddp = DistributedDataParallel(
            engine.model,
            gradient_as_bucket_view=d.gradient_as_bucket_view,
            static_graph=d.static_graph,
            **buffer_sync(broadcast),
        )
        if allreduce is not None:
            ddp.register_comm_hook(None, allreduce_in(torch_dtype(allreduce)))
        task.set_network(name, ddp)


def buffer_sync(on: bool) -> dict[str, Any]:
    """DDP's keyword for the per-forward buffer broadcast: forward_sync_buffers where torch has it
    (its broadcast_buffers is deprecated there), broadcast_buffers before."""
    has_new = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if has_new else "broadcast_buffers": on}


def before_evaluation(task: Task, engines: dict[str, PrecisionEngine], dist: Dist) -> None:
    """Every rank scores its part of the set with one model: rank 0's buffers (batch-norm running
    statistics, which each rank updates from its own slice) are sent to every rank, per-stream
    buffers excepted (collective). Each DDP wrapper is told that its next forward needs no buffer
    broadcast of its own: a rank may score one batch fewer than another, or none, and would not
    meet the others in that collective."""
    for name, engine in engines.items():
        own = set(task.stream_buffers(name))
        for buffer_name, buffer in engine.model.named_buffers():
            if buffer_name not in own:
                torch.distributed.broadcast(buffer, src=0)
    for network in task.networks().values():
        ddp = getattr(network, "_orig_mod", network)  # under torch.compile, the wrapper it compiled
        if isinstance(ddp, DistributedDataParallel):
            ddp.require_forward_param_sync = False


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
