"""Multibox SSD300 with a VGG-16 backbone (Liu et al. 2016; the paper's Table 2), random init.

torchvision's `ssd300_vgg16` supplies every part: VGG-16 with conv4_3 L2-normalized and fc6/fc7 as
dilated convolutions, the extra feature layers, the 8732 default boxes of six feature maps, the
matcher, the box coder and the multibox loss (smooth L1 on the boxes plus cross-entropy with 3:1
hard-negative mining, both divided by the number of matched boxes), and its post-processing (score
0.01, NMS 0.45, 200 boxes per image). The network given to the precision engine is the part with
weights, from image tensor to (box regression, class logits), so the engine's casts and scaling
apply as they do to a classifier; matching, loss and decoding then run in FP32 in this task.

Batches are (images [B, 3, 300, 300] in [0, 1], targets): one dict per image with "boxes"
([n, 4], x1 y1 x2 y2 in the 300x300 pixels), "labels" ([n], 1..C, 0 being background) and, in
validation, "difficult" ([n], bool).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
import torchvision
from omegaconf import DictConfig
from torch import nn
from torchvision.models.detection import ssd300_vgg16
from torchvision.models.detection.anchor_utils import DefaultBoxGenerator
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.ssd import SSD
from torchvision.ops import box_iou

from ..config import ConfigError
from ..datasets.voc import MEAN_PIXEL_01
from ..distributed import Dist
from . import LossTerm, OneNetwork, validate_image_size
from .voc_map import voc_map

# The ImageNet convention of torchvision's other weights: RGB in [0, 1], minus mean, over std.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# SSD300's default boxes for VOC (Liu et al., ssd_pascal.py: conv4_3 at 0.1, then min_ratio 20 to
# max_ratio 90 of the image in steps of 17, not clipped); torchvision's builder has COCO's smaller scales.
VOC_BOX_SCALES = [0.1, 0.2, 0.37, 0.54, 0.71, 0.88, 1.05]
ASPECT_RATIOS = [[2], [2, 3], [2, 3], [2, 3], [2], [2]]
FEATURE_STEPS = [8, 16, 32, 64, 100, 300]


class SSD300Network(nn.Module):
    """The weights of SSD300: image in [0, 1] -> (box regression [B, 8732, 4], class logits [B, 8732, C+1])."""

    mean: torch.Tensor  # buffers, registered in __init__
    gain: torch.Tensor

    def __init__(self, backbone: nn.Module, head: nn.Module, input_convention: str = "unit_variance"):
        super().__init__()
        self.backbone, self.head = backbone, head
        # x -> (x - mean) * gain, per channel.
        if input_convention == "caffe":
            mean, gain = torch.tensor(MEAN_PIXEL_01), torch.full((3,), 255.0)
        else:
            mean, gain = torch.tensor(IMAGENET_MEAN), 1 / torch.tensor(IMAGENET_STD)
        self.register_buffer("mean", mean.view(1, 3, 1, 1), persistent=False)
        self.register_buffer("gain", gain.view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (images - self.mean) * self.gain
        out = self.head(list(self.backbone(x).values()))
        return out["bbox_regression"], out["cls_logits"]


def load_backbone_weights(path: str) -> nn.Module:
    """torchvision's VGG-16 with the state dict saved at `path` (a full vgg16 state dict or its
    `features.*` part). Set model.input_convention to the one the weights were trained with:
    `caffe` for VGG16_Weights.IMAGENET1K_FEATURES, `unit_variance` for IMAGENET1K_V1."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"model.backbone_weights={path}: no such file "
            "(expected a torchvision vgg16 state dict saved with torch.save)"
        )
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(
            f"model.backbone_weights={path}: not a readable torch state dict "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    vgg = torchvision.models.vgg16(weights=None)
    if not isinstance(state, dict) or not any(k.startswith("features.") for k in state):
        raise ConfigError(f"model.backbone_weights={path}: holds no 'features.*' tensors of a torchvision vgg16")
    missing = [k for k in vgg.state_dict() if k.startswith("features.") and k not in state]
    if missing:
        raise ConfigError(
            f"model.backbone_weights={path}: lacks {missing[0]} (and {len(missing) - 1} more) of vgg16's features"
        )
    try:
        vgg.load_state_dict(state, strict=False)  # the classifier, if present, is not used
    except RuntimeError as e:
        raise ConfigError(
            f"model.backbone_weights={path}: does not fit vgg16 ({str(e).splitlines()[-1].strip()})"
        ) from None
    return vgg


def build_ssd300(num_classes: int, backbone_weights: str | None) -> SSD:
    """torchvision's SSD300-VGG16 detector with `num_classes` outputs (background included) and
    SSD300's VOC default boxes."""
    detector = ssd300_vgg16(weights=None, weights_backbone=None, num_classes=num_classes)
    # The same number of boxes per location as torchvision's, so its heads fit unchanged.
    detector.anchor_generator = DefaultBoxGenerator(
        ASPECT_RATIOS, scales=VOC_BOX_SCALES, steps=FEATURE_STEPS, clip=False
    )
    if backbone_weights:
        from torchvision.models.detection.ssd import _vgg_extractor  # the builder's own VGG surgery

        # All five VGG stages trainable, as when the builder starts from random weights; the extra
        # layers and heads stay freshly (Xavier) initialized.
        detector.backbone = _vgg_extractor(load_backbone_weights(backbone_weights), False, 5)
    return detector


class Detection(OneNetwork):
    sample_unit = "images"
    primary_metric = "map"  # VOC2007's 11-point mAP at IoU 0.5, as the paper reports
    higher_is_better = True

    def __init__(self, model_cfg: DictConfig, num_classes: int, class_names: list[str], image_size: int):
        self.cfg = model_cfg
        self.num_classes = num_classes  # foreground classes
        self.class_names = class_names
        self.detector = build_ssd300(num_classes + 1, model_cfg.backbone_weights)
        self.net = SSD300Network(self.detector.backbone, self.detector.head, model_cfg.input_convention)
        self.image_size = image_size
        with torch.no_grad():  # the feature-map sizes fix the default boxes; one small pass finds them
            grids = [f.shape[-2:] for f in self.detector.backbone(torch.zeros(1, 3, image_size, image_size)).values()]
        probe = ImageList(torch.zeros(1, 3, image_size, image_size), [(image_size, image_size)])
        self.default_boxes = self.detector.anchor_generator(probe, [torch.zeros(1, 1, *g) for g in grids])[0]
        self._boxes_on: dict[torch.device, torch.Tensor] = {}

    def anchors(self, device: torch.device) -> torch.Tensor:
        if device not in self._boxes_on:
            self._boxes_on[device] = self.default_boxes.to(device)
        return self._boxes_on[device]

    @property
    def loss_definition(self) -> str:
        return "the multibox loss: box regression plus classification, each as torchvision's SSD normalizes it"

    def train_losses(self, batch: Any) -> Iterator[LossTerm]:
        images, targets = batch
        regression, logits = self.net(images)
        anchors = self.anchors(images.device)
        matched = []
        for t in targets:
            if t["boxes"].numel() == 0:  # an image whose every object was cropped away: all background
                matched.append(torch.full((anchors.shape[0],), -1, dtype=torch.int64, device=anchors.device))
            else:
                matched.append(self.detector.proposal_matcher(box_iou(t["boxes"], anchors)))
        # FP32 whatever the mode: the softmax, the hard-negative ranking and the box targets.
        losses = self.detector.compute_loss(
            targets,
            {"bbox_regression": regression.float(), "cls_logits": logits.float()},
            [anchors] * len(targets),
            matched,
        )
        box, cls = losses["bbox_regression"], losses["classification"]
        yield LossTerm("model", box + cls, {"loss_box": box.detach(), "loss_cls": cls.detach()})

    def count_samples(self, batch: Any) -> int:
        return int(batch[0].shape[0])

    @torch.no_grad()
    def detect(
        self, images: torch.Tensor, forward_context: Callable[[], ContextManager]
    ) -> list[dict[str, torch.Tensor]]:
        with forward_context():
            regression, logits = self.net(images)
        anchors = self.anchors(images.device)
        size = tuple(images.shape[-2:])
        return self.detector.postprocess_detections(
            {"bbox_regression": regression.float(), "cls_logits": logits.float()},
            [anchors] * images.shape[0],
            [size] * images.shape[0],
        )

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[Any],
        forward_context: Callable[[], ContextManager],
        final: bool = False,
        ranks: Dist = Dist(),
    ) -> dict[str, float]:
        self.net.eval()
        scored: list[list[tuple[dict, dict]]] = []  # per batch: (detections, ground truth) per image
        try:
            for images, targets in batches:
                found = [{k: v.cpu() for k, v in d.items()} for d in self.detect(images, forward_context)]
                scored.append(list(zip(found, ({k: v.cpu() for k, v in t.items()} for t in targets))))
        finally:
            self.net.train()
        # mAP ranks every detection of the set by score: it is computed once, over every rank's
        # images in the set's order (the order breaks ties between equal scores).
        ordered = ranks.in_batch_order(scored)
        detections, truths = [d for d, _ in ordered], [t for _, t in ordered]
        if not truths:
            raise ValueError("evaluation saw no samples: the validation set is empty")
        # IoU is unchanged by scaling each axis, so scoring in the resized 300x300 frame equals
        # scoring in each image's own pixels.
        result = voc_map(detections, truths, self.num_classes)
        metrics = {"map": result["map_11pt"], "map_all": result["map_all"], "val_samples": len(truths)}
        for c, r in result["per_class"].items():
            metrics[f"ap_{self.class_names[c - 1]}"] = r.ap_11pt
        return metrics


INPUT_SIZE = 300  # SSD300
INPUT_CONVENTIONS = ("unit_variance", "caffe")


def validate(cfg: DictConfig) -> None:
    validate_image_size(cfg)
    if cfg.schedule.image_size != INPUT_SIZE:
        # Its default boxes and feature-map strides are laid out for this one size.
        raise ConfigError(
            f"schedule.image_size={cfg.schedule.image_size}: "
            f"{cfg.model.name} takes {INPUT_SIZE}x{INPUT_SIZE} images only"
        )
    if cfg.model.input_convention not in INPUT_CONVENTIONS:
        raise ConfigError(
            f"model.input_convention={cfg.model.input_convention}: expected one of {', '.join(INPUT_CONVENTIONS)}"
        )


def build(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> Detection:
    return Detection(
        cfg.model,
        num_classes=data_info["num_classes"],
        class_names=data_info["classes"],
        image_size=cfg.schedule.image_size,
    )
