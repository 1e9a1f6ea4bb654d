"""One run on several processes: the launcher's environment (torchrun's, or a SLURM step's), the
process group, and the few collectives the runner needs beyond DistributedDataParallel's own
gradient all-reduce.

Under `torchrun --nproc_per_node=N -m mpt.runner.cli ...`, or as the N tasks of an `srun` step
(hydra-submitit-launcher's jobs are such steps), every process runs the same config.
`schedule.batch_size` is the global batch: each rank trains on its own slice of every global batch
(the batch a single process would have drawn), so a run's samples do not depend on how many
processes share it. Rank 0 alone writes the record, the log and the checkpoints.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str | None = None  # who started the ranks: "torchrun" or "slurm" (None: a single process)

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


class LaunchError(ValueError):
    """A launcher's variables that do not describe a place in a job (one line, naming the variable)."""


def _whole(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name, "")
    if text == "" and default is not None:
        return default
    if text == "":
        raise LaunchError(f"{name} is not set")
    try:
        return int(text)
    except ValueError:
        raise LaunchError(f"{name}={text!r}: expected a whole number") from None


# torchrun's variables (any env:// launcher's); they win over SLURM's, which torchrun inherits when
# srun starts it (the multi-node recipe: one torchrun per node, scripts/slurm/multinode.sbatch).
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def from_env(env: Mapping[str, str] | None = None) -> Dist:
    """The process's place in its job: torchrun's RANK, WORLD_SIZE and LOCAL_RANK where set; else,
    in an `srun` step of several tasks, SLURM's SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID;
    else a single process.

    Only srun sets the step's variables (SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST, ...): a batch
    script or an `salloc` shell has SLURM_JOB_ID, SLURM_NTASKS and even SLURM_PROCID=0, but it is
    one process, and a plain `mpt-run` there stays one. A step of one task (`srun -n1`, salloc's
    interactive step) is one process too."""
    env = os.environ if env is None else env
    if any(name in env for name in TORCHRUN):
        rank, world, local = (_whole(env, n, default) for n, default in zip(TORCHRUN, (0, 1, 0)))
        names, launcher = TORCHRUN, "torchrun"
    elif _whole(env, "SLURM_STEP_NUM_TASKS", 1) > 1:
        names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
        rank, world, local = (_whole(env, n) for n in names)
        launcher = "slurm"
        rendezvous(env)  # an unreadable node list fails here, in one line, not in init_process_group
    else:
        return Dist()
    if world < 1:
        raise LaunchError(f"{names[1]}={world}: expected at least 1")
    if not 0 <= rank < world:
        raise LaunchError(f"{names[0]}={rank}: not a rank of {names[1]}={world} processes (0 to {world - 1})")
    if not 0 <= local < world:
        raise LaunchError(f"{names[2]}={local}: not a local rank of {names[1]}={world} processes")
    return Dist(rank, world, local, launcher if world > 1 else None)


_RANGES = r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*"  # inside a host list's brackets: 003-005,010
_HOST = rf"(?:[A-Za-z0-9._-]|\[{_RANGES}\])+"


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compressed host list: `gpu[003-005,010],cpu7` -> `gpu003`,
    `rack[1-2]-n[08-09]` -> `rack1-n08` (each bracket's first number, its zero padding kept: the
    host `scontrol show hostnames` prints first)."""
    first = re.match(r"(?:[^,\[\]]|\[[^\[\]]*\])*", nodelist)  # up to the first comma outside brackets
    assert first is not None  # the pattern matches the empty string
    whole = nodelist[first.end() : first.end() + 1] in ("", ",")  # not stopped by a bracket left open
    if whole and re.fullmatch(_HOST, first.group().strip()):
        return re.sub(r"\[(\d+)[^\]]*\]", r"\1", first.group().strip())
    raise LaunchError(f"{nodelist!r}: not a SLURM host list such as gpu[003-005,010],cpu7")


def default_port(job_id: int) -> int:
    """A rendezvous port of the job's own, 20000 to 39999, so that two jobs sharing a first node
    (each with its own id) do not meet on one port; MASTER_PORT chooses another."""
    return 20000 + job_id % 20000


def rendezvous(env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT for a SLURM step's env:// rendezvous, where they are not set: the
    step's first node (task 0's, under SLURM's block and cyclic distributions) and default_port."""
    out = {}
    if not env.get("MASTER_ADDR"):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise LaunchError("SLURM_STEP_NODELIST is not set: set MASTER_ADDR to the host of rank 0")
        out["MASTER_ADDR"] = first_host(nodelist)
    if not env.get("MASTER_PORT"):
        if not env.get("SLURM_JOB_ID"):
            raise LaunchError("SLURM_JOB_ID is not set: set MASTER_PORT to a free port on the host of rank 0")
        out["MASTER_PORT"] = str(default_port(_whole(env, "SLURM_JOB_ID")))
    else:
        _whole(env, "MASTER_PORT")  # one line here rather than a traceback from the TCP store
    return out


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def setup(d: Dist, device: torch.device) -> None:
    """Join the process group (once per process: the runs of a sweep share it)."""
    if d.enabled and not dist.is_initialized():
        if d.launcher == "slurm":  # torchrun sets these itself; srun does not
            os.environ.update(rendezvous(os.environ))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # The rank and world size given, not read from RANK and WORLD_SIZE: srun sets neither.
        dist.init_process_group(
            backend(device),
            rank=d.rank,
            world_size=d.world_size,
            device_id=device if device.type == "cuda" else None,
        )


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
