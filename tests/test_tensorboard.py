"""TensorBoard event files, read back with tensorboard's own reader: the same numbers as the record."""

from __future__ import annotations

import json

import pytest

from .conftest import TINY, build_run, events, read_record
from .test_resume import Killed, stop_at


def test_a_runs_event_files_hold_its_losses_scales_evaluations_and_gradient_histograms(tmp_path, in_process):
    job = build_run(
        tmp_path, TINY, "schedule=smoke", "schedule.steps=6", "schedule.log_every=2", "schedule.eval_every=3",
        "precision=mixed", "scale=dynamic", "stats.grad_hist=true", "stats.lost_updates=true", "stats.every=2",
        "checkpoint=false",
    )  # fmt: skip
    assert job.execute().status == "ok"
    rec = read_record(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if row["kind"] == "train"]
    acc = events(tmp_path)

    def scalars(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert scalars("train/loss") == [(row["step"], pytest.approx(row["loss"], rel=1e-6)) for row in train]
    assert scalars("train/loss_scale") == [(row["step"], row["scale"]) for row in train]
    assert scalars("train/lr") == [(row["step"], pytest.approx(row["lr"], rel=1e-6)) for row in train]
    assert [v for _, v in scalars("train/overflow")] == [float(row["overflow"]) for row in train]
    evals = [row for row in rows if row["kind"] == "eval"]
    assert scalars("eval/top1") == [(row["step"], pytest.approx(row["top1"], rel=1e-6)) for row in evals]
    assert acc.Scalars("eval/top1")[-1].value == pytest.approx(rec["metrics"]["top1"], rel=1e-6)
    unit = rec["throughput"]["unit"].replace("/", " per ")
    assert len(acc.Scalars(f"throughput/{unit}")) == rec["throughput"]["windows"]

    # Each sampled step's histogram of log2|g|: the record's counts of that step, zeros left out.
    for kind in ("activation", "weight"):
        steps = rec["grad_stats"]["networks"]["model"][kind]["steps"]
        hists = acc.Histograms(f"grad_log2/model/{kind}")
        assert [h.step for h in hists] == [s["step"] for s in steps] == rec["grad_stats"]["sampled_steps"]
        for h, s in zip(hists, steps):
            bins = {int(e): c for e, c in s["log2_bins"].items()}
            assert h.histogram_value.num == s["nonzero"] == sum(bins.values())
            assert list(h.histogram_value.bucket_limit) == [e + 1 for e in sorted(bins)]
            assert list(h.histogram_value.bucket) == [bins[e] for e in sorted(bins)]
        assert [e.value for e in acc.Scalars(f"grad_zero_share/model/{kind}")] == [
            pytest.approx(s["share_zero"]) for s in steps
        ]
    lost = rec["grad_stats"]["lost_updates"]["networks"]["model"]["steps"]
    assert scalars("lost_updates/model") == [(s["step"], pytest.approx(s["share_lost_fp16"], rel=1e-6)) for s in lost]


def test_logger_none_writes_no_event_file_and_a_bad_logger_is_named(tmp_path, in_process):
    from mpt.config import ConfigError

    assert build_run(tmp_path, TINY, "schedule=smoke", "logger=none", "checkpoint=false").execute().status == "ok"
    assert (tmp_path / "result.json").exists() and not list(tmp_path.glob("events.out.tfevents.*"))
    with pytest.raises(ConfigError, match="^logger=mlflow: expected one of tensorboard, csv, wandb, none"):
        build_run(tmp_path / "bad", TINY, "logger=mlflow")


def test_a_run_resumed_at_an_evaluation_shows_it_once_and_a_run_started_over_drops_the_old_events(tmp_path):
    args = [TINY, "data.train_samples=12", "schedule=smoke", "schedule.steps=6", "schedule.checkpoint_every=3",
            "schedule.eval_every=3", "schedule.log_every=1", "schedule.throughput_warmup=1",
            "schedule.throughput_window=1", "device=cpu"]  # fmt: skip
    job = build_run(tmp_path, *args)
    stop_at(job, 4)  # after the checkpoint and the evaluation at step 3, and one step more
    with pytest.raises(Killed):
        job.execute()
    job = build_run(tmp_path, *args)
    assert job.step == 3 and job.execute().status == "ok"
    acc = events(tmp_path)
    assert [e.step for e in acc.Scalars("eval/top1")] == [3, 6]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(6))
    rec = read_record(tmp_path)
    windows = acc.Scalars(f"throughput/{rec['throughput']['unit'].replace('/', ' per ')}")
    assert len(windows) == rec["throughput"]["windows"] and len({e.step for e in windows}) == len(windows)

    job = build_run(tmp_path, *args, "force=true", "resume=false")
    assert job.execute().status == "ok"
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert [e.step for e in events(tmp_path).Scalars("train/loss")] == list(range(6))


def test_a_failing_event_writer_warns_once_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full_disk)
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.log_every=1", "checkpoint=false", "device=cpu")
    assert job.execute().status == "ok"
    warnings = [line for line in capsys.readouterr().err.splitlines() if "TensorBoard event files" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]


def test_the_event_files_hold_the_config_the_hparams_and_a_gans_sample_grids(tmp_path, in_process):
    from .test_dcgan import TINY as GAN

    rec = build_run(tmp_path, "model=dcgan64", *GAN, "schedule.eval_every=2", "checkpoint=false").execute()
    assert rec.status == "ok", rec.message
    acc = events(tmp_path)
    assert "model:\n  name: dcgan64" in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    plugins = acc.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in plugins and "_hparams_/session_start_info" in plugins
    started = plugins["_hparams_/session_start_info"].decode("latin-1")
    assert "dcgan64" in started and "precision" in started
    grids = acc.Images("samples")
    assert [g.step for g in grids] == [g["step"] for g in rec.sample_grids]
    from PIL import Image

    with Image.open(tmp_path / rec.sample_grids[-1]["path"]) as drawn:
        assert (grids[-1].width, grids[-1].height) == drawn.size
