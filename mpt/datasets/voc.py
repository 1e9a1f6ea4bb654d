"""PASCAL VOC detection data on disk, in either of its two common layouts.

- The devkit: `root/VOC2007/{Annotations/<id>.xml, JPEGImages/<id>.jpg, ImageSets/Main/<split>.txt}`;
  a set is named `VOC2007/trainval`, and several sets are joined (VOC07+12: `VOC2007/trainval`
  and `VOC2012/trainval`).
- A flat pair of folders: `root/annotations/*.xml` and `root/images/*`, with a set named by a
  split file under root: a `.txt` of ids or file names, one per line, or a `.csv` with a
  `filename` column (the raccoon dataset's `train_labels.csv`).

Every annotation of a set is parsed when the data is built, so a missing or corrupt file, or a
class not in `data.class_names`, stops the run before training, naming the file. Box corners are
VOC's 1-based inclusive pixels; they become continuous coordinates (x1 - 1, y1 - 1, x2, y2). A box
must lie in its image (1 <= xmin <= xmax <= width, 1 <= ymin <= ymax <= height, the size from
<size>, or from the image file where <size> is missing or zero): one that does not is a
CorruptAnnotation, or, with `data.clip_boxes=true`, is clipped to the image (dropped if nothing of it
is inside) and counted. Training and evaluation both read the boxes so checked.

Training augmentation is SSD's, as torchvision's references implement it: photometric distortion,
zoom-out onto a canvas of the mean colour (expand), an IoU-constrained random crop, horizontal flip,
then a resize to image_size x image_size. (torchvision's distortion differs in detail from Caffe
SSD's: it may permute channels, and scales brightness instead of adding to it.) Objects marked
difficult are trained on, as SSD did, unless `data.keep_difficult=false`; evaluation keeps them,
flagged, and ignores them as VOC does.
"""

from __future__ import annotations

import csv
import math
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from ..config import ConfigError
from ..distributed import Dist
from .imagefolder import CorruptImage, load_image
from .sampling import EpochBatches, EvalBatches, LoaderData, SeededSamples, default_workers, shielded_worker

# Caffe's input convention, which torchvision's SSD and its VGG16_Weights.IMAGENET1K_FEATURES use:
# RGB in 0-255 minus the mean pixel (models/detection.py); also the zoom-out's fill.
MEAN_PIXEL_01 = (0.48235, 0.45882, 0.40784)


class CorruptAnnotation(RuntimeError):
    """A VOC XML file that cannot be read as an annotation, or one with a box outside its image
    (which no detection could match: evaluation would lose it silently). The run fails naming it."""


@dataclass
class Annotation:
    image: Path
    boxes: list[list[float]]  # continuous x1 y1 x2 y2
    labels: list[int]  # 1..C
    difficult: list[bool]
    clipped: int = 0  # boxes that data.clip_boxes cut to the image
    dropped: int = 0  # boxes that data.clip_boxes dropped, wholly outside the image


def _number(node: ET.Element, tag: str, file: Path) -> float:
    text = node.findtext(tag)
    try:
        return float(text)  # type: ignore[arg-type]  # a missing tag (None) raises the TypeError caught here
    except (TypeError, ValueError):
        raise CorruptAnnotation(f"corrupt annotation {file}: <{tag}> is {text!r}, not a number") from None


def _image_size(root: ET.Element, file: Path, image: Path) -> tuple[float, float]:
    """(width, height) from <size>; from the image file's header where <size> is missing or zero
    (some annotation tools write <width>0</width>)."""
    size = root.find("size")
    if size is not None and size.findtext("width") is not None and size.findtext("height") is not None:
        width, height = _number(size, "width", file), _number(size, "height", file)
        if width > 0 and height > 0:
            return width, height
    try:
        with Image.open(image) as img:
            return float(img.width), float(img.height)
    except (OSError, SyntaxError, ValueError) as e:
        raise CorruptImage(f"corrupt image {image}: {type(e).__name__}: {e}") from None


def _corners(x1: float, y1: float, x2: float, y2: float) -> str:
    return f"xmin={x1:g}, ymin={y1:g}, xmax={x2:g}, ymax={y2:g}"


