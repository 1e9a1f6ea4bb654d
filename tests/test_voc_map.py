"""VOC mAP: hand-checked cases, and the all-point area against torchmetrics (pycocotools' COCO AP)."""

from __future__ import annotations

import math

import pytest
import torch

from mpt.models.voc_map import average_precision, voc_map


def dets(boxes, scores, labels):
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        "scores": torch.tensor(scores),
        "labels": torch.tensor(labels),
    }


def truth(boxes, labels, difficult=None):
    t = {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), "labels": torch.tensor(labels)}
    if difficult is not None:
        t["difficult"] = torch.tensor(difficult)
    return t


A, B, ELSEWHERE = [0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]


def test_duplicate_detection_is_a_false_positive_and_both_areas_match_hand_values():
    # Scores .9 (hits A), .8 (A again: a duplicate), .7 (hits B):
    # recall .5 .5 1, precision 1 .5 2/3.
    r = voc_map([dets([A, A, B], [0.9, 0.8, 0.7], [1, 1, 1])], [truth([A, B], [1, 1])], num_classes=1)
    # all-point: the envelope is 1 up to recall .5 and 2/3 up to 1.
    assert r["map_all"] == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    # 11-point: recall thresholds 0..0.5 (six of them) reach precision 1, 0.6..1 (five) reach 2/3.
    assert r["map_11pt"] == pytest.approx((6 * 1 + 5 * 2 / 3) / 11)


def test_a_detection_of_a_difficult_object_counts_neither_way():
    # GT: A, and B marked difficult. Detections: .99 elsewhere (false), .9 on B, .8 on A.
    d = [dets([ELSEWHERE, B, A], [0.99, 0.9, 0.8], [1, 1, 1])]
    ignored = voc_map(d, [truth([A, B], [1, 1], [False, True])], 1)
    assert ignored["map_all"] == pytest.approx(0.5)  # recall 0 then 1, precision 0 then 1/2
    assert ignored["per_class"][1].positives == 1
    # The two wrong treatments give other values: difficult as an ordinary positive (2/3), or a
    # detection of it as a false alarm (1/3).
    assert voc_map(d, [truth([A, B], [1, 1], [False, False])], 1)["map_all"] == pytest.approx(2 / 3)
    assert voc_map(
        [dets([ELSEWHERE, ELSEWHERE, A], [0.99, 0.9, 0.8], [1, 1, 1])], [truth([A, B], [1, 1], [False, True])], 1
    )["map_all"] == pytest.approx(1 / 3)


def test_overlap_must_exceed_the_threshold_and_classes_are_scored_apart():
    half = [0, 0, 10, 5]  # IoU with A is exactly 0.5: VOC needs more than 0.5
    assert voc_map([dets([half], [0.9], [1])], [truth([A], [1])], 1)["map_all"] == 0.0
    assert voc_map([dets([[0, 0, 10, 5.2]], [0.9], [1])], [truth([A], [1])], 1)["map_all"] == 1.0
    # Class 2's box on class 1's object: a miss for class 1, a false alarm for class 2. Class 3
    # has no ground truth and stays out of the mean.
    r = voc_map([dets([A, B], [0.9, 0.8], [2, 2])], [truth([A, B], [1, 2])], num_classes=3)
    assert set(r["per_class"]) == {1, 2}
    assert r["per_class"][1].ap_all == 0.0
    assert r["per_class"][2].ap_all == pytest.approx(0.5)  # a false alarm first, then a hit: p = 1/2 at r = 1
    assert r["map_all"] == pytest.approx(0.25)


def test_a_box_matches_only_within_its_own_image():
    r = voc_map([dets([A], [0.9], [1]), dets([], [], [])], [truth([], []), truth([A], [1])], 1)
    assert r["map_all"] == 0.0 and r["map_11pt"] == 0.0


def test_eleven_point_and_all_point_differ_where_they_should():
    recall, precision = torch.tensor([0.05, 0.15]), torch.tensor([1.0, 1.0])
    assert average_precision(recall, precision, eleven_point=False) == pytest.approx(0.15)
    assert average_precision(recall, precision, eleven_point=True) == pytest.approx(2 / 11)  # thresholds 0 and 0.1
    # py-faster-rcnn's thresholds come from np.arange, whose fourth is 0.30000000000000004: a recall
    # of exactly 3/10 does not reach it (the paper's numbers were computed so).
    recall = torch.tensor([3 / 10], dtype=torch.float64)  # as voc_map computes it: 3 hits of 10, in float64
    assert average_precision(recall, torch.tensor([1.0]), eleven_point=True) == pytest.approx(3 / 11)
    assert math.isnan(voc_map([dets([], [], [])], [truth([], [])], 1)["map_all"])  # no ground truth at all


def random_scene(g: torch.Generator, classes: int):
    """Ground truth on a grid of disjoint cells, so a detection overlaps at most one box by more than
    0.5: VOC's matching (best box, else false) and COCO's (best unmatched box) then agree."""
    cells = torch.randperm(16, generator=g)[: int(torch.randint(1, 6, (1,), generator=g))]
    gt_boxes, gt_labels, boxes, scores, labels = [], [], [], [], []
    for cell in cells.tolist():
        x0, y0 = (cell % 4) * 100.0, (cell // 4) * 100.0
        box = torch.tensor([x0 + 10, y0 + 10, x0 + 90, y0 + 90])
        c = int(torch.randint(1, classes + 1, (1,), generator=g))
        gt_boxes.append(box), gt_labels.append(c)
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):  # hits, near misses, duplicates, wrong classes
            jitter = (torch.rand(4, generator=g) - 0.5) * 36
            boxes.append(box + jitter)
            scores.append(float(torch.rand(1, generator=g)))
            labels.append(
                c if torch.rand(1, generator=g) < 0.8 else int(torch.randint(1, classes + 1, (1,), generator=g))
            )
    for _ in range(int(torch.randint(0, 3, (1,), generator=g))):  # background false alarms
        xy = torch.rand(2, generator=g) * 350
        boxes.append(torch.cat([xy, xy + 40]))
        scores.append(float(torch.rand(1, generator=g)))
        labels.append(int(torch.randint(1, classes + 1, (1,), generator=g)))
    d = {
        "boxes": torch.stack(boxes) if boxes else torch.zeros(0, 4),
        "scores": torch.tensor(scores),
        "labels": torch.tensor(labels, dtype=torch.int64),
    }
    return d, {"boxes": torch.stack(gt_boxes), "labels": torch.tensor(gt_labels, dtype=torch.int64)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_all_point_map_agrees_with_torchmetrics(seed):
    torchmetrics = pytest.importorskip("torchmetrics.detection")
    g = torch.Generator().manual_seed(seed)
    scenes = [random_scene(g, classes=3) for _ in range(40)]
    ours = voc_map([d for d, _ in scenes], [t for _, t in scenes], num_classes=3)
    metric = torchmetrics.MeanAveragePrecision(iou_thresholds=[0.5], class_metrics=True)
    metric.update([d for d, _ in scenes], [t for _, t in scenes])
    theirs = metric.compute()
    # COCO samples the precision envelope at 101 recall points instead of integrating it: for a
    # non-increasing envelope in [0, 1] that differs from the exact area by at most 1/100.
    assert abs(ours["map_all"] - float(theirs["map"])) <= 0.01
    for c, value in zip(theirs["classes"].tolist(), theirs["map_per_class"].tolist()):
        assert abs(ours["per_class"][c].ap_all - value) <= 0.01, c
    assert 0.2 < ours["map_all"] < 0.9  # a mix of hits and misses, not a trivial 0 or 1
