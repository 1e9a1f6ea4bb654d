"""The command line end to end, and every precision x scale combination's record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import ROOT, TINY, build_run, mpt_run, process_settings_kept, read_record

PRECISIONS = ["fp32", "fp16", "mixed", "fp16_modmom", "amp", "bf16", "tf32"]
SCALES = ["none", "static", "dynamic"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """All 21 combinations, one after another in this process, as `mpt-run -m` runs a sweep: a run
    must not inherit an earlier one's settings. In process, since what is checked is each Run's
    record; a multirun's own start-up and its Hydra compositions cost more than the runs (the command
    line's sweeps are test_report's, its single run test_summary_is_printed)."""
    out = tmp_path_factory.mktemp("sweep")
    with process_settings_kept():
        for precision in PRECISIONS:
            for scale in SCALES:
                build_run(
                    out / f"{precision}_{scale}",
                    TINY,
                    f"precision={precision}",
                    f"scale={scale}",
                    "schedule=smoke",
                    "checkpoint=false",
                ).execute()
    runs = {}
    for record in out.glob("*/result.json"):
        rec = json.loads(record.read_text())
        runs[(rec["choices"]["precision"], rec["choices"]["scale"])] = record.parent
    return runs


def test_every_combination_leaves_a_record(sweep):
    assert set(sweep) == {(p, s) for p in PRECISIONS for s in SCALES}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("scale", SCALES)
def test_record_is_complete(sweep, precision, scale):
    run_dir = sweep[(precision, scale)]
    rec = read_record(run_dir)
    assert rec["status"] == "ok", rec["message"]
    assert rec["choices"] == {
        "model": "mobilenet_v3_small",
        "precision": precision,
        "scale": scale,
        "data": "synthetic",
        "schedule": "smoke",
    }
    assert rec["steps"] == rec["total_steps"] == 3
    assert 0 <= rec["metrics"]["top1"] <= 1 and rec["metrics"]["step"] == 3
    assert (
        rec["throughput"]["unit"] == "images/s"
        and rec["throughput"]["pipeline"] > 0
        and rec["throughput"]["compute"] > 0
    )
    assert rec["memory"]["peak_bytes"] > 0 and rec["memory"]["kind"] == "cpu_peak_rss"
    assert 0 < rec["memory"]["steady_peak_bytes"] <= rec["memory"]["peak_bytes"]
    assert rec["environment"]["torch"] and rec["environment"]["device_type"] == "cpu"
    assert rec["config"]["precision"]["name"] == precision and rec["config"]["seed"] == 0
    scale_summary = rec["loss_scale"]["model"]
    assert scale_summary["steps"] == 3
    expected_fp32_math = "tf32" if precision == "tf32" else "ieee"
    assert set(rec["precision"]["fp32_math"].values()) == {expected_fp32_math}

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [0, 1, 2]
    assert [r["scale"] for r in train] == pytest.approx(
        {"none": [1.0] * 3, "static": [1000.0] * 3}.get(scale, [r["scale"] for r in train])
    )
    if scale == "none":
        assert all(r["overflow"] is None for r in train)  # scale=none does not check
    else:
        assert scale_summary["skipped_steps"] == sum(r["overflow"] for r in train)
    assert [r["kind"] for r in rows].count("eval") == 1


def test_summary_is_printed(tmp_path):
    r = mpt_run(TINY, "schedule=smoke", "precision=mixed", "scale=dynamic", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    for text in [
        "mpt-run mobilenet_v3_small precision=mixed scale=dynamic",
        "metrics:",
        "throughput:",
        "memory:",
        "loss scale:",
        str(tmp_path / "result.json"),
    ]:
        assert text in r.stdout
    assert read_record(tmp_path)["status"] == "ok"


@pytest.mark.slow
def test_a_sweep_runs_through_submitits_local_launcher(tmp_path):
    """hydra/launcher=submitit_local runs each run of the sweep as its own job process, as
    hydra/launcher=slurm does on a cluster; the records are the same kind."""
    sweep = tmp_path / "runs"
    r = mpt_run(
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        TINY,
        "precision=fp32,mixed",
        "schedule=smoke",
        "schedule.steps=1",
        "checkpoint=false",
        f"hydra.sweep.dir={sweep}",
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    recs = {read_record(p.parent)["choices"]["precision"]: read_record(p.parent) for p in sweep.rglob("result.json")}
    assert set(recs) == {"fp32", "mixed"} and all(rec["status"] == "ok" for rec in recs.values())
    finished_jobs = [
        d for d in (sweep / ".submitit").iterdir() if list(d.glob("*_result.pkl"))
    ]  # submitit's, one per job
    assert len(finished_jobs) == 2


def test_the_slurm_launcher_config_composes_with_its_defaults():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=8"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.tasks_per_node, launcher.timeout_min) == (
        "gpu",
        8,
        1,
        4320,
    )


def test_help_shows_the_commands_and_every_user_facing_option_not_hydras_stock_page():
    r = mpt_run("--help", cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mpt-run model=resnet50 precision=mixed scale=dynamic" in r.stdout and "mpt-run -m " in r.stdout
    assert "powered by Hydra" not in r.stdout and "schema" not in r.stdout
    for group in ("model", "precision", "scale", "data", "schedule", "experiment"):
        line = next(line for line in r.stdout.splitlines() if line.startswith(group + " "))
        assert line.split(": ", 1)[1].split(", ") == sorted(
            p.stem for p in (ROOT / "configs" / group).glob("*.yaml")
        ), group


def test_the_summary_tells_the_scale_search_from_later_overflows():
    from mpt.precision.scaler import DynamicScaler, StaticScaler
    from mpt.runner.cli import explain_skips

    dynamic = DynamicScaler(init=2.0**16, interval=2000, growth=2.0, backoff=0.5, min=1.0, max=2.0**24)
    for overflow in [True, True, True, False, False, True, False]:
        dynamic.update(overflow)
    s = dynamic.summary()
    assert (s["initial"], s["final"], s["skipped_steps"], s["initial_skips"], s["steps"]) == (65536, 4096, 4, 3, 7)
    assert explain_skips(s) == (
        ": the first 3, the scale falling from 65536 until the gradients fit FP16;"
        " 1 later, each an overflow at the scale of its step"
    )

    static = StaticScaler(1000.0)
    for overflow in [True, False, True, True]:
        static.update(overflow)
    assert explain_skips(static.summary()) == (
        ": the first 1, until the gradients fit FP16 at this scale; 2 later, each an overflow at the scale of its step"
    )
    clean = StaticScaler(1000.0)
    clean.update(False)
    assert clean.summary()["initial_skips"] == 0 and explain_skips(clean.summary()) == ""
    older = {
        k: v for k, v in s.items() if k not in ("initial", "initial_skips")
    }  # a record from before they were counted
    assert explain_skips(older) == ""
    never = StaticScaler(1e9)  # every step skipped: nothing fitted, so nothing says it did
    for _ in range(8):
        never.update(True)
    assert explain_skips(never.summary()) == ": every one; the gradients never fit FP16 at 1e+09"
    falling = DynamicScaler(init=2.0**16, interval=2000, growth=2.0, backoff=0.5, min=1.0, max=2.0**24)
    for _ in range(3):
        falling.update(True)
    assert (
        explain_skips(falling.summary())
        == ": every one; the gradients never fit FP16, the scale falling from 65536 to 8192"
    )


@pytest.mark.parametrize("keep", [True, False])
def test_the_summary_gives_the_checkpoints_size_and_says_a_cpus_arithmetic_is_emulated(tmp_path, in_process, keep):
    from mpt.runner.cli import summary_lines

    args = [TINY, "data=synthetic", "schedule=smoke", "device=cpu", f"checkpoint={str(keep).lower()}"]
    rec = build_run(tmp_path, *args).execute()
    lines = summary_lines(rec)
    saved = tmp_path / "checkpoint.pt"
    written = [line for line in lines if line.startswith("  checkpoint: ")]
    assert written == ([f"  checkpoint: {saved.stat().st_size / 2**20:.0f} MiB at step 3 ({saved})"] if keep else [])
    throughput = next(x for x in lines if "throughput:" in x)
    assert throughput.endswith("windows; a CPU's, in FP32)")  # nothing emulated
    rec.precision = {**rec.precision, "name": "mixed"}
    throughput = next(x for x in summary_lines(rec) if "throughput:" in x)
    assert throughput.endswith("windows; a CPU's: its low-precision arithmetic emulated)")
