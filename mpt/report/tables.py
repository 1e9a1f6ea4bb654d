"""Summaries of the tidy run table (numbers, for CSV) and their Markdown renderings (text).

Throughput and memory are compared with `fp32` only on the same device, at the same batch size and
resolution: a speedup across machines would measure the machines.
"""

from __future__ import annotations

import math

import pandas as pd

from ..runner import identity
from .records import GRAD_FIELDS

# Metrics that records keep as fractions and papers print as percentages.
PERCENT_METRICS = {"top1", "top5", "map", "map_11pt", "map_all"}
MODE_KEYS = ["mode", "precision", "scale", "scale_value"]
# A table cell: runs that differ only in their seed.
CELL_KEYS = ["model", "data", "schedule", "variant"]
# Speed and memory are compared only within one setup: same model, device, data, schedule, variant,
# batch size and resolution.
SAME_SETUP = [
    "model",
    "device_name",
    "data",
    "schedule",
    "variant",
    "config.schedule.batch_size",
    "config.schedule.image_size",
]


def sample_std(values: pd.Series) -> float:
    """The sample standard deviation (NaN for fewer than two), scaled by the largest deviation so
    that values near a float's range (a perplexity of 1e200) do not overflow when squared."""
    if len(values) < 2:
        return math.nan
    mean = values.mean()
    deviations = values - mean
    largest = deviations.abs().max()
    if not math.isfinite(largest) or largest == 0:
        return float(largest) if largest == 0 else math.nan
    return float(largest * math.sqrt(((deviations / largest) ** 2).sum() / (len(values) - 1)))


def _mode_order(df: pd.DataFrame) -> list[str]:
    cols = ["mode", "precision_order", "scale_order", "scale_value"]
    return df[cols].drop_duplicates("mode").sort_values(cols[1:], na_position="first")["mode"].tolist()


def skipped_every_step(runs: pd.DataFrame) -> pd.Series:
    """Runs that skipped every step of a network (an older record may still say `ok`)."""
    return runs.get("skipped_every_step", pd.Series(False, index=runs.index)).fillna(False).astype(bool)


