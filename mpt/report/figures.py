"""The paper's figures from the records: training loss per mode (Figures 4 and 5), loss scale per
step, throughput bars with speedups, and a generative model's final samples side by side. PNG
through matplotlib's Agg backend: no display needed."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import cast

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from ..files import write_atomic  # noqa: E402
from ..precision.atlas import overflow_threshold  # noqa: E402
from ..precision.formats import BlockFormat, FloatFormat, get_format  # noqa: E402
from ..runner import identity  # noqa: E402
from ..runner.record import RunRecord  # noqa: E402
from .naming import Figure, FigureIndex, device_word, mode_word, network_word  # noqa: E402
from .output import UnsafeName, target  # noqa: E402
from .tables import PERCENT_METRICS  # noqa: E402


def _modes_in_order(df: pd.DataFrame) -> list[str]:
    return (
        df[["mode", "precision_order", "scale_order"]]
        .drop_duplicates("mode")
        .sort_values(["precision_order", "scale_order"])["mode"]
        .tolist()
    )


CELL_KEYS = ["model", "data", "schedule", "variant"]


def _cell_name(keys: tuple, kind: str = "") -> tuple[Figure, str]:
    """A figure of `kind` for one whole cell (model, data, schedule, variant), and its title."""
    model, data, schedule, variant = keys
    return Figure(kind, model, data, schedule, variant), f"{model}, {data}, {schedule}" + _variant_tag(variant)


def _seed(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _run_figure(kind: str, run: pd.Series, network: str, with_run: bool = True) -> Figure:
    """A figure of `kind` for one run's (or one mode's and seed's) `network`: the mode, the network
    and the seed name it within its cell; the run's folder, where given, makes it one run's."""
    value = run.get("scale_value")
    mode = mode_word(str(run["precision"]), str(run["scale"]), None if pd.isna(value) else float(value))
    seed = _seed(run["seed"])
    cell = f"{run['mode']}, seed {seed}"
    if with_run and "run_dir" in run:
        cell += f", run {Path(str(run['run_dir'])).name}"
    words = (mode, network_word(network), f"s{seed}")
    return Figure(kind, run["model"], run["data"], run["schedule"], run["variant"], cell, network, words)


def _variant_tag(variant: str) -> str:
    # A variant can run to hundreds of characters: the title names it by tag, report.md spells it out.
    return f" (variant {identity.tag(variant)})" if variant else ""


def _save(fig, out: Path, figure: Figure | str, written: list[Path], index: FigureIndex | None = None) -> None:
    """`fig` in `out` under the name naming.py gives `figure` (or under `figure` itself, a name),
    written whole (an interrupted report leaves the previous figure), added to `written` and, with
    its description, to `index`. A name that is not a plain file name is not drawn: one line says which."""
    index = index if index is not None else FigureIndex()
    name = figure if isinstance(figure, str) else index.path(out, figure).name
    try:
        path = target(out, name)
    except UnsafeName as e:
        plt.close(fig)
        print(f"mpt-report: warning: figure not drawn: {e} (its name comes from the records)", file=sys.stderr)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # The format stated: a file object has no suffix for matplotlib to take it from.
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    finally:
        plt.close(fig)
    written.append(path)
    if not isinstance(figure, str):
        index.add(path, figure)


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


def loss_curves(curves: pd.DataFrame, out: Path, index: FigureIndex | None = None) -> list[Path]:
    """Training loss against step for each model, one line per mode and network (mean over seeds)."""
    written: list[Path] = []
    if curves.empty:
        return written
    for keys, df in curves.groupby(CELL_KEYS):
        figure, title = _cell_name(keys, "loss")
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
        _save(fig, out, figure, written, index)
    return written


def loss_scale_curves(curves: pd.DataFrame, out: Path, index: FigureIndex | None = None) -> list[Path]:
    """The loss scale each step ran with, for each model, one line per mode with a scaler (and network)."""
    written: list[Path] = []
    if curves.empty:
        return written
    scaled = curves[curves["scale_strategy"] != "none"]
    for keys, df in scaled.groupby(CELL_KEYS):
        figure, title = _cell_name(keys, "loss_scale")
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, rows in _lines(df):
            per_step = rows.groupby("step")["scale"].median()
            ax.step(per_step.index, per_step.values, where="post", label=label, lw=1.2)
        ax.set(xlabel="step", ylabel="loss scale (median over seeds)", title=f"loss scale: {title}")
        ax.set_yscale("log", base=2)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        _save(fig, out, figure, written, index)
    return written


def throughput_bars(table: pd.DataFrame, out: Path, index: FigureIndex | None = None) -> list[Path]:
    """Samples/s per model and mode, each bar labelled with its speedup over fp32: one figure per
    device, data, schedule, variant, batch size and resolution, since bars are only comparable within one."""
    written: list[Path] = []
    if table.empty:
        return written
    setup = ["device_name", "data", "schedule", "variant", "config.schedule.batch_size", "config.schedule.image_size"]
    for keys, df in table.fillna({"variant": ""}).groupby(
        setup, dropna=False
    ):  # image_size is null for models without images
        device, data, schedule, variant, batch, size = keys
        models = sorted(df["model"].unique())
        modes = _modes_in_order(df)
        width = 0.8 / max(len(modes), 1)
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models) * max(1, len(modes) / 3)), 4))
        for i, mode in enumerate(modes):
            sub = (
                df[df["mode"] == mode]
                .groupby("model")
                .agg(throughput=("throughput", "median"), speedup=("speedup_vs_fp32", "median"))
            )
            xs = [models.index(m) + (i - (len(modes) - 1) / 2) * width for m in sub.index]
            bars = ax.bar(xs, sub["throughput"], width, label=mode)
            for bar, speedup in zip(bars, sub["speedup"]):
                if not math.isnan(speedup):
                    ax.annotate(
                        f"{speedup:.2f}x",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        unit = df["throughput_unit"].dropna().iloc[0] if df["throughput_unit"].notna().any() else "samples/s"
        ax.set_xticks(range(len(models)), models)
        where = (
            f"{data}, {schedule}, batch {batch:g}" + ("" if pd.isna(size) else f", {size:g} px") + _variant_tag(variant)
        )
        ax.set(ylabel=unit, title=f"throughput on {device}\n{where} (label: speedup over fp32)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        sized = not pd.isna(size)
        bench = f"{device}, batch {batch:g}" + (f", {size:g} px" if sized else "") + f"; models {', '.join(models)}"
        words = (device_word(device), f"b{batch:g}", *([f"{size:g}px"] if sized else []))
        _save(fig, out, Figure("throughput", "", data, schedule, variant, bench, "", words), written, index)
    return written


def shift_control(table: pd.DataFrame, out: Path, index: FigureIndex | None = None) -> list[Path]:
    """The loss-scaling control against k (the loss times 2^-k, the gradients times 2^k): the final
    metric (mean over seeds, the bar one standard deviation) above the share of activation gradients left zero,
    one line per mode. The paper's claim shows as FP32 flat, unscaled mixed falling once FP16
    flushes a growing share, and dynamic scaling flat."""
    written: list[Path] = []
    if table.empty:
        return written
    for keys, df in table.fillna({"variant": ""}).groupby(["model", "data", "schedule", "variant"]):
        figure, title = _cell_name(keys, "shift")
        fig, (ax, ax_zero) = plt.subplots(
            2, 1, sharex=True, figsize=(7, 5.5), height_ratios=[3, 2], layout="constrained"
        )
        for mode in _modes_in_order(df):
            rows = df[df["mode"] == mode].sort_values("k")
            scale = 100 if rows.metric.iloc[0] in PERCENT_METRICS else 1
            ax.errorbar(
                rows.k,
                rows["mean"] * scale,
                yerr=rows["std"].fillna(0) * scale,
                marker="o",
                capsize=3,
                lw=1.2,
                label=mode,
            )
            ax_zero.plot(rows.k, rows.activation_share_zero * 100, marker="o", lw=1.2, label=mode)
        metric = df.metric.iloc[0]
        ax.set(
            ylabel=f"{metric}{' (%)' if metric in PERCENT_METRICS else ''}\n(mean ± std over seeds)",
            title=f"loss shifted down by 2^k: {title}",
        )
        values = df["mean"][df["mean"] > 0]
        if len(values) and values.max() > 100 * values.min():  # a perplexity that blew up would flatten the rest
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax_zero.set(xlabel="k", ylabel="% of activation\ngradients zero")
        ax_zero.grid(alpha=0.3)
        _save(fig, out, figure, written, index)
    return written


def sample_grids(runs: pd.DataFrame, out: Path, index: FigureIndex | None = None) -> list[Path]:
    """The final sample grids, modes side by side (as the paper shows its FP32 and mixed-precision
    faces) and one row per seed, one figure per model: one seed's faces can flatter a mode."""
    written: list[Path] = []
    if "final_sample_grid" not in runs or runs["final_sample_grid"].isna().all():
        return written
    shown = runs[runs["final_sample_grid"].notna()].fillna({"variant": ""})
    for keys, df in shown.groupby(CELL_KEYS):
        figure, title = _cell_name(keys, "samples")
        modes, seeds = _modes_in_order(df), sorted(df["seed"].unique())
        # Constrained layout makes room for a suptitle of any number of lines above the panel titles.
        fig, axes = plt.subplots(
            len(seeds), len(modes), figsize=(4 * len(modes), 0.6 + 4 * len(seeds)), squeeze=False, layout="constrained"
        )
        for row, seed in zip(axes, seeds):
            for ax, mode in zip(row, modes):
                ax.axis("off")
                cell = df[(df["mode"] == mode) & (df["seed"] == seed)]
                if cell.empty:
                    continue
                run = (
                    cell.assign(failed=lambda d: d["status"] != "ok").sort_values("failed").iloc[0]
                )  # a finished run's grid first
                status = "" if run["status"] == "ok" else f", {run['status']}"
                ax.set_title(f"{mode}, seed {seed:g}\nstep {run['final_sample_grid_step']:g}{status}", fontsize=9)
                if Path(run["final_sample_grid"]).is_file():
                    ax.imshow(plt.imread(run["final_sample_grid"]))
                else:  # records copied without their samples/ folder
                    ax.text(
                        0.5,
                        0.5,
                        f"grid missing:\n{Path(run['final_sample_grid']).name}",
                        ha="center",
                        va="center",
                        fontsize=8,
                    )
        fig.suptitle(f"final samples (fixed noise):\n{title}", fontsize=9)
        _save(fig, out, figure, written, index)
    return written


