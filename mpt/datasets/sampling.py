"""Epoch-keyed sampling shared by the on-disk loaders: a resumed run sees the samples, order and
augmentation an uninterrupted run would have seen."""

from __future__ import annotations

import os
import signal
from typing import Any, Iterable, Iterator, Sized, cast

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, Sampler

from ..config import ConfigError, positive
from ..distributed import Dist
from ..preemption import signals as preemption_signals


def validate_sample_counts(cfg: DictConfig) -> None:
    """A synthetic source's sizes."""
    for key in ["data.num_classes", "data.train_samples", "data.val_samples"]:
        positive(cfg, key)


def require_one_batch(train_samples: int, batch_size: int) -> None:
    """A synthetic source made of fewer samples than a batch could never yield one."""
    if train_samples < batch_size:
        raise ConfigError(
            f"data.train_samples={train_samples}: fewer than one batch of schedule.batch_size={batch_size}"
        )


def default_workers() -> int:
    """Loader workers for data.num_workers=-1: the CPUs this process was given, less one for the
    process itself. Given: SLURM_CPUS_PER_TASK where SLURM set it, else the affinity mask (what a
    container or taskset allows, not the machine's count) bounded by a cgroup CPU quota; either
    shared among torchrun's processes on the node (LOCAL_WORLD_SIZE)."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        cpus = int(slurm)
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        quota = cgroup_cpu_quota()
        cpus = min(cpus, quota) if quota is not None else cpus
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    cpus //= int(local) if local.isdigit() and int(local) > 0 else 1
    return max(cpus - 1, 0)


def cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """The CPUs a cgroup v2 quota allows (a container limited by quota sees every CPU in its mask),
    rounded up; None without one."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, -(-int(quota) // int(period)))


def shielded_worker(worker_id: int) -> None:
    """A data-loader worker ignores the preemption signals: SLURM signals every process of a job,
    and a worker that died of it would fail the run before it could stop at a step with a
    checkpoint. The main process ends its workers itself (and they end when it dies)."""
    for sig in preemption_signals():
        signal.signal(sig, signal.SIG_IGN)


class SeededSamples(Dataset):
    """Samples keyed by (epoch, index), each augmented from its own seed: the same crops whatever
    the worker count, and again after a resume. The caller's RNG is left as it was."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # the loaders' datasets all have a length

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            # Folded into torch's 64-bit seeds: unchanged below 2**64 (every seed under about 184,000),
            # where larger seeds overflowed it.
            torch.manual_seed(((self.seed * 1_000_003 + epoch) * 100_000_007 + index) % 2**64)
            return self.dataset[index]


def eval_starts(size: int, batch_size: int, shard: Dist, limit: int | None = None) -> Iterator[int]:
    """The first positions of this rank's evaluation batches: of the first `limit` batches (all of
    them: None) of `size` samples in order, batch i is rank i mod world size's (Dist.eval_batches)."""
    count = -(-size // batch_size)
    for b in shard.eval_batches(count if limit is None else min(count, limit)):
        yield b * batch_size


class EvalBatches(Sampler):
    """A DataLoader's evaluation batches, in order: this rank's (eval_starts), of the first `limit`
    (set before each pass), so that a rank's workers load no other rank's images."""

    def __init__(self, size: int, batch_size: int, shard: Dist = Dist(), order: list[int] | None = None):
        self.size, self.batch_size, self.shard, self.order = size, batch_size, shard, order
        self.limit: int | None = None

    def __iter__(self):
        for first in eval_starts(self.size, self.batch_size, self.shard, self.limit):
            positions = range(first, min(first + self.batch_size, self.size))
            yield [self.order[i] for i in positions] if self.order is not None else list(positions)

    def __len__(self) -> int:
        return len(list(eval_starts(self.size, self.batch_size, self.shard, self.limit)))


class EpochBatches(Sampler):
    """Batches of (epoch, index) in a fresh random order each epoch, from batch `start` on. Under
    torchrun each rank takes its slice of every global batch of `batch_size` (the distributed sampler)."""

    def __init__(self, size: int, batch_size: int, generator: torch.Generator, shard: Dist = Dist()):
        self.size, self.batch_size, self.generator, self.shard = size, batch_size, generator, shard
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.size // self.batch_size - self.start

    def __iter__(self):
        perm = torch.randperm(self.size, generator=self.generator).tolist()
        for b in range(self.start, self.size // self.batch_size):
            first, stop = self.shard.shard(b * self.batch_size, (b + 1) * self.batch_size)
            yield [(self.epoch, i) for i in perm[first:stop]]


class EpochOrder:
    """The resume state of a source whose epochs are shuffled by the generator `order`: its state
    when the current epoch began (`begin_epoch` records it), from which `epoch(e, start)` redraws
    the same order and skips to the resumed batch. Every source is one, so its defaults (no test
    split, nothing to close) are the DataSource's."""

    order: torch.Generator

    def begin_epoch(self) -> torch.Generator:
        self.epoch_start_state = self.order.get_state()
        return self.order

    def state_dict(self) -> dict:
        """The order generator as it was when the current epoch began."""
        return {"order": self.epoch_start_state}

    def load_state_dict(self, state: dict) -> None:
        self.order.set_state(state["order"])

    def test(self) -> Iterator[Any] | None:
        """The test split's batches (data.test_split), scored once at the end; None: no test split."""
        return None

    def close(self) -> None:
        """Release what the source holds beyond memory (worker processes)."""


class LoaderData(EpochOrder):
    """A DataSource over two DataLoaders: `train_loader` batched by `batches` (EpochBatches drawing
    from `order`) and `val_loader`; `to_device` moves one loaded batch to the run's device."""

    train_loader: DataLoader
    val_loader: DataLoader  # batched by val_batches
    batches: EpochBatches
    val_batches: EvalBatches

    def to_device(self, batch: Any) -> Any:
        raise NotImplementedError

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """One pass in a fresh random order, from batch `start` (a resumed run's position)."""
        self.begin_epoch()
        self.batches.set_epoch(epoch, start)
        return map(self.to_device, self.train_loader)

    def val(self, limit: int | None = None) -> Iterable[Any]:
        self.val_batches.limit = limit
        return map(self.to_device, self.val_loader)

    def close(self) -> None:
        """End the persistent workers now: left to the interpreter's exit, multiprocessing would
        ask them with SIGTERM, which shielded_worker makes them ignore. DataLoader has no public
        way to end its workers, hence its private iterator."""
        for loader in (self.train_loader, self.val_loader):
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
            loader._iterator = None
