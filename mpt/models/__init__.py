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

The `Task` base class gives the members only some tasks need (sample pictures, a clipped subset
of weights, per-stream buffers) defaults that do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from ..config import ConfigError, positive
from ..config import Task as Task_
from ..distributed import Dist


@dataclass
class LossTerm:
    group: str  # the network (engine) this loss updates
    loss: torch.Tensor  # a scalar, FP32
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # components worth logging


class Task:
    """What the loop calls. The members without a body here are each task's own; the others have
    the defaults most tasks want, so the loop calls every member without asking whether it exists."""

    sample_unit: str  # what throughput counts: "images", "tokens", ...
    primary_metric: str  # the evaluation metric tables report (a key of evaluate()'s result)
    higher_is_better: bool
    # How the metric was computed, or why it was not; the record keeps it under "evaluation".
    evaluation_info: dict | None = None
    # Whether save_samples draws anything: the record then lists the pictures under "sample_grids".
    saves_samples = False

    @property
    def loss_definition(self) -> str:
        """What the training loss the record and summary give is, in words (a sum or a mean, over what)."""
        return ""

    def networks(self) -> dict[str, nn.Module]:
        raise NotImplementedError

    def set_network(self, name: str, module: nn.Module) -> None:
        """Call `module` (networks()[name] wrapped by DistributedDataParallel or torch.compile) in
        its place from now on."""
        raise NotImplementedError

    def train_losses(self, batch: Any) -> Iterator[LossTerm]:
        raise NotImplementedError

    def count_samples(self, batch: Any) -> int:
        raise NotImplementedError

    def evaluate(
        self,
        batches: Iterable[Any],
        forward_context: Callable[[], ContextManager],
        final: bool = False,
        ranks: Dist = Dist(),
    ) -> dict[str, float]:
        """The metrics over `batches`; `final`: the run's last evaluation, which a task may score as its
        recipe scores its result (airbench94's test-time augmentation). Under torchrun `batches` are
        this rank's part of the set, and the task reduces over `ranks` (sums and counts, or gathered
        outputs) so that each rank returns the whole set's metrics (collective)."""
        raise NotImplementedError

    def save_samples(self, path: Path, forward_context: Callable[[], ContextManager]) -> Path | None:
        """A picture drawn at each evaluation (DCGAN's fixed-noise grid), when saves_samples."""
        return None

    def clipped_parameters(self, name: str) -> list[nn.Parameter] | None:
        """The weights of network `name` that optim.clip_grad_norm covers; None: all of them."""
        return None

    def prepare(self, data: Any) -> None:
        """Set what the network takes from the training data before it trains (airbench94's
        whitening), from the run's data source; once, before the precision engines cast it."""

    def begin_epoch(self, epoch: int) -> None:
        """Called as each epoch of training data begins, and at a resumed run's epoch."""

    def frozen_parameters(self, name: str) -> list[nn.Parameter]:
        """The weights of network `name` that the current epoch does not update (their gradients are
        dropped before the update); the loop asks again as each epoch begins."""
        return []

    def stream_buffers(self, name: str) -> dict[str, int]:
        """Buffers of network `name` holding one row per stream of the batch, by name and batch
        dimension (bigLSTM's carried state): under torchrun each rank keeps its own streams' (no
        buffer broadcast), and checkpoints hold the global batch's."""
        return {}


class OneNetwork(Task):
    """A task that trains one network, held in `self.net`."""

    net: nn.Module

    def networks(self) -> dict[str, nn.Module]:
        return {"model": self.net}

    def set_network(self, name: str, module: nn.Module) -> None:
        self.net = module


def validate_image_size(cfg: DictConfig) -> None:
    """A model that takes images: the schedule's size is one it accepts."""
    positive(cfg, "schedule.image_size")
    if cfg.schedule.image_size < cfg.model.small_input_size:
        raise ConfigError(
            f"schedule.image_size={cfg.schedule.image_size}: "
            f"{cfg.model.name} needs at least {cfg.model.small_input_size} pixels"
        )


# The module under mpt.models that holds each task's `validate(cfg)` and `build(cfg, data_info, shard)`.
TASK_MODULES = {
    Task_.classification: "classification",
    Task_.detection: "detection",
    Task_.translation: "gnmt",
    Task_.language_model: "biglstm",
    Task_.causal_lm: "causal_lm",
    Task_.gan: "dcgan",
}


def _module(cfg: DictConfig):
    return import_module(f"{__name__}.{TASK_MODULES[Task_(cfg.model.task)]}")


def validate(cfg: DictConfig) -> None:
    """The model's settings, checked by its task beside its builder."""
    # only a user's builder takes them: a classifier's, or a language model's (checked by its task)
    if cfg.model.kwargs and Task_(cfg.model.task) not in (Task_.classification, Task_.causal_lm):
        raise ConfigError(f"model.kwargs: model={cfg.model.name} is built by mpt's own code, which takes none")
    _module(cfg).validate(cfg)


def build_task(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> Task:
    """`shard`: this process's place in a torchrun job (a task that draws its own inputs, DCGAN's
    latents, takes its slice of the global batch's)."""
    return _module(cfg).build(cfg, data_info, shard)
