"""Checkpoints: a run stopped part-way and rebuilt from its folder ends bitwise where an
uninterrupted run ends (in this process), and so does a real SIGKILL of the command line."""

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

from .conftest import ROOT, TINY, build_run, events, mpt_run, read_record

DETERMINISTIC_FIELDS = [
    "status",
    "steps",
    "samples",
    "epochs",
    "metrics",
    "final_train_loss",
    "last_finite_train_loss",
    "loss_scale",
    "choices",
    "config",
]


class Killed(BaseException):
    """Stands in for a kill: raised inside a step, it skips everything the run would do on an error."""


def stop_at(job, step: int) -> None:
    """Make `job` die as it starts step `step`, as a kill there would leave its folder."""
    losses = job.task.train_losses

    def dies(batch):
        if job.step == step:
            raise Killed
        return losses(batch)

    job.task.train_losses = dies


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
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpt.runner.cli", *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        log = run_dir / "metrics.jsonl"
        if (run_dir / checkpoint.FILENAME).exists() and log.exists() and len(logged_steps(log)) >= after_rows:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    return proc.wait()


# The image cases have 12 training samples, so 3 batches an epoch: the stop lands mid-epoch after an
# epoch boundary. MobileNetV3 has dropout, so fp32 also needs the random stream restored.
# The language model also carries its LSTM state between batches (buffers) and draws its negatives
# from the random stream; GNMT draws length-bucketed batches.
SMALL_LM = [
    "model.hidden_size=32",
    "model.proj_size=8",
    "model.num_sampled=64",
    "model.bptt=5",
    "data.train_samples=12",
]
SMALL_NMT = [
    "model.hidden_size=16",
    "model.encoder_layers=2",
    "model.decoder_layers=2",
    "data.train_samples=40",
    "model.beam_size=2",
]
# Gradient histograms sampled before and after the stop accumulate into the same counts.
GRAD_STATS = ["stats.grad_hist=true", "stats.every=3"]
# The GAN has two engines and draws its latents from the random stream.
SMALL_GAN = ["model.ngf=4", "model.ndf=4", "model.sample_grid=4", "data.train_samples=12", "data.val_samples=4"]


def resume_args(model: str, precision: str, scale: str, extra: list[str]) -> list[str]:
    return [
        f"model={model}",
        f"precision={precision}",
        f"scale={scale}",
        "scale.interval=2",
        *extra,
        "schedule=smoke",
        "schedule.steps=8",
        "schedule.checkpoint_every=2",
        "schedule.log_every=1",
        "schedule.eval_every=3",
        "deterministic=true",
        "device=cpu",
    ]


def assert_resumed_as_uninterrupted(reference: Path, resumed: Path) -> None:
    ref, res = read_record(reference), read_record(resumed)
    for field in DETERMINISTIC_FIELDS:
        assert res[field] == ref[field], field
    if ref["grad_stats"]:
        assert ref["grad_stats"]["sampled_steps"] == [2, 5]
        for key in ("sampled_steps", "loss_scales", "networks"):
            assert res["grad_stats"][key] == ref["grad_stats"][key], key
    assert log_rows(resumed) == log_rows(reference)  # every step's loss, lr, scale and overflow, every evaluation
    assert res.get("sample_grids") == ref.get("sample_grids")  # a generative task's pictures, by step
    # TensorBoard's view: what the killed run logged past its checkpoint is purged, each step shows once.
    ref_board, res_board = events(reference), events(resumed)
    tags = [t for t in ref_board.Tags()["scalars"] if not t.startswith("throughput/")]
    assert "train/loss" in tags or "train/loss/generator" in tags
    for tag in tags:
        assert [(e.step, e.value) for e in res_board.Scalars(tag)] == [
            (e.step, e.value) for e in ref_board.Scalars(tag)
        ], tag
    for grid in ref.get("sample_grids") or []:
        assert (resumed / grid["path"]).read_bytes() == (reference / grid["path"]).read_bytes()
    assert [r["step"] for r in log_rows(reference) if r["kind"] == "eval"] == [3, 6, 8]
    a, b = checkpoint.load(reference), checkpoint.load(resumed)
    assert tensors_equal(a["engines"], b["engines"])  # weights, masters, momentum, schedule, scaler
    assert a["step"] == b["step"] == 8


