"""Image classification with torchvision's ILSVRC architectures (the paper's Table 1), He et al.'s CIFAR
ResNets (cifar_resnet.py) and Jordan 2024's airbench94 (airbench.py), random init.

The loss is cross-entropy with the model's label smoothing, its mean or (airbench94's) sum over the
batch. The run's final evaluation scores the model's test-time augmentation (model.tta): the logits
averaged over the image and its mirror (level 1), and at level 2, with weight one half, over the
mirrored pairs of the image translated by one pixel up-left and down-right (reflected at the border).
The evaluations along the way score the image alone: Jordan 2024 logs them so, for their cost (level
2 is six forward passes).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn.functional as F
import torchvision
from omegaconf import DictConfig, OmegaConf

from ..config import MODEL_REQUIRES, ConfigError
from ..distributed import Dist
from . import LossTerm, OneNetwork, builders, validate_image_size
from .airbench import Airbench94, airbench94
from .cifar_resnet import resnet20, resnet56

# Architectures whose constructors need extra arguments to build without pretrained weights.
_BUILD_KWARGS = {
    "googlenet": dict(aux_logits=True, init_weights=True, transform_input=False),
    "inception_v3": dict(aux_logits=True, init_weights=True, transform_input=False),
}
# Architectures torchvision does not have, built by mpt's own code.
_OWN_ARCHS = {"resnet20": resnet20, "resnet56": resnet56, "airbench94": airbench94}
LOSS_REDUCTIONS = ("mean", "sum")
TTA_LEVELS = (0, 1, 2)
WHITENING_IMAGES = 5000  # training images whose patches set airbench94's whitening (Jordan 2024's count)


class Classification(OneNetwork):
    sample_unit = "images"
    primary_metric = "top1"
    higher_is_better = True

    def __init__(self, model_cfg: DictConfig, num_classes: int, world_size: int = 1):
        self.cfg = model_cfg
        # A loss summed over the global batch: each process sums its share and data parallelism
        # averages the gradients over processes, so each share's sum counts world_size times.
        self.sum_factor = float(world_size) if model_cfg.loss_reduction == "sum" else 1.0
        self.frozen: list[torch.nn.Parameter] = []
        dropout = {} if model_cfg.dropout is None else {"dropout": model_cfg.dropout}
        given = {**dropout, **OmegaConf.to_container(model_cfg.kwargs, resolve=True)}  # type: ignore[dict-item]
        if model_cfg.builder is not None:
            self.net = builders.build(model_cfg.builder, given, num_classes)
        elif model_cfg.library == "timm":
            self.net = builders.timm_model(model_cfg.name, given, num_classes)
        else:
            try:
                if model_cfg.arch in _OWN_ARCHS:
                    self.net = _OWN_ARCHS[model_cfg.arch](num_classes=num_classes, **dropout)
                else:  # torchvision's, with the arguments some need to build without pretrained weights
                    kwargs = {**_BUILD_KWARGS.get(model_cfg.arch, {}), **given}
                    self.net = torchvision.models.get_model(
                        model_cfg.arch, weights=None, num_classes=num_classes, **kwargs
                    )
            except TypeError as e:
                if "dropout" in str(e) and "dropout" not in model_cfg.kwargs:
                    raise ConfigError(
                        f"model.dropout={model_cfg.dropout}: {model_cfg.name} has no dropout to set"
                    ) from None
                raise ConfigError(f"model={model_cfg.name}: building it with {sorted(given)} failed: {e}") from None
        self.num_classes = num_classes
        self.base = self.net  # the network as built, while self.net may become a wrapper of it

    @property
    def loss_definition(self) -> str:
        over = "mean over" if self.cfg.loss_reduction == "mean" else "summed over"
        smoothing = f" with label smoothing {self.cfg.label_smoothing:g}" if self.cfg.label_smoothing else ""
        heads = f", plus {self.cfg.aux_loss_weight:g} x each auxiliary head's" if self.cfg.aux_loss_weight else ""
        return f"cross-entropy{smoothing}, {over} the batch's images{heads}"

    def train_losses(self, batch: Any) -> Iterator[LossTerm]:
        images, labels = batch
        out = self.net(images)
        if isinstance(out, tuple):  # GoogLeNet / Inception v3 in training: (logits, aux...)
            logits, *aux = [o for o in out if o is not None]
            main = self._loss(logits, labels)
            loss = main + self.cfg.aux_loss_weight * sum(self._loss(a, labels) for a in aux)
            yield LossTerm("model", loss, {"main_loss": main.detach()})
            return
        yield LossTerm("model", self._loss(out, labels))

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(
            logits, labels, label_smoothing=self.cfg.label_smoothing, reduction=self.cfg.loss_reduction
        )
        return loss * self.sum_factor if self.sum_factor != 1.0 else loss

    def count_samples(self, batch: Any) -> int:
        return int(batch[1].shape[0])

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[Any],
        forward_context: Callable[[], ContextManager],
        final: bool = False,
        ranks: Dist = Dist(),
    ) -> dict[str, float]:
        self.net.eval()
        k = min(5, self.num_classes)
        correct1 = correct5 = seen = 0
        loss_sum = torch.zeros((), dtype=torch.float64)
        for images, labels in batches:
            with forward_context():
                logits = (self._tta_logits(images) if final else self.net(images)).float()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").double().cpu()
            topk = logits.topk(k, dim=1).indices
            hits = topk.eq(labels[:, None])
            correct1 += int(hits[:, 0].sum())
            correct5 += int(hits.any(dim=1).sum())
            seen += labels.shape[0]
        self.net.train()
        device = next(self.net.parameters()).device  # a rank may have scored no batch: NCCL reduces on the device
        correct1, correct5, seen = (int(ranks.total(n, device)) for n in (correct1, correct5, seen))
        loss = ranks.total(float(loss_sum), device)
        if seen == 0:
            raise ValueError("evaluation saw no samples: the validation set is empty")
        return {
            "top1": correct1 / seen,
            f"top{k}": correct5 / seen,
            "val_loss": loss / seen,
            "val_samples": seen,
        }

    def _tta_logits(self, images: torch.Tensor) -> torch.Tensor:
        def mirrored(x: torch.Tensor) -> torch.Tensor:
            return 0.5 * self.net(x) + 0.5 * self.net(x.flip(-1))

        if self.cfg.tta == 0:
            return self.net(images)
        if self.cfg.tta == 1:
            return mirrored(images)
        h, w = images.shape[-2:]
        padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
        shifted = 0.5 * mirrored(padded[..., :h, :w]) + 0.5 * mirrored(padded[..., 2 : h + 2, 2 : w + 2])
        return 0.5 * mirrored(images) + 0.5 * shifted

    def prepare(self, data: Any) -> None:
        """airbench94's whitening filters, from the patches of a fixed sample of training images."""
        net = self.base
        if isinstance(net, Airbench94):
            if not hasattr(data, "plain_train_images"):
                raise ConfigError(
                    f"model={self.cfg.name} sets its whitening from training images, "
                    f"which {type(data).__name__} does not give; use data=imagefolder or data=synthetic"
                )
            net.init_whitening(data.plain_train_images(WHITENING_IMAGES))

    def begin_epoch(self, epoch: int) -> None:
        """airbench94's whitening bias trains for model.whiten_bias_epochs epochs, then stays: its
        gradient is dropped before each update (frozen_parameters), which skips it as torch's SGD
        skips a weight without a gradient, and leaves data parallelism's buckets as they were."""
        net, epochs = self.base, self.cfg.whiten_bias_epochs
        self.frozen = (
            [net.whiten_bias] if isinstance(net, Airbench94) and epochs is not None and epoch >= epochs else []
        )

    def frozen_parameters(self, name: str) -> list[torch.nn.Parameter]:
        return self.frozen


