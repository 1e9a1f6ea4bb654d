"""A tiny sweep through the real CLI, relaunched, and the report built from its records."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf
from PIL import Image

from mpt.report.cli import build_report
from mpt.report.cli import main as report_main
from mpt.report.figures import _cell_name
from mpt.report.naming import Figure, figure_name
from mpt.report.records import cell_variant, load_runs, mode_label
from mpt.report.tables import accuracy, render_accuracy, render_relative, sample_std, throughput
from mpt.runner import identity

from .conftest import ROOT, mpt_run

SWEEP = ["-m", "precision=fp32,fp16", "scale=none,dynamic", "seed=0,1", "schedule=smoke", "checkpoint=false"]


def records(runs: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in runs.glob("*/result.json")}


def skipped_all(rec: dict) -> bool:
    """Whether a network of the run skipped every step: FP16 without master weights under the
    dynamic scale does in the sweep's three steps (the scale's search from 2^16), which older
    versions recorded as `ok` and newer ones as `diverged`. Either way, no result."""
    return any(0 < s["steps"] == s["skipped_steps"] for s in rec["loss_scale"].values())


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("sweep") / "runs"
    r = mpt_run(*SWEEP, f"hydra.sweep.dir={runs}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    # No terminal here: each run's plain progress line, labelled with its place in the sweep.
    assert [line.split(":")[1] for line in r.stdout.splitlines() if line.startswith("mpt-run: run ")] == [
        f" run {i}/8" for i in range(1, 9)
    ]
    assert "run 8/8: step 3/3 (100%), loss " in r.stdout
    r = mpt_run(
        "-m",
        "precision=fp32",
        "optim.lr=1e12",
        "schedule=smoke",
        "schedule.log_every=1",
        "checkpoint=false",
        f"hydra.sweep.dir={runs}",
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return runs


@pytest.fixture(scope="module")
def report(swept) -> Path:
    """mpt-report's command line, run in this process: a second interpreter's start-up would cost
    more than the report."""
    out = swept.parent / "report"
    report_main([str(swept), "--out", str(out)])  # exits on an error
    return out


def test_each_configuration_has_its_own_folder_named_from_its_choices(swept):
    recs = records(swept)
    assert len(recs) == 9
    assert "resnet50_fp16_dynamic_synthetic_smoke_cpu_seed1" in recs
    diverged = [name for name, rec in recs.items() if rec["status"] == "diverged" and not skipped_all(rec)]
    assert len(diverged) == 1 and diverged[0].startswith("resnet50_fp32_none_synthetic_smoke_cpu_seed0__lr-")
    assert recs[diverged[0]]["variant"] == "optim.lr=1000000000000.0"  # how often it logs is not what it computes


def test_each_launch_into_one_sweep_folder_keeps_its_config(swept):
    launches = sorted(swept.glob("multirun-*.yaml"))  # the slow test below launches more
    tasks = [OmegaConf.load(p).hydra.overrides.task for p in launches]
    second = ["precision=fp32", "optim.lr=1e12", "schedule=smoke", "schedule.log_every=1", "checkpoint=false"]
    assert tasks[:2] == [SWEEP[1:], second]
    assert (swept / "multirun.yaml").read_text() == launches[-1].read_text()  # Hydra's: the last launch's


@pytest.mark.slow  # over 20 s on 2 cores: the fast tier's budget
def test_relaunching_a_sweep_skips_finished_runs_and_force_reruns(swept):
    before = {p: p.stat().st_mtime_ns for p in [*swept.glob("*/result.json"), *swept.glob("*/.hydra/*.yaml")]}
    r = mpt_run(*SWEEP, f"hydra.sweep.dir={swept}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("skipped (force=true runs it again)") == 8
    # A skipped run's files stay as its run wrote them, Hydra's too: committed records stay clean.
    assert {p: p.stat().st_mtime_ns for p in [*swept.glob("*/result.json"), *swept.glob("*/.hydra/*.yaml")]} == before

    # A run that did not finish (its record still says `running`) is redone.
    unfinished = swept / "resnet50_fp32_none_synthetic_smoke_cpu_seed1" / "result.json"
    rec = json.loads(unfinished.read_text())
    unfinished.write_text(json.dumps({**rec, "status": "running"}))
    r = mpt_run(
        "-m",
        "precision=fp32",
        "scale=none",
        "seed=0,1",
        "schedule=smoke",
        "checkpoint=false",
        f"hydra.sweep.dir={swept}",
        cwd=ROOT,
    )
    assert r.stdout.count("skipped (force=true") == 1 and json.loads(unfinished.read_text())["status"] == "ok"

    r = mpt_run(
        "-m",
        "precision=fp32",
        "scale=none",
        "seed=0",
        "schedule=smoke",
        "force=true",
        "checkpoint=false",
        f"hydra.sweep.dir={swept}",
        cwd=ROOT,
    )
    assert "skipped (force=true" not in r.stdout
    forced = swept / "resnet50_fp32_none_synthetic_smoke_cpu_seed0" / "result.json"
    assert forced.stat().st_mtime_ns != before[forced]

    # A diverged run is a result too: relaunched, it is skipped, not diverged again.
    r = mpt_run(
        "-m",
        "precision=fp32",
        "optim.lr=1e12",
        "schedule=smoke",
        "schedule.log_every=1",
        "checkpoint=false",
        f"hydra.sweep.dir={swept}",
        cwd=ROOT,
    )
    assert "already has a record with status diverged; skipped" in r.stdout
    # Relaunched logging or timing differently, it is the same computation: the same folder, skipped.
    before = {p: p.stat().st_mtime_ns for p in swept.glob("*/result.json")}
    r = mpt_run("-m", "precision=fp32", "optim.lr=1e12", "schedule=smoke", "schedule.log_every=3",
                "schedule.throughput_window=2", "checkpoint=false",
                f"hydra.sweep.dir={swept}", cwd=ROOT)  # fmt: skip
    assert "already has a record with status diverged; skipped" in r.stdout
    assert {p: p.stat().st_mtime_ns for p in swept.glob("*/result.json")} == before
    diverged = next(swept.glob("resnet50_fp32_none_synthetic_smoke_cpu_seed0__lr-*"))  # logged every step
    assert json.loads((diverged / "result.json").read_text())["status"] == "diverged"
    assert "log_every: 1\n" in (diverged / ".hydra" / "config.yaml").read_text()  # not the relaunch's 3


def test_runs_csv_has_one_row_per_record_with_its_values(report, swept):
    runs = pd.read_csv(report / "runs.csv")
    recs = records(swept)
    assert len(runs) == len(recs)
    for row in runs.itertuples():
        rec = recs[Path(row.run_dir).name]
        assert row.status == rec["status"] and row.precision == rec["choices"]["precision"] and row.seed == rec["seed"]
        assert row.skipped_steps == rec["loss_scale"]["model"]["skipped_steps"]
        assert row.throughput == pytest.approx(rec["throughput"]["pipeline"])
        if rec["status"] == "ok":
            assert row.metric_value == pytest.approx(rec["metrics"]["top1"])


def test_accuracy_pivot_holds_the_mean_over_seeds(report, swept):
    acc = pd.read_csv(report / "tables" / "accuracy.csv").fillna({"variant": ""})
    recs = records(swept).values()
    for precision in ("fp32", "fp16"):
        for scale in ("none", "dynamic"):
            top1 = [
                r["metrics"]["top1"]
                for r in recs
                if r["choices"]["precision"] == precision
                and r["choices"]["scale"] == scale
                and r["status"] == "ok"
                and not r["variant"]
                if not skipped_all(r)
            ]
            cell = acc[(acc.precision == precision) & (acc.scale == scale) & (acc.variant == "")]
            assert len(cell) == 1 and cell.n.item() == len(top1)
            if not top1:  # every seed skipped every step
                assert cell.skipped_every_step.item() == 2
                continue
            assert len(top1) == 2
            assert cell["mean"].item() == pytest.approx(statistics.mean(top1))
            assert cell["std"].item() == pytest.approx(statistics.stdev(top1))
    assert "FP16 + LS (dynamic)" in (report / "tables" / "accuracy.md").read_text()


def test_a_diverged_run_shows_as_diverged(report):
    md = (report / "tables" / "accuracy.md").read_text()
    line = next(line for line in md.splitlines() if "optim.lr=" in line)
    assert "diverged" in line
    acc = pd.read_csv(report / "tables" / "accuracy.csv")
    assert acc[acc.variant.fillna("").str.contains("optim.lr=")].diverged.item() == 1


def test_throughput_speedup_is_over_fp32_on_the_same_device(report, swept):
    tp = pd.read_csv(report / "tables" / "throughput.csv", dtype={"variant": "string"})
    recs = [r for r in records(swept).values()]

    def median(precision, scale):
        return statistics.median(
            r["throughput"]["pipeline"]
            for r in recs
            if r["choices"]["precision"] == precision
            and r["choices"]["scale"] == scale
            and r["status"] == "ok"
            and not r["variant"]
        )

    fp16 = tp[(tp.precision == "fp16") & (tp.scale == "none") & tp.variant.isna()]
    assert fp16.throughput.item() == pytest.approx(median("fp16", "none"))
    # a CPU emulates FP16: its ratio to FP32 would measure the emulation, so the table gives none
    assert tp.speedup_vs_fp32.isna().all()
    assert set(tp.throughput_unit) == {"images/s (CPU: any low-precision arithmetic emulated)"}
    assert not tp.variant.fillna("").str.contains("optim.lr").any()  # the diverged run times nothing

    # The same records as a GPU's: the speedup is the ratio of the medians, where both cells timed
    # at least 3 windows, and none (the windows counted in the cell) where fp16's timed fewer.
    for windows, expected in [(3, median("fp16", "none") / median("fp32", "none")), (2, None)]:
        runs = load_runs([swept]).assign(device_type="cuda")
        runs["throughput_windows"] = [3 if p == "fp32" else windows for p in runs.precision]
        table = throughput(runs)
        row = table[(table.precision == "fp16") & (table.scale == "none") & (table.variant.fillna("") == "")]
        if expected is None:
            assert row.speedup_vs_fp32.isna().item() and row.note.item() == "2 windows"
            rendered = render_relative(table, "throughput", "speedup_vs_fp32", lambda v: f"{v:.4g}", "throughput_unit")
            assert f"{row.throughput.item():.4g} (2 windows)" in rendered
        else:
            assert row.speedup_vs_fp32.item() == pytest.approx(expected) and row.note.item() == ""


def test_the_time_to_result_table_holds_each_cells_median_time_and_mean_metric(report, swept):
    ttr = pd.read_csv(report / "tables" / "time_to_result.csv", dtype={"variant": "string"})
    recs = [r for r in records(swept).values() if r["status"] == "ok" and not r["variant"]]

    def cell(precision):
        mine = [r for r in recs if r["choices"]["precision"] == precision and r["choices"]["scale"] == "none"]
        return statistics.median(r["time_to_result"]["seconds"] for r in mine), statistics.mean(
            r["metrics"]["top1"] for r in mine
        )

    (fp16_s, fp16_top1), (fp32_s, _) = cell("fp16"), cell("fp32")
    row = ttr[(ttr.precision == "fp16") & (ttr.scale == "none") & ttr.variant.isna()]
    assert row.time_to_result_s.item() == pytest.approx(fp16_s)
    assert row.ratio_to_fp32.item() == pytest.approx(fp16_s / fp32_s)
    assert row.metric_mean.item() == pytest.approx(fp16_top1)
    assert "Time to result" in (report / "report.md").read_text()


def test_the_steady_peak_table_holds_each_cells_median_steady_peak(report, swept):
    mem = pd.read_csv(report / "tables" / "memory_steady.csv", dtype={"variant": "string"})
    recs = [r for r in records(swept).values() if r["status"] == "ok" and not r["variant"]]
    fp16 = mem[(mem.precision == "fp16") & (mem.scale == "none") & mem.variant.isna()]
    steady = [
        r["memory"]["steady_peak_bytes"]
        for r in recs
        if r["choices"]["precision"] == "fp16" and r["choices"]["scale"] == "none"
    ]
    assert fp16.steady_peak_memory_bytes.item() == pytest.approx(statistics.median(steady))
    assert "after the warm-up" in (report / "report.md").read_text()


def test_paper_comparison_puts_our_cells_next_to_the_published_ones(report):
    paper = pd.read_csv(report / "tables" / "paper_comparison.csv")
    acc = pd.read_csv(report / "tables" / "accuracy.csv").fillna({"variant": ""})
    row = paper[
        (paper.table == "Table 1")
        & (paper.model == "resnet50")
        & (paper.precision == "fp32")
        & (paper.variant.fillna("") == "")
    ]
    assert row.published.item() == 75.92 and row.data.item() == "synthetic" and row.schedule.item() == "smoke"
    ours = acc[(acc.precision == "fp32") & (acc.scale == "none") & (acc.variant == "")]["mean"].item()
    assert row.ours.item() == pytest.approx(100 * ours)
    md = (report / "tables" / "paper_comparison.md").read_text().splitlines()
    ours_diverged = [line for line in md if "| resnet50 | fp32 |" in line and "optim.lr=" in line]
    assert len(ours_diverged) == 3 and all(
        "| diverged |" in line for line in ours_diverged
    )  # Table 1 top-1, GTC top-1 and top-5


def report_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """mpt-report's command line in this process: its exit status, stdout and stderr."""
    try:
        report_main([*map(str, argv)])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    if isinstance(code, str):  # the interpreter prints such a message to stderr and exits 1
        return 1, out.out, out.err + code
    return code, out.out, out.err


