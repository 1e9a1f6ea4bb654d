"""logger=csv: metrics.csv holds metrics.jsonl's rows as tidy (kind, step, group, key, value) rows,
and a resumed run keeps those before its checkpoint."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd

from mpt.runner.csv_log import CSVLog

from .conftest import TINY, build_run


def test_the_csv_holds_every_value_metrics_jsonl_holds(tmp_path, in_process):
    rec = build_run(tmp_path, TINY, "data=synthetic", "schedule=smoke", "schedule.steps=4", "schedule.eval_every=2",
                    "schedule.throughput_window=1", "checkpoint=false", "logger=csv").execute()  # fmt: skip
    assert rec.status == "ok"
    table = pd.read_csv(tmp_path / "metrics.csv")
    assert list(table.columns) == ["kind", "step", "group", "key", "value"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = {
        (r["kind"], r["step"], r.get("group", ""), k): float(v)
        for r in rows
        for k, v in r.items()
        if k not in ("kind", "step", "group") and isinstance(v, (int, float))
    }
    got = {
        (r.kind, r.step, "" if pd.isna(r.group) else r.group, r.key): r.value
        for r in table[table.kind != "throughput"].itertuples()
    }
    assert got == expected and ("train", 3, "model", "loss") in got and ("eval", 4, "", "top1") in got
    assert len(table[table.kind == "throughput"]) >= 1


def test_a_resumed_run_keeps_the_rows_before_its_checkpoint(tmp_path):
    meter = SimpleNamespace(unit="images", pipeline=[])
    log = CSVLog(tmp_path, None, meter)
    log.write([{"kind": "train", "step": s, "group": "model", "loss": float(s)} for s in range(6)])
    log.close()
    log = CSVLog(tmp_path, 3, meter)
    log.write([{"kind": "train", "step": 3, "group": "model", "loss": 30.0}])
    log.close()
    table = pd.read_csv(tmp_path / "metrics.csv")
    assert list(table.step) == [0, 1, 2, 3] and list(table.value) == [0.0, 1.0, 2.0, 30.0]