LIBRARIES = ("timm",)


def validate(cfg: DictConfig) -> None:
    m = cfg.model
    if m.arch == "custom" and m.builder is None:
        raise ConfigError(f"model.builder: not given; model=custom needs model.builder={MODEL_REQUIRES['builder']}")
    # a builder or a library only where the run is named after it, not under a zoo model's name
    if m.builder is not None and m.arch != "custom":
        raise ConfigError(f"model.builder={m.builder} under model={m.name}: use model=custom model.builder={m.builder}")
    if m.library is not None and m.arch != m.library:
        raise ConfigError(f"model.library={m.library} under model={m.name}: use model=timm model.name=<its model>")
    if m.kwargs and m.arch in _OWN_ARCHS:
        raise ConfigError(f"model.kwargs: {m.name} is built by mpt's own code, which takes none")
    if m.builder is not None:
        builders.resolve(m.builder)  # importable, and a function: one line now, not a traceback later
    elif m.library is not None:
        if m.library not in LIBRARIES:
            raise ConfigError(f"model.library={m.library}: expected one of {', '.join(LIBRARIES)} (or null)")
    elif m.arch not in _OWN_ARCHS and m.arch not in torchvision.models.list_models(module=torchvision.models):
        raise ConfigError(
            f"model.arch={m.arch}: not a torchvision classifier (torchvision.models.list_models() lists them)"
        )
    elif m.name != m.arch:  # a zoo model's name with another architecture: every table would misname it
        raise ConfigError(
            f"model.arch={m.arch} under model={m.name}: use model=torchvision model.arch={m.arch} (named after it)"
        )
    validate_image_size(cfg)
    if not 0 <= m.label_smoothing < 1:
        raise ConfigError(f"model.label_smoothing={m.label_smoothing}: must be in [0, 1)")
    if m.loss_reduction not in LOSS_REDUCTIONS:
        raise ConfigError(f"model.loss_reduction={m.loss_reduction}: must be one of {', '.join(LOSS_REDUCTIONS)}")
    if m.tta not in TTA_LEVELS:
        raise ConfigError(f"model.tta={m.tta}: must be 0 (none), 1 (mirror) or 2 (mirror and translate)")
    if m.whiten_bias_epochs is not None and (m.arch != "airbench94" or m.whiten_bias_epochs < 0):
        raise ConfigError(
            f"model.whiten_bias_epochs={m.whiten_bias_epochs}: "
            "a number of epochs >= 0 for airbench94's whitening layer, null otherwise"
        )


def build(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> Classification:
    return Classification(cfg.model, num_classes=data_info["num_classes"], world_size=shard.world_size)
