"""Data sources. Each yields batches already on the run's device.

`build_data` returns a DataSource: `epoch(e, start)` iterates one pass of training batches from
batch `start`, `val(limit)` this process's part of the first `limit` validation batches (under
torchrun, batch i is rank i mod world size's; the carried language-model stream gives each rank its
rows of every window), `steps_per_epoch` and `info` (num_classes, ...) size
the run and the model, and `state_dict()` holds the position a resumed run continues from.
A source given a test split also offers `test()`, which the loop scores once, at the end.
A batch is what the task consumes, e.g. (images, labels) for classification; for a GAN it is one
tensor of real images in [-1, 1] (image_dir, or synthetic discs).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol

import torch
from omegaconf import DictConfig

from ..config import ConfigError, Task
from ..distributed import Dist


class DataSource(Protocol):
    info: dict
    steps_per_epoch: int

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Any]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def val(self, limit: int | None = None) -> Iterable[Any]: ...

    def test(self) -> Optional[Iterable[Any]]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Source:
    """How one data source makes one task's batches: `module.build` makes them and
    `module.validate(cfg)` checks its settings before anything is built (the module is imported
    only when its pair is chosen)."""

    module: str  # under mpt.datasets
    build: str = "build"
    validate: str = "validate"
    sharded: bool = True  # runs under torchrun: each process trains on its slice of the global batch

    def builder(self):
        return getattr(import_module(f"{__name__}.{self.module}"), self.build)

    def check(self, cfg: DictConfig) -> None:
        getattr(import_module(f"{__name__}.{self.module}"), self.validate)(cfg)


# The one list of which data each source can make, for which task.
SOURCES: dict[tuple[str, Task], Source] = {
    ("synthetic", Task.classification): Source("synthetic"),
    ("synthetic", Task.detection): Source("shapes"),
    ("synthetic", Task.gan): Source("discs"),
    ("synthetic", Task.translation): Source("translation", "synthetic_translation"),
    ("synthetic", Task.language_model): Source("text_corpus", "synthetic_lm", validate="validate_synthetic"),
    ("synthetic", Task.causal_lm): Source("text_corpus", "synthetic_lm", validate="validate_synthetic"),
    ("imagefolder", Task.classification): Source("resident_images"),  # the loader's, or on the device (data.resident)
    ("voc", Task.detection): Source("voc"),
    ("parallel_text", Task.translation): Source("parallel_text", "parallel_text"),
    ("text_corpus", Task.language_model): Source("text_corpus", "text_corpus"),
    ("text_corpus", Task.causal_lm): Source("text_corpus", "text_corpus"),
    ("image_dir", Task.gan): Source("image_dir"),
}


def source(cfg: DictConfig) -> Source:
    """The source of `data` for the model's task, or a ConfigError naming the data that fit."""
    names = sorted({name for name, _ in SOURCES})
    if cfg.data.name not in names:
        raise ConfigError(f"data.name={cfg.data.name}: expected one of {', '.join(names)}")
    task = Task(cfg.model.task)
    if (cfg.data.name, task) not in SOURCES:
        fits = [name for name, t in SOURCES if t == task]
        raise ConfigError(
            f"data={cfg.data.name} has no {task} data for model={cfg.model.name}; use data={' or data='.join(fits)}"
        )
    return SOURCES[cfg.data.name, task]


def validate(cfg: DictConfig) -> None:
    """The data's settings, checked by the source that reads them."""
    source(cfg).check(cfg)
    if "num_workers" in cfg.data and cfg.data.num_workers < -1:  # sources made on the device have no loader
        raise ConfigError(f"data.num_workers={cfg.data.num_workers}: must be -1 (auto) or >= 0")


def build_data(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> DataSource:
    """`workdir`: the run's folder, for what a source makes and the run must keep (a trained
    tokenizer); `resuming`: the run continues from a checkpoint there, so it reuses what it made;
    `shard`: this process's place in a torchrun job (it trains on its slice of each global batch)."""
    chosen = source(cfg)
    if shard.enabled and not chosen.sharded:
        sharded = sorted((d, str(t)) for (d, t), s in SOURCES.items() if s.sharded)
        raise ConfigError(
            f"data={cfg.data.name} for model={cfg.model.name} does not run under torchrun yet; "
            f"data parallel runs take {', '.join(f'data={d} ({t})' for d, t in sharded)}"
        )
    return chosen.builder()(cfg, device, workdir=workdir, resuming=resuming, shard=shard)
