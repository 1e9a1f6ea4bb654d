"""Tasks: what the training loop runs, without knowing which model it is.

A Task builds its network(s), turns a batch into one or more losses, evaluates its metric, and says
what one "sample" is for throughput. The loop (runner/train.py) does only this, per batch:

    losses = task.train_losses(batch)           # a generator of LossTerm
    for term in losses:                         # (its forward code runs under the precision's autocast)
        engines[term.group].backward(term.loss)
        engines[term.group].step()

Each named network from `task.networks()` gets its own precision engine (optimizer, master
weights, loss scaler). How the paper's other models fit this seam:

- Classification (this package's `classification`): one network "model"; a batch is (images,
  labels); one LossTerm per step; samples are images; metrics top-1/top-5.
- Detection (SSD): batches are (list of images, list of target dicts); the task sums the multibox
  loss's dict into one LossTerm and reports the parts in `LossTerm.parts`; evaluation decodes boxes
  and computes VOC mAP; samples are images.
- Translation (`gnmt`): length-bucketed padded batches (datasets/translation.py); one LossTerm of
  label-smoothed cross-entropy; `count_samples` is the number of non-padding target tokens;
  evaluation decodes by beam search and scores BLEU with sacrebleu.
- Language models (`biglstm`): windows of continuous text streams, the LSTM state carried between
  batches in the network's buffers; a sampled-softmax LossTerm; samples are words; evaluation
  computes perplexity with the full softmax.
- GAN (`dcgan`): `networks()` returns {"discriminator": D, "generator": G}; `train_losses` yields
  the discriminator's LossTerm first and the generator's second. Because it is a generator, D's
  update is applied before G's loss is computed, as DCGAN trains, and each network has its own
  engine, so an overflow in D's backward skips only D's update. Samples are real images; the
  metric is FID (with local Inception weights).

Two optional members: `save_samples(path, forward_context)`, pictures a task writes at each
evaluation (DCGAN's fixed-noise grid; the record lists them), and `evaluation_info`, a dict the
record keeps under "evaluation" (how the metric was computed, or why it was not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Protocol

import torch
from omegaconf import DictConfig
from torch import nn

from ..distributed import Dist


@dataclass
class LossTerm:
    group: str  # the network (engine) this loss updates
    loss: torch.Tensor  # a scalar, FP32
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # components worth logging


class Task(Protocol):
    sample_unit: str  # what throughput counts: "images", "tokens", ...
    primary_metric: str  # the evaluation metric tables report (a key of evaluate()'s result)
    higher_is_better: bool

    def networks(self) -> dict[str, nn.Module]: ...

    def train_losses(self, batch: Any) -> Iterator[LossTerm]: ...

    def count_samples(self, batch: Any) -> int: ...

    def evaluate(self, batches: Iterable[Any], forward_context: Callable[[], ContextManager]) -> dict[str, float]: ...

    # Optional: `set_network(name, module)` makes the task call `module` (its network wrapped in
    # DistributedDataParallel) in place of networks()[name]; a task without it cannot run under torchrun.


class OneNetwork:
    """A task that trains one network, held in `self.net`."""

    net: nn.Module

    def networks(self) -> dict[str, nn.Module]:
        return {"model": self.net}

    def set_network(self, name: str, module: nn.Module) -> None:
        """Train and evaluate through `module` from now on (the network wrapped for data parallelism)."""
        self.net = module


def build_task(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> Task:
    """`shard`: this process's place in a torchrun job (a task that draws its own inputs, DCGAN's
    latents, takes its slice of the global batch's)."""
    if cfg.model.task == "classification":
        from .classification import Classification

        return Classification(cfg.model, num_classes=data_info["num_classes"])
    if cfg.model.task == "detection":
        from .detection import Detection

        return Detection(cfg.model, num_classes=data_info["num_classes"], class_names=data_info["classes"], image_size=cfg.schedule.image_size)
    if cfg.model.task == "translation":
        from .gnmt import Translation

        return Translation(cfg.model, data_info)
    if cfg.model.task == "language_model":
        from .biglstm import LanguageModel

        return LanguageModel(cfg.model, data_info, batch_size=cfg.schedule.batch_size, shard=shard)
    if cfg.model.task == "gan":
        from .dcgan import GAN

        return GAN(cfg.model, seed=cfg.seed, batch_size=cfg.schedule.batch_size, shard=shard)
    raise ValueError(f"model.task={cfg.model.task}: no such task")
