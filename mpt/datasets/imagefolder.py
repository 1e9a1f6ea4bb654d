"""ImageFolder data (ImageNet's on-disk layout): root/<split>/<class>/<image>.

Training: RandomResizedCrop(image_size) and horizontal flip; validation: Resize(image_size *
resize_ratio) and CenterCrop(image_size), 256/224 by default, as the PyTorch ImageNet example does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from ..runner.config import ConfigError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def open_split(root: Path, split: str, transform) -> datasets.ImageFolder:
    folder = root / split
    if not folder.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise ConfigError(f"data.root={root}: no '{split}' folder (found: {', '.join(found) or 'nothing'}); expected {split}/<class>/<image>")
    try:
        return datasets.ImageFolder(str(folder), transform=transform)
    except FileNotFoundError as e:  # no class folders, or a class folder without images
        raise ConfigError(f"data.root={root}: {split}/ is not an image folder: {e}") from None


class ImageFolderData:
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device):
        if data.root is None:
            raise ConfigError("data.root is not set: give the ImageFolder root, e.g. data.root=/data/imagenet")
        root = Path(os.path.expanduser(data.root))
        if not root.is_dir():
            raise ConfigError(f"data.root={root}: no such folder (expected {data.train_split}/<class>/<image> and {data.val_split}/<class>/<image>)")
        size = schedule.image_size
        normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        train_tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
        val_tf = transforms.Compose(
            [transforms.Resize(round(size * data.resize_ratio)), transforms.CenterCrop(size), transforms.ToTensor(), normalize]
        )
        self.train_set = open_split(root, data.train_split, train_tf)
        self.val_set = open_split(root, data.val_split, val_tf)
        if self.val_set.classes != self.train_set.classes:
            raise ConfigError(
                f"data.root={root}: {data.val_split}/ has classes {self.val_set.classes[:5]}... but {data.train_split}/ has {self.train_set.classes[:5]}..."
            )
        if len(self.train_set) < schedule.batch_size:
            raise ConfigError(f"data.root={root}: {len(self.train_set)} training images, fewer than one batch of {schedule.batch_size}")
        self.device = device
        workers = min(8, os.cpu_count() or 1) if data.num_workers == -1 else data.num_workers
        common = dict(
            batch_size=schedule.batch_size,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
        )
        self.order = torch.Generator().manual_seed(seed)
        self.train_loader = DataLoader(self.train_set, shuffle=True, drop_last=True, generator=self.order, **common)
        self.val_loader = DataLoader(self.val_set, shuffle=False, **common)
        self.steps_per_epoch = len(self.train_loader)
        self.info = {
            "num_classes": len(self.train_set.classes),
            "classes": self.train_set.classes,
            "train_samples": len(self.train_set),
            "val_samples": len(self.val_set),
            "resident": False,
            "num_workers": workers,
        }

    def _to_device(self, loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in loader:
            yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._to_device(self.train_loader)

    def val(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        return self._to_device(self.val_loader)
