"""Data sources. Each yields batches already on the run's device.

`build_data` returns a DataSource: `epoch(e, start)` iterates one pass of training batches from
batch `start`, `val()` the validation batches, `steps_per_epoch` and `info` (num_classes, ...) size
the run and the model, and `state_dict()` holds the position a resumed run continues from.
A source given a test split also offers `test()`, which the loop scores once, at the end.
A batch is what the task consumes, e.g. (images, labels) for classification; for a GAN it is one
tensor of real images in [-1, 1] (image_dir, or synthetic discs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol

import torch
from omegaconf import DictConfig

from ..config import ConfigError
from ..distributed import Dist


class DataSource(Protocol):
    info: dict
    steps_per_epoch: int

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Any]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def val(self) -> Iterable[Any]: ...


SHARDED = {
    ("synthetic", "classification"),
    ("imagefolder", "classification"),
    ("voc", "detection"),
    ("image_dir", "gan"),
    ("synthetic", "gan"),
    ("synthetic", "translation"),
    ("parallel_text", "translation"),
    ("synthetic", "language_model"),
    ("text_corpus", "language_model"),
}


def build_data(cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()) -> DataSource:
    """`workdir`: the run's folder, for what a source makes and the run must keep (a trained
    tokenizer); `resuming`: the run continues from a checkpoint there, so it reuses what it made;
    `shard`: this process's place in a torchrun job (it trains on its slice of each global batch)."""
    if shard.enabled and (cfg.data.name, cfg.model.task) not in SHARDED:
        raise ConfigError(
            f"data={cfg.data.name} for model={cfg.model.name} does not run under torchrun yet; "
            f"data parallel runs take {', '.join(f'data={d} ({t})' for d, t in sorted(SHARDED))}"
        )
    if cfg.data.name == "synthetic" and cfg.model.task == "translation":
        from .translation import synthetic_translation

        return synthetic_translation(cfg, device, shard)
    if cfg.data.name == "synthetic" and cfg.model.task == "language_model":
        from .text_corpus import synthetic_lm

        return synthetic_lm(cfg, device, shard)
    if cfg.data.name == "text_corpus":
        from .text_corpus import text_corpus

        return text_corpus(cfg, device, shard)
    if cfg.data.name == "parallel_text":
        from .parallel_text import parallel_text

        return parallel_text(cfg, device, workdir, resuming, shard)
    if cfg.data.name == "synthetic" and cfg.model.task == "detection":
        from .shapes import SyntheticShapes

        return SyntheticShapes(cfg.data, cfg.schedule, seed=cfg.seed, device=device)
    if cfg.data.name == "synthetic" and cfg.model.task == "gan":
        from .discs import SyntheticDiscs

        return SyntheticDiscs(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
    if cfg.data.name == "synthetic":
        from .synthetic import SyntheticImages

        return SyntheticImages(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
    if cfg.data.name == "imagefolder":
        from .imagefolder import ImageFolderData

        return ImageFolderData(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
    if cfg.data.name == "voc":
        from .voc import VOCData

        return VOCData(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
    if cfg.data.name == "image_dir":
        from .image_dir import ImageDirData

        return ImageDirData(cfg.data, cfg.schedule, seed=cfg.seed, device=device, shard=shard)
    raise ValueError(f"data.name={cfg.data.name}: expected synthetic, imagefolder, voc, image_dir, parallel_text or text_corpus")
