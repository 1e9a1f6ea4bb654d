"""Result records -> one tidy table (one row per run) and per-step curves.

Numbers stay numbers here: every formatting decision belongs to the renderers (tables.py).
"""

from __future__ import annotations

import json
import re
import sys
import zlib
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from ..runner import identity, run_lock
from ..runner.record import RunRecord
from .output import RULE, plain

# The order modes appear in tables and legends.
PRECISION_ORDER = ["fp32", "tf32", "fp16", "mixed", "fp16_modmom", "amp", "bf16"]
SCALE_ORDER = ["none", "static", "dynamic", "auto"]
# Gradient statistics (record "grad_stats") that become columns grad.<network>.<kind>.<field>.
GRAD_FIELDS = [
    "values",
    "share_zero",
    "share_lost_fp16",
    "share_subnormal_fp16",
    "share_normal_fp16",
    "share_overflow_fp16",
    "max_abs",
    "recommended_scale",
    "max_safe_scale",
    "keep",
]


def mode_label(precision_label: str, scale: str, scale_value: float | None) -> str:
    """The paper's way of naming a cell: "Mixed", "Mixed + LS (static 8)", "FP16 + LS (dynamic)"."""
    if scale == "none":
        return precision_label
    detail = f"static {scale_value:g}" if scale == "static" and scale_value is not None else scale
    return f"{precision_label} + LS ({detail})"


