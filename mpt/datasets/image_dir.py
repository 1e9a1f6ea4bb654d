"""A folder of images for GAN training (CelebA's img_align_celeba/*.jpg, or nested folders).

Every image file under `data.root`, at any depth, is a training image: a GAN learns the whole
distribution and its FID is measured against that same distribution, so nothing is held out. The
reference set that the task scores D(x) and FID against is the first `data.val_samples` images of
a seeded permutation of all files (a sample of the distribution, not the first names in sort order,
which in CelebA are neighbouring ids). Each image is center-cropped to a square of `data.crop`
pixels (null: its shorter side) and resized to schedule.image_size, with no augmentation, as DCGAN
did. Batches are [B, 3, S, S] float32 in [-1, 1], the range of the generator's tanh.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from ..config import ConfigError, positive
from ..distributed import Dist
from .discs import to_unit_range
from .imagefolder import load_image
from .sampling import EpochBatches, EvalBatches, LoaderData, SeededSamples, default_workers, shielded_worker

SHOWN = 5  # file names an error message lists


class CropTooLarge(ValueError):
    """data.crop is larger than an image's shorter side. Raised where the image is loaded (a
    loader worker), so the message is one line naming the file: the run's record keeps that line."""


def find_images(root: Path) -> tuple[list[str], list[str]]:
    """(image files, other files) under `root`, as paths relative to it, sorted. Hidden files and
    folders (.DS_Store, .git, .thumbnails) are skipped."""
    images: list[str] = []
    others: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # pruned in place: os.walk does not descend
        for name in files:
            if name.startswith("."):
                continue
            rel = os.path.relpath(os.path.join(folder, name), root)
            (images if name.lower().endswith(IMG_EXTENSIONS) else others).append(rel)
    return sorted(images), sorted(others)


def listing(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")


class ImageFiles(Dataset):
    """Image `i` of `paths`, center-cropped and resized to `size`, as uint8 [3, size, size]: a
    quarter of the bytes of float through the workers' shared memory and the copy to the device,
    which converts them."""

    def __init__(self, paths: list[str], size: int, crop: Optional[int]):
        self.paths, self.size, self.crop = paths, size, crop

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        path = self.paths[index]
        img = load_image(path)
        w, h = img.size
        side = min(w, h) if self.crop is None else self.crop
        if side > min(w, h):
            raise CropTooLarge(
                f"data.crop={self.crop}: larger than image {path} ({w}x{h}); "
                f"use a crop of at most {min(w, h)} or data.crop=null (the shorter side)"
            )
        img = TF.center_crop(img, [side, side])
        # PIL's bilinear resize widens its filter when shrinking, i.e. it is antialiased.
        img = TF.resize(img, [self.size, self.size], interpolation=InterpolationMode.BILINEAR, antialias=True)
        return TF.pil_to_tensor(img)


def validate(cfg: DictConfig) -> None:
    d = cfg.data
    if d.root is None:
        raise ConfigError(
            "data.root is not set: data=image_dir needs the folder of images (e.g. CelebA's img_align_celeba)"
        )
    positive(cfg, "data.crop", allow_none=True)
    positive(cfg, "data.val_samples")  # reference images for FID


class ImageDirData(LoaderData):
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device, shard: Dist = Dist()):
        root = Path(os.path.expanduser(data.root))
        if not root.exists():
            raise ConfigError(f"data.root={root}: no such folder")
        if not root.is_dir():
            raise ConfigError(f"data.root={root}: a file, not a folder of images (unpack an archive first)")
        images, others = find_images(root)
        if not images:
            accepted = " ".join(IMG_EXTENSIONS)
            found = f"found {len(others)} files, none an image: {listing(others)}" if others else "found no files"
            raise ConfigError(
                f"data.root={root}: no image files at any depth (accepted: {accepted}, any case); {found}"
            )
        if len(images) < schedule.batch_size:
            raise ConfigError(
                f"data.root={root}: {len(images)} images, "
                f"fewer than one batch of schedule.batch_size={schedule.batch_size}"
            )
        paths = [str(root / p) for p in images]
        self._check_crop(data.crop, paths[0])
        dataset = ImageFiles(paths, schedule.image_size, data.crop)
        n_val = min(data.val_samples, len(paths))
        reference = torch.randperm(len(paths), generator=torch.Generator().manual_seed(30_000 + seed))[:n_val].tolist()
        self.device = device
        workers = default_workers() if data.num_workers == -1 else data.num_workers
        # Loaders get generators of their own, so iterating them never draws from the global RNG:
        # a resumed run's random stream stays the uninterrupted one's.
        common: dict[str, Any] = dict(
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            worker_init_fn=shielded_worker,
        )
        self.order = torch.Generator().manual_seed(seed)
        self.batches = EpochBatches(len(paths), schedule.batch_size, self.order, shard)
        self.train_loader = DataLoader(
            SeededSamples(dataset, seed),
            batch_sampler=self.batches,
            generator=torch.Generator().manual_seed(seed),
            **common,
        )
        self.val_batches = EvalBatches(n_val, schedule.batch_size, shard)
        self.val_loader = DataLoader(
            Subset(dataset, reference),
            batch_sampler=self.val_batches,
            generator=torch.Generator().manual_seed(seed),
            **common,
        )
        self.steps_per_epoch = len(paths) // schedule.batch_size
        self.info = {"train_samples": len(paths), "val_samples": n_val, "resident": False, "num_workers": workers}

    @staticmethod
    def _check_crop(crop: Optional[int], path: str) -> None:
        """A crop too large for the first image is a ConfigError before any training (a folder of
        one size, like CelebA, fails here); a larger image elsewhere fails when it is loaded."""
        if crop is None:
            return
        try:
            with Image.open(path) as img:
                w, h = img.size
        except (OSError, SyntaxError, ValueError):
            return  # unreadable: the loader names it when it gets there
        if crop > min(w, h):
            raise ConfigError(
                f"data.crop={crop}: larger than image {path} ({w}x{h}); "
                f"use a crop of at most {min(w, h)} or data.crop=null (the shorter side)"
            )

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        return to_unit_range(batch.to(self.device, non_blocking=True))


def build(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> ImageDirData:
    return ImageDirData(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