def test_a_report_of_only_diverged_runs_says_so(swept, tmp_path, capsys):
    import shutil

    only = tmp_path / "only"
    for rec in swept.glob("*/result.json"):
        if json.loads(rec.read_text())["status"] == "diverged" and not skipped_all(json.loads(rec.read_text())):
            shutil.copytree(rec.parent, only / rec.parent.name)
    code, _, err = report_cli(capsys, only, "--out", tmp_path / "out")
    assert code == 0, err[-2000:]
    rows = [
        line
        for line in (tmp_path / "out" / "tables" / "accuracy.md").read_text().splitlines()
        if line.startswith("| resnet50")
    ]
    assert len(rows) == 1 and rows[0].endswith("| diverged |")


def test_figures_are_valid_pngs(report):
    names = sorted(p.name for p in (report / "figures").glob("*.png"))
    smoke = ("resnet50", "synthetic", "smoke")
    assert figure_name(Figure("loss", *smoke)) in names and figure_name(Figure("loss_scale", *smoke)) in names
    assert any(n.startswith("throughput_") for n in names)
    for name in names:
        with Image.open(report / "figures" / name) as im:
            im.verify()
            assert im.format == "PNG"
    assert all(f"figures/{n}" in (report / "report.md").read_text() for n in names)


def markdown_table(text: str) -> list[dict[str, str]]:
    """The rows of the one Markdown table in `text`, by header; escaped pipes unescaped."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = [re.split(r"(?<!\\)\|", line)[1:-1] for line in lines]
    split = [[c.strip().replace("\\|", "|").replace("\\\\", "\\") for c in row] for row in cells]
    header, rule, *rows = split
    assert all(re.fullmatch(r":?-+:?", c) for c in rule) and all(len(r) == len(header) for r in rows)
    return [dict(zip(header, r)) for r in rows]


def test_figures_md_lists_every_figure_once_with_what_its_tag_stands_for(report):
    from mpt.report import naming

    assert "[figures.md](figures.md)" in (report / "report.md").read_text()
    rows = markdown_table((report / "figures.md").read_text())
    linked = [re.fullmatch(r"\[(.+)\]\((.+)\)", row["figure"]) for row in rows]
    assert all(m and m[2] == f"figures/{m[1]}" for m in linked)
    names = [m[1] for m in linked if m]
    assert sorted(names) == sorted(p.name for p in (report / "figures").glob("*.png"))  # every figure, each once
    variants = set(pd.read_csv(report / "runs.csv")["variant"].fillna(""))
    assert len(variants) == 2 and "" in variants  # the sweep's and the diverging run's
    for name, row in zip(names, rows):
        assert len(name) <= naming.NAME_LIMIT
        variant = row["variant"].strip("`")
        assert variant in variants
        # The row is the whole description: from it alone, the name's tag again.
        figure = Figure(row["kind"], row["model"], row["data"], row["schedule"], variant, row["cell"], row["network"])
        assert name.endswith(f"_{row['tag']}.png") and row["tag"] == naming.tag(figure)
    assert {row["variant"].strip("`") for row in rows if row["kind"] == "loss"} == variants


def test_report_without_records_is_an_error(tmp_path, capsys):
    code, _, err = report_cli(capsys, tmp_path, "--out", tmp_path / "out")
    assert code != 0 and f"no result.json under {tmp_path}" in err


def test_mode_labels_follow_the_paper():
    assert mode_label("FP32", "none", None) == "FP32"
    assert mode_label("Mixed", "static", 8.0) == "Mixed + LS (static 8)"
    assert mode_label("FP16 mod. momentum", "dynamic", None) == "FP16 mod. momentum + LS (dynamic)"


def test_a_preempted_run_counts_as_unfinished_and_a_cut_log_line_is_left_out(swept, tmp_path, capsys):
    import shutil

    src = swept / "resnet50_fp16_dynamic_synthetic_smoke_cpu_seed1"
    shutil.copytree(src, tmp_path / "runs" / src.name)
    record = tmp_path / "runs" / src.name / "result.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "status": "preempted"}))
    with open(record.parent / "metrics.jsonl", "a") as log:
        log.write('{"kind": "train", "step": 3, "lo')  # a line cut short by the kill or a full disk
    code, _, err = report_cli(capsys, tmp_path / "runs", "--out", tmp_path / "out")
    assert code == 0, err[-2000:]
    acc = pd.read_csv(tmp_path / "out" / "tables" / "accuracy.csv")
    assert (acc.ok.item(), acc.failed.item(), acc.diverged.item()) == (0, 1, 0)


def test_a_static_scales_value_is_the_modes_not_the_variants():
    assert cell_variant("scale.value=128,schedule.steps=50") == "schedule.steps=50"


def test_the_accuracy_table_holds_the_test_split_beside_validation():
    def run(precision, scale, value, seed, bleu, test_bleu):
        return {"model": "gnmt_small", "data": "parallel_text", "schedule": "short", "variant": "", "status": "ok",
                "seed": seed, "mode": mode_label(precision.title(), scale, value), "precision": precision,
                "scale": scale, "scale_value": value, "precision_order": 0 if precision == "fp32" else 3,
                "scale_order": 0 if scale == "none" else 2, "primary_metric": "bleu", "metric.bleu": bleu,
                "metric.test_bleu": test_bleu, "metric.val_loss": 3.0}  # fmt: skip

    runs = pd.DataFrame([run("fp32", "none", None, 0, 10.0, 6.0), run("fp32", "none", None, 1, 12.0, 8.0),
                         run("mixed", "static", 1024.0, 0, 11.0, 7.0)])  # fmt: skip
    acc = accuracy(runs)
    assert set(acc.metric) == {"bleu", "test_bleu"}  # not val_loss
    fp32_test = acc[(acc.metric == "test_bleu") & (acc.precision == "fp32")]
    assert fp32_test["mean"].item() == 7.0 and fp32_test["std"].item() == pytest.approx(2**0.5)
    rows = [line for line in render_accuracy(acc).splitlines() if line.startswith("| gnmt_small")]
    assert len(rows) == 2 and "7 ± 1.414" in rows[1] and "Mixed + LS (static 1024)" in render_accuracy(acc)


def test_a_rebuilt_report_keeps_only_the_figures_it_lists(swept, tmp_path):
    out = tmp_path / "out"
    build_report([swept], out, None)
    stale = out / "figures" / "loss_a_variant_since_renamed.png"
    stale.write_bytes(b"")
    build_report([swept], out, None)
    listed = {
        line.split("(figures/")[1].rstrip(")")
        for line in (out / "report.md").read_text().splitlines()
        if "(figures/" in line
    }
    assert listed and {p.name for p in (out / "figures").iterdir()} == listed


@pytest.mark.slow  # a sweep of its own
def test_no_machine_path_reaches_a_table_and_titles_leave_the_variant_to_report_md(tmp_path):
    from .conftest import TINY
    from .test_imagefolder import make_folder

    data = make_folder(tmp_path / "on-this-machine", per_class=4, size=32)
    runs = tmp_path / "runs"
    r = mpt_run(
        "-m",
        TINY,
        "data=imagefolder",
        f"data.root={data}",
        "data.num_workers=0",
        "schedule=smoke",
        "checkpoint=false",
        f"hydra.sweep.dir={runs}",
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "report"
    build_report([runs], out, None)
    for written in [out / "report.md", out / "runs.csv", *(out / "tables").iterdir()]:
        assert str(tmp_path) not in written.read_text(), written.name
    variant = pd.read_csv(out / "runs.csv")["variant"].item()
    assert re.search(r"data\.root=…[0-9a-f]{8}/on-this-machine(,|$)", variant)
    lines = (out / "report.md").read_text().splitlines()
    figure = next(i for i, line in enumerate(lines) if line.startswith("![loss_"))
    assert lines[figure + 2] == f"variant {identity.tag(variant)}: `{variant}`"
    assert (
        _cell_name(("resnet50", "imagefolder", "smoke", variant))[1]
        == f"resnet50, imagefolder, smoke (variant {identity.tag(variant)})"
    )


def copied(swept: Path, dest: Path, name: str, **changes) -> Path:
    """A run folder of the sweep copied into `dest` (its .lock too), its record changed."""
    import shutil

    run = shutil.copytree(swept / name, dest / name)
    rec = json.loads((run / "result.json").read_text())
    (run / "result.json").write_text(json.dumps({**rec, **changes}))
    return run


def test_a_running_record_whose_process_was_killed_shows_as_died(swept, tmp_path):
    from mpt.report.records import load_runs

    from .test_lock_probe import hold

    run = copied(swept, tmp_path / "runs", "resnet50_fp32_dynamic_synthetic_smoke_cpu_seed1", status="running")
    child = hold(run)
    try:
        assert load_runs([tmp_path / "runs"]).status.tolist() == ["running"]
    finally:
        child.send_signal(9)  # SIGKILL: no chance to write a final record, as the OOM killer
        child.wait()
    shown = load_runs([tmp_path / "runs"])
    assert shown.status.tolist() == ["died"] and "no process holds" in shown.message.item()
    assert json.loads((run / "result.json").read_text())["status"] == "running"  # the record stays as it is

    build_report([tmp_path / "runs"], tmp_path / "out", None)
    assert "1 runs: 1 died." in (tmp_path / "out" / "report.md").read_text()
    assert pd.read_csv(tmp_path / "out" / "tables" / "accuracy.csv").failed.item() == 1

    (run / ".lock").unlink()  # a copy without its lock file: nothing tells whether it lives
    assert load_runs([tmp_path / "runs"]).status.tolist() == ["unknown"]


def test_a_crafted_record_writes_nothing_outside_out(swept, tmp_path, capsys):
    from mpt.report import figures
    from mpt.report.output import UnsafeName, target
    from mpt.report.records import record_row
    from mpt.runner.record import RunRecord

    name = "resnet50_fp32_dynamic_synthetic_smoke_cpu_seed0"
    rec = json.loads((swept / name / "result.json").read_text())
    # Without the check, loss_<model>_synthetic_smoke.png would land in tmp_path, beside out's parent.
    copied(swept, tmp_path / "runs", name, choices={**rec["choices"], "model": "../../../../x"})
    copied(swept, tmp_path / "runs", "resnet50_fp32_none_synthetic_smoke_cpu_seed0")
    before = {p for p in tmp_path.parent.rglob("*")}
    out = tmp_path / "deep" / "out"
    code, _, err = report_cli(capsys, tmp_path / "runs", "--out", out)
    assert code == 0, err[-2000:]
    assert f"left out {tmp_path / 'runs' / name / 'result.json'}: choices.model is '../../../../x'" in err
    assert {p for p in tmp_path.parent.rglob("*")} - before <= {tmp_path / "deep", out, *out.rglob("*")}
    assert len(pd.read_csv(out / "runs.csv")) == 1

    # Names from deeper in a record (a network's, a format's) meet the same rule when a figure is saved.
    fig = figures.plt.figure()
    written = []
    figures._save(fig, out / "figures", "grads_weight_resnet50_../../../y.png", written)
    assert written == []
    assert "figure not drawn: 'grads_weight_resnet50_../../../y.png' is not a plain name" in capsys.readouterr().err
    for bad in ("a/b", "a\\b", "..", ".hidden", "a\0b", ""):
        with pytest.raises(UnsafeName):
            target(out, bad)
    # A sample grid named outside its run's folder is not read into a figure.
    grid = RunRecord.from_dict({**rec, "sample_grids": [{"step": 3, "path": "../../../secret.png"}]})
    assert record_row(grid, swept / name / "result.json")["final_sample_grid"] is None


def table_row(md: Path) -> str:
    """A Markdown table's first row of resnet50."""
    return next(line for line in md.read_text().splitlines() if line.startswith("| resnet50"))


