"""One run on several processes: torchrun's environment, the process group, and the few
collectives the runner needs beyond DistributedDataParallel's own gradient all-reduce.

Under `torchrun --nproc_per_node=N -m mpt.runner.cli ...` every process runs the same config.
`schedule.batch_size` is the global batch: each rank trains on its own slice of every global batch
(the batch a single process would have drawn), so a run's samples do not depend on how many
processes share it. Rank 0 alone writes the record, the log and the checkpoints.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """In place, the element-wise maximum over ranks (an overflow anywhere is an overflow everywhere)."""
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t /= self.world_size
        return t

    def total(self, value: float, device: torch.device) -> float:
        """The sum over ranks of a host number."""
        return self._reduce_number(value, dist.ReduceOp.SUM, device)

    def largest(self, value: float, device: torch.device) -> float:
        return self._reduce_number(value, dist.ReduceOp.MAX, device)

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` is true on any rank."""
        return bool(self._reduce_number(float(flag), dist.ReduceOp.MAX, device))

    def _reduce_number(self, value: float, op, device: torch.device) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)  # on the device: NCCL reduces nothing else
        dist.all_reduce(t, op=op)
        return float(t)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t`, concatenated in rank order along `dim` (the global batch's rows)."""
        if not self.enabled:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order (evaluation's hypotheses and detections)."""
        if not self.enabled:
            return [obj]
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, obj)
        return parts

    def eval_batches(self, count: int) -> range:
        """This rank's part of `count` evaluation batches: batch i goes to rank i mod world size, so
        that the parts are disjoint, cover every batch, and differ in length by one at most."""
        return range(self.rank, count, self.world_size)

    def in_batch_order(self, per_batch: list[list[Any]]) -> list[Any]:
        """Items evaluated per batch on this rank (one list per batch of eval_batches), gathered from
        every rank and put back in the order of the batches, as one process would have made them
        (collective)."""
        parts = self.gather_objects(per_batch)
        merged: list[Any] = []
        for k in range(max((len(p) for p in parts), default=0)):
            for p in parts:
                if k < len(p):
                    merged += p[k]
        return merged

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def shard(self, start: int, stop: int) -> tuple[int, int]:
        """This rank's part of the positions [start, stop) of a global batch."""
        per = (stop - start) // self.world_size
        return start + self.rank * per, start + (self.rank + 1) * per


def allreduce_in(dtype: torch.dtype):
    """A DistributedDataParallel communication hook: each gradient bucket averaged in `dtype`
    (divided by the process count first, as torch's fp16_compress_hook does, so the sum cannot
    overflow where the mean does not), then written back in the bucket's own dtype."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None  # a hook runs only inside an initialised process group
        buffer = bucket.buffer()
        t = buffer.to(dtype).div_(group.size())
        future = dist.all_reduce(t, group=group, async_op=True).get_future()

        def back(f):
            buffer.copy_(f.value()[0])
            return buffer

        return future.then(back)

    return hook


def from_env() -> Dist:
    """The process's place in a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK), or a single process."""
    env = os.environ
    return Dist(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def setup(d: Dist, device: torch.device) -> None:
    """Join the process group (once per process: the runs of a sweep share it)."""
    if d.enabled and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend(device), device_id=device if device.type == "cuda" else None)


def teardown() -> None:
    """Leave the process group once the process's runs are done: the ranks meet once more, so that
    none closes its connections before its peers have read everything it sent, then the group is
    destroyed. Only after runs that ended normally: a failed rank must not wait for peers that may
    be stuck in a collective (torchtitan#1342)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End a torchrun rank without finalizing its interpreter.

    gloo's worker threads outlive destroy_process_group() (DistributedDataParallel keeps the group
    alive), and one may still hold the last reference to a collective's tensor, whose Python object
    it must release under the GIL. If the interpreter is finalizing by then, Python ends the thread
    inside C++ code that may not unwind, and the process aborts ("terminate called without an
    active exception", SIGABRT; a core dump shows ProcessGroupGloo::runLoop destroying an
    AsyncAllreduceWork, in gil_scoped_acquire, while the main thread is in Py_FinalizeEx). On a busy
    machine that worker can be that late. Everything the run writes is on disk by now (records and
    checkpoints are fsynced, the log is closed), so the process flushes its streams and exits.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
