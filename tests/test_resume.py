"""Checkpoints: a run killed with SIGKILL and resumed ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mpt.runner import checkpoint

from .conftest import ROOT, read_record, run_cli

DETERMINISTIC_FIELDS = ["status", "steps", "samples", "epochs", "metrics", "final_train_loss", "last_finite_train_loss", "loss_scale", "choices", "config"]


def log_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def logged_steps(log: Path) -> set[int]:
    """The training steps in the log so far (a GAN logs two rows a step; the last line may be half written)."""
    steps = set()
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == "train":
            steps.add(row["step"])
    return steps


def kill_after_checkpoint(args: list[str], run_dir: Path, after_rows: int) -> int:
    """Start the run, SIGKILL it once a checkpoint exists and `after_rows` steps are logged."""
    proc = subprocess.Popen([sys.executable, "-m", "mpt.runner.cli", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        log = run_dir / "metrics.jsonl"
        if (run_dir / checkpoint.FILENAME).exists() and log.exists() and len(logged_steps(log)) >= after_rows:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    return proc.wait()


# AlexNet has dropout, so the fp32 case also needs the random stream restored; 12 training samples
# make 3 batches an epoch, so the kill lands mid-epoch after an epoch boundary.
# The language model also carries its LSTM state between batches (buffers) and draws its negatives
# from the random stream; GNMT draws length-bucketed batches.
SMALL_LM = ["model.hidden_size=32", "model.proj_size=8", "model.num_sampled=64", "model.bptt=5", "data.train_samples=12"]
SMALL_NMT = ["model.hidden_size=16", "model.encoder_layers=2", "model.decoder_layers=2", "data.train_samples=40", "model.beam_size=2"]
# Gradient histograms sampled before and after the kill accumulate into the same counts.
GRAD_STATS = ["stats.grad_hist=true", "stats.every=3"]
# The GAN has two engines and draws its latents from the random stream.
SMALL_GAN = ["model.ngf=4", "model.ndf=4", "model.sample_grid=4", "data.train_samples=12", "data.val_samples=4"]


@pytest.mark.parametrize(
    "model,precision,scale,extra",
    [("alexnet", "fp32", "none", ["data.train_samples=12"]), ("resnet50", "mixed", "dynamic", ["data.train_samples=12"]),
     ("resnet50", "fp16_modmom", "static", ["data.train_samples=12"]), ("biglstm_tiny", "mixed", "auto", SMALL_LM),
     ("gnmt", "mixed", "dynamic", SMALL_NMT), ("dcgan64", "mixed", "dynamic", [*SMALL_GAN, *GRAD_STATS])],
)  # fmt: skip
def test_killed_and_resumed_run_matches_an_uninterrupted_one(tmp_path, model, precision, scale, extra):
    args = [f"model={model}", f"precision={precision}", f"scale={scale}", "scale.interval=2", *extra,
            "schedule=smoke", "schedule.steps=8",
            "schedule.checkpoint_every=2", "schedule.log_every=1", "schedule.eval_every=3", "deterministic=true"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    r = run_cli(*args, f"hydra.run.dir={reference}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]

    assert kill_after_checkpoint(args, killed, after_rows=5) == -signal.SIGKILL
    assert read_record(killed)["status"] == "running"  # a killed run never claims ok
    r = run_cli(*args, f"hydra.run.dir={killed}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mpt-run: resuming from the checkpoint at step" in r.stdout

    ref, res = read_record(reference), read_record(killed)
    assert res["resumed_from_step"] in (4, 6)  # (images: mid-epoch, or at an epoch boundary, 3 batches an epoch)
    for field in DETERMINISTIC_FIELDS:
        assert res[field] == ref[field], field
    if ref["grad_stats"]:
        assert ref["grad_stats"]["sampled_steps"] == [2, 5]
        for key in ("sampled_steps", "loss_scales", "networks"):
            assert res["grad_stats"][key] == ref["grad_stats"][key], key
    assert log_rows(killed) == log_rows(reference)  # every step's loss, lr, scale and overflow, every evaluation
    assert res.get("sample_grids") == ref.get("sample_grids")  # a generative task's pictures, by step
    for grid in ref.get("sample_grids") or []:
        assert (killed / grid["path"]).read_bytes() == (reference / grid["path"]).read_bytes()
    assert [r["step"] for r in log_rows(reference) if r["kind"] == "eval"] == [3, 6, 8]
    a, b = checkpoint.load(reference), checkpoint.load(killed)
    assert tensors_equal(a["engines"], b["engines"])  # weights, masters, momentum, schedule, scaler
    assert a["step"] == b["step"] == 8


def test_resume_false_starts_over(tmp_path):
    args = ["schedule=smoke", "schedule.steps=2", f"hydra.run.dir={tmp_path}"]
    assert run_cli(*args, cwd=ROOT).returncode == 0
    record = tmp_path / "result.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "status": "error"}))  # as if it had failed
    r = run_cli(*args, cwd=ROOT)
    assert "resuming from the checkpoint at step 2" in r.stdout and read_record(tmp_path)["resumed_from_step"] == 2
    record.write_text(json.dumps({**json.loads(record.read_text()), "status": "error"}))
    written = (tmp_path / checkpoint.FILENAME).stat().st_mtime_ns  # a resume at the last step trains nothing, so writes nothing
    r = run_cli(*args, "resume=false", cwd=ROOT)
    assert "resuming" not in r.stdout and "resumed_from_step" not in read_record(tmp_path)
    assert (tmp_path / checkpoint.FILENAME).stat().st_mtime_ns != written  # trained again from step 0


def test_an_unreadable_checkpoint_is_an_error_record(tmp_path):
    args = ["schedule=smoke", "schedule.steps=2", f"hydra.run.dir={tmp_path}"]
    assert run_cli(*args, cwd=ROOT).returncode == 0
    record = tmp_path / "result.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "status": "running"}))  # as if killed
    (tmp_path / checkpoint.FILENAME).write_bytes(b"not a checkpoint")
    r = run_cli(*args, cwd=ROOT)
    assert r.returncode == 1
    rec = read_record(tmp_path)
    assert rec["status"] == "error" and "\n" not in rec["message"] and rec["choices"]["model"] == "resnet50"
    assert r.stderr.strip().splitlines()[-1] == f"mpt-run: error: {rec['message']}"


def test_a_kill_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, {"step": 1, "w": torch.ones(3)})

    def dies_midway(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt  # stands in for the kill

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, {"step": 2, "w": torch.zeros(3)})
    saved = checkpoint.load(tmp_path)
    assert saved["step"] == 1 and torch.equal(saved["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILENAME]
