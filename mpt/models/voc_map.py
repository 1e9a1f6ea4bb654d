"""PASCAL VOC detection metric: average precision per class at one IoU threshold, and its mean.

As the VOC devkit computes it (VOCevaldet, and the py-faster-rcnn port SSD was evaluated with):
detections of a class, over all images, in descending score order; each is a true positive if its
best-overlapping ground-truth box of that class overlaps it by more than the threshold and was
not already taken by a higher-scoring detection, a false positive otherwise. Ground truth marked
`difficult` counts neither way: a detection whose best match is difficult is ignored, and
difficult boxes are not in the recall's denominator.

Two areas under the precision/recall curve:
- `eleven_point` (VOC2007's, what the paper reports): the mean over recall r in {0, 0.1, ..., 1} of
  the highest precision at recall >= r;
- all-point (VOC2010 on): the exact area under the precision envelope.

Boxes are (x1, y1, x2, y2) in continuous pixel coordinates (area = width * height), as torchvision
uses, not the devkit's inclusive integer pixels (area = (width + 1) * (height + 1)); the loaders
convert VOC's 1-based inclusive corners accordingly. Classes without ground truth have no AP and
are left out of the mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.ops import box_iou


def average_precision(recall: torch.Tensor, precision: torch.Tensor, eleven_point: bool) -> float:
    """Area under a precision/recall curve given at each detection, in score order."""
    recall, precision = recall.double(), precision.double()
    if eleven_point:
        # The thresholds exactly as py-faster-rcnn's voc_eval (np.arange(0, 1.1, 0.1)), whose
        # 0.30000000000000004, 0.6000000000000001 and 0.7000000000000001 exclude a recall of exactly 0.3, 0.6 or 0.7.
        points = []
        for t in np.arange(0.0, 1.1, 0.1):
            reached = precision[recall >= float(t)]
            points.append(float(reached.max()) if reached.numel() else 0.0)
        return sum(points) / 11
    r = torch.cat([torch.zeros(1, dtype=torch.float64), recall, torch.ones(1, dtype=torch.float64)])
    p = torch.cat([torch.zeros(1, dtype=torch.float64), precision, torch.zeros(1, dtype=torch.float64)])
    p = torch.flip(
        torch.cummax(torch.flip(p, [0]), 0).values, [0]
    )  # the envelope: best precision at this recall or more
    steps = torch.nonzero(r[1:] != r[:-1]).flatten()
    return float(((r[steps + 1] - r[steps]) * p[steps + 1]).sum())


@dataclass
class ClassResult:
    ap_11pt: float
    ap_all: float
    positives: int  # non-difficult ground-truth boxes
    detections: int


def match_class(
    dets: list[tuple[int, float, torch.Tensor]], gts: dict[int, tuple[torch.Tensor, torch.Tensor]], iou_threshold: float
):
    """True/false positive flags of one class's detections (image, score, box) in descending score order."""
    order = sorted(range(len(dets)), key=lambda i: -dets[i][1])  # stable: equal scores keep their order
    taken = {img: torch.zeros(len(boxes), dtype=torch.bool) for img, (boxes, _) in gts.items()}
    tp, fp = [], []
    for i in order:
        img, _, box = dets[i]
        boxes, difficult = gts.get(img, (torch.zeros(0, 4), torch.zeros(0, dtype=torch.bool)))
        if len(boxes):
            ious = box_iou(box[None].double(), boxes.double())[0]
            best_iou, j = ious.max(0)
            if best_iou > iou_threshold:
                if difficult[j]:
                    continue  # ignored: neither a hit nor a false alarm
                if not taken[img][j]:
                    taken[img][j] = True
                    tp.append(1)
                    fp.append(0)
                    continue
        tp.append(0)
        fp.append(1)
    return torch.tensor(tp, dtype=torch.float64), torch.tensor(fp, dtype=torch.float64)


def voc_map(detections: list[dict], ground_truths: list[dict], num_classes: int, iou_threshold: float = 0.5) -> dict:
    """VOC AP of classes 1..num_classes (0 is background) and the means over classes with ground truth.

    detections[i]: {"boxes": [N, 4], "scores": [N], "labels": [N]} for image i;
    ground_truths[i]: {"boxes": [M, 4], "labels": [M], "difficult": [M] (optional)}.
    Returns {"map_11pt", "map_all", "per_class": {label: ClassResult}}.
    """
    if len(detections) != len(ground_truths):
        raise ValueError(f"{len(detections)} images of detections but {len(ground_truths)} of ground truth")
    per_class = {}
    for c in range(1, num_classes + 1):
        dets, gts, positives = [], {}, 0
        for img, (d, g) in enumerate(zip(detections, ground_truths)):
            keep = d["labels"] == c
            dets += [(img, float(s), b) for s, b in zip(d["scores"][keep].cpu(), d["boxes"][keep].cpu().float())]
            mine = g["labels"] == c
            difficult = g.get("difficult", torch.zeros_like(g["labels"], dtype=torch.bool))[mine].cpu().bool()
            if mine.any():
                gts[img] = (g["boxes"][mine].cpu().float(), difficult)
            positives += int((~difficult).sum())
        if positives == 0:
            continue
        tp, fp = match_class(dets, gts, iou_threshold)
        ctp, cfp = torch.cumsum(tp, 0), torch.cumsum(fp, 0)
        recall = ctp / positives
        precision = ctp / torch.clamp(ctp + cfp, min=1e-12)
        per_class[c] = ClassResult(
            average_precision(recall, precision, True),
            average_precision(recall, precision, False),
            positives,
            len(dets),
        )

    def mean(key: str) -> float:
        return sum(getattr(r, key) for r in per_class.values()) / len(per_class) if per_class else math.nan

    return {"map_11pt": mean("ap_11pt"), "map_all": mean("ap_all"), "per_class": per_class}
