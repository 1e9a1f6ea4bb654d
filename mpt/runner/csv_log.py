"""A run's log as one tidy CSV in its folder (`logger=csv`): `metrics.csv`, a row per value, with the
columns kind, step, group, key and value, so that `pd.read_csv(...).pivot_table(...)` gives any view.
The same rows as metrics.jsonl (the record of every step), plus each timing window's throughput."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

from ..files import write_text_atomic

FILENAME = "metrics.csv"
COLUMNS = ["kind", "step", "group", "key", "value"]


class CSVLog:
    """Steps are metrics.jsonl's: a train row's is the 0-based step, an evaluation's the count of
    steps done. A resumed run keeps the rows before its checkpoint's step, as metrics.jsonl does. A
    failing write (a full disk) warns once and goes quiet."""

    def __init__(self, run_dir: Path, resumed_at: int | None, meter):
        self.path = run_dir / FILENAME
        kept: list[list[str]] = []
        if resumed_at is not None and self.path.exists():
            with self.path.open(newline="") as f:
                kept = [row for row in csv.reader(f)][1:]
            kept = [row for row in kept if len(row) == len(COLUMNS) and int(row[1]) < resumed_at]
        # The rows kept, written whole before any new one: a relaunch killed before its first
        # checkpoint leaves them as they were.
        text = io.StringIO()
        csv.writer(text).writerows([COLUMNS, *kept])
        write_text_atomic(self.path, text.getvalue())
        self.file = self.path.open("a", newline="")
        self.out = csv.writer(self.file)
        self.unit = meter.unit + "/s"
        self.windows = len(meter.pipeline)  # what a resumed run restored was logged before the kill
        self.failed = False

    def write(self, rows: list[dict]) -> None:
        self._guarded(self._write, rows)

    def image(self, tag: str, path: Path, step: int) -> None:
        pass  # pictures stay where the task drew them; the record lists them

    def sync(self, step: int, meter, grad_stats) -> None:
        self._guarded(self._sync, step, meter)

    def flush(self) -> None:
        self._guarded(self.file.flush)

    def close(self) -> None:
        self._guarded(self.file.close)

    def _guarded(self, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except OSError as e:
            self.failed = True
            print(f"mpt-run: warning: {self.path}: {e}; no more rows (metrics.jsonl goes on)", file=sys.stderr)

    def _write(self, rows: list[dict]) -> None:
        for row in rows:
            group = row.get("group", "")
            for key, value in row.items():
                if key in ("kind", "step", "group") or value is None or not isinstance(value, (int, float)):
                    continue
                self.out.writerow([row["kind"], row["step"], group, key, repr(float(value))])

    def _sync(self, step: int, meter) -> None:
        for value in meter.pipeline[self.windows :]:  # at the last step done, as TensorBoard's are
            self.out.writerow(["throughput", step - 1, "", self.unit, repr(float(value))])
        self.windows = len(meter.pipeline)
