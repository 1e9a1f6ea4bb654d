"""ImageFolder JPEGs decoded on the run's device (data.decode=device): ImageNet's input at a GPU's pace.

The loader's workers read each file's bytes and draw its augmentation, without decoding it: the
RandomResizedCrop box (from the image's size in its header) and the flip, from the same seeded
generator the host path draws them from, so the boxes and flips are the host path's, whatever the
worker count, and again after a resume. The main process decodes the batch's JPEGs in one call
(torchvision.io.decode_jpeg, nvJPEG on CUDA), cuts and resizes each box on the device (bilinear,
antialiased, as torchvision's tensor transforms), flips and normalizes there: only compressed bytes
cross to the device. Validation resizes and center-crops there as the host path's transform does.
What differs from the host path is the arithmetic: the decoder (nvJPEG's or libjpeg's IDCT) and the
tensor resize against PIL's, a grey level or two per pixel. A file that is not a JPEG (a PNG in the
tree) is decoded on the host and moved; a corrupt file fails the run naming it.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from omegaconf import DictConfig
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets, transforms
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from torchvision.transforms.v2 import functional as F

from ..config import ConfigError
from ..distributed import Dist
from . import imagefolder
from .sampling import EpochBatches, LoaderData, SeededSamples, default_workers, shielded_worker

JPEG_MAGIC = (0xFF, 0xD8)


def validate(cfg: DictConfig) -> None:
    d = cfg.data
    if d.decode not in ("host", "device"):
        raise ConfigError(f"data.decode={d.decode}: must be host (PIL in the loader's workers) or device (the JPEGs' bytes decoded on the run's device)")
    if d.decode == "device" and d.resident:
        raise ConfigError("data.decode=device with data.resident=true: a resident source decodes once and keeps the pixels; choose one")
    if d.decode == "device" and d.augment != "imagenet":
        raise ConfigError(f"data.decode=device: data.augment={d.augment} is not computed there (expected imagenet; CIFAR-sized data: data.resident=true)")


class _Encoded(Dataset):
    """An ImageFolder split's files as bytes, with each one's crop box and flip drawn as the host
    path's RandomResizedCrop and RandomHorizontalFlip draw them (train), or none (validation)."""

    def __init__(self, folder: datasets.ImageFolder, train: bool):
        self.samples, self.train = folder.samples, train
        self.crop = transforms.RandomResizedCrop(1)  # only its scale and ratio ranges are used

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[bytes, torch.Tensor, bool, int, str]:
        path, label = self.samples[index]
        box, flip = torch.zeros(4, dtype=torch.int64), False
        if self.train:
            try:
                with Image.open(path) as img:  # the header only: no pixels are decoded here
                    box = torch.tensor(transforms.RandomResizedCrop.get_params(img, list(self.crop.scale), list(self.crop.ratio)))
            except (OSError, SyntaxError, ValueError) as e:
                raise imagefolder.CorruptImage(f"corrupt image {path}: {type(e).__name__}: {e}") from None
            flip = bool(torch.rand(1) < 0.5)  # RandomHorizontalFlip's draw, after the crop's
        with open(path, "rb") as f:  # bytes, not tensors: a worker shares each tensor through a file descriptor of its own
            return f.read(), box, flip, label, path


def _collate(items: list) -> tuple[list[bytes], torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    data, boxes, flips, labels, paths = zip(*items)
    return list(data), torch.stack(boxes), torch.tensor(flips), torch.tensor(labels), list(paths)


def decode(files: list[bytes], paths: list[str], device: torch.device) -> list[torch.Tensor]:
    """Each file's RGB uint8 (3, H, W) on `device`: the JPEGs in one batched call there, any other
    format on the host."""
    data = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    out: list[Optional[torch.Tensor]] = [None] * len(data)
    jpegs = [i for i, d in enumerate(data) if d.numel() > 1 and tuple(d[:2].tolist()) == JPEG_MAGIC]
    try:
        if jpegs:
            decoded = decode_jpeg([data[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
            for i, image in zip(jpegs, decoded):
                out[i] = image
        for i in sorted(set(range(len(data))) - set(jpegs)):
            out[i] = decode_image(data[i], mode=ImageReadMode.RGB).to(device)
    except RuntimeError as e:  # which file: decoded one by one on the host to find it
        for d, path in zip(data, paths):
            try:
                decode_image(d, mode=ImageReadMode.RGB)
            except RuntimeError as bad:
                raise imagefolder.CorruptImage(f"corrupt image {path}: {bad}") from None
        raise imagefolder.CorruptImage(f"a batch of {len(data)} images failed to decode on {device}: {e}") from None
    return [o for o in out if o is not None]


class DeviceDecodedImages(LoaderData):
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device, shard: Dist = Dist()):
        root = imagefolder.folder_root(data)
        self.size, self.val_size = schedule.image_size, round(schedule.image_size * data.resize_ratio)
        train_set, val_set = imagefolder.open_split(root, data.train_split, None), imagefolder.open_split(root, data.val_split, None)
        imagefolder.check_splits(root, data, train_set.classes, val_set.classes, len(train_set), schedule.batch_size)
        self.device = device
        workers = default_workers() if data.num_workers == -1 else data.num_workers
        common: dict[str, Any] = dict(num_workers=workers, collate_fn=_collate, persistent_workers=workers > 0, worker_init_fn=shielded_worker)
        self.order = torch.Generator().manual_seed(seed)
        self.batches = EpochBatches(len(train_set), schedule.batch_size, self.order, shard)
        self.train_loader = DataLoader(SeededSamples(_Encoded(train_set, train=True), seed), batch_sampler=self.batches, **common)
        val_order = imagefolder.fixed_order(len(val_set)).tolist()  # the host path's evaluation order
        self.val_loader = DataLoader(_Encoded(val_set, train=False), batch_size=schedule.batch_size, sampler=val_order, **common)
        self.steps_per_epoch = len(train_set) // schedule.batch_size
        self.mean, self.std = (torch.tensor(s, device=device).view(1, 3, 1, 1) for s in (imagefolder.IMAGENET_MEAN, imagefolder.IMAGENET_STD))
        self.root, self.train_split = root, data.train_split
        self.info = {
            "num_classes": len(train_set.classes),
            "classes": train_set.classes,
            "train_samples": len(train_set),
            "val_samples": len(val_set),
            "resident": False,
            "decode": f"device ({device.type})",
            "num_workers": workers,
        }

    def _normalized(self, images: list[torch.Tensor]) -> torch.Tensor:
        return (torch.stack(images).float() / 255 - self.mean) / self.std

    def to_device(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch: each image's box resized to the training size, and its flip."""
        data, boxes, flips, labels, paths = batch
        images = decode(data, paths, self.device)
        out = [F.resized_crop(im, *box.tolist(), [self.size, self.size], antialias=True) for im, box in zip(images, boxes)]
        out = [o.flip(-1) if f else o for o, f in zip(out, flips.tolist())]
        return self._normalized(out), labels.to(self.device, non_blocking=True)

    def _evaluation_batch(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Resize(image_size * resize_ratio) and CenterCrop(image_size), as the host path's."""
        data, _, _, labels, paths = batch
        out = [F.center_crop(F.resize(im, [self.val_size], antialias=True), [self.size, self.size]) for im in decode(data, paths, self.device)]
        return self._normalized(out), labels.to(self.device, non_blocking=True)

    def val(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return map(self._evaluation_batch, self.val_loader)

    def plain_train_images(self, n: int) -> torch.Tensor:
        return imagefolder.plain_images(self.root, self.train_split, self.size, n, self.device)