# Below 2^-25 a value becomes zero in FP16 (from 2^-25 it rounds up to the smallest subnormal,
# 2^-24); from 2^-14 it is normal; from 65520 it is inf (precision/grad_histogram.py).
FP16_LOST_EXP, FP16_NORMAL_EXP, FP16_MAX_LOG2 = -25, -14, math.log2(65520)
FIGURE_OF_KIND = {"activation": "the paper's Figure 3", "weight": "the paper's Figure 2b"}


FP16_RANGES = ("FP16", FP16_LOST_EXP, FP16_NORMAL_EXP, FP16_MAX_LOG2, "65520")


def format_ranges(name: str) -> tuple[str, int, int, float, str]:
    """A scalar format's ranges on the log2 axis: below `lost` a value becomes 0, from `normal` it
    is normal, from 2^overflow it overflows (precision/atlas.py's thresholds)."""
    fmt = cast(FloatFormat, get_format(name))  # the callers pass scalar formats only
    threshold, _ = overflow_threshold(fmt)
    return name, fmt.emin - fmt.man_bits - 1, fmt.emin, math.log2(threshold), f"{threshold:g}"


def _histogram_panel(
    ax, bins: dict[int, int], zeros: int, shift: int, span: tuple[int, int], ranges=FP16_RANGES, what: str = "gradient"
) -> None:
    """One histogram of floor(log2|v|) against a format's ranges (FP16's by default), every value
    multiplied by 2^shift."""
    name, lost, normal, over, over_text = ranges
    total = sum(bins.values()) + zeros
    lo, hi = span
    exps = sorted(bins)
    ax.bar(
        [e + shift for e in exps],
        [bins[e] / total * 100 for e in exps],
        width=1.0,
        align="edge",
        color="C0",
        label="values in [2^k, 2^(k+1))",
        zorder=3,
    )
    zero_x = lo - 3  # the zero bucket, apart at the left
    zero_share = zeros / total * 100
    ax.bar([zero_x], [zero_share], width=1.0, align="edge", color="0.35", label="zero", zorder=3)
    # The zeros (often most values: ReLU) would flatten the rest: the axis fits the non-zero
    # bins and the zero bar carries its number.
    top = max([bins[e] / total * 100 for e in exps] or [zero_share]) * 1.25
    ax.set_ylim(0, max(top, 1e-9) if zero_share > top else max(top, zero_share * 1.05))
    ax.annotate(
        f"{zero_share:.1f}%",
        (zero_x + 0.5, min(zero_share, ax.get_ylim()[1])),
        ha="center",
        va="bottom" if zero_share <= top else "top",
        fontsize=7,
        xytext=(0, 2 if zero_share <= top else -2),
        textcoords="offset points",
        color="k" if zero_share <= top else "w",
        rotation=90,
    )
    ax.axvspan(lo - 1, lost, color="tab:red", alpha=0.1, label=f"becomes 0 in {name} (below $2^{{{lost}}}$)")
    ax.axvspan(lost, normal, color="tab:orange", alpha=0.15, label=f"{name} subnormal")
    ax.axvspan(normal, over, color="tab:green", alpha=0.08, label=f"{name} normal")
    ax.axvspan(over, hi + 1, color="tab:purple", alpha=0.12, label=f"overflows {name} (from {over_text})")
    ax.axvline(lo - 1, color="k", lw=0.6)
    step = 8 if hi - lo > 40 else 4
    ticks = [t for t in range(lo - lo % step, hi + 2) if t % step == 0 and t >= lo]
    ax.set_xticks([zero_x + 0.5, *ticks], ["0", *(f"$2^{{{t}}}$" for t in ticks)])
    ax.set_xlim(zero_x - 1, hi + 1)
    ax.set(xlabel=f"|{what}| (log scale; zero apart)", ylabel="% of values")
    ax.grid(axis="y", alpha=0.3)