def test_a_run_that_skipped_every_step_is_flagged_and_no_result(swept, tmp_path, capsys):
    one = "resnet50_fp32_dynamic_synthetic_smoke_cpu_seed0"
    rec = json.loads((swept / one / "result.json").read_text())
    scaler = rec["loss_scale"]["model"]
    assert rec["status"] == "ok" and 0 == scaler["skipped_steps"] < scaler["steps"]
    # An older record: every step skipped, yet `ok`.
    copied(swept, tmp_path / "runs", one, loss_scale={"model": {**scaler, "skipped_steps": scaler["steps"]}})
    copied(swept, tmp_path / "runs", "resnet50_fp32_dynamic_synthetic_smoke_cpu_seed1")
    out = tmp_path / "out"
    code, _, err = report_cli(capsys, tmp_path / "runs", "--out", out)
    assert code == 0, err[-2000:]

    runs = pd.read_csv(out / "runs.csv")
    assert runs.set_index("seed").skipped_every_step.to_dict() == {0: True, 1: False}
    acc = pd.read_csv(out / "tables" / "accuracy.csv")
    assert (acc.runs.item(), acc.ok.item(), acc.n.item(), acc.skipped_every_step.item()) == (2, 1, 1, 1)
    row = table_row(out / "tables" / "accuracy.md")
    assert "(1 of 2 seeds, 1 skipped every step)" in row
    assert pd.read_csv(out / "tables" / "throughput.csv").runs.item() == 1  # seed 1's alone
    scaling = table_row(out / "tables" / "loss_scaling.md")
    assert "(every step in 1 of 2 runs)" in scaling
    assert "2 runs: 2 ok; 1 skipped every step (no result)." in (out / "report.md").read_text()

    # Alone in its cell, it is no number at all.
    (tmp_path / "runs" / "resnet50_fp32_dynamic_synthetic_smoke_cpu_seed1" / "result.json").unlink()
    build_report([tmp_path / "runs"], out, None)
    row = table_row(out / "tables" / "accuracy.md")
    assert row.endswith("| skipped every step |")


