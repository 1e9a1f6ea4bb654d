"""Every check of a composed config, run before anything is built: the settings every run has
(config.py), then the data source's and the task's, each beside its own builder."""

from __future__ import annotations

from omegaconf import DictConfig

from .. import config, datasets, models
from ..config import ConfigError
from ..precision import product_operands
from ..precision.formats import FORMATS


def validate(cfg: DictConfig) -> None:
    """Raises ConfigError naming the first bad value."""
    config.validate(cfg)
    for name in cfg.stats.formats:
        if name not in FORMATS:
            raise ConfigError(f"stats.formats: {name!r} is no format; choose from {', '.join(FORMATS)}")
    product_operands.validate(cfg.precision)
    datasets.source(cfg)  # the data fits the task before either reads its settings
    models.validate(cfg)
    datasets.validate(cfg)
