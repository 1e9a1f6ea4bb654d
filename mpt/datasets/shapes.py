"""Synthetic detection images: coloured shapes on noisy backgrounds, with their boxes and classes.

Class k is a shape (rectangle, ellipse or triangle, k mod 3) in a colour of its own; an image
holds 1 to `max_objects` of them at random sizes (10% to 50% of the side) and places, overlapping
little, on a smooth random background with Gaussian pixel noise. A detector learns them in a few
hundred steps, so a short run shows mAP rising. Generated once from a seeded CPU generator (the
same pixels on every device and in every precision mode) and kept on the run's device as uint8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torchvision.ops import box_iou

from ..config import ConfigError, positive
from ..distributed import Dist
from .sampling import EpochOrder, eval_starts, require_one_batch, validate_sample_counts


def validate(cfg: DictConfig) -> None:
    validate_sample_counts(cfg)
    positive(cfg, "data.max_objects")
    if not 0 <= cfg.data.pixel_noise < 1:
        raise ConfigError(f"data.pixel_noise={cfg.data.pixel_noise}: must be in [0, 1)")


SHAPES = ("rectangle", "ellipse", "triangle")


def shape_mask(kind: str, box: torch.Tensor, size: int) -> torch.Tensor:
    x1, y1, x2, y2 = box.tolist()
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    inside = (xs >= x1) & (xs < x2) & (ys >= y1) & (ys < y2)
    if kind == "ellipse":
        cx, cy, rx, ry = (x1 + x2) / 2, (y1 + y2) / 2, (x2 - x1) / 2, (y2 - y1) / 2
        return ((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2 <= 1
    if kind == "triangle":  # apex at the top centre, base along the bottom edge
        half_width = (ys - y1) / (y2 - y1) * (x2 - x1) / 2
        return inside & ((xs - (x1 + x2) / 2).abs() <= half_width)
    return inside


def make_image(size: int, colors: torch.Tensor, max_objects: int, noise: float, g: torch.Generator):
    coarse = torch.rand(1, 3, 4, 4, generator=g) * 0.6 + 0.2
    image = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)[0]
    boxes: list[torch.Tensor] = []
    labels: list[int] = []
    for _ in range(int(torch.randint(1, max_objects + 1, (1,), generator=g))):
        for _attempt in range(10):  # a placement that hides no earlier object much
            w, h = ((torch.rand(2, generator=g) * 0.4 + 0.1) * size).tolist()
            x, y = (torch.rand(1, generator=g).item() * (size - w), torch.rand(1, generator=g).item() * (size - h))
            box = torch.tensor([x, y, x + w, y + h])
            if not boxes or box_iou(box[None], torch.stack(boxes)).max() < 0.3:
                break
        else:
            continue
        k = int(torch.randint(0, colors.shape[0], (1,), generator=g))
        mask = shape_mask(SHAPES[k % len(SHAPES)], box, size)
        shade = colors[k] * (0.85 + 0.3 * torch.rand(1, generator=g))
        image = torch.where(mask, shade.clamp(0, 1)[:, None, None], image)
        boxes.append(box)
        labels.append(k + 1)  # 0 is background
    image = (image + noise * torch.randn(image.shape, generator=g)).clamp(0, 1)
    return (image * 255).round().to(torch.uint8), torch.stack(boxes), torch.tensor(labels, dtype=torch.int64)


class SyntheticShapes(EpochOrder):
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device, shard: Dist = Dist()):
        self.batch_size, self.shard = schedule.batch_size, shard
        require_one_batch(data.train_samples, self.batch_size)
        size = schedule.image_size
        g = torch.Generator().manual_seed(10_000 + seed)
        colors = torch.rand(data.num_classes, 3, generator=g)
        self.device = device

        def make(n):
            images, targets = [], []
            for _ in range(n):
                image, boxes, labels = make_image(size, colors, data.max_objects, data.pixel_noise, g)
                images.append(image)
                targets.append(
                    {
                        "boxes": boxes.to(device),
                        "labels": labels.to(device),
                        "difficult": torch.zeros_like(labels, dtype=torch.bool).to(device),
                    }
                )
            return torch.stack(images).to(device), targets

        self.train_images, self.train_targets = make(data.train_samples)
        self.val_images, self.val_targets = make(data.val_samples)
        self.order = torch.Generator().manual_seed(20_000 + seed)
        self.steps_per_epoch = data.train_samples // self.batch_size
        self.info = {
            "num_classes": data.num_classes,
            "classes": [f"{SHAPES[k % len(SHAPES)]}{k // len(SHAPES)}" for k in range(data.num_classes)],
            "train_samples": data.train_samples,
            "val_samples": data.val_samples,
            "resident": True,
        }

    def _batch(self, images: torch.Tensor, targets: list[dict], idx: list[int]):
        train = targets is self.train_targets
        picked = [
            targets[i] if not train else {"boxes": targets[i]["boxes"], "labels": targets[i]["labels"]} for i in idx
        ]
        return images[idx].float().div_(255), picked

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, list[dict]]]:
        """One pass in a fresh random order, from batch `start` (a resumed run's position)."""
        perm = torch.randperm(len(self.train_targets), generator=self.begin_epoch()).tolist()
        for i in range(start, self.steps_per_epoch):  # under torchrun, this rank's slice of each global batch
            yield self._batch(
                self.train_images,
                self.train_targets,
                perm[slice(*self.shard.shard(i * self.batch_size, (i + 1) * self.batch_size))],
            )

    def val(self, limit: int | None = None) -> Iterator[tuple[torch.Tensor, list[dict]]]:
        n = len(self.val_targets)
        for i in eval_starts(n, self.batch_size, self.shard, limit):
            yield self._batch(self.val_images, self.val_targets, list(range(i, min(i + self.batch_size, n))))


def build(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> SyntheticShapes:
    return SyntheticShapes(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
