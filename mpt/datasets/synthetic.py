"""Synthetic classification images: no files, learnable, generated once and kept on the device.

Each class has a smooth random template (a 4x4 pattern upsampled to the image size); a sample is
its class template plus Gaussian noise. A network that learns the templates beats chance quickly,
so a short run shows the metric move. Generation uses its own seeded CPU generator, so every device
and every precision mode sees the same pixels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ..distributed import Dist
from .sampling import EpochOrder, eval_starts, require_one_batch, validate_sample_counts

validate = validate_sample_counts


def make_images(n: int, num_classes: int, size: int, noise: float, generator: torch.Generator, templates: torch.Tensor):
    labels = torch.arange(n) % num_classes
    images = templates[labels] + noise * torch.randn(n, 3, size, size, generator=generator)
    return images, labels


class SyntheticImages(EpochOrder):
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device, shard: Dist = Dist()):
        self.batch_size, self.shard = schedule.batch_size, shard
        require_one_batch(data.train_samples, self.batch_size)
        size = schedule.image_size
        g = torch.Generator().manual_seed(10_000 + seed)
        coarse = torch.randn(data.num_classes, 3, 4, 4, generator=g)
        templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
        train = make_images(data.train_samples, data.num_classes, size, data.noise, g, templates)
        val = make_images(data.val_samples, data.num_classes, size, data.noise, g, templates)
        self.train_images, self.train_labels = (t.to(device) for t in train)
        self.val_images, self.val_labels = (t.to(device) for t in val)
        self.order = torch.Generator().manual_seed(20_000 + seed)
        self.steps_per_epoch = data.train_samples // self.batch_size
        self.info = {
            "num_classes": data.num_classes,
            "train_samples": data.train_samples,
            "val_samples": data.val_samples,
            "resident": True,
        }

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass in a fresh random order, from batch `start` (a resumed run's position)."""
        perm = torch.randperm(self.train_labels.shape[0], generator=self.begin_epoch()).to(self.train_labels.device)
        for i in range(start, self.steps_per_epoch):
            idx = perm[slice(*self.shard.shard(i * self.batch_size, (i + 1) * self.batch_size))]
            yield self.train_images[idx], self.train_labels[idx]

    def plain_train_images(self, n: int) -> torch.Tensor:
        """The first n training images (they are in no class order)."""
        return self.train_images[:n]

    def val(self, limit: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in eval_starts(self.val_labels.shape[0], self.batch_size, self.shard, limit):
            yield self.val_images[i : i + self.batch_size], self.val_labels[i : i + self.batch_size]


def build(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> SyntheticImages:
    return SyntheticImages(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
