"""`mpt-report`: turn result records into runs.csv, Markdown/CSV tables and PNG figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

import pandas as pd

from ..files import WriteError, remove_stale_temporaries
from ..runner import identity
from ..runner.record import RecordError
from . import comparisons, figures, tables
from .naming import INDEX_NAME, Figure, FigureIndex, render_index
from .output import write_text
from .records import load_atlas, load_curves, load_lost_update_steps, load_overflow_origins, load_runs, shown_path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def default_published() -> Path:
    """results/paper/published.csv of the working directory, else of the checkout the package runs from."""
    for root in (Path.cwd(), PACKAGE_ROOT):
        candidate = root / "results" / "paper" / "published.csv"
        if candidate.exists():
            return candidate
    return Path("results/paper/published.csv")


def write_table(df: pd.DataFrame, markdown: str, out: Path, name: str, written: list[Path]) -> str:
    csv = df.drop(columns=[c for c in ("precision_order", "scale_order") if c in df.columns]).to_csv(index=False)
    written.append(write_text(out, "tables", f"{name}.csv", text=csv))
    written.append(write_text(out, "tables", f"{name}.md", text=markdown + "\n"))
    return markdown


def _figure_entry(path: Path, figure: Figure | None) -> str:
    """A figure in report.md, and under it the variant its title names only by tag."""
    entry = f"![{path.stem}](figures/{path.name})"
    variant = figure.variant if figure is not None else ""
    return entry + (f"\n\nvariant {identity.tag(variant)}: `{variant}`" if variant else "")


def build_report(
    paths: list[Path], out: Path, published_path: Path | None, declared: Iterable[comparisons.Declared] = ()
) -> list[Path]:
    runs = load_runs(paths)
    if runs.empty:
        raise SystemExit(f"mpt-report: error: no result.json under {', '.join(map(str, paths))}")
    out.mkdir(parents=True, exist_ok=True)
    for own in (out / "tables", out / "figures"):  # the report's own folders: what a killed report left half-written
        if own.is_dir():
            remove_stale_temporaries(own)
    written: list[Path] = []
    tidy = runs.drop(columns=["precision_order", "scale_order"]).map(shown_path)
    written.append(write_text(out, "runs.csv", text=tidy.to_csv(index=False)))

    verdicts = comparisons.comparisons(runs, declared)
    acc = tables.accuracy(runs)
    tp = tables.throughput(runs)
    ttr = tables.time_to_result(runs)
    mem = tables.memory(runs)
    steady = tables.memory(runs, "steady_peak_memory_bytes")
    ls = tables.loss_scaling(runs)
    util = tables.mfu(runs)
    gs = tables.gradient_stats(runs)
    lu = tables.lost_updates(runs)
    atlas_rows = load_atlas(runs)
    at = tables.atlas(atlas_rows)
    origins = load_overflow_origins(runs)
    shifted = tables.shift_control(runs)
    sections = [
        (
            (
                "Comparisons (each cell against its baseline, paired by seed: Δ and its 95% Student-t interval, the "
                "verdict by the margin the experiment declared)"
            ),
            "comparisons",
            verdicts,
            comparisons.render(verdicts),
        ),
        ("Accuracy", "accuracy", acc, tables.render_accuracy(acc)),
        (
            "Throughput (median samples/s; speedup over fp32 on the same device, batch and resolution, from at least "
            f"{tables.MIN_WINDOWS} timing windows on each side; none on a CPU, whose low-precision arithmetic is "
            "emulated)",
            "throughput",
            tp,
            tables.render_relative(tp, "throughput", "speedup_vs_fp32", lambda v: f"{v:.4g}", "throughput_unit"),
        ),
        (
            (
                "Time to result (median seconds from the first step to the end of the final evaluation, device "
                "synchronized, earlier evaluations, checkpoints and statistics steps left out; ratio to fp32; the "
                "metric's mean)"
            ),
            "time_to_result",
            ttr,
            tables.render_time_to_result(ttr),
        ),
        (
            "Peak memory (MiB; ratio to fp32 on the same device, batch and resolution)",
            "memory",
            mem,
            tables.render_relative(
                mem, "peak_memory_bytes", "ratio_to_fp32", lambda v: f"{v / 2**20:.0f}", "memory_kind"
            ),
        ),
        (
            (
                "Peak memory after the warm-up (MiB; ratio to fp32): without what only the first steps allocated, such "
                "as cuDNN's benchmark workspaces"
            ),
            "memory_steady",
            steady,
            tables.render_relative(
                steady, "steady_peak_memory_bytes", "ratio_to_fp32", lambda v: f"{v / 2**20:.0f}", "memory_kind"
            ),
        ),
        (
            (
                "Model FLOPs utilization (model FLOPs per sample x samples/s over the GPU's dense peak for the mode's "
                "math)"
            ),
            "mfu",
            util,
            tables.render_mfu(util),
        ),
        ("Loss scaling", "loss_scaling", ls, tables.render_loss_scaling(ls)),
        (
            (
                "The loss-scaling control (the loss times 2^-k before the backward, the gradients times 2^k before the "
                "update)"
            ),
            "shift_control",
            shifted,
            tables.render_shift_control(shifted),
        ),
        (
            (
                "Where skipped steps overflowed first (per run: the module and tensor whose values became non-finite "
                "first, and how many skips each caused)"
            ),
            "overflow_origins",
            origins,
            tables.render_overflow_origins(origins),
        ),
        (
            (
                "Gradients against FP16's range (shares of non-zero values; % zero of all; unscaled; sampled steps' "
                "cost against a plain step)"
            ),
            "gradient_stats",
            gs,
            tables.render_gradient_stats(gs),
        ),
        (
            (
                "Updates lost in FP16 (of the weight elements the sampled steps updated: lost by FP16 weights updated "
                "in place, or that an FP16 weight would lose, counted on FP32 masters or weights)"
            ),
            "lost_updates",
            lu,
            tables.render_lost_updates(lu),
        ),
        (
            (
                "Numerics atlas (network totals over the sampled steps: % of non-zero values each format loses or "
                "holds as subnormals as they are; SQNR as they are and scaled; power-of-two scales)"
            ),
            "atlas",
            at,
            tables.render_atlas(at),
        ),
    ]
    if published_path is not None and published_path.exists():
        paper = tables.paper_comparison(runs, pd.read_csv(published_path))
        shown = (
            published_path.resolve().relative_to(Path.cwd())
            if published_path.resolve().is_relative_to(Path.cwd())
            else shown_path(str(published_path.resolve()))
        )
        sections.append(
            (f"Against the published values ({shown})", "paper_comparison", paper, tables.render_paper(paper))
        )
    counts = ", ".join(f"{n} {s}" for s, n in runs.status.value_counts().items())
    skipped = int(tables.skipped_every_step(runs).sum())
    # A run that skipped every step trained nothing, whatever its record says: never a result.
    counts += f"; {skipped} skipped every step (no result)" if skipped else ""
    text = [f"# Report\n\n{len(runs)} runs: {counts}.\n"]
    for title, name, df, md in sections:
        text.append(f"## {title}\n\n" + write_table(df, md, out, name, written) + "\n")

    curves = load_curves(runs)
    lost_steps = load_lost_update_steps(runs, curves)
    if not lost_steps.empty:  # one row per sampled step: a CSV to read, not a table to print
        shown_steps = lost_steps.drop(columns=["precision_order", "scale_order"]).map(shown_path)
        written.append(write_text(out, "tables", "lost_updates_by_step.csv", text=shown_steps.to_csv(index=False)))
    drawn, index = out / "figures", FigureIndex()
    figs = figures.loss_curves(curves, drawn, index=index) + figures.loss_scale_curves(curves, drawn, index=index)
    figs += figures.throughput_bars(tp, drawn, index=index) + figures.shift_control(shifted, drawn, index=index)
    figs += figures.sample_grids(runs, drawn, index=index) + figures.gradient_histograms(runs, drawn, index=index)
    figs += figures.gradient_histograms_over_training(runs, drawn, index=index)
    figs += figures.lost_update_curves(lost_steps, curves, drawn, index=index)
    figs += figures.atlas_heatmaps(atlas_rows, drawn, index=index) + figures.atlas_histograms(runs, drawn, index=index)
    written += figs
    # figures/ is the report's own: a figure an earlier report drew for a cell that no longer exists
    # (a variant renamed, a record removed) would otherwise sit beside the new ones, unlisted.
    for stale in set((out / "figures").glob("*.png")) - set(figs):
        stale.unlink()
    # What each figure's tag stands for: its whole description, one row per figure.
    described = [(p, f) for p in dict.fromkeys(figs) if (f := index.get(p)) is not None]
    written.append(write_text(out, INDEX_NAME, text=render_index(described, out)))
    listed = f"Each figure's full description (what the tag ending its name stands for): [{INDEX_NAME}]({INDEX_NAME})."
    entries = [listed, *(_figure_entry(p, index.get(p)) for p in figs)] if figs else []
    text.append("## Figures\n\n" + "\n\n".join(entries) + "\n")
    written.append(write_text(out, "report.md", text="\n".join(text)))
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="mpt-report", description="Tables and figures from mpt-run's result records.")
    ap.add_argument(
        "paths",
        nargs="*",
        type=Path,
        default=[Path("results/runs")],
        help="folders searched for result.json (default: results/runs)",
    )
    ap.add_argument(
        "--out", type=Path, default=Path("results"), help="where runs.csv, tables/ and figures/ go (default: results)"
    )
    ap.add_argument(
        "--comparisons",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help=(
            "an experiment declaration (a preset, or its experiment: node) applied to the runs whose records declare "
            "none; the table says it came after the runs (repeatable)"
        ),
    )
    ap.add_argument(
        "--published", type=Path, default=None, help="published values CSV (default: results/paper/published.csv)"
    )
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        print(f"mpt-report: error: no such folder: {', '.join(missing)}", file=sys.stderr)
        sys.exit(2)
    try:
        declared = [comparisons.load_declaration(path) for path in args.comparisons]
        written = build_report(args.paths, args.out, args.published or default_published(), declared)
    except (
        RecordError,
        comparisons.DeclarationError,
    ) as e:  # a result.json that is not a record this version reads: name it, write nothing more
        print(f"mpt-report: error: {e}", file=sys.stderr)
        sys.exit(2)
    except WriteError as e:  # a full disk: the file it names is as the previous report left it
        print(f"mpt-report: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"mpt-report: {len(written)} files in {args.out}: runs.csv, report.md, tables/, figures/, {INDEX_NAME}")


if __name__ == "__main__":
    main()