def _number(value: Any) -> float | None:
    """Records write NaN and inf as strings (JSON has neither)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return float(value)


def _flatten(prefix: str, node: Any, out: dict) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(node, list):
        out[prefix] = json.dumps(node)
    else:
        out[prefix] = node


def find_records(paths: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_file() and path.name == "result.json":
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(path.rglob("result.json")))
    return sorted(set(found))


# Overrides the mode's label states (`Mixed + LS (static 128)`): left in the variant, they would put
# runs of one setup on different rows of a table and in different figures.
STATED_BY_MODE = {"scale.value"}


ABSOLUTE_PATH = re.compile(r"^(/|~|[A-Za-z]:[\\/])")


def shown_path(value: Any) -> Any:
    """An absolute path as a report shows it: a hash of the whole, then its last part
    (`…5f255303/raccoon`), which keeps two folders of one name apart without printing one machine's
    layout into tables and figures that are committed and read elsewhere. Other values unchanged."""
    if not isinstance(value, str) or not ABSOLUTE_PATH.match(value):
        return value
    name = re.split(r"[\\/]", value.rstrip("/\\"))[-1]
    return f"…{zlib.crc32(value.encode()):08x}/{name}"  # the hash stands for what is left out


def cell_variant(variant: str) -> str:
    """What sets a run's setup apart from its model, data and schedule's default: its computational
    overrides less those the mode states, paths as shown."""
    parts = identity.variant_parts(variant)
    shown = []
    for part in parts:
        key, _, value = part.partition("=")
        if key not in STATED_BY_MODE:
            path = value.strip("'\"")
            shown.append(f"{key}={shown_path(path)}" if ABSOLUTE_PATH.match(path) else part)
    return ",".join(shown)


def _grid_path(run_dir: Path, relative: str) -> str | None:
    """A sample grid inside the run's folder; a record naming a file elsewhere gets none (the report
    would otherwise copy any image it can read into a figure)."""
    parts = Path(relative).parts
    if Path(relative).is_absolute() or not parts or not all(plain(p) or p == "." for p in parts):
        return None
    return str(run_dir / relative)


def record_row(rec: RunRecord, path: Path) -> dict:
    # Sections a run fills as it goes are None in the record of a run that failed before them, and
    # fields added since are None in older records.
    metrics = rec.metrics or {}
    tp = rec.throughput or {}
    mem = rec.memory or {}
    env = rec.environment or {}
    git = rec.git or {}
    stats = rec.grad_stats or {}
    scale_value = _number((rec.scale_config or {}).get("value"))
    # A run that failed while being set up has only a minimal record: name its mode from its choices.
    label = (rec.precision or {}).get("label") or (rec.precision or {}).get("name") or rec.choices["precision"]
    primary = rec.primary_metric or "top1"
    grids = rec.sample_grids or []
    scalers = rec.loss_scale or {}
    row = {
        "run_dir": str(path.parent),
        "status": rec.status,
        "message": rec.message,
        **rec.choices,
        "variant": cell_variant(rec.variant or ""),
        "seed": rec.seed,
        "precision_label": label,
        "scale_value": scale_value,
        "mode": mode_label(label, rec.choices["scale"], scale_value),
        "primary_metric": primary,
        "higher_is_better": True if rec.higher_is_better is None else rec.higher_is_better,
        "metric_value": _number(metrics.get(primary)),
        "metric_step": metrics.get("step"),
        "final_train_loss": _number(rec.final_train_loss),
        "last_finite_train_loss": _number(rec.last_finite_train_loss),
        "diverged_at_step": rec.diverged_at_step,
        "steps": rec.steps,
        "total_steps": rec.total_steps,
        "samples": rec.samples,
        "duration_s": rec.duration_s,
        "time_to_result_s": _number((rec.time_to_result or {}).get("seconds")),
        "throughput": _number(tp.get("pipeline")),
        "throughput_compute": _number(tp.get("compute")),
        "throughput_unit": tp.get("unit"),
        "throughput_windows": tp.get("windows"),
        "flops_per_sample": _number((rec.flops or {}).get("per_sample")),
        "mfu": _number((rec.mfu or {}).get("value")),
        "mfu_math": (rec.mfu or {}).get("math"),
        "peak_memory_bytes": mem.get("peak_bytes"),
        "steady_peak_memory_bytes": mem.get("steady_peak_bytes"),
        "memory_kind": mem.get("kind"),
        "skipped_steps": sum(s.get("skipped_steps", 0) for s in (rec.loss_scale or {}).values()),
        # A network whose every step was skipped never trained: whatever the status, no result.
        "skipped_every_step": any(0 < (s.get("steps") or 0) == s.get("skipped_steps") for s in scalers.values()),
        "device_type": env.get("device_type"),
        "device_name": env.get("device_name"),
        "torch": env.get("torch"),
        "cuda": env.get("cuda"),
        "git_commit": git.get("commit"),
        "git_dirty": git.get("dirty"),
        "started_at": rec.started_at,
        "final_sample_grid": _grid_path(path.parent, grids[-1]["path"]) if grids else None,
        "final_sample_grid_step": grids[-1]["step"] if grids else None,
    }
    for key, value in metrics.items():
        if key != "step":
            row[f"metric.{key}"] = _number(value)
    for group, summary in (rec.loss_scale or {}).items():
        for key, value in summary.items():
            row[f"loss_scale.{group}.{key}"] = _number(value)
    if stats:
        row["grad_sampled_steps"] = len(stats.get("sampled_steps", []))
        row["grad_cost_ratio"] = _number((stats.get("cost") or {}).get("ratio"))
    for net, kinds in (stats.get("networks") or {}).items():
        for kind, hist in kinds.items():
            for key in GRAD_FIELDS:
                row[f"grad.{net}.{kind}.{key}"] = _number(hist["total"].get(key))
    for net, lost in ((stats.get("lost_updates") or {}).get("networks") or {}).items():
        if lost is None:
            continue
        for key in ("updated", "lost_fp16", "share_lost_fp16"):
            row[f"lost.{net}.{key}"] = _number(lost["total"].get(key))
        row[f"lost.{net}.counted"] = lost["counted"]
    _flatten("config", rec.config or {}, row)
    return row


# The message a derived status shows where the record has none.
DIED = "its record says running, but no process holds its folder's lock: killed (SIGKILL, the OOM killer)?"
NO_LOCK = "its record says running, and no .lock beside it tells whether its process lives"


def shown_status(rec: RunRecord, path: Path) -> tuple[RunRecord, str]:
    """The status a report shows for a record, and the record to show. A `running` record is
    `running` while a live process holds its folder's lock (or where the file system has no locks:
    nothing can tell), `died` where none does, and `unknown` without a `.lock` beside it (a run
    makes the file before its record, so such a record was copied or committed without it).
    Derived when reading: the record stays as it is. A copy of a live run's folder made with its
    `.lock` shows `died`: locks do not travel with copies."""
    if rec.status != "running":
        return rec, rec.status
    if not (path.parent / run_lock.FILENAME).exists():
        return rec, "unknown"
    try:
        alive = run_lock.held(path.parent)
    except RuntimeError:  # this very process has the lock file open: it is the run, or its host
        alive = True
    if alive is not False:
        return rec, "running"
    # A run writes its final record before it lets go of the lock: one that ended since its record
    # was read has that record now.
    again = RunRecord.load(path)
    return again, "died" if again.status == "running" else again.status


def _unplain_choice(rec: RunRecord) -> str | None:
    """A choice that is not a plain name, as `choices.<group> is '<value>'`: choices name figures."""
    for group, value in rec.choices.items():
        if not plain(value):
            return f"choices.{group} is {value!r}"
    return None


def load_runs(paths: Iterable[Path]) -> pd.DataFrame:
    rows = []
    for path in find_records(paths):
        rec = RunRecord.load(path)
        bad = _unplain_choice(rec)
        if bad:
            print(f"mpt-report: warning: left out {path}: {bad}, not {RULE}", file=sys.stderr)
            continue
        rec, status = shown_status(rec, path)
        row = record_row(rec, path)
        if status != rec.status:
            row.update(status=status, message=row["message"] or (DIED if status == "died" else NO_LOCK))
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["precision_order"] = df["precision"].map(
        lambda p: PRECISION_ORDER.index(p) if p in PRECISION_ORDER else len(PRECISION_ORDER)
    )
    df["scale_order"] = df["scale"].map(lambda s: SCALE_ORDER.index(s) if s in SCALE_ORDER else len(SCALE_ORDER))
    return df.sort_values(
        ["model", "data", "schedule", "variant", "precision_order", "scale_order", "scale_value", "seed"],
        na_position="first",
    ).reset_index(drop=True)


ATLAS_KEYS = [
    "model",
    "data",
    "schedule",
    "variant",
    "mode",
    "precision",
    "scale",
    "scale_value",
    "precision_order",
    "scale_order",
    "seed",
    "run_dir",
]


def load_atlas(runs: pd.DataFrame) -> pd.DataFrame:
    """The numerics atlas of every run that has one (stats.formats): one row per run, network,
    layer ("(total)" for the network's), role and format."""
    rows = []
    for _, run in runs[runs.get("grad_sampled_steps", pd.Series(index=runs.index, dtype=float)).notna()].iterrows():
        stats = RunRecord.load(Path(run["run_dir"]) / "result.json").grad_stats or {}
        atlas, steps = stats.get("atlas"), stats.get("sampled_steps") or []
        sampled = ", ".join(map(str, steps)) if len(steps) <= 3 else f"{steps[0]}-{steps[-1]} ({len(steps)})"
        for net, parts in ((atlas or {}).get("networks") or {}).items():
            for layer, roles in [("(total)", parts["total"]), *parts["layers"].items()]:
                for role, summary in roles.items():
                    for fmt, entry in summary["formats"].items():
                        rows.append(
                            {
                                **{k: run[k] for k in ATLAS_KEYS},
                                "sampled_steps": sampled,
                                "network": net,
                                "layer": layer,
                                "role": role,
                                "format": fmt,
                                **{k: summary[k] for k in ("values", "nonzero", "share_zero", "max_abs")},
                                **entry,
                            }
                        )
    return pd.DataFrame(rows)


def load_overflow_origins(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run, network, module and role: how many skipped steps overflowed there first."""
    rows = []
    for _, run in runs[runs.get("skipped_steps", pd.Series(0, index=runs.index)).fillna(0) > 0].iterrows():
        origins = RunRecord.load(Path(run["run_dir"]) / "result.json").overflow_origins or {}
        for net, found in (origins.get("networks") or {}).items():
            for entry in found["by_module"]:
                rows.append(
                    {**{k: run[k] for k in ATLAS_KEYS}, "network": net, **entry, "skipped_steps": run["skipped_steps"]}
                )
    return pd.DataFrame(rows)


def _log_rows(path: Path) -> list[dict]:
    """A run's metrics.jsonl; a line cut short (a kill or a full disk mid-write) is left out."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def load_curves(runs: pd.DataFrame) -> pd.DataFrame:
    """Per-step training rows of every run, with the run's model, mode and seed."""
    frames = []
    for run in runs.itertuples():
        path = Path(run.run_dir) / "metrics.jsonl"
        if not path.exists():
            continue
        train = pd.DataFrame([r for r in _log_rows(path) if r.get("kind") == "train"])
        if train.empty:
            continue
        for col in ("loss", "scale"):
            train[col] = train[col].map(_number)
        train = train.assign(
            run_dir=run.run_dir,
            model=run.model,
            data=run.data,
            schedule=run.schedule,
            variant=run.variant,
            mode=run.mode,
            scale_strategy=run.scale,
            seed=run.seed,
            precision_order=run.precision_order,
            scale_order=run.scale_order,
        )
        frames.append(train)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def load_lost_update_steps(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """Per run, network and sampled step: the share of updates lost in FP16 and the learning rate
    that step ran with, read from the run's training log. The record's own `lr` of a sampled step is
    that rate only in records made since 2026-11-27; older ones hold the rate after the step, so the
    step just before each drop carries the lower one."""
    counted = [c for c in runs.columns if c.startswith("lost.") and c.endswith(".updated")]
    rows = []
    for _, run in runs[runs[counted].notna().any(axis=1)].iterrows() if counted else []:
        stats = RunRecord.load(Path(run["run_dir"]) / "result.json").grad_stats or {}
        for net, lost in ((stats.get("lost_updates") or {}).get("networks") or {}).items():
            for s in (lost or {}).get("steps", []):
                rows.append(
                    {
                        "run_dir": run["run_dir"],
                        **{
                            k: run[k]
                            for k in [
                                "model",
                                "data",
                                "schedule",
                                "variant",
                                "mode",
                                "precision_order",
                                "scale_order",
                                "seed",
                            ]
                        },
                        "network": net,
                        "counted": lost["counted"],
                        "step": s["step"],
                        "share_lost_fp16": s["share_lost_fp16"],
                    }
                )
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    if curves.empty:
        return table.assign(lr=float("nan"))
    logged = (
        curves[["run_dir", "group", "step", "lr"]]
        .rename(columns={"group": "network"})
        .drop_duplicates(["run_dir", "network", "step"])
    )
    return table.merge(logged, on=["run_dir", "network", "step"], how="left")