def _kept(bins: dict[int, int], shift: int) -> float:
    nonzero = sum(bins.values())
    return sum(c for e, c in bins.items() if e + shift >= FP16_LOST_EXP) / nonzero if nonzero else 1.0


def _grad_stats_of(run: pd.Series) -> tuple[dict, str]:
    """A run's gradient statistics from its record, and its cell's title."""
    stats = RunRecord.load(Path(run["run_dir"]) / "result.json").grad_stats or {}
    _, title = _cell_name(tuple(run[k] for k in CELL_KEYS))
    return stats, title


def gradient_histograms(runs: pd.DataFrame, out: Path, index: FigureIndex | None = None) -> list[Path]:
    """For each run with gradient statistics, each network and each kind: the histogram of
    log2|g| against FP16's range (activation gradients: the paper's Figure 3; weight gradients:
    Figure 2b) and beside it the same values multiplied by the recommended power-of-two scale
    (the largest safe one when none keeps the stated share)."""
    written: list[Path] = []
    if "grad_sampled_steps" not in runs:
        return written
    for _, run in runs[runs["grad_sampled_steps"].notna()].fillna({"variant": ""}).iterrows():
        stats, title = _grad_stats_of(run)
        for net, kinds in (stats.get("networks") or {}).items():
            for kind, hist in kinds.items():
                t = hist["total"]
                bins = {int(e): c for e, c in t["log2_bins"].items()}
                if not bins and not t["zeros"]:
                    continue
                scale = t["recommended_scale"] or t["max_safe_scale"] or 1.0
                shift = int(round(math.log2(scale)))
                exps = [*bins, FP16_LOST_EXP - 6]
                span = (min(exps) + min(0, shift), max([*exps, 17]) + max(0, shift))
                fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), sharey=True, constrained_layout=True)
                _histogram_panel(axes[0], bins, t["zeros"], 0, span)
                axes[0].set_title(
                    f"as computed (unscaled): {_kept(bins, 0) * 100:.2f}% of non-zero values survive FP16", fontsize=9
                )
                _histogram_panel(axes[1], bins, t["zeros"], shift, span)
                why = (
                    f"recommended: keeps {t['keep'] * 100:g}%"
                    if t["recommended_scale"]
                    else "largest safe scale: none keeps the share"
                )
                axes[1].set_title(f"times {scale:g} ({why}): {_kept(bins, shift) * 100:.2f}% survive", fontsize=9)
                axes[1].legend(fontsize=7, loc="upper right")
                where = f"{net}, " if len(kinds) and len(stats["networks"]) > 1 else ""
                fig.suptitle(
                    f"{kind} gradients ({FIGURE_OF_KIND[kind]}), {where}{run['mode']}, seed {run['seed']}, "
                    f"{len(stats['sampled_steps'])} sampled steps;"
                    f" {t['share_zero'] * 100:.1f}% zeros\n{title}",
                    fontsize=9,
                )
                _save(fig, out, _run_figure(f"grads_{kind}", run, net), written, index)
    return written


