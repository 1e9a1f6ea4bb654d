"""Synthetic GAN images: one soft-edged disc per image, no files, generated once and kept on the device.

Each image is a disc of a random bright colour, centre and radius (15% to 35% of the side, centred
so that most of it lies inside) on a random dark-grey background, plus Gaussian pixel noise. The
distribution is simple enough for a DCGAN to learn in a short run (samples turn from noise into
discs), yet has a few continuous factors to cover, so a collapsed generator shows. Generated from a
seeded CPU generator, so every device and every precision mode sees the same pixels; stored as uint8
(512 images of 128x128 take 25 MB) and turned into [-1, 1] floats a batch at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import torch
from omegaconf import DictConfig

from ..distributed import Dist
from .sampling import EpochOrder, eval_starts, require_one_batch, validate_sample_counts

validate = validate_sample_counts

CHUNK = 256  # images generated at once: bounds the float working memory at 128x128


def make_discs(n: int, size: int, noise: float, g: torch.Generator) -> torch.Tensor:
    """`n` images [n, 3, size, size] as uint8. Draws from `g` in a fixed order per chunk, so the
    pixels depend on (n, size, noise, the generator's state) alone."""
    out = torch.empty(n, 3, size, size, dtype=torch.uint8)
    centres = torch.arange(size, dtype=torch.float32) + 0.5
    edge = max(1.0, size / 32)  # the width of the soft rim, in pixels: a smooth edge at any size
    for lo in range(0, n, CHUNK):
        m = min(CHUNK, n - lo)
        radius = (0.15 + 0.2 * torch.rand(m, generator=g)) * size
        margin = 0.8 * radius  # the centre keeps at least 80% of the radius from each side
        cx, cy = (margin + torch.rand(m, generator=g) * (size - 2 * margin) for _ in range(2))
        colour = torch.rand(m, 3, generator=g)
        # Bright and saturated (the largest channel at 0.6 to 1), so every disc stands out from the
        # dark background whatever hue it drew.
        colour = colour / colour.amax(1, keepdim=True).clamp_min(1e-6) * (0.6 + 0.4 * torch.rand(m, 1, generator=g))
        background = 0.25 * torch.rand(m, 1, generator=g)
        dist = (
            (centres[None, None, :] - cx[:, None, None]) ** 2 + (centres[None, :, None] - cy[:, None, None]) ** 2
        ).sqrt()
        alpha = ((radius[:, None, None] - dist) / edge + 0.5).clamp(0, 1)[:, None]  # [m, 1, size, size]
        images = background[:, :, None, None] + alpha * (colour[:, :, None, None] - background[:, :, None, None])
        # Drawn even when noise is 0, so the discs are the same whatever data.pixel_noise is.
        images = images + noise * torch.randn(m, 3, size, size, generator=g)
        out[lo : lo + m] = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    return out


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] to float32 [-1, 1], the range of the generator's tanh."""
    return images.float().div_(127.5).sub_(1)


class SyntheticDiscs(EpochOrder):
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device, shard: Dist = Dist()):
        self.batch_size, self.shard = schedule.batch_size, shard
        require_one_batch(data.train_samples, self.batch_size)
        size = schedule.image_size
        g = torch.Generator().manual_seed(10_000 + seed)
        self.train_images = make_discs(data.train_samples, size, data.pixel_noise, g).to(device)
        self.val_images = make_discs(data.val_samples, size, data.pixel_noise, g).to(device)
        self.order = torch.Generator().manual_seed(20_000 + seed)
        self.steps_per_epoch = data.train_samples // self.batch_size
        self.info = {"train_samples": data.train_samples, "val_samples": data.val_samples, "resident": True}

    def epoch(self, epoch: int, start: int = 0) -> Iterator[torch.Tensor]:
        """One pass in a fresh random order, from batch `start` (a resumed run's position)."""
        perm = torch.randperm(self.train_images.shape[0], generator=self.begin_epoch()).to(self.train_images.device)
        for i in range(start, self.steps_per_epoch):
            yield to_unit_range(
                self.train_images[perm[slice(*self.shard.shard(i * self.batch_size, (i + 1) * self.batch_size))]]
            )

    def val(self, limit: int | None = None) -> Iterator[torch.Tensor]:
        for i in eval_starts(self.val_images.shape[0], self.batch_size, self.shard, limit):
            yield to_unit_range(self.val_images[i : i + self.batch_size])


def build(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> SyntheticDiscs:
    return SyntheticDiscs(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