def test_a_report_cut_short_leaves_the_previous_files_whole(swept, tmp_path, capsys, monkeypatch):
    import errno

    from mpt import files

    out = tmp_path / "out"
    build_report([swept], out, None)
    (out / "runs.csv").write_text("the previous runs.csv\n")
    figure = out / "figures" / figure_name(Figure("loss", "resnet50", "synthetic", "smoke"))  # the first figure drawn
    figure.write_bytes(b"the previous figure")
    real_write = files._Recorder.write

    def full_disk_at(first_bytes: bytes):
        def write(self, data):
            if not bytes(data).startswith(first_bytes):
                return real_write(self, data)
            real_write(self, data[: len(data) // 2])  # half of it reaches the disk, then the disk is full
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error

        return write

    monkeypatch.setattr(files._Recorder, "write", full_disk_at(b"run_dir,"))  # runs.csv's header
    code, _, err = report_cli(capsys, swept, "--out", out)
    assert code == 1
    assert err.strip() == f"mpt-report: error: could not write {out / 'runs.csv'}: No space left on device"
    assert (out / "runs.csv").read_text() == "the previous runs.csv\n"

    monkeypatch.setattr(files._Recorder, "write", full_disk_at(b"\x89PNG"))  # the first figure
    code, _, err = report_cli(capsys, swept, "--out", out)
    assert code == 1 and "No space left on device" in err
    assert figure.read_bytes() == b"the previous figure"
    assert (out / "runs.csv").read_text().startswith("run_dir,")  # written whole before the figures
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]  # no half-written temporary left


def test_a_declaration_after_the_runs_gives_the_comparisons_table(swept, report, tmp_path, capsys):
    assert (report / "tables" / "comparisons.md").read_text().startswith("(no experiment declares comparisons")
    late = tmp_path / "late.yaml"
    late.write_text(
        "experiment:\n  name: smoke\n  metric: val_loss\n  margin: 0.5\n  comparisons:\n"
        "    - {cell: {precision: fp16}, against: {precision: fp32, scale: none}, expect: equivalent}\n"
    )
    code, _, err = report_cli(capsys, swept, "--out", tmp_path / "out", "--comparisons", late)
    assert code == 0, err[-2000:]
    table = pd.read_csv(tmp_path / "out" / "tables" / "comparisons.csv")
    assert sorted(table.cell) == ["FP16", "FP16 + LS (dynamic)"] and set(table.against) == {"FP32"}
    assert set(table.declared) == {"after the runs, in late.yaml"} and (table.n <= 2).all()
    assert "## Comparisons" in (tmp_path / "out" / "report.md").read_text()
    code, _, err = report_cli(capsys, swept, "--out", tmp_path / "out", "--comparisons", tmp_path / "nothing.yaml")
    assert code == 2 and err.strip() == f"mpt-report: error: --comparisons {tmp_path / 'nothing.yaml'}: no such file"


@pytest.mark.slow
def test_the_loss_shift_control_is_tabled_and_drawn_against_k(tmp_path):
    runs = tmp_path / "runs"
    r = mpt_run(
        "-m", "model=mobilenet_v3_small", "precision=fp32,mixed", "scale.shift_down=0,24", "schedule=smoke",
        "stats.grad_hist=true", "stats.every=1", "checkpoint=false", "logger=none", f"hydra.sweep.dir={runs}", cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    build_report([runs], tmp_path / "report", None)
    table = pd.read_csv(tmp_path / "report" / "tables" / "shift_control.csv").set_index(["mode", "k"])
    assert sorted(table.index) == [("FP32", 0), ("FP32", 24), ("Mixed", 0), ("Mixed", 24)]
    # FP32 is the same run at any k; FP16 flushes more of the shifted activation gradients to zero.
    assert table.loc[("FP32", 24), "mean"] == table.loc[("FP32", 0), "mean"]
    assert table.loc[("FP32", 24), "activation_share_zero"] == table.loc[("FP32", 0), "activation_share_zero"]
    assert table.loc[("Mixed", 24), "activation_share_zero"] > table.loc[("Mixed", 0), "activation_share_zero"] + 0.1
    (figure,) = (tmp_path / "report" / "figures").glob("shift_*.png")
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_time_to_result_table_keeps_the_metric_of_a_setup_without_an_image_size():
    from mpt.report import tables

    def row(precision, seed, seconds, ppl):
        return {
            "model": "biglstm_tiny",
            "device_name": "cpu",
            "data": "text_corpus",
            "schedule": "paper",
            "variant": None,
            "config.schedule.batch_size": 32,
            "config.schedule.image_size": math.nan,  # a language model's
            "mode": precision,
            "precision": precision,
            "scale": "none",
            "scale_value": math.nan,
            "precision_order": 0 if precision == "fp32" else 1,
            "scale_order": 0,
            "primary_metric": "ppl",
            "status": "ok",
            "seed": seed,
            "time_to_result_s": seconds,
            "metric_value": ppl,
        }

    runs = pd.DataFrame(
        [
            row("fp32", 0, 10.0, 140.0),
            row("fp32", 1, 12.0, 142.0),
            row("bf16", 0, 5.0, 141.0),
            row("bf16", 1, 7.0, 143.0),
        ]
    )
    table = tables.time_to_result(runs).set_index("precision")
    assert table.loc["bf16", "metric_mean"] == pytest.approx(142.0) and table.loc[
        "fp32", "metric_mean"
    ] == pytest.approx(141.0)
    assert table.loc["bf16", "ratio_to_fp32"] == pytest.approx(6.0 / 11.0)


def test_the_spread_of_values_near_a_floats_range_is_finite():
    """pandas' std squares the deviations and overflows for perplexities of 1e200: the table's
    spread is the same statistic, scaled, as statistics.stdev gives of the values divided down."""
    values = [1.5, 4.0, 2.25]
    assert sample_std(pd.Series([v * 1e200 for v in values])) / 1e200 == pytest.approx(
        statistics.stdev(values), rel=1e-12
    )
    assert sample_std(pd.Series(values)) == pytest.approx(statistics.stdev(values), rel=1e-12)
    assert sample_std(pd.Series([3.0, 3.0])) == 0.0 and math.isnan(sample_std(pd.Series([3.0])))