def parse_annotation(file: Path, image_dir: Path, class_index: dict[str, int], clip_boxes: bool = False) -> Annotation:
    try:
        root = ET.parse(file).getroot()
    except (ET.ParseError, OSError) as e:
        raise CorruptAnnotation(f"corrupt annotation {file}: {type(e).__name__}: {e}") from None
    filename = root.findtext("filename") or f"{file.stem}.jpg"
    image = image_dir / filename
    if not image.is_file() and (image_dir / f"{file.stem}.jpg").is_file():
        image = image_dir / f"{file.stem}.jpg"  # VOC's <filename> sometimes disagrees with the id
    if not image.is_file():
        raise ConfigError(f"{file}: its image {image} does not exist")
    width: float | None = None  # read at the first box: a file without objects needs no size
    height: float | None = None
    boxes: list[list[float]] = []
    labels: list[int] = []
    difficult: list[bool] = []
    clipped = dropped = 0
    for k, obj in enumerate(root.iter("object"), start=1):
        name = (obj.findtext("name") or "").strip()
        if name not in class_index:
            raise ConfigError(f"{file}: object class '{name}' is not in data.class_names ({', '.join(class_index)})")
        box = obj.find("bndbox")
        if box is None:
            raise CorruptAnnotation(f"corrupt annotation {file}: an object '{name}' has no <bndbox>")
        x1, y1, x2, y2 = (_number(box, t, file) for t in ("xmin", "ymin", "xmax", "ymax"))
        where = f"corrupt annotation {file}: box {k} ({name}) {_corners(x1, y1, x2, y2)}"
        if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
            raise CorruptAnnotation(f"{where} is not finite")
        if not (x2 >= x1 and y2 >= y1):  # clipping cannot say which corner was meant
            raise CorruptAnnotation(f"{where} has its corners swapped")
        if width is None:
            width, height = _image_size(root, file, image)
        assert height is not None  # read with width
        if not (1 <= x1 and x2 <= width and 1 <= y1 and y2 <= height):
            if not clip_boxes:
                advice = "fix it, or set data.clip_boxes=true to clip such boxes"
                raise CorruptAnnotation(f"{where} lies outside its {width:g}x{height:g} image; {advice}")
            x1, y1, x2, y2 = max(x1, 1), max(y1, 1), min(x2, width), min(y2, height)
            if x1 > x2 or y1 > y2:  # nothing of it is inside: no pixel to train or score on
                dropped += 1
                continue
            clipped += 1
        boxes.append([x1 - 1, y1 - 1, x2, y2])
        labels.append(class_index[name])
        difficult.append(obj.findtext("difficult", "0").strip() == "1")
    return Annotation(image, boxes, labels, difficult, clipped, dropped)


def _ids_from_split_file(file: Path) -> list[str]:
    if file.suffix == ".csv":
        with open(file, newline="") as f:
            reader = csv.DictReader(f)
            if "filename" not in (reader.fieldnames or []):
                raise ConfigError(
                    f"{file}: a split .csv needs a 'filename' column (found: {', '.join(reader.fieldnames or [])})"
                )
            names = [row["filename"] for row in reader]
    else:
        names = [line.split()[0] for line in file.read_text().splitlines() if line.strip()]
    return list(dict.fromkeys(Path(n).stem for n in names))  # a csv has a row per object: one id per image


def resolve_set(root: Path, name: str) -> tuple[list[str], Path, Path]:
    """(ids, annotation folder, image folder) of one named set, in either layout."""
    parts = Path(name).parts
    if len(parts) == 2 and (root / parts[0] / "Annotations").is_dir():
        year, split = parts
        split_file = root / year / "ImageSets" / "Main" / f"{split}.txt"
        if not split_file.is_file():
            raise ConfigError(
                f"data set {name}: no {split_file} (the devkit's split lists are ImageSets/Main/<split>.txt)"
            )
        return _ids_from_split_file(split_file), root / year / "Annotations", root / year / "JPEGImages"
    if (root / "annotations").is_dir() and (root / "images").is_dir():
        split_file = root / name
        if not split_file.is_file():
            raise ConfigError(
                f"data set {name}: no split file {split_file} (a .txt of ids or a .csv with a filename column)"
            )
        return _ids_from_split_file(split_file), root / "annotations", root / "images"
    raise ConfigError(
        f"data.root={root}: neither a VOC devkit (VOC2007/Annotations, ...) holding set {name} "
        "nor a flat annotations/ + images/ folder pair"
    )


def read_sets(root: Path, names: list[str], class_names: list[str], clip_boxes: bool = False) -> list[Annotation]:
    class_index = {n: i + 1 for i, n in enumerate(class_names)}
    out = []
    for name in names:
        ids, ann_dir, image_dir = resolve_set(root, name)
        for i in ids:
            file = ann_dir / f"{i}.xml"
            if not file.is_file():
                raise ConfigError(f"data set {name}: image '{i}' has no annotation {file}")
            out.append(parse_annotation(file, image_dir, class_index, clip_boxes))
    return out


