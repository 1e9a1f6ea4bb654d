"""ImageFolder data (ImageNet's on-disk layout): root/<split>/<class>/<image>.

Training: RandomResizedCrop(image_size) and horizontal flip; validation: Resize(image_size *
resize_ratio) and CenterCrop(image_size), 256/224 by default, as the PyTorch ImageNet example does.
With data.augment=cifar, CIFAR's recipe instead: a random crop of the image padded by 4 pixels, and
flip; normalized by CIFAR-10's channel statistics. With data.augment=airbench, Jordan 2024's: a
random crop of the image padded by 2 reflected pixels, and alternating flips (each image mirrored
or not at random in the first epoch, then the other way each following epoch); CIFAR-10's statistics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from ..config import ConfigError
from ..distributed import Dist
from .sampling import EpochBatches, EvalBatches, LoaderData, SeededSamples, default_workers, shielded_worker

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# CIFAR-10's training images' per-channel mean and std, for augment=cifar.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
AUGMENTS = ("imagenet", "cifar", "airbench")


class CorruptImage(RuntimeError):
    """An image file PIL cannot read. The run fails naming it, rather than train on a silently
    smaller dataset; fix or remove the file and rerun to resume from the last checkpoint."""


def load_image(path: str) -> Image.Image:
    img: Image.Image  # an ImageFile as opened, a plain Image once converted from 16 bits
    try:
        with open(path, "rb") as f, Image.open(f) as img:
            if img.mode.startswith("I;16"):
                # 16-bit grayscale: PIL's convert clips to 255 (nearly all white); keep the top 8 bits.
                img = Image.fromarray((np.asarray(img, dtype=np.uint16) >> 8).astype(np.uint8), "L")
            return img.convert("RGB")  # grayscale, palette and CMYK images become RGB
    except (OSError, SyntaxError, ValueError) as e:
        raise CorruptImage(f"corrupt image {path}: {type(e).__name__}: {e}") from None


def open_split(root: Path, split: str, transform) -> datasets.ImageFolder:
    folder = root / split
    if not folder.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise ConfigError(
            f"data.root={root}: no '{split}' folder (found: {', '.join(found) or 'nothing'}); "
            f"expected {split}/<class>/<image>"
        )
    try:
        return datasets.ImageFolder(str(folder), transform=transform, loader=load_image)
    except FileNotFoundError as e:  # no class folders, or a class folder without images
        raise ConfigError(f"data.root={root}: {split}/ is not an image folder: {e}") from None


def validate(cfg: DictConfig) -> None:
    if cfg.data.root is None:
        raise ConfigError("data.root is not set: give the ImageFolder root, e.g. data.root=/data/imagenet")
    if cfg.data.augment not in AUGMENTS:
        raise ConfigError(f"data.augment={cfg.data.augment}: must be one of {', '.join(AUGMENTS)}")


def train_transform(augment: str, size: int) -> transforms.Compose:
    if augment == "airbench":  # the flip is AlternatingFlips', which knows the epoch
        return transforms.Compose(
            [
                transforms.Resize(size),
                transforms.RandomCrop(size, padding=2, padding_mode="reflect"),
                transforms.ToTensor(),
                transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
            ]
        )
    if augment == "cifar":
        # He et al. 2016, section 4.2: pad 4 pixels on each side, take a random crop of the original
        # size or its horizontal flip; images smaller or larger than `size` are resized first.
        return transforms.Compose(
            [
                transforms.Resize(size),
                transforms.RandomCrop(size, padding=4),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
            ]
        )
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def first_flips(n: int, seed: int) -> torch.Tensor:
    """Alternating flips' first-epoch coins, one per image, drawn once from the run's seed."""
    return torch.rand(n, generator=torch.Generator().manual_seed(30_000 + seed)) < 0.5


class AlternatingFlips(SeededSamples):
    """Jordan 2024's flips: image i is mirrored in epoch e if its first-epoch coin (drawn once, from
    the run's seed) xor e is odd, so every image is seen both ways in every two epochs."""

    def __init__(self, dataset, seed: int):
        super().__init__(dataset, seed)
        self.first_flip = first_flips(len(dataset), seed)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        image, label = super().__getitem__(key)
        return (image.flip(-1) if bool(self.first_flip[index]) != bool(epoch % 2) else image), label