def results(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs whose numbers are results: finished `ok`, with no network that skipped every step."""
    return runs[(runs.status == "ok") & ~skipped_every_step(runs)]


def _metric_columns(runs: pd.DataFrame) -> list[str]:
    return [c for c in runs.columns if c.startswith("metric.")]


def metric_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, mode, metric): mean and std over the seeds that finished, and how many diverged."""
    rows = []
    for keys, group in runs.groupby([*CELL_KEYS, *MODE_KEYS], dropna=False, sort=False):
        ok = results(group)
        base = dict(zip([*CELL_KEYS, *MODE_KEYS], keys))
        base.update(
            runs=len(group),
            ok=len(ok),
            diverged=int((group.status == "diverged").sum()),
            # Not finished, no result: error, oom, preempted, running, died, unknown.
            failed=int((~group.status.isin(["ok", "diverged"])).sum()),
            skipped_every_step=int(skipped_every_step(group).sum()),
            primary=group.primary_metric.iloc[0],
            precision_order=group.precision_order.iloc[0],
            scale_order=group.scale_order.iloc[0],
        )
        # The task's own metric always gets a row, so a cell whose every run diverged still shows.
        columns = dict.fromkeys([f"metric.{base['primary']}", *_metric_columns(runs)])
        for col in columns:
            values = ok[col].dropna() if col in ok else pd.Series(dtype=float)
            values = values[values.map(math.isfinite)]
            rows.append(
                {
                    **base,
                    "metric": col.removeprefix("metric."),
                    "n": len(values),
                    "mean": values.mean() if len(values) else math.nan,
                    "std": sample_std(values),
                }
            )
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


SUMMARY_COLUMNS = [*CELL_KEYS, *MODE_KEYS, "runs", "ok", "diverged", "failed", "skipped_every_step"]
SUMMARY_COLUMNS += ["primary", "precision_order", "scale_order", "metric", "n", "mean", "std"]


def accuracy(runs: pd.DataFrame) -> pd.DataFrame:
    """The task's own metric on the validation split, and on the held-out test split where a run
    scored one (data.test_split: `test_bleu`, `test_ppl`)."""
    summary = metric_summary(runs)
    if summary.empty:
        return summary
    own = summary.metric == summary.primary
    test = (summary.metric == "test_" + summary.primary) & (summary.n > 0)
    return summary[own | test].drop(columns="primary").reset_index(drop=True)


def _fmt_metric(metric: str, value: float) -> str:
    return f"{value * 100:.2f}" if metric in PERCENT_METRICS else f"{value:.4g}"


def accuracy_cell(row) -> str:
    skipped = int(row.get("skipped_every_step", 0) or 0)  # summaries built before the column have none
    every = f"{skipped} skipped every step"
    if row.n == 0:
        word = "diverged" if row.diverged else "skipped every step" if skipped else "failed" if row.failed else "n/a"
        return word + (f" ({every})" if skipped and row.diverged else "")
    text = _fmt_metric(row.metric, row["mean"])
    if row.n > 1:
        text += " ± " + _fmt_metric(row.metric, row["std"])
    notes = []
    if row.n != row.runs:
        notes.append(f"{row.n} of {row.runs} seeds")
    if row.diverged:
        notes.append(f"{row.diverged} diverged")
    if skipped:
        notes.append(every)
    return text + (f" ({', '.join(notes)})" if notes else "")


MIN_WINDOWS = 3  # a speedup needs the median of at least this many timing windows, in the cell and in fp32's
CPU_UNIT = " (CPU: any low-precision arithmetic emulated)"


def throughput(runs: pd.DataFrame) -> pd.DataFrame:
    """Median samples/s per (setup, mode) of the runs that finished, and the speedup over `fp32`
    without scaling in the same setup. No speedup where either side's runs timed fewer than
    MIN_WINDOWS windows, or on a CPU, whose FP16, BF16 and FP8 arithmetic is emulated: a ratio there
    measures the emulation (the unit says so). `windows`: the fewest any of the cell's runs timed."""
    finished = results(runs).dropna(subset=["throughput"])
    if finished.empty:
        return pd.DataFrame()
    on_cpu = finished.get("device_type", pd.Series("", index=finished.index)).eq("cpu")
    units = finished.throughput_unit.fillna("").astype(str) + on_cpu.map({True: CPU_UNIT, False: ""})
    finished = finished.assign(throughput_unit=units, windows=finished.get("throughput_windows", math.nan))
    table = _relative_to_fp32(finished, "throughput", "speedup_vs_fp32", extra=["throughput_unit"])
    keys = [k for k in SAME_SETUP if k in finished.columns]
    group = [*keys, *MODE_KEYS, "precision_order", "scale_order", "throughput_unit"]
    fewest = finished.groupby(group, dropna=False, sort=False)["windows"].min().reset_index()
    table = table.merge(fewest, on=group, how="left")
    base = table[(table.precision == "fp32") & (table.scale == "none")].set_index(keys)["windows"]
    timed = [
        row.windows >= MIN_WINDOWS and base.get(tuple(row[k] for k in keys), 0) >= MIN_WINDOWS
        for _, row in table.iterrows()
    ]
    untimed = ~pd.Series(timed, index=table.index) | table.throughput_unit.str.endswith(CPU_UNIT)
    table.loc[untimed, "speedup_vs_fp32"] = math.nan
    table["note"] = [
        f"{int(w)} window{'s' if w != 1 else ''}" if w == w and w < MIN_WINDOWS else "" for w in table.windows
    ]
    return table


def time_to_result(runs: pd.DataFrame) -> pd.DataFrame:
    """Median seconds from the first step to the end of the final evaluation per (setup, mode), as
    Jordan 2024 times airbench, the mean of the task's metric beside it, and the ratio to `fp32`'s
    time in the same setup."""
    finished = results(runs).dropna(subset=["time_to_result_s"])
    if finished.empty:
        return pd.DataFrame()
    table = _relative_to_fp32(finished, "time_to_result_s", "ratio_to_fp32", extra=["primary_metric"])
    keys = [k for k in SAME_SETUP if k in finished.columns]
    # a merge, not a lookup: a setup key may be NaN (the sequence models have no image size)
    means = (
        finished.groupby([*keys, "mode"], dropna=False, sort=False)["metric_value"]
        .mean()
        .rename("metric_mean")
        .reset_index()
    )
    return table.merge(means, on=[*keys, "mode"], how="left")


def render_time_to_result(table: pd.DataFrame) -> str:
    if table.empty:
        return "_no runs with this figure_"
    table = table.assign(
        cell=[
            f"{r.time_to_result_s:.4g} s"
            + ("" if math.isnan(r.ratio_to_fp32) else f" ({r.ratio_to_fp32:.2f}x)")
            + (
                ""
                if math.isnan(r.metric_mean)
                else f", {r.primary_metric} {_fmt_metric(r.primary_metric, r.metric_mean)}"
            )
            for r in table.itertuples()
        ]
    )
    return render_cells(table, "primary_metric")


def memory(runs: pd.DataFrame, column: str = "peak_memory_bytes") -> pd.DataFrame:
    """Median peak memory per (setup, mode), and its ratio to `fp32`'s; `column`: the run's peak or
    its steady-state one."""
    finished = results(runs).dropna(subset=[column])
    return _relative_to_fp32(finished, column, "ratio_to_fp32", extra=["memory_kind"])


def mfu(runs: pd.DataFrame) -> pd.DataFrame:
    """Median MFU per (setup, mode), with the model FLOPs per sample and the math the peak is for."""
    finished = results(runs).dropna(subset=["mfu"]) if "mfu" in runs else runs.iloc[0:0]
    if finished.empty:
        return pd.DataFrame()
    keys = [k for k in SAME_SETUP if k in finished.columns]
    return (
        finished.groupby(
            [*keys, *MODE_KEYS, "precision_order", "scale_order", "throughput_unit", "mfu_math"],
            dropna=False,
            sort=False,
        )
        .agg(mfu=("mfu", "median"), flops_per_sample=("flops_per_sample", "median"), runs=("mfu", "count"))
        .reset_index()
    )


def render_mfu(table: pd.DataFrame) -> str:
    if table.empty:
        return "_no runs with an MFU (schedule=bench on a GPU in the peak table)_"
    keys = [k for k in SAME_SETUP if k in table.columns]
    order = _mode_order(table)
    table = (
        table.assign(
            cell=[f"{r.mfu * 100:.1f}% ({r.mfu_math})" for r in table.itertuples()],
            gflop_per_sample=[f"{v / 1e9:.4g}" for v in table.flops_per_sample],
        )
        .astype({k: object for k in keys})
        .fillna({k: "" for k in keys})
    )  # object first: a blank in a float column (image size of a language model)
    # FLOPs per sample are the model's, the same in every mode, up to what autograd skips.
    pivot = table.pivot_table(index=[*keys, "throughput_unit"], columns="mode", values="cell", aggfunc="first")
    flops = table.groupby([*keys, "throughput_unit"], dropna=False)["gflop_per_sample"].first()
    pivot = pivot[[m for m in order if m in pivot.columns]]
    pivot.insert(0, "GFLOP/sample", flops.reindex(pivot.index).values)
    pivot = pivot.reset_index().fillna("")
    pivot.columns = [str(c).removeprefix("config.schedule.") for c in pivot.columns]
    return _md(pivot)


def _relative_to_fp32(runs: pd.DataFrame, value: str, ratio: str, extra: list[str]) -> pd.DataFrame:
    if runs.empty:
        return pd.DataFrame()
    keys = [k for k in SAME_SETUP if k in runs.columns]
    table = (
        runs.groupby([*keys, *MODE_KEYS, "precision_order", "scale_order", *extra], dropna=False, sort=False)[value]
        .agg(["median", "count"])
        .rename(columns={"median": value, "count": "runs"})
        .reset_index()
    )
    baseline = table[(table.precision == "fp32") & (table.scale == "none")].set_index(keys)[value]
    table[ratio] = [
        row[value] / baseline.loc[tuple(row[k] for k in keys)]
        if tuple(row[k] for k in keys) in baseline.index
        else math.nan
        for _, row in table.iterrows()
    ]
    return table


def loss_scaling(runs: pd.DataFrame) -> pd.DataFrame:
    """Final and minimum loss scale and skipped steps, per network, for runs with a scaler."""
    scaled = runs[runs.scale != "none"]
    groups = sorted({c.split(".")[1] for c in runs.columns if c.startswith("loss_scale.") and c.endswith(".final")})
    rows = []
    for keys, group in scaled.groupby(
        [*CELL_KEYS, *MODE_KEYS, "precision_order", "scale_order"], dropna=False, sort=False
    ):
        for net in groups:
            skipped, steps = group[f"loss_scale.{net}.skipped_steps"], group[f"loss_scale.{net}.steps"]
            rows.append(
                {
                    **dict(zip([*CELL_KEYS, *MODE_KEYS, "precision_order", "scale_order"], keys)),
                    "network": net,
                    "runs": len(group),
                    "final_scale": group[f"loss_scale.{net}.final"].median(),
                    "min_scale": group[f"loss_scale.{net}.min"].min(),
                    "skipped_steps": skipped.mean(),
                    "steps": steps.mean(),
                    "skipped_every_step": int(((steps > 0) & (skipped == steps)).sum()),
                }
            )
    return pd.DataFrame(rows)


def gradient_stats(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run, network and kind (activation, weight): where its sampled gradients lie against
    FP16's range and the scale the histogram recommends (the paper's Figures 2b and 3 as numbers)."""
    cols = [c for c in runs.columns if c.startswith("grad.") and c.endswith(".values")]
    rows = []
    for col in cols:
        _, net, kind, _ = col.split(".")
        for _, run in runs[runs[col] > 0].iterrows():  # a network no sampled step reached has nothing to show
            rows.append(
                {
                    **{k: run[k] for k in [*CELL_KEYS, *MODE_KEYS, "seed", "status"]},
                    "network": net,
                    "kind": kind,
                    "sampled_steps": run["grad_sampled_steps"],
                    **{k: run[f"grad.{net}.{kind}.{k}"] for k in GRAD_FIELDS},
                    "cost_ratio": run["grad_cost_ratio"],
                }
            )
    return pd.DataFrame(rows)


def lost_updates(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run and network: of the weight elements its sampled steps updated, how many updates its
    FP16 weights lost (`counted`: lost, FP16 weights updated in place) or an FP16 weight would lose
    (would_be_lost, counted on FP32 masters or weights): the paper's Section 3.1."""
    cols = [c for c in runs.columns if c.startswith("lost.") and c.endswith(".updated")]
    rows = []
    for col in cols:
        net = col.split(".")[1]
        for _, run in runs[runs[col].notna()].iterrows():
            rows.append(
                {
                    **{k: run[k] for k in [*CELL_KEYS, *MODE_KEYS, "seed", "status"]},
                    "network": net,
                    "sampled_steps": run["grad_sampled_steps"],
                    **{k: run[f"lost.{net}.{k}"] for k in ("counted", "updated", "lost_fp16", "share_lost_fp16")},
                }
            )
    return pd.DataFrame(rows)


SHIFT = "config.scale.shift_down"


def _without_shift(variant: str) -> str:
    return ",".join(p for p in identity.variant_parts(variant or "") if not p.startswith("scale.shift_down="))


def shift_control(runs: pd.DataFrame) -> pd.DataFrame:
    """The loss-scaling control (scale.shift_down = k): per setup, mode and k, the final metric over
    the seeds that finished, how many diverged, and the share of activation gradients that were zero
    as the backward left them (FP16 flushes what 2^-k pushes below its subnormals; FP32's zeros are
    the network's own). Empty unless some run shifted."""
    if SHIFT not in runs or not (runs[SHIFT].fillna(0) > 0).any():
        return pd.DataFrame()
    shifted = runs.assign(k=runs[SHIFT].fillna(0).astype(int), setup_variant=runs["variant"].map(_without_shift))
    setup = ["model", "data", "schedule", "setup_variant"]
    # Only the setups where some run shifted: the others' runs are no part of this control.
    shifted = shifted.groupby(setup, dropna=False, sort=False).filter(lambda g: bool((g.k > 0).any()))
    rows = []
    for (model, data, schedule, variant, mode, k), group in shifted.groupby(
        ["model", "data", "schedule", "setup_variant", "mode", "k"], sort=True
    ):
        ok = results(group)
        metric = f"metric.{group.primary_metric.iloc[0]}"
        zero = "grad.model.activation.share_zero"
        values = ok[metric].dropna() if metric in ok else pd.Series(dtype=float)
        zeros = ok[zero].dropna() if zero in ok else pd.Series(dtype=float)
        rows.append(
            {
                "model": model,
                "data": data,
                "schedule": schedule,
                "variant": variant,
                "mode": mode,
                "precision_order": group.precision_order.iloc[0],
                "scale_order": group.scale_order.iloc[0],
                "k": k,
                "metric": group.primary_metric.iloc[0],
                "runs": len(group),
                "diverged": int(((group.status == "diverged") | skipped_every_step(group)).sum()),
                "n": len(values),
                "mean": values.mean() if len(values) else math.nan,
                "std": sample_std(values),
                "activation_share_zero": zeros.mean() if len(zeros) else math.nan,
            }
        )
    return pd.DataFrame(rows)


def render_shift_control(table: pd.DataFrame) -> str:
    if table.empty:
        return "_no run shifted its loss (scale.shift_down)_"
    shown = pd.DataFrame(
        {
            "setup": table.model
            + " "
            + table.data
            + " "
            + table.schedule
            + table.variant.map(lambda v: f" (variant {identity.tag(v)})" if v else ""),
            "mode": table["mode"],
            "k": table.k,
            table.metric.iloc[0]: [
                "-" if n == 0 else _fmt_metric(m, mean) + ("" if n < 2 else f" ± {_fmt_metric(m, sd)}")
                for m, mean, sd, n in zip(table.metric, table["mean"], table["std"], table.n)
            ],
            "n": table.n.astype(str) + table.diverged.map(lambda d: f" (+{d} diverged)" if d else ""),
            "% of activation gradients zero": table.activation_share_zero.map(
                lambda v: "-" if pd.isna(v) else f"{v * 100:.2f}"
            ),
        }
    )
    return _md(shown)


def render_lost_updates(table: pd.DataFrame) -> str:
    if table.empty:
        return "_no runs with stats.lost_updates=true_"
    parts = []
    for model, rows in table.groupby("model", sort=False):
        out = pd.DataFrame(
            {
                **{k: rows[k] for k in [*CELL_KEYS[1:], "mode", "seed", "network", "sampled_steps"]},
                "counted": rows.counted.map(
                    {"lost": "lost by the FP16 weights", "would_be_lost": "an FP16 weight would lose"}
                ),
                "updated": rows.updated.map(lambda v: f"{v:.0f}"),
                "% lost in FP16": rows.share_lost_fp16.map(lambda v: f"{v * 100:.2f}"),
            }
        )
        parts.append(f"### {model}\n\n" + _md(out))
    return "\n\n".join(parts)


def paper_comparison(runs: pd.DataFrame, published: pd.DataFrame) -> pd.DataFrame:
    """Each published cell next to ours for the same model, precision, scale and metric."""
    ours = metric_summary(runs)
    rows = []
    for pub in published.itertuples():
        match = ours[
            (ours.model == pub.model)
            & (ours.precision == pub.precision)
            & (ours.scale == pub.scale)
            & (ours.metric == pub.metric)
        ]
        if not pd.isna(pub.scale_value):
            match = match[match.scale_value == pub.scale_value]
        row = {
            "table": pub.table,
            "model": pub.model,
            "precision": pub.precision,
            "scale": pub.scale,
            "scale_value": pub.scale_value,
            "metric": pub.metric,
            "published": pub.value,
            "published_status": pub.status,
            "source": pub.source,
        }
        if match.empty:
            rows.append(row)
        factor = 100 if pub.metric in PERCENT_METRICS else 1
        for m in match.itertuples():  # every cell of ours: the data and schedule say what it can be compared with
            rows.append(
                {
                    **row,
                    "data": m.data,
                    "schedule": m.schedule,
                    "variant": m.variant,
                    "ours": m.mean * factor,
                    "ours_std": m.std * factor,
                    "ours_seeds": m.n,
                    "ours_diverged": m.diverged,
                    "ours_skipped_every_step": m.skipped_every_step,
                    "ours_runs": m.runs,
                }
            )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- Markdown


def atlas(rows: pd.DataFrame) -> pd.DataFrame:
    """Per run, network, role and format: the atlas's network totals (per-layer rows stay in the
    heatmaps and the record)."""
    if rows.empty:
        return rows
    keep = [
        *CELL_KEYS,
        *MODE_KEYS,
        "seed",
        "sampled_steps",
        "network",
        "role",
        "format",
        "values",
        "nonzero",
        "share_zero",
        "share_underflow",
        "share_subnormal",
        "share_overflow",
        "share_lost",
    ]
    keep += ["sqnr_db", "sqnr_db_scaled", "scaling", "recommended_scale", "max_safe_scale"]
    return rows[rows.layer == "(total)"].reindex(columns=keep).reset_index(drop=True)


def render_atlas(table: pd.DataFrame) -> str:
    if table.empty:
        return "_no runs with stats.formats_"
    pct = lambda v: "" if pd.isna(v) else f"{v * 100:.3g}"  # noqa: E731
    db = lambda v, nonzero, lost: ("" if not nonzero else "n/a" if lost else "exact") if pd.isna(v) else f"{v:.1f}"  # noqa: E731
    scale = lambda v: "none" if pd.isna(v) else f"2^{round(math.log2(v))}"  # noqa: E731
    parts = []
    for model, rows in table.groupby("model", sort=False):
        fit = _atlas_fit(rows, pct, scale)
        out = pd.DataFrame(
            {
                **{k: rows[k] for k in [*CELL_KEYS[1:], "mode", "seed", "sampled_steps", "network", "role", "format"]},
                "% zero": rows.share_zero.map(pct),
                "% underflow": rows.share_underflow.map(pct),
                "% subnormal": rows.share_subnormal.map(pct),
                "% overflow": rows.share_overflow.map(pct),
                "SQNR dB": [db(v, n, lost) for v, n, lost in zip(rows.sqnr_db, rows.nonzero, rows.share_lost)],
                "SQNR dB scaled": [
                    f"{db(v, n, lost)} ({how})"
                    for v, n, lost, how in zip(rows.sqnr_db_scaled, rows.nonzero, rows.share_lost, rows.scaling)
                ],
                "recommended scale": [
                    scale(v) if how == "per-tensor" else "" for v, how in zip(rows.recommended_scale, rows.scaling)
                ],
                "largest safe": [
                    scale(v) if how == "per-tensor" else "" for v, how in zip(rows.max_safe_scale, rows.scaling)
                ],
            }
        )
        parts.append(f"### {model}\n\n{fit}\n\n" + _md(out))
    return "\n\n".join(parts)


def _atlas_fit(rows: pd.DataFrame, pct, scale) -> str:
    """One model's atlas at a glance: per sampled step, network and role, the % of non-zero values
    each format loses as it is (underflow + overflow), and for a per-tensor format the power-of-two
    scale that would keep the most."""
    cell = [
        pct(lost) + (f" ({scale(rec)})" if how == "per-tensor" and (pd.isna(rec) or rec != 1) else "")
        for lost, how, rec in zip(rows.share_lost, rows.scaling, rows.recommended_scale)
    ]
    index = ["mode", "seed", "sampled_steps", "network", "role"]
    wide = rows.assign(cell=cell).pivot_table(index=index, columns="format", values="cell", aggfunc="first", sort=False)
    wide = wide.reindex(columns=list(dict.fromkeys(rows["format"]))).reset_index()
    note = "% lost as it is (underflow + overflow); in brackets, a per-tensor format's recommended scale"
    note += " where it is not 2^0"
    return f"{note}:\n\n" + _md(wide.rename(columns={"sampled_steps": "step"}))


def render_overflow_origins(table: pd.DataFrame) -> str:
    if table.empty:
        return "_no skipped step traced (stats.trace_overflow)_"
    cols = [*CELL_KEYS, "mode", "seed", "network", "module", "role", "skips"]
    return _md(table[cols].fillna({"variant": ""}))


def _md(df: pd.DataFrame) -> str:
    header = "| " + " | ".join(map(str, df.columns)) + " |"
    rule = "|" + "---|" * len(df.columns)
    body = [
        "| " + " | ".join("" if (isinstance(v, float) and math.isnan(v)) else str(v) for v in row) + " |"
        for row in df.itertuples(index=False)
    ]
    return "\n".join([header, rule, *body])


def render_accuracy(acc: pd.DataFrame) -> str:
    if acc.empty:
        return "_no runs_"
    acc = acc.assign(cell=[accuracy_cell(r) for _, r in acc.iterrows()])
    order = _mode_order(acc)
    pivot = acc.pivot_table(index=[*CELL_KEYS, "metric"], columns="mode", values="cell", aggfunc="first")
    pivot = pivot[[m for m in order if m in pivot.columns]].reset_index().fillna("")
    return _md(pivot)


def render_relative(table: pd.DataFrame, value: str, ratio: str, fmt_value, unit_col: str) -> str:
    if table.empty:
        return "_no runs with this figure_"
    notes = table["note"] if "note" in table.columns else pd.Series("", index=table.index)
    table = table.assign(
        cell=[
            f"{fmt_value(r[value])}"
            + ("" if math.isnan(r[ratio]) else f" ({r[ratio]:.2f}x)")
            + (f" ({note})" if note else "")
            for (_, r), note in zip(table.iterrows(), notes)
        ]
    )
    return render_cells(table, unit_col)


def render_cells(table: pd.DataFrame, unit_col: str) -> str:
    """A table's `cell` column pivoted: a row per setup, a column per mode."""
    keys = [k for k in SAME_SETUP if k in table.columns]
    order = _mode_order(table)
    pivot = (
        table.astype({k: object for k in keys})
        .fillna({k: "" for k in keys})
        .pivot_table(index=[*keys, unit_col], columns="mode", values="cell", aggfunc="first")
    )
    pivot = pivot[[m for m in order if m in pivot.columns]].reset_index().fillna("")
    pivot.columns = [str(c).removeprefix("config.schedule.") for c in pivot.columns]
    return _md(pivot)


def render_loss_scaling(table: pd.DataFrame) -> str:
    if table.empty:
        return "_no runs with loss scaling_"
    out = table[[*CELL_KEYS, "mode", "network", "runs", "final_scale", "min_scale", "skipped_steps", "steps"]].copy()
    for col in ["final_scale", "min_scale"]:
        out[col] = out[col].map(lambda v: f"{v:g}")
    every = table.get("skipped_every_step", pd.Series(0, index=table.index))
    out["skipped_steps"] = [
        f"{s:g} of {n:g}" + ("" if not k else " (every step)" if k == r else f" (every step in {k:g} of {r:g} runs)")
        for s, n, k, r in zip(out.skipped_steps, out.steps, every, out.runs)
    ]
    return _md(out.drop(columns="steps"))


def render_gradient_stats(table: pd.DataFrame) -> str:
    """One table per model (the paper's Figures 2b and 3 as numbers)."""
    if table.empty:
        return "_no runs with stats.grad_hist=true_"
    return "\n\n".join(
        f"### {model}\n\n" + _gradient_stats_md(rows) for model, rows in table.groupby("model", sort=False)
    )


def _gradient_stats_md(table: pd.DataFrame) -> str:
    pct = lambda v: f"{v * 100:.2f}"  # noqa: E731
    scale = lambda v: "none" if pd.isna(v) else f"{v:g}"  # noqa: E731
    out = pd.DataFrame(
        {
            **{k: table[k] for k in [*CELL_KEYS[1:], "mode", "seed", "network", "kind", "sampled_steps"]},
            "% zero": table.share_zero.map(pct),
            "% lost in FP16": table.share_lost_fp16.map(pct),
            "% FP16 subnormal": table.share_subnormal_fp16.map(pct),
            "% FP16 normal": table.share_normal_fp16.map(pct),
            "% overflow": table.share_overflow_fp16.map(pct),
            "max abs": table.max_abs.map(lambda v: f"{v:.3g}"),
            "recommended scale": [
                f"none keeps {k * 100:g}%" if pd.isna(r) else f"{r:g} (keeps {k * 100:g}%)"
                for r, k in zip(table.recommended_scale, table.keep)
            ],
            "largest safe scale": table.max_safe_scale.map(scale),
            "sampled step cost": table.cost_ratio.map(lambda v: "" if pd.isna(v) else f"{v:.2f}x"),
        }
    )
    return _md(out)


def render_paper(table: pd.DataFrame) -> str:
    if table.empty:
        return "_no published values_"
    out = table.copy()
    out["published"] = [
        ("diverges" if s == "diverged" else f"{v:g}") for v, s in zip(out.published, out.published_status)
    ]
    if "ours" not in out:
        out["ours"] = math.nan
    cells = []
    for r in out.itertuples():
        if "ours_runs" not in out or pd.isna(getattr(r, "ours_runs", math.nan)):
            cells.append("not run")
        elif r.ours_seeds == 0:
            skipped = getattr(r, "ours_skipped_every_step", 0)
            cells.append("diverged" if r.ours_diverged else "skipped every step" if skipped else "failed")
        else:
            cells.append(
                f"{r.ours:.2f}" + (f" ± {r.ours_std:.2f}" if r.ours_seeds > 1 else "") + f" (n={r.ours_seeds:g})"
            )
    out["ours"] = cells
    out["scale"] = [s if pd.isna(v) else f"{s} {v:g}" for s, v in zip(out.scale, out.scale_value)]
    for col in ("data", "schedule", "variant"):
        out[col] = out[col].fillna("") if col in out else ""
    return _md(
        out[
            [
                "table",
                "model",
                "precision",
                "scale",
                "metric",
                "published",
                "ours",
                "data",
                "schedule",
                "variant",
                "source",
            ]
        ]
    )