def lost_update_curves(
    steps: pd.DataFrame,
    curves: pd.DataFrame,
    out: Path,
    index: FigureIndex | None = None,
) -> list[Path]:
    """For each model: the share of updates lost in FP16 at each sampled step, one line per mode
    and network (mean over seeds), above the learning rate every step ran with. The paper's case
    for a master copy (Section 3.1) is that this share grows as the learning rate falls. FP16
    weights updated in place count what they lost; the others what an FP16 weight would lose.

    `steps` is records.load_lost_update_steps'; the learning rate comes from the training log
    (`curves`), not from the record's sampled steps, whose older records hold the rate after the step."""
    written: list[Path] = []
    if steps.empty:
        return written
    df_all = steps.rename(columns={"network": "group"}).fillna({"variant": ""})
    logged = dict(iter(curves.fillna({"variant": ""}).groupby(CELL_KEYS))) if not curves.empty else {}
    for keys, df in df_all.groupby(CELL_KEYS):
        figure, title = _cell_name(keys, "lost_updates")
        fig, (ax, ax_lr) = plt.subplots(2, 1, sharex=True, figsize=(7, 5.5), height_ratios=[3, 1], layout="constrained")
        for label, lines in _lines(df):
            per_step = lines.groupby("step")["share_lost_fp16"].mean() * 100
            lost_in_place = (lines["counted"] == "lost").all()
            ax.plot(
                per_step.index,
                per_step.values,
                label=f"{label}: {'lost' if lost_in_place else 'would be lost'}",
                lw=1.2,
                ls="-" if lost_in_place else "--",
            )
        for label, rows in _lines(logged[keys]) if keys in logged else []:
            lr = rows.groupby("step")["lr"].median()
            ax_lr.step(lr.index, lr.values, where="post", lw=1, label=label)
        ax.set(ylabel="% of updates lost in FP16\n(mean over seeds)", title=f"updates lost in FP16 weights: {title}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax_lr.set(xlabel="step", ylabel="learning rate")
        ax_lr.set_yscale("log")
        ax_lr.grid(alpha=0.3)
        _save(fig, out, figure, written, index)
    return written


def _lowest_seed_with_stats(runs: pd.DataFrame) -> pd.DataFrame:
    """Each cell's and mode's lowest seed among the runs with sampled statistics."""
    if "grad_sampled_steps" not in runs:
        return runs.iloc[:0]
    sampled = runs[runs["grad_sampled_steps"].notna()].fillna({"variant": ""})
    return sampled.sort_values("seed").drop_duplicates([*CELL_KEYS, "mode"])


def gradient_histograms_over_training(runs: pd.DataFrame, out: Path, index: FigureIndex | None = None) -> list[Path]:
    """For each mode's lowest seed with gradient statistics, each network and kind: the histogram
    of one sampled step's gradients at the start, middle and end of training, side by side on one
    axis (the paper's Figure 3 is one moment; where the values move as training goes on shows
    whether one loss scale serves a whole run)."""
    written: list[Path] = []
    for _, run in _lowest_seed_with_stats(runs).iterrows():
        stats, title = _grad_stats_of(run)
        for net, kinds in (stats.get("networks") or {}).items():
            for kind, hist in kinds.items():
                steps = hist["steps"]
                if len(steps) < 2:
                    continue
                shown = [steps[0], steps[len(steps) // 2], steps[-1]] if len(steps) > 2 else steps
                all_bins = [{int(e): c for e, c in s["log2_bins"].items()} for s in shown]
                exps = [e for b in all_bins for e in b] + [FP16_LOST_EXP - 6]
                span = (min(exps), max([*exps, 17]))
                fig, axes = plt.subplots(
                    1, len(shown), figsize=(6 * len(shown), 4.6), sharey=True, squeeze=False, constrained_layout=True
                )
                for ax, s, bins in zip(axes[0], shown, all_bins):
                    _histogram_panel(ax, bins, s["zeros"], 0, span)
                    ax.set_title(
                        f"step {s['step']}: {s['share_zero'] * 100:.1f}% zeros; "
                        f"of the rest {s['share_lost_fp16'] * 100:.2f}% become 0 in FP16,"
                        f" {s['share_subnormal_fp16'] * 100:.1f}% subnormal",
                        fontsize=8,
                    )
                axes[0][-1].legend(fontsize=7, loc="upper right")
                where = f"{net}, " if len(stats["networks"]) > 1 else ""
                fig.suptitle(
                    f"{kind} gradients over training ({FIGURE_OF_KIND[kind]}), {where}{run['mode']}, "
                    f"seed {run['seed']}, unscaled\n{title}",
                    fontsize=9,
                )
                _save(fig, out, _run_figure(f"grads_over_training_{kind}", run, net), written, index)
    return written


ATLAS_ROLES = ["input", "weight", "activation_grad", "weight_grad"]


def atlas_heatmaps(rows: pd.DataFrame, out: Path, worst: int = 3, index: FigureIndex | None = None) -> list[Path]:
    """For each mode's lowest seed with an atlas, each network and format: layers down, roles
    across, each cell the share of its non-zero values the format loses as they are (underflow to
    zero or overflow), on one 0-100% scale for every format; the `worst` cells are named."""
    written: list[Path] = []
    if rows.empty:
        return written
    layers = rows[rows.layer != "(total)"].fillna({"variant": ""})
    first = layers.sort_values("seed").drop_duplicates([*CELL_KEYS, "mode"])
    for _, run in first.iterrows():
        keys = [*CELL_KEYS, "mode", "seed"]
        mine = layers.merge(run[keys].to_frame().T, on=keys)
        _, title = _cell_name(tuple(run[k] for k in CELL_KEYS))
        for (net, fmt), df in mine.groupby(["network", "format"], sort=False):
            grid = df.pivot_table(index="layer", columns="role", values="share_lost", aggfunc="first", sort=False)
            grid = grid.reindex(columns=[r for r in ATLAS_ROLES if r in grid.columns]) * 100
            fig, ax = plt.subplots(figsize=(6.5, 1.2 + 0.2 * len(grid)), constrained_layout=True)
            im = ax.imshow(
                grid.to_numpy(dtype=float), aspect="auto", cmap="magma_r", vmin=0, vmax=100, interpolation="nearest"
            )
            ax.set_xticks(range(len(grid.columns)), [c.replace("_", " ") for c in grid.columns], fontsize=8)
            ax.set_yticks(range(len(grid)), grid.index, fontsize=6 if len(grid) > 30 else 8)
            fig.colorbar(im, ax=ax, label="% of non-zero values lost (underflow or overflow)")
            ranked = grid.stack().sort_values(ascending=False)
            named = [(layer, role, v) for (layer, role), v in ranked.head(worst).items() if v > 0]
            for layer, role, v in named:
                ax.text(
                    list(grid.columns).index(role),
                    list(grid.index).index(layer),
                    f"{v:.3g}%",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="tab:cyan",
                )
            worst_text = (
                "; ".join(f"{layer} {role.replace('_', ' ')} {v:.3g}%" for layer, role, v in named) or "nothing lost"
            )
            where = f"{net}, " if df["network"].nunique() and mine["network"].nunique() > 1 else ""
            ax.set_title(f"{fmt}: {where}{run['mode']}, seed {run['seed']}\n{title}\nworst: {worst_text}", fontsize=8)
            _save(fig, out, _run_figure(f"atlas_{fmt}", run, net, with_run=False), written, index)
    return written


def atlas_histograms(runs: pd.DataFrame, out: Path, index: FigureIndex | None = None) -> list[Path]:
    """For each mode's lowest seed with an atlas, each network and role: the histogram of log2|v|
    over the sampled steps, one panel per scalar format with that format's ranges shaded (block
    formats have no fixed range: their scale moves with each block)."""
    written: list[Path] = []
    for _, run in _lowest_seed_with_stats(runs).iterrows():
        stats, title = _grad_stats_of(run)
        atlas = stats.get("atlas") or {}
        scalar = [f for f in atlas.get("formats", []) if not isinstance(get_format(f), BlockFormat)]
        for net, parts in (atlas.get("networks") or {}).items():
            for role, t in parts["total"].items():
                bins = {int(e): c for e, c in (t.get("log2_bins") or {}).items()}
                if not scalar or not bins:
                    continue
                fig, axes = plt.subplots(
                    1,
                    len(scalar),
                    figsize=(5.5 * len(scalar), 4.2),
                    sharey=True,
                    squeeze=False,
                    constrained_layout=True,
                )
                for ax, fmt in zip(axes[0], scalar):
                    r = format_ranges(fmt)
                    # The data and the format's edges, but no more than 12 binades beyond the data
                    # (BF16's range would flatten it to a line).
                    lo, hi = min(bins), max(bins)
                    span = (max(min(lo, r[1] - 3), lo - 12), min(max(hi, math.ceil(r[3]) + 2), hi + 12))
                    _histogram_panel(ax, bins, t["zeros"], 0, span, r, what=role.replace("_", " "))
                    f = t["formats"][fmt]
                    ax.set_title(
                        f"{fmt}: {f['share_underflow'] * 100:.3g}% become 0, "
                        f"{f['share_subnormal'] * 100:.3g}% subnormal, {f['share_overflow'] * 100:.3g}% overflow",
                        fontsize=8,
                    )
                    ax.legend(fontsize=6, loc="upper right")
                where = f"{net}, " if len(atlas["networks"]) > 1 else ""
                fig.suptitle(
                    f"{role.replace('_', ' ')}, all layers, {where}{run['mode']}, seed {run['seed']}, "
                    f"{len(stats['sampled_steps'])} sampled steps\n{title}",
                    fontsize=9,
                )
                _save(fig, out, _run_figure(f"atlas_hist_{role}", run, net), written, index)
    return written
