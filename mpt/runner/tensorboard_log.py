"""TensorBoard event files in the run's folder (`logger=tensorboard`, the default), so that
`tensorboard --logdir results/runs` sets runs side by side. metrics.jsonl stays the record of every
step; this is a view of the same rows, plus what the record keeps only in summary: the throughput
windows, and on sampled steps the gradient histograms and the share of updates lost in FP16."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunAbout:
    """What a run is, for a logger's overview: its composed config, its settings as HParams and its metric."""

    config_yaml: str
    hparams: dict[str, str | float | int | bool]
    metric: str

    @classmethod
    def of(cls, cfg, choices: dict[str, str], metric: str) -> RunAbout:
        from omegaconf import OmegaConf

        settings = {"seed": int(cfg.seed), "lr": float(cfg.optim.lr), "batch_size": int(cfg.schedule.batch_size)}
        return cls(OmegaConf.to_yaml(cfg, resolve=True), {**choices, **settings}, metric)


class NullBoard:
    def write(self, rows: list[dict]) -> None:
        pass

    def image(self, tag: str, path: Path, step: int) -> None:
        pass

    def sync(self, step: int, meter, grad_stats) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLog:
    """One SummaryWriter per run. Tags: `train/<key>` (a network's name appended when the task
    trains several), `eval/<metric>`, `throughput/<unit>`; on sampled steps `grad_log2/<network>/<kind>`
    (a histogram of log2|g|, zeros left out), `grad_zero_share/...`, `grad_lost_in_fp16_share/...`
    and `lost_updates/<network>`. Steps are metrics.jsonl's: a train row's is the 0-based step, an
    evaluation's the count of steps done. A failing writer (a full disk) warns once and goes quiet:
    the run and its record matter more than this view of them."""

    def __init__(
        self,
        run_dir: Path,
        resumed_at: int | None,
        meter,
        grad_stats,
        per_process: bool = False,
        about: RunAbout | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter

        if resumed_at is None:  # starting over, as metrics.jsonl does: an earlier attempt's events go
            for old in run_dir.glob("events.out.tfevents.*"):
                old.unlink()
        # A resumed run hides what a killed one logged at or past its checkpoint's step; the
        # evaluation at that step is logged again by the caller.
        self.writer = SummaryWriter(str(run_dir), purge_step=resumed_at, flush_secs=10)
        self.unit = f"{meter.unit} per s" + (" per process" if per_process else "")
        self.failed = False
        # What a resumed run restored was logged before the kill.
        self.windows = len(meter.pipeline)
        self.grad_steps = {
            (net, kind): len(steps) for net, kinds in grad_stats.step_hists.items() for kind, steps in kinds.items()
        }
        self.lost_steps = {net: len(steps) for net, steps in grad_stats.lost_steps.items()}
        if about is not None and resumed_at is None:  # a resumed run's were written by its first launch
            self._guarded(self._describe, about)

    def image(self, tag: str, path: Path, step: int) -> None:
        """A picture the task drew (a GAN's sample grid), from its PNG."""
        self._guarded(self._image, tag, path, step)

    def _image(self, tag: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as picture:
            self.writer.add_image(tag, np.asarray(picture.convert("RGB")), step, dataformats="HWC")

    def _describe(self, about: RunAbout) -> None:
        """The composed config as text, and the run's choices as HParams, against its evaluation metric
        (the HParams dashboard reads that metric's `eval/` scalars)."""
        from torch.utils.tensorboard.summary import hparams

        self.writer.add_text("config", "```\n" + about.config_yaml + "\n```", 0)
        writer = self.writer.file_writer  # the run's own event file, not add_hparams' subfolder
        assert writer is not None  # add_text opened it
        for summary in hparams(about.hparams, {f"eval/{about.metric}": 0.0}):
            writer.add_summary(summary)

    def write(self, rows: list[dict]) -> None:
        self._guarded(self._write, rows)

    def sync(self, step: int, meter, grad_stats) -> None:
        """What the meter and the collector completed since the last call; `step` steps are done."""
        self._guarded(self._sync, step, meter, grad_stats)

    def flush(self) -> None:
        """Before a checkpoint: what a kill would lose from the writer's queue cannot be logged again."""
        self._guarded(self.writer.flush)

    def close(self) -> None:
        self._guarded(self.writer.close)

    def _guarded(self, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except Exception as e:  # the writer's thread re-raises a failed write on the next call
            self.failed = True
            print(
                f"mpt-run: warning: TensorBoard event files: {e}; no more events for this run (metrics.jsonl goes on)",
                file=sys.stderr,
                flush=True,
            )

    def _write(self, rows: list[dict]) -> None:
        for row in rows:
            step = row["step"]
            if row["kind"] == "eval":
                for key, value in row.items():
                    if key not in ("kind", "step") and isinstance(value, (int, float)):
                        self.writer.add_scalar(f"eval/{key}", float(value), step)
                continue
            suffix = "" if row["group"] == "model" else f"/{row['group']}"  # a GAN's two networks
            for key, value in row.items():
                if key in ("kind", "step", "group") or value is None:
                    continue
                self.writer.add_scalar(f"train/{'loss_scale' if key == 'scale' else key}{suffix}", float(value), step)

    def _sync(self, step: int, meter, grad_stats) -> None:
        # At the last step done, on the train rows' 0-based axis: a resumed run's purge at its
        # checkpoint's step then keeps the windows timed before it.
        for value in meter.pipeline[self.windows :]:
            self.writer.add_scalar(f"throughput/{self.unit}", value, step - 1)
        self.windows = len(meter.pipeline)
        for net, kinds in grad_stats.step_hists.items():
            for kind, steps in kinds.items():
                for sampled, hist in steps[self.grad_steps.get((net, kind), 0) :]:
                    self._histogram(f"{net}/{kind}", sampled, hist.summary(grad_stats.keep))
                self.grad_steps[(net, kind)] = len(steps)
        for net, steps in grad_stats.lost_steps.items():
            for row in steps[self.lost_steps.get(net, 0) :]:
                if row.get("share_lost_fp16") is not None:
                    self.writer.add_scalar(f"lost_updates/{net}", row["share_lost_fp16"], row["step"])
            self.lost_steps[net] = len(steps)

    def _histogram(self, tag: str, step: int, summary: dict) -> None:
        self.writer.add_scalar(f"grad_zero_share/{tag}", summary["share_zero"], step)
        self.writer.add_scalar(
            f"grad_lost_in_fp16_share/{tag}", summary["share_lost_fp16"], step
        )  # of the non-zero values
        bins = sorted((int(e), c) for e, c in summary["log2_bins"].items())
        if not bins:
            return
        # Bucket e holds the values with floor(log2|g|) = e: its right edge is e + 1.
        self.writer.add_histogram_raw(
            f"grad_log2/{tag}",
            min=bins[0][0],
            max=bins[-1][0] + 1,
            num=sum(c for _, c in bins),
            sum=sum(e * c for e, c in bins),
            sum_squares=sum(e * e * c for e, c in bins),
            bucket_limits=[e + 1 for e, _ in bins],
            bucket_counts=[c for _, c in bins],
            global_step=step,
        )
