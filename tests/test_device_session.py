"""The GPU's prepared calls, dry-run on the CPU: a lent GPU is never spent on set-up or a bug."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile

import pytest

from mpt.report.comparisons import comparisons
from mpt.report.records import load_runs

from .conftest import ROOT

GRID_CELLS = (
    13  # fp32, bf16; mixed unscaled and dynamic; amp; fp16 and fp16_modmom x unscaled, dynamic x FP16, FP32 batch-norm
)
SHIFT_CELLS = 6  # mixed unscaled and dynamic at k = 0, 12, 24


def dry_run(part: str, tmp_path, timeout: int, seeds: str | None = None) -> subprocess.CompletedProcess:
    """The part on this CPU, two steps a run, seeds 0 and 1 planned (`seeds` of them run, where given); its
    tarball under tmp_path/out."""
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "PLAN": "0,1",
        **({"SEEDS": seeds} if seeds else {}),
        "WORK": str(tmp_path / "work"),
        "OUT": str(tmp_path / "out"),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        ["bash", "scripts/device/device_session.sh", part],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_the_accuracy_call_runs_every_cell_seed_by_seed_and_its_report_compares_them(tmp_path):
    done = dry_run("accuracy", tmp_path, timeout=1800)
    # each run as it finished, in the order it ran: every cell's seed 0 before any cell's seed 1
    finished = re.findall(r"record: +\S+/accuracy/(grid|shift)/\S+_seed(\d)_\S+/result.json", done.stdout)
    grid = [int(seed) for part, seed in finished if part == "grid"]
    assert grid == [0] * GRID_CELLS + [1] * GRID_CELLS
    assert sorted(int(seed) for part, seed in finished if part == "shift") == [0] * SHIFT_CELLS + [1] * SHIFT_CELLS
    # what comes back: one tarball with every record, and no checkpoint
    with tarfile.open(tmp_path / "out" / "accuracy.tar.gz") as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "back", filter="data")
    assert sum(n.endswith("result.json") for n in names) == 2 * (GRID_CELLS + SHIFT_CELLS) and not any(
        n.endswith(".pt") for n in names
    )
    records = [json.loads(p.read_text()) for p in (tmp_path / "back").rglob("result.json")]
    assert all(r["config"]["data"]["resident"] for r in records)
    # what the speed goal is read from; a run that did not end ok reached no result to time
    finished = [r for r in records if r["status"] == "ok"]
    assert finished and all(r["time_to_result"]["seconds"] > 0 for r in finished)
    assert all(r["time_to_result"]["seconds"] is None for r in records if r["status"] != "ok")
    assert {tuple(r["config"]["experiment"]["seeds"]) for r in records} == {(0, 1)}
    table = comparisons(load_runs([tmp_path / "back"]))
    assert set(table.experiment) == {"cifar10_airbench", "cifar10_airbench_shift"}
    assert "incomplete" not in set(table.finding) and (table.n + table.diverged).max() == 2


LM_CELLS = 5  # fp32, bf16; mixed unscaled, 128, dynamic
MT_CELLS = 10  # SGD: fp32, bf16, mixed unscaled and dynamic, fp16 unscaled and static;
#                Adam: fp32, bf16, mixed unscaled and dynamic


@pytest.mark.slow
def test_the_sequences_call_runs_both_settings_seed_by_seed_then_the_long_run(tmp_path):
    done = dry_run("sequences", tmp_path, timeout=2400)
    finished = re.findall(r"record: +\S+/sequences/(lm|mt|long)/\S+_seed(\d)_\S+/result.json", done.stdout)
    order = [(part, int(seed)) for part, seed in finished]
    per_seed = [("lm", 0)] * LM_CELLS + [("mt", 0)] * MT_CELLS + [("lm", 1)] * LM_CELLS + [("mt", 1)] * MT_CELLS
    assert order == per_seed + [("long", 0)]
    with tarfile.open(tmp_path / "out" / "sequences.tar.gz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    (long,) = (tmp_path / "back" / "sequences" / "long").rglob("result.json")
    record = json.loads(long.read_text())
    assert record["status"] == "ok" and record["config"]["scale"]["name"] == "none" and record["grad_stats"]
    table = comparisons(load_runs([tmp_path / "back"]))
    assert set(table.experiment) == {"ptb_biglstm", "multi30k_gnmt", "multi30k_gnmt_adam"}
    assert "incomplete" not in set(table.finding)


@pytest.mark.slow
def test_the_speed_call_runs_each_goals_rows_and_their_baselines(tmp_path):
    dry_run("speed", tmp_path, timeout=1800)
    with tarfile.open(tmp_path / "out" / "speed.tar.gz") as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "back", filter="data")
    assert not any(n.endswith(".pt") for n in names)
    rows = set()
    for path in (tmp_path / "back").rglob("result.json"):
        r = json.loads(path.read_text())
        c = r["config"]
        choices, cell = r["choices"], c["precision"]["products"]["fused_cell"]
        rows.add(
            (
                choices["model"],
                choices["precision"],
                choices["scale"],
                c["data"].get("decode"),
                c["compile"]["backend"],
                c["scale"]["on_device"],
                cell,
            )
        )
        if r["loss_scale"]:  # a CPU keeps the scale on the host unless told: the GPU default is null's other side
            assert not any(s["on_device"] for s in r["loss_scale"].values())
        assert r["throughput"]["windows"] >= 1  # every row has its figure
        assert c["compile"]["backend"] is None or "frames" in r["compile"]
    cells = {  # the dry run's small LSTM models stand in for GNMT's and bigLSTM's
        *((m, p, "none", None, None, None, None) for m in ("gnmt_small", "biglstm_tiny") for p in ("bf16", "fp8")),
        *((m, "fp8", "none", None, None, None, "aot_eager") for m in ("gnmt_small", "biglstm_tiny")),  # the fused cell
        ("resnet50", "amp", "none", None, None, None, None),  # the baseline of BF16's and compile's rows
        *(
            ("resnet50", "amp", s, None, None, d, None) for s in ("none", "dynamic") for d in (None, False)
        ),  # the scaler's
        ("resnet50", "bf16", "none", None, None, None, None),
        ("dcgan", "amp", "none", None, None, None, None),
        ("dcgan", "bf16", "none", None, None, None, None),
        ("resnet50", "amp", "none", None, "aot_eager", None, None),
        ("resnet50", "bf16", "none", None, "aot_eager", None, None),
        ("resnet50", "amp", "none", "host", None, None, None),
        ("resnet50", "amp", "none", "device", None, None, None),
    }
    assert rows == cells
    # the profiles: every cell of speed_norm, speed_fp8_lstm and _fused, its table and trace
    profiles = {
        p.parent.relative_to(tmp_path / "back" / "speed" / "speed" / "profile").as_posix()
        for p in (tmp_path / "back").rglob("profile.json")
    }
    assert profiles == {
        *(f"speed_norm/{m}_{p}" for m in ("resnet50", "dcgan") for p in ("amp", "bf16")),
        *(f"speed_fp8_lstm/{m}_{p}" for m in ("gnmt_small", "biglstm_tiny") for p in ("bf16", "fp8")),
        *(f"speed_fp8_lstm_fused/{m}_fp8" for m in ("gnmt_small", "biglstm_tiny")),
    }
    fp8 = json.loads(next((tmp_path / "back").rglob("speed_fp8_lstm/biglstm_tiny_fp8/profile.json")).read_text())
    assert fp8["labelled_per_step"]["mpt.weight_operand lstm.hh_l0"] == 1  # once per pass, not per time step
    norm = json.loads(next((tmp_path / "back").rglob("speed_norm/resnet50_bf16/profile.json")).read_text())
    assert (
        sum(norm["batch_norm_backends"]["layers"].values()) == 53
    )  # every batch-norm layer of ResNet-50 says which backend it took


@pytest.mark.slow
def test_the_gpt_call_runs_its_four_modes_seed_by_seed_and_its_report_compares_them(tmp_path):
    done = dry_run("gpt", tmp_path, timeout=1200, seeds="0")  # one seed of the two planned: the CI's time
    finished = re.findall(r"record: +\S+/gpt/gpt/gpt2_tiny_(\w+?)_none_\S+_seed(\d)_\S+/result.json", done.stdout)
    assert finished == [(mode, "0") for mode in ("fp32", "bf16", "fp8", "mxfp8")]
    with tarfile.open(tmp_path / "out" / "gpt.tar.gz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    table = comparisons(load_runs([tmp_path / "back"]))
    # seed 1, planned, has not run: no verdict yet
    assert set(table.experiment) == {"ptb_gpt"} and len(table) == 3 and set(table.finding) == {"incomplete"}
