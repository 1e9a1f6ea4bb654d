"""Weights & Biases (`logger=wandb`, the optional extra `mpt[wandb]`): the same rows as TensorBoard's,
the composed config, and the GAN's sample grids. Offline by default (`wandb.mode=offline`): the run is
kept under the run folder's `wandb/`, for `wandb sync` later, and nothing leaves the machine while it
trains. The W&B run's id is the folder's, so a resumed run continues its W&B run.

Keys: `train/<key>` (a network's name appended when the task trains several), `eval/<metric>`,
`throughput/<unit>`, each against the run's step (`step`): a train row's is the 0-based step, an
evaluation's the count of steps done, as in metrics.jsonl. A failing call warns once and goes quiet."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from typing import Any

from .tensorboard_log import RunAbout


def run_id(run_dir: Path) -> str:
    """A W&B run id of the folder: stable across relaunches, distinct between folders."""
    return f"{run_dir.name[:40]}-{zlib.crc32(str(run_dir.resolve()).encode()):08x}"


class WandbLog:
    def __init__(self, run_dir: Path, settings, meter, about: RunAbout | None, resumed_at: int | None):
        import wandb

        self.wandb = wandb
        self.unit = meter.unit + "/s"
        self.windows = len(meter.pipeline)  # what a resumed run restored was logged before the kill
        self.failed = False
        config: dict[str, Any] = {"hparams": about.hparams, "config_yaml": about.config_yaml} if about else {}
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            mode=settings.mode,
            dir=str(run_dir),
            name=run_dir.name,
            id=run_id(run_dir),
            resume="allow",
            config=config,
            reinit="create_new",
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if resumed_at is not None:
            self.run.summary["resumed_at_step"] = resumed_at

    def write(self, rows: list[dict]) -> None:
        self._guarded(self._write, rows)

    def image(self, tag: str, path: Path, step: int) -> None:
        self._guarded(lambda: self.run.log({"step": step, tag: self.wandb.Image(str(path))}))

    def sync(self, step: int, meter, grad_stats) -> None:
        self._guarded(self._sync, step, meter)

    def flush(self) -> None:
        pass  # W&B's own process writes as rows come

    def close(self) -> None:
        self._guarded(self.run.finish)

    def _guarded(self, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except Exception as e:  # W&B's errors are its own: the run and its record matter more
            self.failed = True
            print(f"mpt-run: warning: wandb: {type(e).__name__}: {e}; no more rows (metrics.jsonl goes on)",
                  file=sys.stderr)  # fmt: skip

    def _write(self, rows: list[dict]) -> None:
        for row in rows:  # TensorBoard's names: a GAN's second network as a suffix, the scale as loss_scale
            suffix = "" if row.get("group", "model") == "model" else f"/{row['group']}"
            values = {}
            for key, value in row.items():
                if key in ("kind", "step", "group") or value is None or isinstance(value, str):
                    continue
                name = "loss_scale" if key == "scale" and row["kind"] == "train" else key
                values[f"{row['kind']}/{name}{suffix if row['kind'] == 'train' else ''}"] = float(value)
            if values:
                self.run.log({"step": row["step"], **values})

    def _sync(self, step: int, meter) -> None:
        for value in meter.pipeline[self.windows :]:
            self.run.log({"step": step - 1, f"throughput/{self.unit}": float(value)})
        self.windows = len(meter.pipeline)
