"""ImageFolder data kept on the device (data.resident=true): CIFAR-sized images at GPU speed.

The folder is read once, as the loader would read it, into uint8 tensors (50,000 CIFAR-10 training
images are 150 MB), cached as a tensor file under data.cache_dir keyed by the folder's files and the transform,
so the data on disk stays the standard ImageFolder tree. Each batch is gathered, augmented and
normalized on the device: the crop of the padded image (data.augment=cifar: 4 zero pixels;
airbench: 2 reflected pixels) and the flip (cifar: at random; airbench: the loader's alternating
flips, the same mirror for the same image and epoch) drawn from a generator seeded by the run's
seed, the epoch and the batch, so a resumed run draws what an uninterrupted one drew, whatever the
number of processes sharing each batch. The batches hold the images the loader's would, in its
order (the same order generator); the crops' random draws differ from the loader's, and a
non-square image is center-cropped once at decoding where the loader crops it at random. Validation
scores the loader's fixed order too.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from torchvision import transforms

from ..config import ConfigError
from ..distributed import Dist
from ..files import write_atomic
from . import device_decode, imagefolder
from .device_decode import DeviceDecodedImages
from .sampling import EpochOrder, default_workers, eval_starts, shielded_worker

# (pad, padding mode) of each augmentation a resident source computes on the device
PADDING = {"cifar": (4, "constant"), "airbench": (2, "reflect")}


def validate(cfg: DictConfig) -> None:
    imagefolder.validate(cfg)
    device_decode.validate(cfg)
    if cfg.data.resident and cfg.data.augment not in PADDING:
        raise ConfigError(
            f"data.resident=true: data.augment={cfg.data.augment} is not computed on the device "
            f"(expected {' or '.join(PADDING)})"
        )
    size = cfg.data.eval_batch_size
    if size is not None and not cfg.data.resident:
        raise ConfigError(
            f"data.eval_batch_size={size}: a resident source's setting; set data.resident=true or leave it null"
        )
    if size is not None and size < 1:
        raise ConfigError(
            f"data.eval_batch_size={size}: must be a positive number of images, or null for schedule.batch_size"
        )


def stamp(folder: Path) -> str:
    """What the folder's files are as the cache knows them: each one's path, size and modification
    time (an image rewritten at the same size is decoded again), hashed."""
    entries = sorted(
        f"{p.relative_to(folder).as_posix()}\t{p.stat().st_size}\t{p.stat().st_mtime_ns}"
        for p in folder.rglob("*")
        if p.is_file()
    )
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def decode(
    root: Path, split: str, tf: transforms.Compose, workers: int, cache_dir: Optional[Path]
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """A split's images as uint8 (N, 3, H, W), its labels and classes: read from the cache when the
    folder and the transform are those it was made from, else decoded and cached."""
    made = hashlib.sha256(repr(tf).encode()).hexdigest()[:8]  # the transform, its sizes and interpolation
    key = f"{split}-{made}-{stamp(root / split)}"
    cached = cache_dir / f"{key}.pt" if cache_dir is not None else None
    if cached is not None and cached.is_file():
        found = torch.load(cached, weights_only=True)
        return found["images"], found["labels"], list(found["classes"])
    folder = imagefolder.open_split(root, split, transforms.Compose([*tf.transforms, transforms.PILToTensor()]))
    images, labels = [], []
    for x, y in DataLoader(
        folder, batch_size=500, num_workers=workers, worker_init_fn=shielded_worker
    ):  # in the folder's order
        images.append(x)
        labels.append(y)
    out = torch.cat(images), torch.cat(labels), folder.classes
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cached, lambda f: torch.save({"images": out[0], "labels": out[1], "classes": out[2]}, f))
    return out


def normalized(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 images as ToTensor and Normalize make them: /255, then (x - mean) / std."""
    return images.float().div(255).sub_(mean).div_(std)


