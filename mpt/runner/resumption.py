"""Whether a run continues the checkpoint in its folder, decided before the run is built.

A checkpoint of the same computation resumes, as does one of the same computation under a longer
or shorter schedule in the same unit (steps for steps, epochs for epochs: milestones count in that
unit), or with data.root moved to a copy of the same files. Any other is moved aside
(`checkpoint.pt.stale-<UTC time>`), so no later launch resumes it and no progress is lost; only
force=true discards it. An unreadable or unsafe one raises: the run ends `error` and the file stays.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from ..config import as_plain, checkpointing
from ..datasets.fingerprint import fingerprint
from ..distributed import Dist
from . import checkpoint, identity


class Resumption:
    def __init__(self, cfg: DictConfig, run_dir: Path, dist: Dist, device: torch.device):
        self.cfg, self.run_dir, self.dist, self.device = cfg, run_dir, dist, device
        self._fingerprint: str | None = None  # of data.root, read once (by rank 0), when first needed

    def checkpoint(self) -> dict | None:
        """The folder's checkpoint if this run continues it. Under torchrun rank 0 decides, and the
        others read the file only after it has (a rank reading while rank 0 moves it aside would fail)."""
        saved = self._decide() if self.dist.is_main else None
        if self.dist.any(saved is not None, self.device) and not self.dist.is_main:
            saved = checkpoint.load(self.run_dir)
        return saved

    def _decide(self) -> dict | None:
        cfg, path = self.cfg, self.run_dir / checkpoint.FILENAME
        if not path.is_file():
            return None
        if cfg.force:
            path.unlink()
            print(f"mpt-run: force=true: discarded {path}; starting over", flush=True)
            return None
        why = "resume=false" if not cfg.resume else None
        if why is None and not checkpointing(cfg):
            why = "checkpoint=false" if cfg.checkpoint is not None else "a smoke run writes no checkpoint"
        if why is None:
            saved = checkpoint.load(self.run_dir)
            assert saved is not None  # the file is there (is_file above)
            why = self._why_not_resumable(saved)
            if why is None:
                return saved
        self._set_aside(why)
        return None

    def _set_aside(self, why: str) -> None:
        aside = checkpoint.set_aside(self.run_dir)
        print(
            f"mpt-run: {why}: moved the checkpoint aside to {aside.name if aside else '(gone)'}; starting over",
            flush=True,
        )

    def _why_not_resumable(self, saved: dict) -> str | None:
        """None if `saved` continues this run's computation."""
        differ = identity.differences(saved["config"], as_plain(self.cfg))
        if "data.root" in differ and self._same_data(saved):
            differ.remove("data.root")
        saved_in_steps = (saved["config"].get("schedule") or {}).get("steps") is not None
        same_unit = saved_in_steps == (self.cfg.schedule.steps is not None)
        others = [k for k in differ if k not in identity.LENGTH or not same_unit]
        if others:
            shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
            return f"the checkpoint is of a different config ({shown})"
        return None

    def within_schedule(self, saved: dict | None, total_steps: int) -> dict | None:
        """`saved`, unless this run's schedule is another length and ends at or before its step: then
        there is nothing of the new schedule left to run from it (not even its last evaluation), and
        it is moved aside. Every rank reaches the same answer; rank 0 moves it once all have read it."""
        if saved is None or saved["step"] < total_steps:
            return saved
        if not [k for k in identity.differences(saved["config"], as_plain(self.cfg)) if k in identity.LENGTH]:
            return saved  # the same schedule, ended (its record was not written): nothing to redo
        self.dist.barrier()
        if self.dist.is_main:
            self._set_aside(
                f"the checkpoint is at step {saved['step']}, not before this schedule's end at step {total_steps}"
            )
        return None

    def _same_data(self, saved: dict) -> bool:
        """Whether this run's data.root holds the files the checkpoint's did (names and sizes)."""
        return saved["data_fingerprint"] is not None and saved["data_fingerprint"] == self.data_fingerprint()

    def data_fingerprint(self) -> str | None:
        root = self.cfg.data.get("root")
        if root is None:
            return None
        if self._fingerprint is None:
            self._fingerprint = fingerprint(Path(root))
        return self._fingerprint
