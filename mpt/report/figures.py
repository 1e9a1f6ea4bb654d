"""The paper's figures from the records: training loss per mode (Figures 4 and 5), loss scale per
step, throughput bars with speedups, and a generative model's final samples side by side. PNG
through matplotlib's Agg backend: no display needed."""

from __future__ import annotations

import math
import textwrap
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def _modes_in_order(df: pd.DataFrame) -> list[str]:
    return df[["mode", "precision_order", "scale_order"]].drop_duplicates("mode").sort_values(["precision_order", "scale_order"])["mode"].tolist()


CELL_KEYS = ["model", "data", "schedule", "variant"]


def _cell_name(keys: tuple) -> tuple[str, str]:
    """A file stem and a title for one cell (model, data, schedule, variant)."""
    model, data, schedule, variant = keys
    # Wrapped: a long variant would otherwise stretch the figure to its width and shrink the plot.
    title = textwrap.fill(f"{model}, {data}, {schedule}" + (f", {variant}" if variant else ""), width=70)
    stem = f"{model}_{data}_{schedule}" + (f"_{zlib.crc32(variant.encode()):08x}" if variant else "")
    return stem, title


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _lines(df: pd.DataFrame):
    """(label, rows) per mode, and per network where a model trains several (a GAN's D and G have
    their own loss and loss scale: averaging them would plot a number no network had)."""
    groups = sorted(df["group"].dropna().unique()) if "group" in df else []
    for mode in _modes_in_order(df):
        rows = df[df["mode"] == mode]
        if len(groups) < 2:
            yield mode, rows
            continue
        for group in groups:
            yield f"{mode} [{group}]", rows[rows["group"] == group]


def loss_curves(curves: pd.DataFrame, out: Path) -> list[Path]:
    """Training loss against step for each model, one line per mode and network (mean over seeds)."""
    written = []
    if curves.empty:
        return written
    for keys, df in curves.groupby(CELL_KEYS):
        stem, title = _cell_name(keys)
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, rows in _lines(df):
            per_step = rows.groupby("step")["loss"].mean()
            ax.plot(per_step.index, per_step.values, label=label, lw=1.2)
        ax.set(xlabel="step", ylabel="training loss (mean over seeds)", title=f"training loss: {title}")
        finite = df["loss"][df["loss"].map(math.isfinite)]
        if len(finite) and (finite > 0).all() and finite.max() > 10 * finite.min():
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / f"loss_{stem}.png"))
    return written


def loss_scale_curves(curves: pd.DataFrame, out: Path) -> list[Path]:
    """The loss scale each step ran with, for each model, one line per mode with a scaler (and network)."""
    written = []
    if curves.empty:
        return written
    scaled = curves[curves["scale_strategy"] != "none"]
    for keys, df in scaled.groupby(CELL_KEYS):
        stem, title = _cell_name(keys)
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, rows in _lines(df):
            per_step = rows.groupby("step")["scale"].median()
            ax.step(per_step.index, per_step.values, where="post", label=label, lw=1.2)
        ax.set(xlabel="step", ylabel="loss scale (median over seeds)", title=f"loss scale: {title}")
        ax.set_yscale("log", base=2)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / f"loss_scale_{stem}.png"))
    return written


def throughput_bars(table: pd.DataFrame, out: Path) -> list[Path]:
    """Samples/s per model and mode, each bar labelled with its speedup over fp32: one figure per
    device, data, schedule, variant, batch size and resolution, since bars are only comparable within one."""
    written = []
    if table.empty:
        return written
    setup = ["device_name", "data", "schedule", "variant", "config.schedule.batch_size", "config.schedule.image_size"]
    for keys, df in table.fillna({"variant": ""}).groupby(setup, dropna=False):  # image_size is null for models without images
        device, data, schedule, variant, batch, size = keys
        models = sorted(df["model"].unique())
        modes = _modes_in_order(df)
        width = 0.8 / max(len(modes), 1)
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models) * max(1, len(modes) / 3)), 4))
        for i, mode in enumerate(modes):
            sub = df[df["mode"] == mode].groupby("model").agg(throughput=("throughput", "median"), speedup=("speedup_vs_fp32", "median"))
            xs = [models.index(m) + (i - (len(modes) - 1) / 2) * width for m in sub.index]
            bars = ax.bar(xs, sub["throughput"], width, label=mode)
            for bar, speedup in zip(bars, sub["speedup"]):
                if not math.isnan(speedup):
                    ax.annotate(f"{speedup:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        unit = df["throughput_unit"].dropna().iloc[0] if df["throughput_unit"].notna().any() else "samples/s"
        ax.set_xticks(range(len(models)), models)
        where = f"{data}, {schedule}, batch {batch:g}" + ("" if pd.isna(size) else f", {size:g} px") + (f", {variant}" if variant else "")
        ax.set(ylabel=unit, title=f"throughput on {device}\n{where} (label: speedup over fp32)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        written.append(_save(fig, out / f"throughput_{zlib.crc32(repr(keys).encode()):08x}.png"))
    return written


def sample_grids(runs: pd.DataFrame, out: Path) -> list[Path]:
    """The final sample grid of each mode side by side, one figure per model (as the paper shows its
    FP32 and mixed-precision faces). With several seeds, the lowest seed that finished stands for the mode."""
    written = []
    if "final_sample_grid" not in runs or runs["final_sample_grid"].isna().all():
        return written
    shown = runs[runs["final_sample_grid"].notna()].fillna({"variant": ""})
    for keys, df in shown.groupby(CELL_KEYS):
        stem, title = _cell_name(keys)
        modes = _modes_in_order(df)
        fig, axes = plt.subplots(1, len(modes), figsize=(4 * len(modes), 4.6), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            # A finished run's grid before a failed one's, then the lowest seed.
            run = df[df["mode"] == mode].assign(failed=lambda d: d["status"] != "ok").sort_values(["failed", "seed"]).iloc[0]
            status = "" if run["status"] == "ok" else f", {run['status']}"
            ax.set_title(f"{mode}\nstep {run['final_sample_grid_step']:g}{status}", fontsize=9)
            ax.axis("off")
            if Path(run["final_sample_grid"]).is_file():
                ax.imshow(plt.imread(run["final_sample_grid"]))
            else:  # records copied without their samples/ folder
                ax.text(0.5, 0.5, f"grid missing:\n{Path(run['final_sample_grid']).name}", ha="center", va="center", fontsize=8)
        fig.suptitle(f"final samples (fixed noise):\n{title}", fontsize=9)
        written.append(_save(fig, out / f"samples_{stem}.png"))
    return written
