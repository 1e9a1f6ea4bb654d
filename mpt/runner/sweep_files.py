"""Each launch of a sweep keeps its own config: `multirun-<UTC time>.yaml` in the sweep folder.

Hydra's BasicSweeper writes `<sweep dir>/multirun.yaml` on every `mpt-run -m`, so two sweeps into
one folder (results/runs by default) leave only the last one's. Hydra calls `on_multirun_start`
just before the sweeper writes it (hydra/_internal/hydra.py: the callback, then the sweeper's
sweep(), which saves the file before its first job), with the same config: the copy this callback
writes is what multirun.yaml holds until the next launch. The SLURM launcher (hydra/launcher=slurm)
changes how the jobs run, not the sweeper, so the same holds there.

Registered in configs/config.yaml under hydra.callbacks. Hydra turns an exception in a callback
into a warning: a copy that cannot be written does not stop the sweep.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ..files import write_text_atomic


def launch_file(folder: Path, now: datetime | None = None) -> Path:
    """A new `multirun-<UTC time>.yaml` in `folder`, made (empty) so that no other launch takes
    its name. Milliseconds, so that names sort as the launches came; a launch within the same
    millisecond as another gets `_002`, `_003`, ...: `_` and zero-padding sort after the first
    name's `.yaml` and in order, where `-2` would sort before it."""
    now = now or datetime.now(timezone.utc)
    stamp = f"{now:%Y-%m-%dT%H-%M-%S}.{now.microsecond // 1000:03d}Z"  # no colons: Windows and SMB shares
    for n in range(1, 1000):
        path = folder / f"multirun-{stamp}{'' if n == 1 else f'_{n:03d}'}.yaml"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{folder}: a thousand launches in {stamp}")


class PerLaunchConfig(Callback):
    """Writes the launch's config, as multirun.yaml has it, to its own `multirun-<UTC time>.yaml`."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        folder = Path(str(config.hydra.sweep.dir))
        folder.mkdir(parents=True, exist_ok=True)
        path = launch_file(folder)
        try:
            # OmegaConf.to_yaml unresolved, as the sweeper's OmegaConf.save writes multirun.yaml.
            write_text_atomic(path, OmegaConf.to_yaml(config))
        except BaseException:
            path.unlink(missing_ok=True)  # no empty copy that looks like a launch's config
            raise
