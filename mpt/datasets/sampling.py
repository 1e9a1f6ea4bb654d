"""Epoch-keyed sampling shared by the on-disk loaders: a resumed run sees the samples, order and
augmentation an uninterrupted run would have seen."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Sampler


class SeededSamples(Dataset):
    """Samples keyed by (epoch, index), each augmented from its own seed: the same crops whatever
    the worker count, and again after a resume. The caller's RNG is left as it was."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((self.seed * 1_000_003 + epoch) * 100_000_007 + index)
            return self.dataset[index]


class EpochBatches(Sampler):
    """Batches of (epoch, index) in a fresh random order each epoch, from batch `start` on."""

    def __init__(self, size: int, batch_size: int, generator: torch.Generator):
        self.size, self.batch_size, self.generator = size, batch_size, generator
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.size // self.batch_size - self.start

    def __iter__(self):
        perm = torch.randperm(self.size, generator=self.generator).tolist()
        for b in range(self.start, self.size // self.batch_size):
            yield [(self.epoch, i) for i in perm[b * self.batch_size : (b + 1) * self.batch_size]]
