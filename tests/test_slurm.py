"""Ranks from SLURM: a process's place in an srun step (distributed.from_env), the first host of
SLURM's host list, and one run on 2 CPU processes (gloo) started two ways without a cluster: as the
2 tasks of a step (the variables srun and hydra-submitit-launcher's jobs give, set by the test), and
by scripts/slurm/multinode.sbatch run twice as two "nodes" of one machine, each a torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpt.config import ConfigError
from mpt.distributed import Dist, LaunchError, default_port, first_host, from_env, rendezvous
from mpt.runner.process import resolve_device

from .conftest import ROOT, mpt_run, read_record
from .test_distributed import ALEXNET, train_losses

SBATCH = ROOT / "scripts" / "slurm" / "multinode.sbatch"

# Task 1 of a 2-task srun step on two nodes (what srun sets, trimmed to what mpt reads).
STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[003-004]",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "gpu[003-004]",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}
# A batch script's (or an salloc shell's) variables: a job of 8 tasks, but no step, one process.
BATCH = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[003-004]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


def test_torchruns_variables_place_the_process_and_win_over_slurms():
    assert from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == Dist(3, 8, 1, "torchrun")
    # torchrun started by srun (scripts/slurm/multinode.sbatch): its processes inherit the step's variables
    assert from_env({**STEP, "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}) == Dist(0, 4, 0, "torchrun")
    assert from_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) == Dist()  # one process
    assert from_env({}) == Dist() and Dist().launcher is None


def test_a_task_of_an_srun_step_is_a_rank_and_finds_rank_0():
    assert from_env(STEP) == Dist(1, 2, 0, "slurm")
    assert from_env({**STEP, "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}) == Dist(
        5, 8, 1, "slurm"
    )
    # env:// needs MASTER_ADDR and MASTER_PORT: the step's first node, and a port of the job's own
    assert rendezvous(STEP) == {"MASTER_ADDR": "gpu003", "MASTER_PORT": str(20000 + 4242)}
    assert default_port(123456789) == 20000 + 123456789 % 20000 < 40000
    given = {**STEP, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}
    assert rendezvous(given) == {}
    no_step_list = {k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}
    assert rendezvous(no_step_list)["MASTER_ADDR"] == "gpu003"  # the job's list


def test_a_batch_script_or_an_salloc_shell_stays_one_process():
    assert from_env(BATCH) == Dist()
    # a step of one task (srun -n1, salloc's interactive step) is one process too
    assert from_env({**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}) == Dist()


def _without(env: dict, key: str) -> dict:
    return {k: v for k, v in env.items() if k != key}


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one': expected a whole number"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2: not a rank of WORLD_SIZE=2 processes (0 to 1)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0: expected at least 1"),
        ({**STEP, "SLURM_PROCID": "2"}, "SLURM_PROCID=2: not a rank of SLURM_STEP_NUM_TASKS=2 processes (0 to 1)"),
        ({**STEP, "SLURM_STEP_NUM_TASKS": "2(x2)"}, "SLURM_STEP_NUM_TASKS='2(x2)': expected a whole number"),
        ({**STEP, "SLURM_LOCALID": "-1"}, "SLURM_LOCALID=-1: not a local rank of SLURM_STEP_NUM_TASKS=2 processes"),
        (_without(STEP, "SLURM_PROCID"), "SLURM_PROCID is not set"),
        (
            {**STEP, "SLURM_STEP_NODELIST": "gpu[003-"},
            "'gpu[003-': not a SLURM host list such as gpu[003-005,010],cpu7",
        ),
        (
            _without(STEP, "SLURM_JOB_ID"),
            "SLURM_JOB_ID is not set: set MASTER_PORT to a free port on the host of rank 0",
        ),
        ({**STEP, "MASTER_PORT": "http"}, "MASTER_PORT='http': expected a whole number"),
    ],
)
def test_bad_launch_variables_are_one_line(env, message):
    with pytest.raises(LaunchError) as e:
        from_env(env)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("localhost", "localhost"),
        ("gpu[003-005,010],cpu7", "gpu003"),
        ("node7,node1", "node7"),
        ("gpu[010,003-005]", "gpu010"),  # the list's order, not sorted
        ("rack[1-2]-n[08-09]", "rack1-n08"),
        ("n-01.cluster.org", "n-01.cluster.org"),
    ],
)
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", ",gpu1", "gpu[003", "gpu[]", "gpu[a-b]", "gpu 1", "gpu]"])
def test_a_host_list_that_is_not_one_is_one_line(nodelist):
    with pytest.raises(LaunchError, match="not a SLURM host list"):
        first_host(nodelist)


def test_mpt_run_says_a_bad_launch_variable_in_one_line_before_anything_starts(tmp_path):
    env = {**STEP, "SLURM_PROCID": "7"}
    r = mpt_run("schedule=smoke", f"hydra.run.dir={tmp_path}", cwd=ROOT, env=env)
    assert r.returncode == 2
    assert r.stderr == "mpt-run: error: SLURM_PROCID=7: not a rank of SLURM_STEP_NUM_TASKS=2 processes (0 to 1)\n"
    assert not list(tmp_path.iterdir())


def test_each_task_takes_its_local_ranks_gpu_or_the_one_it_was_given(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", Dist(5, 8, 1, "slurm")) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="process 5 of its node sees 4 GPUs"):
        resolve_device("cuda", Dist(5, 8, 5, "slurm"))
    # --gpus-per-task=1 (or --gpu-bind): each task sees its own GPU only, as cuda:0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto", Dist(3, 4, 3, "slurm")) == torch.device("cuda", 0)


# --- Multi-process runs (gloo) ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict:
    """The test's environment without any launcher's variables (a test may run under SLURM itself),
    with these set; mpt importable from this checkout wherever the command runs."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """ALEXNET on 1 process, the reference both ways of starting 2 must follow."""
    run = tmp_path_factory.mktemp("one")
    r = mpt_run(*ALEXNET, "device=cpu", f"hydra.run.dir={run}", cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stderr[-2000:]
    return run


def finish(procs: list[subprocess.Popen], timeout: int = 600) -> list[tuple[int, str, str]]:
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_two_tasks_of_an_srun_step_are_one_run(one_process, tmp_path):
    """2 plain processes (no torchrun) with the variables srun gives the tasks of a 2-task step on
    one node: one run, its folder named for 2 processes, one lock and one record, held and written
    by rank 0, and the losses of 1 process with the same global batch."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        task = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "MASTER_PORT": port}
        env = clean_env(**{**STEP, "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost", **task})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "mpt.runner.cli", *ALEXNET, "device=cpu"],
                cwd=tmp_path,  # the default folder, results/runs/<run> here: its name counts the processes
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = finish(procs)
    for code, _out, err in results:
        assert code == 0, err[-3000:]
    (run,) = (tmp_path / "results" / "runs").iterdir()
    assert "_cpux2_seed0_" in run.name
    assert results[0][1].count("mpt-run alexnet") == 1 and "mpt-run alexnet" not in results[1][1]  # rank 0's summary
    rec = read_record(run)
    assert rec["status"] == "ok"
    assert rec["distributed"]["world_size"] == 2 and rec["distributed"]["launcher"] == "slurm"
    assert rec["distributed"]["backend"] == "gloo" and rec["distributed"]["per_process_batch_size"] == 4
    a, b = train_losses(one_process), train_losses(run)
    assert len(a) == len(b) == 6 and a[0] != a[-1]
    assert b == pytest.approx(a, rel=1e-5)  # as tests/test_distributed.py's torchrun run: the sums' order differs
    assert rec["samples"] == read_record(one_process)["samples"]


