"""Image classification with torchvision's ILSVRC architectures (the paper's Table 1) and He et al.'s CIFAR
ResNets (cifar_resnet.py), random init."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn.functional as F
import torchvision
from omegaconf import DictConfig

from ..config import ConfigError
from ..distributed import Dist
from . import LossTerm, OneNetwork, validate_image_size
from .cifar_resnet import resnet20, resnet56

# Architectures whose constructors need extra arguments to build without pretrained weights.
_BUILD_KWARGS = {
    "googlenet": dict(aux_logits=True, init_weights=True, transform_input=False),
    "inception_v3": dict(aux_logits=True, init_weights=True, transform_input=False),
}
# Architectures torchvision does not have, built by mpt's own code.
_OWN_ARCHS = {"resnet20": resnet20, "resnet56": resnet56}


class Classification(OneNetwork):
    sample_unit = "images"
    primary_metric = "top1"
    higher_is_better = True

    def __init__(self, model_cfg: DictConfig, num_classes: int):
        self.cfg = model_cfg
        kwargs = dict(_BUILD_KWARGS.get(model_cfg.arch, {}))
        if model_cfg.dropout is not None:
            kwargs["dropout"] = model_cfg.dropout
        try:
            if model_cfg.arch in _OWN_ARCHS:
                self.net = _OWN_ARCHS[model_cfg.arch](num_classes=num_classes, **kwargs)
            else:
                self.net = torchvision.models.get_model(model_cfg.arch, weights=None, num_classes=num_classes, **kwargs)
        except TypeError as e:
            if "dropout" in str(e):
                raise ConfigError(f"model.dropout={model_cfg.dropout}: {model_cfg.name} has no dropout to set") from None
            raise
        self.num_classes = num_classes

    def train_losses(self, batch: Any) -> Iterator[LossTerm]:
        images, labels = batch
        out = self.net(images)
        if isinstance(out, tuple):  # GoogLeNet / Inception v3 in training: (logits, aux...)
            logits, *aux = [o for o in out if o is not None]
            main = F.cross_entropy(logits, labels)
            loss = main + self.cfg.aux_loss_weight * sum(F.cross_entropy(a, labels) for a in aux)
            yield LossTerm("model", loss, {"main_loss": main.detach()})
            return
        yield LossTerm("model", F.cross_entropy(out, labels))

    def count_samples(self, batch: Any) -> int:
        return int(batch[1].shape[0])

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Any], forward_context: Callable[[], ContextManager]) -> dict[str, float]:
        self.net.eval()
        k = min(5, self.num_classes)
        correct1 = correct5 = seen = 0
        loss_sum = torch.zeros((), dtype=torch.float64)
        for images, labels in batches:
            with forward_context():
                logits = self.net(images).float()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").double().cpu()
            topk = logits.topk(k, dim=1).indices
            hits = topk.eq(labels[:, None])
            correct1 += int(hits[:, 0].sum())
            correct5 += int(hits.any(dim=1).sum())
            seen += labels.shape[0]
        self.net.train()
        if seen == 0:
            raise ValueError("evaluation saw no samples: the validation set is empty")
        return {"top1": correct1 / seen, f"top{k}": correct5 / seen, "val_loss": float(loss_sum) / seen, "val_samples": seen}


validate = validate_image_size


def build(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> Classification:
    return Classification(cfg.model, num_classes=data_info["num_classes"])