class VOCDetection(Dataset):
    def __init__(self, annotations: list[Annotation], transform, keep_difficult: bool, with_difficult: bool):
        self.annotations, self.transform = annotations, transform
        self.keep_difficult, self.with_difficult = keep_difficult, with_difficult

    def __len__(self) -> int:
        return len(self.annotations)

    def __getitem__(self, index: int):
        a = self.annotations[index]
        image = tv_tensors.Image(v2.functional.pil_to_tensor(load_image(str(a.image))))
        keep = [k for k, d in enumerate(a.difficult) if self.keep_difficult or self.with_difficult or not d]
        boxes = torch.tensor([a.boxes[k] for k in keep], dtype=torch.float32).reshape(-1, 4)
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=tuple(image.shape[-2:])),
            "labels": torch.tensor([a.labels[k] for k in keep], dtype=torch.int64),
        }
        if self.with_difficult:
            target["difficult"] = torch.tensor([a.difficult[k] for k in keep], dtype=torch.bool)
        image, target = self.transform(image, target)
        return image, {k: v.as_subclass(torch.Tensor) for k, v in target.items()}


def ssd_train_transform(size: int):
    return v2.Compose(
        [
            v2.RandomPhotometricDistort(),
            v2.RandomZoomOut(fill=[round(255 * m) for m in MEAN_PIXEL_01], side_range=(1.0, 4.0), p=0.5),
            v2.RandomIoUCrop(),
            v2.RandomHorizontalFlip(p=0.5),
            v2.Resize((size, size), antialias=True),
            v2.SanitizeBoundingBoxes(min_size=1.0),  # boxes the crop cut to slivers go, with their labels
            v2.ToDtype(torch.float32, scale=True),
        ]
    )


def eval_transform(size: int):
    return v2.Compose([v2.Resize((size, size), antialias=True), v2.ToDtype(torch.float32, scale=True)])


def collate(samples):
    images, targets = zip(*samples)
    return torch.stack(images), list(targets)


def validate(cfg: DictConfig) -> None:
    d = cfg.data
    if d.root is None:
        raise ConfigError("data.root is not set: give the VOCdevkit folder, or a folder with annotations/ and images/")
    for key in ["data.train_sets", "data.val_sets", "data.class_names"]:
        if not OmegaConf.select(cfg, key):
            raise ConfigError(f"{key} is empty: data=voc needs it (see configs/data/voc.yaml)")
    if len(set(d.class_names)) != len(d.class_names):
        raise ConfigError(f"data.class_names={list(d.class_names)}: a class is listed twice")


class VOCData(LoaderData):
    def __init__(self, data: DictConfig, schedule: DictConfig, seed: int, device: torch.device, shard: Dist = Dist()):
        root = Path(os.path.expanduser(data.root))
        if not root.is_dir():
            raise ConfigError(f"data.root={root}: no such folder")
        size = schedule.image_size
        train = read_sets(root, list(data.train_sets), list(data.class_names), data.clip_boxes)
        val = read_sets(root, list(data.val_sets), list(data.class_names), data.clip_boxes)
        if len(train) < schedule.batch_size:
            raise ConfigError(
                f"data.train_sets={list(data.train_sets)}: {len(train)} images, "
                f"fewer than one batch of {schedule.batch_size}"
            )
        self.device = device
        workers = default_workers() if data.num_workers == -1 else data.num_workers
        common: dict[str, Any] = dict(
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            worker_init_fn=shielded_worker,
            collate_fn=collate,
        )
        # Loaders get generators of their own, so iterating them never draws from the global RNG.
        self.order = torch.Generator().manual_seed(seed)
        self.batches = EpochBatches(len(train), schedule.batch_size, self.order, shard)
        train_set = VOCDetection(train, ssd_train_transform(size), data.keep_difficult, with_difficult=False)
        val_set = VOCDetection(val, eval_transform(size), keep_difficult=True, with_difficult=True)
        self.train_loader = DataLoader(
            SeededSamples(train_set, seed),
            batch_sampler=self.batches,
            generator=torch.Generator().manual_seed(seed),
            **common,
        )
        self.val_batches = EvalBatches(len(val_set), schedule.batch_size, shard)
        self.val_loader = DataLoader(
            val_set, batch_sampler=self.val_batches, generator=torch.Generator().manual_seed(seed), **common
        )
        self.steps_per_epoch = len(train) // schedule.batch_size
        self.info = {
            "num_classes": len(data.class_names),
            "classes": list(data.class_names),
            "train_samples": len(train),
            "val_samples": len(val),
            "train_objects": sum(sum(1 for d in a.difficult if data.keep_difficult or not d) for a in train),
            "val_objects": sum(len(a.labels) for a in val),
            # boxes reaching outside their image, clipped or dropped (data.clip_boxes), in both splits
            "clipped_boxes": sum(a.clipped for a in train + val),
            "dropped_boxes": sum(a.dropped for a in train + val),
            "resident": False,
            "num_workers": workers,
        }

    def to_device(self, batch: tuple[torch.Tensor, list[dict]]) -> tuple[torch.Tensor, list[dict]]:
        images, targets = batch
        return images.to(self.device, non_blocking=True), [
            {k: v.to(self.device, non_blocking=True) for k, v in t.items()} for t in targets
        ]


def build(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> VOCData:
    return VOCData(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