@pytest.mark.parametrize(
    "model,precision,scale,extra",
    [("mobilenet_v3_small", "fp32", "none", ["data.train_samples=12"]),
     ("mobilenet_v3_small", "mixed", "dynamic", ["data.train_samples=12"]),
     ("mobilenet_v3_small", "fp16_modmom", "static", ["data.train_samples=12"]),
     # delayed scaling's amax histories and scales are state: a history of 3 steps wraps before the stop
     # (slow-tier: FP8 emulation makes it 10x fp32's run; test_quantized_products checks the state's round trip)
     pytest.param("mobilenet_v3_small", "fp8_delayed", "none",
                  ["data.train_samples=12", "precision.products.amax_history=3"], marks=pytest.mark.slow),
     ("biglstm_tiny", "mixed", "auto", SMALL_LM),
     ("gnmt", "mixed", "dynamic", SMALL_NMT), ("dcgan64", "mixed", "dynamic", [*SMALL_GAN, *GRAD_STATS]),
     # the scale on the device: two engines read back at each flush, and sampled steps at once
     ("dcgan64", "mixed", "dynamic", [*SMALL_GAN, *GRAD_STATS, "optim.implementation=fused", "scale.on_device=true"])],
)  # fmt: skip
def test_a_stopped_and_rebuilt_run_matches_an_uninterrupted_one(tmp_path, in_process, model, precision, scale, extra):
    args = resume_args(model, precision, scale, extra)
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert build_run(reference, *args).execute().status == "ok"

    job = build_run(stopped, *args)
    stop_at(job, 5)  # after the checkpoint at step 4 and one step more, which the log has
    with pytest.raises(Killed):
        job.execute()
    assert read_record(stopped)["status"] == "running"  # a killed run never claims ok
    assert {r["step"] for r in log_rows(stopped) if r["kind"] == "train"} == set(range(5))
    del job

    job = build_run(stopped, *args)
    assert job.step == 4 and job.record.resumed_from_step == 4
    assert job.execute().status == "ok"
    assert_resumed_as_uninterrupted(reference, stopped)