def fixed_order(n: int) -> torch.Tensor:
    """One permutation of n images, the same for every seed and mode: evaluation's order, whose
    every prefix is a uniform sample, and the draw of whole training images."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))


def folder_root(data: DictConfig) -> Path:
    """data.root, or a ConfigError naming the layout it should hold."""
    root = Path(os.path.expanduser(data.root))
    if not root.is_dir():
        raise ConfigError(
            f"data.root={root}: no such folder "
            f"(expected {data.train_split}/<class>/<image> and {data.val_split}/<class>/<image>)"
        )
    return root


def check_splits(
    root: Path, data: DictConfig, classes: list[str], val_classes: list[str], train_samples: int, batch_size: int
) -> None:
    """Both splits name the same classes, and training has at least one batch."""
    if val_classes != classes:
        raise ConfigError(
            f"data.root={root}: {data.val_split}/ has classes {val_classes[:5]}... "
            f"but {data.train_split}/ has {classes[:5]}..."
        )
    if train_samples < batch_size:
        raise ConfigError(f"data.root={root}: {train_samples} training images, fewer than one batch of {batch_size}")


def plain_images(
    root: Path, split: str, size: int, n: int, device: torch.device, normalize: Optional[transforms.Normalize] = None
) -> torch.Tensor:
    """n training images drawn uniformly (the same for every seed), whole at the training size (not
    evaluation's resize-and-crop, whose ratio may zoom), not augmented, normalized (by ImageNet's
    statistics unless `normalize` says otherwise). On `device`."""
    normalize = normalize or transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    plain = open_split(
        root,
        split,
        transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor(), normalize]),
    )
    chosen = fixed_order(len(plain))[:n].tolist()
    return torch.stack([plain[i][0] for i in chosen]).to(device)


class ImageFolderData(LoaderData):
    def __init__(
        self,
        data: DictConfig,
        schedule: DictConfig,
        seed: int,
        device: torch.device,
        shard: Dist = Dist(),
        verify: bool = False,
    ):
        root = folder_root(data)
        size = schedule.image_size
        normalize = transforms.Normalize(
            *((CIFAR10_MEAN, CIFAR10_STD) if data.augment in ("cifar", "airbench") else (IMAGENET_MEAN, IMAGENET_STD))
        )
        train_tf = train_transform(data.augment, size)
        val_tf = transforms.Compose(
            [
                transforms.Resize(round(size * data.resize_ratio)),
                transforms.CenterCrop(size),
                transforms.ToTensor(),
                normalize,
            ]
        )
        self.train_set = open_split(root, data.train_split, train_tf)
        self.val_set = open_split(root, data.val_split, val_tf)
        check_splits(root, data, self.train_set.classes, self.val_set.classes, len(self.train_set), schedule.batch_size)
        if verify:
            verify_images([path for split in (self.train_set, self.val_set) for path, _ in split.samples])
        self.device = device
        workers = default_workers() if data.num_workers == -1 else data.num_workers
        # Loaders get generators of their own, so iterating them never draws from the global RNG
        # that dropout uses: a resumed run's random stream stays the uninterrupted one's.
        common: dict[str, Any] = dict(
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            worker_init_fn=shielded_worker,
        )
        self.order = torch.Generator().manual_seed(seed)
        self.batches = EpochBatches(len(self.train_set), schedule.batch_size, self.order, shard)
        samples = (
            AlternatingFlips(self.train_set, seed)
            if data.augment == "airbench"
            else SeededSamples(self.train_set, seed)
        )
        self.train_loader = DataLoader(
            samples, batch_sampler=self.batches, generator=torch.Generator().manual_seed(seed), **common
        )
        # ImageFolder lists a split class by class, so a capped evaluation (schedule.eval_batches)
        # would score the first classes only. One fixed order, the same for every seed and mode,
        # makes any prefix a uniform sample and lets every run score the same images.
        val_order = fixed_order(len(self.val_set)).tolist()
        self.val_batches = EvalBatches(len(self.val_set), schedule.batch_size, shard, val_order)
        self.val_loader = DataLoader(
            self.val_set, batch_sampler=self.val_batches, generator=torch.Generator().manual_seed(seed), **common
        )
        self.steps_per_epoch = len(self.train_set) // schedule.batch_size
        self.root, self.train_split, self.size, self.normalize = root, data.train_split, size, normalize
        self.info = {
            "num_classes": len(self.train_set.classes),
            "classes": self.train_set.classes,
            "train_samples": len(self.train_set),
            "val_samples": len(self.val_set),
            "resident": False,
            "num_workers": workers,
        }

    def plain_train_images(self, n: int) -> torch.Tensor:
        return plain_images(self.root, self.train_split, self.size, n, self.device, self.normalize)

    def to_device(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        return images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)


def verify_images(paths: list[str]) -> None:
    """Decode each image as training would; a ConfigError naming every one that cannot be read, a line each."""
    bad = []
    for path in paths:
        try:
            load_image(path)
        except CorruptImage as e:
            bad.append(str(e))
    if bad:
        lines = "\n  ".join(bad)
        raise ConfigError(
            f"data.verify: {len(bad)} of {len(paths)} images cannot be read; fix or remove them "
            f"(data.verify=false skips this check):\n  {lines}"
        )


def wants_verify(cfg: DictConfig) -> bool:
    """data.verify, or where null, whether the run is a smoke run (a check of a set-up)."""
    return cfg.data.verify if cfg.data.verify is not None else cfg.schedule.name == "smoke"


def build(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> ImageFolderData:
    verify = wants_verify(cfg)
    return ImageFolderData(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard, verify=verify)
