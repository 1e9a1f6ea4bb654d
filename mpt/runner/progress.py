"""What a run shows while it trains: on a terminal one tqdm line, redrawn at each log flush; with
no terminal (CI, a SLURM log) a plain line at most every `every_s` seconds and at the end. Both
read what the flush already brought to the host, so showing progress costs no device sync."""

from __future__ import annotations

import contextlib
import math
import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    def __init__(
        self,
        label: str,
        total: int,
        start: int,
        skipped: dict[str, int],
        unit: str,
        interactive: bool | None = None,
        every_s: float = 30.0,
        clock=time.monotonic,
    ):
        """`unit`: what the rate counts, as shown (`images/s`)."""
        self.label, self.total, self.unit, self.every_s, self.clock = label, total, unit, every_s, clock
        # Per network, the steps its scaler skipped (a resumed run's too), counted on from the rows,
        # whose overflow flags the flush has already brought to the host.
        self.skipped = dict(skipped)
        self.losses: dict[str, float] = {}
        self.scales: dict[str, float] = {}
        self.start_step, self.t0 = start, clock()
        self.printed_at = self.t0
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar = None
        self._redirect = contextlib.ExitStack()
        if self.interactive:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(
                total=total, initial=start, desc=label, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True
            )
            # The console log shares the terminal with the bar: a line logged mid-bar (an evaluation,
            # a divergence) would be glued to the bar's text. tqdm clears the bar around it instead.
            self._redirect.enter_context(logging_redirect_tqdm())

    def update(self, step: int, rows: list[dict], rate: float | None) -> None:
        """`step` steps done; `rows` the train rows just flushed; `rate` the last timing window's
        samples/s (None before the first window closes)."""
        for row in rows:
            if row["kind"] != "train":
                continue
            self.losses[row["group"]], self.scales[row["group"]] = row["loss"], row["scale"]
            self.skipped[row["group"]] = self.skipped.get(row["group"], 0) + bool(row["overflow"])
        status = self._status(rate)
        if self.bar is not None:
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(step - self.bar.n)
            return
        now = self.clock()
        if now - self.printed_at >= self.every_s or step == self.total:
            self.printed_at = now
            done = step - self.start_step
            eta = (
                f", ETA {_duration((now - self.t0) / done * (self.total - step))}"
                if 0 < done and step < self.total
                else ""
            )
            print(f"{self.label}: step {step}/{self.total} ({100 * step / self.total:.0f}%){eta}, {status}", flush=True)

    def _status(self, rate: float | None) -> str:
        several = len(self.losses) > 1  # a GAN: each network's own
        parts = []
        for group, loss in self.losses.items():
            name = f"{group} " if several else ""
            loss_text = f"{loss:.4g}" if math.isfinite(loss) else str(loss)
            parts.append(f"{name}loss {loss_text}, scale {self.scales[group]:g}, skipped {self.skipped.get(group, 0)}")
        if rate is not None:
            parts.append(f"{rate:.4g} {self.unit}")
        return "; ".join(parts)

    def close(self) -> None:
        with self._redirect:  # the console handlers back, after the bar's last line
            if self.bar is not None:
                self.bar.close()
