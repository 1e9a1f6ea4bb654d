"""torchrun data parallelism on CPU processes (gloo): the loss curve of 2 processes against 1
process with the same global batch, and an overflow on one rank only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import ROOT, TINY, mpt_run, read_record

INJECT = Path(__file__).parent / "distributed_inject"


def torchrun(*args: str, nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "mpt.runner.cli",
        *args,
    ]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def processes_naming(marker: str) -> list[int]:
    """The processes whose command line contains `marker` (Linux's /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="ignore"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


def kill_processes_naming(marker: str) -> None:
    import signal

    for pid in processes_naming(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_and_two_processes(args: list[str], tmp_path: Path) -> tuple[Path, Path]:
    """The same config run by 1 process and by torchrun with 2: their run folders."""
    one, two = tmp_path / "one", tmp_path / "two"
    r = mpt_run(*args, f"hydra.run.dir={one}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    r = torchrun(*args, f"hydra.run.dir={two}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("mpt-run ") == 1  # one summary, from rank 0
    return one, two


def train_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


# AlexNet without dropout (whose masks depend on how a batch is split) and without batch-norm
# (whose statistics do): 2 processes on halves of each global batch compute what 1 process does.
ALEXNET = [
    "model=alexnet",
    "model.dropout=0",
    "schedule=smoke",
    "schedule.steps=6",
    "schedule.batch_size=8",
    "data.train_samples=32",
    "optim.lr=0.02",
    "optim.lr_batch=null",
    "checkpoint=false",
]


@pytest.mark.slow
def test_two_processes_follow_one_process_with_the_same_global_batch_and_fp16_all_reduce_stays_close(tmp_path):
    one, two = one_and_two_processes(ALEXNET, tmp_path)
    a, b = train_losses(one), train_losses(two)
    assert len(a) == len(b) == 6 and a[0] != a[-1]
    # Stated tolerance: the order of the gradient sums differs (two halves, then all-reduce).
    assert b == pytest.approx(a, rel=1e-5)
    rec1, rec2 = read_record(one), read_record(two)
    assert rec2["distributed"] == {
        "world_size": 2,
        "backend": "gloo",
        "launcher": "torchrun",
        "global_batch_size": 8,
        "per_process_batch_size": 4,
        "allreduce_dtype": "the gradients' own",
        "sync_batchnorm": False,
        "gradient_as_bucket_view": True,
        "broadcast_buffers": False,
        "static_graph": False,
        "evaluation": "sharded",
    }
    assert rec1["distributed"]["world_size"] == 1
    assert rec2["samples"] == rec1["samples"] == 48
    assert (
        rec2["throughput"]["processes"] == 2
        and rec2["throughput"]["pipeline"] > rec2["throughput"]["pipeline_per_process"]
    )
    assert rec2["metrics"]["val_loss"] == pytest.approx(rec1["metrics"]["val_loss"], rel=1e-5)

    # Gradients all-reduced in FP16 (a communication hook): close, and not the same.
    fp16 = tmp_path / "fp16"
    r = torchrun(*ALEXNET, "precision.allreduce_dtype=float16", f"hydra.run.dir={fp16}")
    assert r.returncode == 0, r.stderr[-3000:]
    c = train_losses(fp16)
    assert c[0] == b[0] and c[1:] != b[1:]  # the same first forward; FP16 sums change the updates after it
    assert c == pytest.approx(b, rel=1e-3)
    assert read_record(fp16)["distributed"]["allreduce_dtype"] == "float16"


@pytest.mark.slow  # over 20 s on 2 cores: the fast tier's budget
def test_an_overflow_on_one_rank_is_skipped_by_every_rank(tmp_path):
    """mixed + dynamic, an infinite loss injected into rank 1's second backward only: both ranks
    skip that step, halve the scale, and end with identical weights, masters and scaler."""
    out = tmp_path / "states"
    out.mkdir()
    run_dir = tmp_path / "run"
    r = torchrun(
        *ALEXNET,
        "precision=mixed",
        "scale=dynamic",
        "scale.init=1024",
        f"hydra.run.dir={run_dir}",
        env={"PYTHONPATH": os.pathsep.join([str(INJECT), os.environ.get("PYTHONPATH", "")]), "MPT_TEST_OUT": str(out)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert [row["overflow"] for row in rows] == [False, True, False, False, False, False]
    assert [row["scale"] for row in rows] == [1024, 1024, 512, 512, 512, 512]
    assert read_record(run_dir)["loss_scale"]["model"]["skipped_steps"] == 1
    s0, s1 = (torch.load(out / f"rank{i}.pt", weights_only=False)["model"] for i in (0, 1))
    assert s0["scaler"] == s1["scaler"]
    # Both ranks left without finalizing their interpreters (distributed.leave): gloo's worker
    # threads, alive after destroy_process_group, could otherwise abort them (SIGABRT).
    assert not list(out.glob("finalized_rank*"))
    assert all(torch.equal(s0["model"][k], s1["model"][k]) for k in s0["model"])
    assert all(torch.equal(m0, m1) for m0, m1 in zip(s0["masters"], s1["masters"])) and len(s0["masters"]) > 0


@pytest.mark.slow
def test_a_global_batch_that_does_not_divide_is_one_line(tmp_path):
    r = torchrun("schedule=smoke", "schedule.batch_size=5", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0
    assert "mpt-run: error: schedule.batch_size=5 is the global batch: it does not divide among 2 processes" in r.stderr


@pytest.mark.slow
def test_synchronized_batch_norm_on_cpu_processes_is_one_line(tmp_path):
    r = torchrun("schedule=smoke", "distributed.sync_batchnorm=true", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0
    assert "mpt-run: error: distributed.sync_batchnorm=true: torch's SyncBatchNorm runs on CUDA only" in r.stderr


LM = [
    "model=biglstm_tiny",
    "model.hidden_size=32",
    "model.proj_size=8",
    "model.num_sampled=64",
    "model.bptt=5",
    "data.train_samples=40",
    "schedule=smoke",
]


@pytest.mark.slow
@pytest.mark.parametrize("model", [
    [*ALEXNET, "schedule.steps=8"],
    # Each rank's LSTM state: the checkpoint gathers the global batch's, each rank takes its rows back.
    [*LM, "schedule.steps=8", "precision=mixed", "model.dropout=0.1"],
], ids=["alexnet", "biglstm"])  # fmt: skip
def test_a_killed_two_process_run_resumes_from_rank_0s_checkpoint(tmp_path, model):
    """Rank 0 writes the checkpoint, every rank reads it: killed after a checkpoint and relaunched,
    the run's log and final weights equal an uninterrupted one's."""
    import time

    from mpt.runner import checkpoint

    args = [
        *model,
        "scale=dynamic",
        "scale.init=1024",
        "scale.interval=2",
        "checkpoint=true",
        "schedule.checkpoint_every=2",
        "schedule.log_every=1",
        "deterministic=true",
    ]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    r = torchrun(*args, f"hydra.run.dir={reference}")
    assert r.returncode == 0, r.stderr[-3000:]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "mpt.runner.cli",
        *args,
        f"hydra.run.dir={killed}",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        log = killed / "metrics.jsonl"
        if (killed / checkpoint.FILENAME).exists() and log.exists() and log.read_text().count('"train"') >= 5:
            kill_processes_naming(
                f"hydra.run.dir={killed}"
            )  # the launcher and both ranks (torchrun puts them in their own groups)
            break
        time.sleep(0.02)
    proc.wait()
    time.sleep(1)
    assert not processes_naming(f"hydra.run.dir={killed}")
    assert read_record(killed)["status"] == "running"
    r = torchrun(*args, f"hydra.run.dir={killed}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from the checkpoint at step" in r.stdout
    ref, res = read_record(reference), read_record(killed)
    assert res["resumed_from_step"] in (4, 6) and res["status"] == "ok"
    assert train_losses(killed) == train_losses(reference) and res["loss_scale"] == ref["loss_scale"]
    a, b = checkpoint.load(reference), checkpoint.load(killed)
    assert all(
        torch.equal(a["engines"]["model"]["model"][k], b["engines"]["model"]["model"][k])
        for k in a["engines"]["model"]["model"]
    )
    assert res["samples"] == ref["samples"]


@pytest.mark.slow
def test_a_preempted_two_process_run_stops_every_rank_at_one_step_and_resumes(tmp_path):
    """SIGTERM to torchrun, which passes it to both ranks: they agree on the step to stop at (the
    log's collective carries the flag), write one checkpoint and a `preempted` record, and the
    relaunched job ends as an uninterrupted one."""
    import signal
    import time

    args = [TINY, "schedule=smoke", "schedule.steps=30", "schedule.batch_size=8", "data.train_samples=32",
            "schedule.checkpoint_every=100", "schedule.log_every=1", "deterministic=true", "scale=dynamic",
            "precision=mixed"]  # fmt: skip
    reference, preempted = tmp_path / "reference", tmp_path / "preempted"
    r = torchrun(*args, f"hydra.run.dir={reference}")
    assert r.returncode == 0, r.stderr[-3000:]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "mpt.runner.cli",
        *args,
        f"hydra.run.dir={preempted}",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, deadline = preempted / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and not (log.exists() and log.read_text().count('"train"') >= 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    rec = read_record(preempted)
    assert rec["status"] == "preempted", err[-3000:]
    from mpt.runner import checkpoint

    assert checkpoint.load(preempted)["step"] == rec["steps"] == rec["preempted_at_step"] < 30
    assert "SIGABRT" not in err and "terminate called" not in err
    r = torchrun(*args, f"hydra.run.dir={preempted}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_record(preempted)["resumed_from_step"] == rec["steps"]
    assert train_losses(preempted) == train_losses(reference)


@pytest.mark.slow
def test_dcgan_on_two_processes_keeps_both_networks_identical_across_ranks(tmp_path):
    """Two networks, each in its own DDP wrapper and with its own scaler; the generator's loss goes
    through the discriminator itself (frozen), not its wrapper. An infinite loss on rank 1's second
    backward (the generator's, step 0) skips that generator step on both ranks and nothing else."""
    out = tmp_path / "states"
    out.mkdir()
    run_dir = tmp_path / "run"
    r = torchrun(
        "model=dcgan64",
        "model.ngf=4",
        "model.ndf=4",
        "model.sample_grid=4",
        "data.train_samples=16",
        "data.val_samples=4",
        "schedule=smoke",
        "schedule.steps=4",
        "precision=mixed",
        "scale=dynamic",
        "scale.init=1024",
        "checkpoint=false",
        f"hydra.run.dir={run_dir}",
        env={"PYTHONPATH": os.pathsep.join([str(INJECT), os.environ.get("PYTHONPATH", "")]), "MPT_TEST_OUT": str(out)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert [(row["group"], row["overflow"]) for row in rows[:2]] == [("discriminator", False), ("generator", True)]
    rec = read_record(run_dir)
    assert (
        rec["loss_scale"]["generator"]["skipped_steps"] == 1
        and rec["loss_scale"]["discriminator"]["skipped_steps"] == 0
    )
    assert len(rec["sample_grids"]) == 1 and (run_dir / rec["sample_grids"][0]["path"]).is_file()
    s0, s1 = (torch.load(out / f"rank{i}.pt", weights_only=False) for i in (0, 1))
    for net in ("generator", "discriminator"):
        assert s0[net]["scaler"] == s1[net]["scaler"]
        # Weights; batch-norm statistics are each rank's own between DDP's broadcasts from rank 0.
        weights = [k for k in s0[net]["model"] if "running_" not in k and "num_batches" not in k]
        assert len(weights) > 10 and all(torch.equal(s0[net]["model"][k], s1[net]["model"][k]) for k in weights), net


@pytest.mark.slow
def test_the_language_model_on_two_processes_follows_one_process(tmp_path):
    """bigLSTM carries each stream's LSTM state between batches in buffers: each rank keeps its own
    streams' (no buffer broadcast), and both draw the same sampled-softmax negatives, as one process does."""
    args = [
        "model=biglstm_tiny",
        "model.hidden_size=32",
        "model.proj_size=8",
        "model.num_sampled=64",
        "model.bptt=5",
        "model.dropout=0",
        "data.train_samples=40",
        "schedule=smoke",
        "schedule.steps=6",
        "checkpoint=false",
    ]
    one, two = one_and_two_processes(args, tmp_path)
    a, b = train_losses(one), train_losses(two)
    assert len(a) == 6 and b == pytest.approx(a, rel=1e-5)
    assert read_record(two)["metrics"]["ppl"] == pytest.approx(read_record(one)["metrics"]["ppl"], rel=1e-5)


@pytest.mark.slow
def test_gnmt_on_parallel_text_shares_rank_0s_tokenizer(tmp_path):
    from .conftest import shared_data

    root = shared_data("multi30k")
    run_dir = tmp_path / "run"
    r = torchrun(
        "model=gnmt",
        "model.hidden_size=16",
        "model.encoder_layers=2",
        "model.decoder_layers=2",
        "model.beam_size=1",
        "data=parallel_text",
        f"data.root={root}",
        "data.val_split=val",
        "data.vocab_size=500",
        "data.tokenizer_sentences=2000",
        "schedule=smoke",
        "schedule.batch_size=8",
        "schedule.steps=2",
        "schedule.eval_batches=1",
        "checkpoint=false",
        f"hydra.run.dir={run_dir}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rec = read_record(run_dir)
    assert rec["status"] == "ok" and rec["distributed"]["world_size"] == 2
    import hashlib

    assert hashlib.sha256((run_dir / "tokenizer.model").read_bytes()).hexdigest() == rec["data"]["tokenizer_sha256"]