@pytest.mark.slow
def test_the_sbatch_script_runs_one_run_on_two_local_nodes(one_process, tmp_path):
    """scripts/slurm/multinode.sbatch twice, as the two tasks srun would start on two nodes, each
    running the script's own torchrun line (SRUN= runs it directly), with the variables a 2-node job
    gives and one process per "node": the two torchruns meet in the c10d rendezvous on localhost,
    and make one run of 2 processes that follows 1 process."""
    run = tmp_path / "run"
    env = clean_env(
        SLURM_JOB_ID="4243",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NNODES="2",
        GPUS_PER_NODE="1",
        RDZV_PORT=str(free_port()),
        SRUN="",
        PYTHON=sys.executable,
        TORCHRUN=f"{sys.executable} -m torch.distributed.run",
    )
    procs = [
        subprocess.Popen(
            ["bash", str(SBATCH), *ALEXNET, "device=cpu", f"hydra.run.dir={run}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = finish(procs)
    for code, out, err in results:
        assert code == 0, (out + err)[-3000:]
        assert "2 nodes x 1, rendezvous at localhost:" in out
    assert sum(out.count("mpt-run alexnet") for _, out, _ in results) == 1  # one summary: rank 0's
    rec = read_record(run)
    assert rec["status"] == "ok"
    assert rec["distributed"]["world_size"] == 2 and rec["distributed"]["launcher"] == "torchrun"
    assert train_losses(run) == pytest.approx(train_losses(one_process), rel=1e-5)


FAKE_TORCHRUN = """
import pathlib, signal, sys, time
log = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    log.write_text(log.read_text() + "SIGTERM\\n")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
log.write_text(" ".join(sys.argv[2:]) + "\\n")
time.sleep(120)
"""


def test_the_sbatch_script_stops_the_ranks_then_requeues_before_the_time_limit(tmp_path):
    """SLURM's USR1 to the batch shell (--signal=B:USR1@300): the script sends SIGTERM to its step
    (here torchrun itself, a stand-in that logs), waits for it to end, then asks SLURM to requeue
    the job (a stand-in scontrol on PATH)."""
    import signal
    import time

    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/scontrol.args\n')
    scontrol.chmod(0o755)
    (tmp_path / "torchrun.py").write_text(FAKE_TORCHRUN)
    log = tmp_path / "torchrun.log"
    env = clean_env(
        SLURM_JOB_ID="4244",
        SLURM_JOB_NODELIST="gpu[007-008]",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="8",
        SRUN="",
        PYTHON=sys.executable,
        TORCHRUN=f"{sys.executable} {tmp_path / 'torchrun.py'} {log}",
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
    )
    proc = subprocess.Popen(
        ["bash", str(SBATCH), "model=alexnet"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 60
        while not log.exists() and time.time() < deadline:
            time.sleep(0.05)
        torchrun_line = log.read_text().split()
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert torchrun_line == [
        "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv_id=4244",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu007:29500",
        "-m",
        "mpt.runner.cli",
        "model=alexnet",
    ]
    assert log.read_text().endswith("SIGTERM\n")  # the step was stopped (mpt-run checkpoints on it)
    requeued = tmp_path / "scontrol.args"
    assert requeued.read_text() == "requeue 4244\n"
    assert requeued.stat().st_mtime_ns >= log.stat().st_mtime_ns  # after the step ended
    assert "requeueing job 4244" in out
