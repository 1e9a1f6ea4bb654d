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
tree) is read by PIL on the host, as the host path reads it, and moved; a corrupt file fails the run
naming it.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from omegaconf import DictConfig
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets, transforms
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.functional import pil_to_tensor
from torchvision.transforms.v2 import functional as F

from ..config import ConfigError
from ..distributed import Dist
from . import imagefolder
from .sampling import EpochBatches, EvalBatches, LoaderData, SeededSamples, default_workers, shielded_worker

JPEG_MAGIC = b"\xff\xd8"


def validate(cfg: DictConfig) -> None:
    d = cfg.data
    if d.decode not in ("host", "device"):
        raise ConfigError(
            f"data.decode={d.decode}: must be host (PIL in the loader's workers) "
            "or device (the JPEGs' bytes decoded on the run's device)"
        )
    if d.decode == "device" and d.resident:
        raise ConfigError(
            "data.decode=device with data.resident=true: "
            "a resident source decodes once and keeps the pixels; choose one"
        )
    if d.decode == "device" and d.augment != "imagenet":
        raise ConfigError(
            f"data.decode=device: data.augment={d.augment} is not computed there "
            "(expected imagenet; CIFAR-sized data: data.resident=true)"
        )


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
                    box = torch.tensor(
                        transforms.RandomResizedCrop.get_params(img, list(self.crop.scale), list(self.crop.ratio))
                    )
            except (OSError, SyntaxError, ValueError) as e:
                raise imagefolder.CorruptImage(f"corrupt image {path}: {type(e).__name__}: {e}") from None
            flip = bool(torch.rand(1) < 0.5)  # RandomHorizontalFlip's draw, after the crop's
        with open(
            path, "rb"
        ) as f:  # bytes, not tensors: a worker shares each tensor through a file descriptor of its own
            return f.read(), box, flip, label, path


def _collate(items: list) -> tuple[list[bytes], torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    data, boxes, flips, labels, paths = zip(*items)
    return list(data), torch.stack(boxes), torch.tensor(flips), torch.tensor(labels), list(paths)


def _on_host(data: bytes, path: str) -> torch.Tensor:
    """One file as the host path reads it (PIL: any format it knows; a corrupt file named)."""
    if not data:
        raise imagefolder.CorruptImage(f"corrupt image {path}: the file is empty")
    return pil_to_tensor(imagefolder.load_image(path))


def _jpegs_on(device: torch.device, encoded: list[torch.Tensor]) -> list[torch.Tensor]:
    """decode_jpeg on `device`. On CUDA on a stream of its own: nvJPEG writes its output from a
    stream of its pool, so the output is allocated from a pool no kernel of the training stream
    still reads (an upstream report: torchvision's decoder does not wait for the caller's stream)."""
    if device.type != "cuda":
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    current.wait_stream(side)
    for image in images:
        image.record_stream(current)
    return images


def decode(files: list[bytes], paths: list[str], device: torch.device) -> list[torch.Tensor]:
    """Each file's RGB uint8 (3, H, W) on `device`: the JPEGs in one batched call there, any other
    format by PIL on the host, as the host path reads it. A batch the device's decoder refuses is
    decoded a file at a time, and a file it refuses (a CMYK JPEG for some decoders) on the host."""
    jpegs = [i for i, f in enumerate(files) if f[:2] == JPEG_MAGIC]
    out: dict[int, torch.Tensor] = {
        i: _on_host(files[i], paths[i]).to(device) for i in range(len(files)) if i not in set(jpegs)
    }
    encoded = {i: torch.frombuffer(bytearray(files[i]), dtype=torch.uint8) for i in jpegs}
    try:
        out.update(zip(jpegs, _jpegs_on(device, [encoded[i] for i in jpegs]) if jpegs else []))
    except RuntimeError:
        for i in jpegs:
            try:
                out[i] = _jpegs_on(device, [encoded[i]])[0]
            except RuntimeError:
                out[i] = _on_host(files[i], paths[i]).to(device)
    return [out[i] for i in range(len(files))]


class DeviceDecodedImages(LoaderData):
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device, shard: Dist = Dist()):
        root = imagefolder.folder_root(data)
        self.size, self.val_size = schedule.image_size, round(schedule.image_size * data.resize_ratio)
        train_set, val_set = (
            imagefolder.open_split(root, data.train_split, None),
            imagefolder.open_split(root, data.val_split, None),
        )
        imagefolder.check_splits(root, data, train_set.classes, val_set.classes, len(train_set), schedule.batch_size)
        self.device = device
        workers = default_workers() if data.num_workers == -1 else data.num_workers
        common: dict[str, Any] = dict(
            num_workers=workers, collate_fn=_collate, persistent_workers=workers > 0, worker_init_fn=shielded_worker
        )
        self.order = torch.Generator().manual_seed(seed)
        self.batches = EpochBatches(len(train_set), schedule.batch_size, self.order, shard)
        # Loaders with generators of their own, as the host path's: iterating them never draws from
        # the global RNG that dropout uses, so a resumed run's random stream is the uninterrupted one's.
        common["generator"] = torch.Generator().manual_seed(seed)
        self.train_loader = DataLoader(
            SeededSamples(_Encoded(train_set, train=True), seed), batch_sampler=self.batches, **common
        )
        val_order = imagefolder.fixed_order(len(val_set)).tolist()  # the host path's evaluation order
        common["generator"] = torch.Generator().manual_seed(seed)
        self.val_batches = EvalBatches(len(val_set), schedule.batch_size, shard, val_order)
        self.val_loader = DataLoader(_Encoded(val_set, train=False), batch_sampler=self.val_batches, **common)
        self.steps_per_epoch = len(train_set) // schedule.batch_size
        self.mean, self.std = (
            torch.tensor(s, device=device).view(1, 3, 1, 1)
            for s in (imagefolder.IMAGENET_MEAN, imagefolder.IMAGENET_STD)
        )
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
        out = [
            F.resized_crop(im, *box.tolist(), [self.size, self.size], antialias=True) for im, box in zip(images, boxes)
        ]
        out = [o.flip(-1) if f else o for o, f in zip(out, flips.tolist())]
        return self._normalized(out), labels.to(self.device, non_blocking=True)

    def _evaluation_batch(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Resize(image_size * resize_ratio) and CenterCrop(image_size), as the host path's."""
        data, _, _, labels, paths = batch
        out = [
            F.center_crop(F.resize(im, [self.val_size], antialias=True), [self.size, self.size])
            for im in decode(data, paths, self.device)
        ]
        return self._normalized(out), labels.to(self.device, non_blocking=True)

    def val(self, limit: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.val_batches.limit = limit
        return map(self._evaluation_batch, self.val_loader)

    def plain_train_images(self, n: int) -> torch.Tensor:
        return imagefolder.plain_images(self.root, self.train_split, self.size, n, self.device)
