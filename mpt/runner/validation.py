"""Every check of a composed config, run before anything is built: the settings every run has
(config.py), then each owner's beside its own code: the loss scale (precision/scaler.py), the
precision mode (precision/engine.py), compile (runner/compiling.py), the products' formats
(precision/product_operands.py), the data source's and the task's."""

from __future__ import annotations

from omegaconf import DictConfig

from .. import config, datasets, models
from ..config import ConfigError
from ..precision import engine, product_operands, scaler
from ..precision.formats import FORMATS
from . import compiling


def validate(cfg: DictConfig) -> None:
    """Raises ConfigError naming the first bad value."""
    config.validate(cfg)
    scaler.validate(cfg)
    engine.validate(cfg)
    compiling.validate(cfg)
    for name in cfg.stats.formats:
        if name not in FORMATS:
            raise ConfigError(f"stats.formats: {name!r} is no format; choose from {', '.join(FORMATS)}")
    product_operands.validate(cfg.precision)
    datasets.source(cfg)  # the data fits the task before either reads its settings
    models.validate(cfg)
    datasets.validate(cfg)