@pytest.mark.slow  # over 20 s on 2 cores: the fast tier's budget
def test_a_run_killed_with_sigkill_and_relaunched_matches_an_uninterrupted_one(tmp_path):
    """The command line itself, killed by the kernel wherever it is after a checkpoint."""
    args = resume_args("mobilenet_v3_small", "mixed", "dynamic", ["data.train_samples=12"])
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    r = mpt_run(*args, f"hydra.run.dir={reference}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]

    assert kill_after_checkpoint(args, killed, after_rows=5) == -signal.SIGKILL
    assert read_record(killed)["status"] == "running"
    r = mpt_run(*args, f"hydra.run.dir={killed}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mpt-run: resuming from the checkpoint at step" in r.stdout
    assert read_record(killed)["resumed_from_step"] in (4, 6)  # mid-epoch, or at an epoch boundary
    assert_resumed_as_uninterrupted(reference, killed)


def test_resume_false_starts_over(tmp_path, in_process):
    args = [TINY, "schedule=smoke", "schedule.steps=2", "checkpoint=true"]
    build_run(tmp_path, *args).execute()
    again = build_run(tmp_path, *args)
    assert again.step == 2 and again.record.resumed_from_step == 2
    fresh = build_run(tmp_path, *args, "resume=false")
    assert fresh.step == 0 and fresh.record.resumed_from_step is None
    assert not (tmp_path / checkpoint.FILENAME).exists()  # it cannot be resumed later, by mistake
    (aside,) = stale_checkpoints(tmp_path)  # nor is it lost: moved aside, whole
    assert torch.load(aside, weights_only=True)["step"] == 2
    assert fresh.execute().status == "ok" and checkpoint.load(tmp_path)["step"] == 2


def stale_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob(checkpoint.FILENAME + checkpoint.STALE + "*"))


def test_only_force_discards_a_checkpoint_and_says_so(tmp_path, in_process, capsys):
    args = [TINY, "schedule=smoke", "schedule.steps=2", "checkpoint=true"]
    build_run(tmp_path, *args).execute()
    fresh = build_run(tmp_path, *args, "force=true")
    assert fresh.step == 0 and not (tmp_path / checkpoint.FILENAME).exists() and not stale_checkpoints(tmp_path)
    assert f"mpt-run: force=true: discarded {tmp_path / checkpoint.FILENAME}; starting over" in capsys.readouterr().out


def test_a_checkpoint_of_another_config_is_moved_aside_naming_what_differs(tmp_path, in_process, capsys):
    args = [TINY, "schedule=smoke", "schedule.steps=2", "checkpoint=true"]
    build_run(tmp_path, *args).execute()
    other = build_run(tmp_path, *args, "optim.lr=0.5")
    assert other.step == 0
    (aside,) = stale_checkpoints(tmp_path)
    out = capsys.readouterr().out
    assert (
        f"the checkpoint is of a different config (optim.lr): moved the checkpoint aside to {aside.name}; starting over"
        in out
    )
    # Twice in one second: the second set-aside does not overwrite the first.
    assert other.execute().status == "ok"
    build_run(tmp_path, *args)
    assert len(stale_checkpoints(tmp_path)) == 2


def test_a_longer_schedule_resumes_and_extends_the_run_as_if_it_had_been_that_long(tmp_path, in_process, capsys):
    args = [TINY, "schedule=smoke", "schedule.log_every=1", "deterministic=true", "device=cpu", "checkpoint=true"]
    short = tmp_path / "short"
    assert build_run(short, *args, "schedule.steps=3").execute().status == "ok"
    longer = build_run(short, *args, "schedule.steps=6")
    assert (
        longer.step == 3
        and "resuming from the checkpoint at step 3 of 6, extending the run from 3 steps" in capsys.readouterr().out
    )
    rec = longer.execute()
    assert rec.status == "ok" and rec.steps == 6 and not stale_checkpoints(short)
    assert [(s["from_step"], s["to_step"], s["total_steps"]) for s in rec.segments] == [(0, 3, 3), (3, 6, 6)]
    whole = tmp_path / "whole"
    build_run(whole, *args, "schedule.steps=6").execute()
    train = [[r for r in log_rows(d) if r["kind"] == "train"] for d in (short, whole)]
    assert [(r["step"], r["loss"]) for r in train[0]] == [(r["step"], r["loss"]) for r in train[1]]
    # A schedule that ends before the checkpoint does not continue it: set aside, not lost.
    assert build_run(short, *args, "schedule.steps=4").step == 0 and len(stale_checkpoints(short)) == 1


def test_a_schedule_ending_at_the_checkpoint_or_counted_in_epochs_does_not_resume_it(tmp_path, in_process, capsys):
    args = [TINY, "schedule=smoke", "schedule.checkpoint_every=2"]
    job = build_run(tmp_path, *args, "schedule.steps=6")
    stop_at(job, 5)
    with pytest.raises(Killed):
        job.execute()
    # Ends exactly at the checkpoint: nothing of it to run, not even its last evaluation.
    assert build_run(tmp_path, *args, "schedule.steps=4").step == 0 and len(stale_checkpoints(tmp_path)) == 1
    assert "the checkpoint is at step 4, not before this schedule's end at step 4" in capsys.readouterr().out
    assert build_run(tmp_path, *args, "schedule.steps=4").execute().status == "ok"
    # Counted in epochs, its milestones and evaluations would count in another unit.
    assert (
        build_run(tmp_path, *args, "schedule.steps=null", "schedule.epochs=2").step == 0
        and len(stale_checkpoints(tmp_path)) == 2
    )
    assert "different config (schedule.steps, schedule.epochs)" in capsys.readouterr().out


def test_a_resumed_launch_killed_before_its_own_checkpoint_leaves_a_record_naming_the_one_it_resumed(
    tmp_path, in_process
):
    args = [TINY, "schedule=smoke", "schedule.steps=8", "schedule.checkpoint_every=4"]
    first = build_run(tmp_path, *args)
    stop_at(first, 5)
    with pytest.raises(Killed):
        first.execute()
    second = build_run(tmp_path, *args)
    stop_at(second, 6)
    with pytest.raises(Killed):
        second.execute()
    rec = read_record(tmp_path)
    assert rec["status"] == "running" and rec["steps"] == rec["checkpoint_step"] == 4 and rec["samples"] == 4 * 4


def test_a_run_resumes_across_a_commit_and_an_uncommitted_change_naming_both(tmp_path, in_process, monkeypatch, capsys):
    from mpt import provenance

    args = [TINY, "schedule=smoke", "schedule.steps=4", "schedule.checkpoint_every=2"]
    codes = iter([{"commit": "a" * 40, "dirty": False}, {"commit": "b" * 40, "dirty": True}])
    monkeypatch.setattr(provenance, "code_identity", lambda: code)  # read when a record starts
    code = next(codes)
    first = build_run(tmp_path, *args)
    stop_at(first, 3)
    with pytest.raises(Killed):
        first.execute()
    code = next(codes)
    resumed = build_run(tmp_path, *args)
    warning = (
        "mpt-run: warning: the checkpoint was written by commit aaaaaaaaaaaa;"
        " this is commit bbbbbbbbbbbb (with uncommitted changes)"
    )
    assert resumed.step == 2 and warning in capsys.readouterr().out
    rec = resumed.execute()
    assert rec.status == "ok" and rec.git == code and rec.resumed_from_step == 2
    assert [(s["from_step"], s["to_step"], s["git"]["commit"][0]) for s in rec.segments] == [(0, 2, "a"), (2, 4, "b")]


def test_the_record_follows_each_checkpoint(tmp_path, in_process):
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=8", "schedule.checkpoint_every=3")
    stop_at(job, 7)
    with pytest.raises(Killed):
        job.execute()
    rec = read_record(tmp_path)  # what a kill at step 7 leaves: the record says what a relaunch keeps
    assert rec["status"] == "running" and rec["steps"] == rec["checkpoint_step"] == 6 and rec["samples"] == 6 * 4


def test_a_moved_data_root_with_the_same_files_resumes_and_other_files_do_not(tmp_path, in_process):
    import shutil

    from .test_imagefolder import make_folder

    root = make_folder(tmp_path / "images", per_class=4, size=32)
    args = [
        TINY,
        "data=imagefolder",
        "data.num_workers=0",
        "schedule=smoke",
        "schedule.batch_size=4",
        "schedule.steps=2",
        "checkpoint=true",
    ]
    run_dir = tmp_path / "run"
    build_run(run_dir, *args, f"data.root={root}").execute()
    moved = shutil.copytree(root, tmp_path / "elsewhere")
    shutil.rmtree(root)
    assert build_run(run_dir, *args, f"data.root={moved}").step == 2 and not stale_checkpoints(run_dir)
    image = next(p for p in moved.rglob("*") if p.is_file())
    (image.parent / f"copy{image.suffix}").write_bytes(image.read_bytes())  # one more image: another dataset
    assert build_run(run_dir, *args, f"data.root={moved}").step == 0 and len(stale_checkpoints(run_dir)) == 1


def test_an_unreadable_checkpoint_is_an_error_record(tmp_path, in_process):
    args = [TINY, "schedule=smoke", "schedule.steps=2", "checkpoint=true"]
    build_run(tmp_path, *args).execute()
    record = tmp_path / "result.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "status": "running"}))  # as if killed
    (tmp_path / checkpoint.FILENAME).write_bytes(b"not a checkpoint")
    r = mpt_run(*args, f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert r.returncode == 1
    rec = read_record(tmp_path)
    assert rec["status"] == "error" and "\n" not in rec["message"] and rec["choices"]["model"] == "mobilenet_v3_small"
    assert rec["message"].startswith(f"CorruptCheckpoint: {tmp_path / checkpoint.FILENAME} cannot be read (")
    assert rec["message"].endswith("); resume=false starts the run over")
    assert r.stderr.strip().splitlines()[-1] == f"mpt-run: error: {rec['message']}"
    assert build_run(tmp_path, *args, "resume=false").execute().status == "ok"  # what the message says to do


def a_checkpoint(step: int, w: torch.Tensor) -> dict:
    """The smallest dict with a checkpoint's shape (checkpoint.REQUIRED)."""
    return {"config": {}, "step": step, "engines": {"model": {"w": w}}, "rng": checkpoint.rng_state(), "data": {}}


def test_a_kill_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, a_checkpoint(1, torch.ones(3)))

    def dies_midway(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt  # stands in for the kill

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, a_checkpoint(2, torch.zeros(3)))
    saved = checkpoint.load(tmp_path)
    assert saved["step"] == 1 and torch.equal(saved["engines"]["model"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILENAME]


class RunsCode:
    """What a planted checkpoint carries: unpickling it would call os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_checkpoint_is_refused_in_one_line_with_nothing_run(tmp_path):
    marker = tmp_path / "ran"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save({**a_checkpoint(1, torch.ones(1)), "payload": RunsCode(marker)}, run_dir / checkpoint.FILENAME)
    r = mpt_run(TINY, "schedule=smoke", "schedule.steps=2", "checkpoint=true", f"hydra.run.dir={run_dir}", cwd=ROOT)
    assert r.returncode == 1 and not marker.exists()
    path = run_dir / checkpoint.FILENAME
    line = (
        f"mpt-run: error: UnsafeCheckpoint: {path} would call posix.system when read,"
        " which no mpt checkpoint does: refused, nothing in it was run"
    )
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(line) and "Traceback" not in r.stdout
    assert read_record(run_dir)["status"] == "error" and path.exists()  # kept, for whoever looks into it


def test_numpys_generator_round_trips_through_a_weights_only_checkpoint(tmp_path):
    import numpy as np

    np.random.seed(7)
    np.random.standard_normal()  # a cached Gaussian is part of the state too
    checkpoint.save(tmp_path, a_checkpoint(1, torch.ones(1)))
    expected = np.random.standard_normal(5)
    np.random.seed(0)
    checkpoint.set_rng_state(checkpoint.load(tmp_path)["rng"])
    assert np.random.standard_normal(5).tolist() == expected.tolist()


def test_a_checkpoint_written_before_weights_only_loading_still_resumes(tmp_path):
    """Older checkpoints held numpy's state as an array: read with exactly numpy's array globals."""
    import numpy as np

    state = a_checkpoint(1, torch.ones(1))
    state["rng"]["numpy"] = np.random.get_state()
    torch.save(state, tmp_path / checkpoint.FILENAME)
    expected = np.random.standard_normal(3)
    checkpoint.set_rng_state(checkpoint.load(tmp_path)["rng"])
    assert np.random.standard_normal(3).tolist() == expected.tolist()


@pytest.mark.parametrize(
    "content", [{"weights": torch.ones(2)}, [1, 2], {**a_checkpoint(1, torch.ones(1)), "config": "x"}]
)
def test_a_torch_file_that_is_not_a_checkpoint_is_one_line(tmp_path, content):
    torch.save(content, tmp_path / checkpoint.FILENAME)
    with pytest.raises(checkpoint.CorruptCheckpoint) as e:
        checkpoint.load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / checkpoint.FILENAME} ") and "not an mpt checkpoint" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_smoke_run_writes_no_checkpoint_unless_asked_and_sets_an_old_one_aside(tmp_path, in_process, capsys):
    """schedule=smoke checks a set-up: no checkpoint (AlexNet's is 570 MB), unless checkpoint=true or
    schedule.checkpoint_every asks for one; a checkpoint already there is moved aside, not resumed."""
    args = [TINY, "schedule=smoke", "schedule.steps=2"]
    assert build_run(tmp_path / "plain", *args).execute().status == "ok"
    assert not (tmp_path / "plain" / checkpoint.FILENAME).exists()
    assert "checkpoint_step" not in read_record(tmp_path / "plain")
    for asked in ["checkpoint=true", "schedule.checkpoint_every=2"]:
        build_run(tmp_path / asked, *args, asked).execute()
        assert checkpoint.load(tmp_path / asked)["step"] == 2
    again = build_run(tmp_path / "checkpoint=true", *args, "force=true", "schedule.steps=3")
    assert again.step == 0
    again = build_run(
        tmp_path / "schedule.checkpoint_every=2", *args, "schedule.checkpoint_every=2", "schedule.steps=3"
    )
    assert again.step == 2  # asked for: resumed
    plain = build_run(tmp_path / "schedule.checkpoint_every=2", *args, "schedule.steps=3")
    assert plain.step == 0 and "a smoke run writes no checkpoint: moved the checkpoint aside" in capsys.readouterr().out