def crop_and_flip(
    images: torch.Tensor, pad: int, mode: str, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor
) -> torch.Tensor:
    """Each image padded by `pad` pixels (`mode` as F.pad's), cropped back to its size at offset
    (dy, dx) of the padded image, then mirrored where `flip`."""
    n, c, h, w = images.shape
    if mode == "reflect":  # F.pad reflects floating-point tensors only; every value of uint8 is one
        padded = F.pad(images.float(), (pad,) * 4, mode=mode).to(images.dtype)
    else:
        padded = F.pad(images, (pad,) * 4, mode=mode)
    rows = (dy[:, None] + torch.arange(h, device=images.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, None, :]
    out = padded[
        torch.arange(n, device=images.device)[:, None, None, None],
        torch.arange(c, device=images.device)[None, :, None, None],
        rows,
        cols,
    ]
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


class ResidentImages(EpochOrder):
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device, shard: Dist = Dist()):
        root = imagefolder.folder_root(data)
        size = schedule.image_size
        workers = default_workers() if data.num_workers == -1 else data.num_workers
        cache = Path(os.path.expanduser(data.cache_dir)) if data.cache_dir else None
        # Training images whole at the training size, evaluation's resized and cropped as the loader's
        whole = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size)])
        val_tf = transforms.Compose([transforms.Resize(round(size * data.resize_ratio)), transforms.CenterCrop(size)])
        train_images, train_labels, classes = decode(root, data.train_split, whole, workers, cache)
        val_images, val_labels, val_classes = decode(root, data.val_split, val_tf, workers, cache)
        imagefolder.check_splits(root, data, classes, val_classes, len(train_labels), schedule.batch_size)
        self.train_images, self.train_labels = train_images.to(device), train_labels.to(device)
        # the loader's fixed evaluation order (imagefolder.py): any prefix a uniform sample
        val_order = imagefolder.fixed_order(len(val_labels))
        self.val_images, self.val_labels = val_images[val_order].to(device), val_labels[val_order].to(device)
        stats = imagefolder.CIFAR10_MEAN, imagefolder.CIFAR10_STD
        self.mean, self.std = (torch.tensor(s, device=device).view(1, 3, 1, 1) for s in stats)
        self.pad, self.mode = PADDING[data.augment]
        self.alternating = data.augment == "airbench"
        self.first_flip = imagefolder.first_flips(len(train_labels), seed).to(device)
        self.seed, self.device, self.batch_size, self.shard = seed, device, schedule.batch_size, shard
        self.eval_batch_size = data.eval_batch_size or schedule.batch_size
        self.order = torch.Generator().manual_seed(seed)  # the loader's order generator and its draws
        self.steps_per_epoch = len(train_labels) // schedule.batch_size
        self.info = {
            "num_classes": len(classes),
            "classes": classes,
            "train_samples": len(train_labels),
            "val_samples": len(val_labels),
            "resident": True,
        }

    def _augmented(self, idx: torch.Tensor, epoch: int, batch: int, mine: slice) -> torch.Tensor:
        """The images `idx` of one global batch, augmented; `mine`: this process's share of it. The
        draws are the whole batch's, so a sample's crop does not depend on how many processes share it."""
        g = torch.Generator(device=self.device).manual_seed(
            ((self.seed * 1_000_003 + epoch) * 100_000_007 + batch) % 2**63
        )
        n, room = self.batch_size, 2 * self.pad + 1
        dy = torch.randint(room, (n,), generator=g, device=self.device)[mine]
        dx = torch.randint(room, (n,), generator=g, device=self.device)[mine]
        if self.alternating:
            flip = self.first_flip[idx] != bool(epoch % 2)
        else:
            flip = (torch.rand(n, generator=g, device=self.device) < 0.5)[mine]
        return normalized(crop_and_flip(self.train_images[idx], self.pad, self.mode, dy, dx, flip), self.mean, self.std)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass in the loader's random order, from batch `start` (a resumed run's position)."""
        perm = torch.randperm(len(self.train_labels), generator=self.begin_epoch()).to(self.device)
        for b in range(start, self.steps_per_epoch):
            first, stop = self.shard.shard(b * self.batch_size, (b + 1) * self.batch_size)
            idx = perm[first:stop]
            mine = slice(first - b * self.batch_size, stop - b * self.batch_size)
            yield self._augmented(idx, epoch, b, mine), self.train_labels[idx]

    def val(self, limit: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        size = self.eval_batch_size
        for i in eval_starts(len(self.val_labels), size, self.shard, limit):
            yield normalized(self.val_images[i : i + size], self.mean, self.std), self.val_labels[i : i + size]

    def plain_train_images(self, n: int) -> torch.Tensor:
        """The loader's n uniformly drawn training images (the same for every seed), whole, not augmented."""
        chosen = imagefolder.fixed_order(len(self.train_labels))[:n].to(self.device)
        return normalized(self.train_images[chosen], self.mean, self.std)


def build(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
):
    """The source of data=imagefolder: kept on the device with data.resident=true, decoded there with
    data.decode=device, else the loader's."""
    if cfg.data.resident:  # decodes every image as it starts: an unreadable one stops it there, named
        return ResidentImages(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
    if cfg.data.decode == "device":
        if imagefolder.wants_verify(cfg):
            root = imagefolder.folder_root(cfg.data)
            splits = [imagefolder.open_split(root, s, None) for s in (cfg.data.train_split, cfg.data.val_split)]
            imagefolder.verify_images([path for split in splits for path, _ in split.samples])
        return DeviceDecodedImages(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
    return imagefolder.build(cfg, device, workdir, resuming, shard)
