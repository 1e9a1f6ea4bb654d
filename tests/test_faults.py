"""Faults a long run meets: preemption (SIGTERM, submitit's signal), a second launch of the same run,
and a disk that fills up while a file is written. Nothing already written is lost."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpt import preemption
from mpt.runner import checkpoint
from mpt.runner.identity import folder_name
from mpt.runner.run_lock import AlreadyRunning, RunLock

from .conftest import ROOT, TINY, build_run, mpt_run, read_record
from .test_resume import assert_resumed_as_uninterrupted, log_rows, resume_args


@pytest.fixture
def signals():
    """What a test's runs noted of the preemption signals is forgotten after it."""
    preemption.reset()
    yield
    preemption.reset()


def signal_at(job, step: int, signum: int) -> None:
    """Deliver `signum` to this process while `job` runs step `step` (as SLURM would, mid-step), once:
    an overflowing step's traced re-run asks for its losses again, and a second signal stops at once."""
    losses = job.task.train_losses
    sent = []

    def signalled(batch):
        if job.step == step and not sent:
            sent.append(signum)
            signal.raise_signal(signum)
        return losses(batch)

    job.task.train_losses = signalled


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, pytest.param(signal.SIGUSR2, marks=pytest.mark.slow)], ids=["SIGTERM", "SIGUSR2"]
)  # SIGUSR2 takes SIGTERM's path
def test_a_preempted_run_checkpoints_its_step_and_resumes_as_if_uninterrupted(tmp_path, in_process, signals, signum):
    args = resume_args("mobilenet_v3_small", "mixed", "dynamic", ["data.train_samples=12"])
    reference, preempted = tmp_path / "reference", tmp_path / "preempted"
    assert build_run(reference, *args).execute().status == "ok"

    job = build_run(preempted, *args)
    signal_at(job, 5, signum)  # mid-step 5: the step finishes, then the run stops
    rec = job.execute()
    assert preemption.requested() == signum
    assert rec.status == "preempted" and rec.preempted_at_step == 6 and rec.steps == 6
    assert rec.message == (
        f"{signal.Signals(signum).name} at step 6: stopped after it, with a checkpoint at that step;"
        " run the same command again to resume"
    )
    assert read_record(preempted)["status"] == "preempted"
    assert checkpoint.load(preempted)["step"] == 6
    assert {r["step"] for r in log_rows(preempted) if r["kind"] == "train"} == set(range(6))

    preemption.reset()
    job = build_run(preempted, *args)
    assert job.record.resumed_from_step == 6
    assert job.execute().status == "ok"
    assert_resumed_as_uninterrupted(reference, preempted)


def test_preemption_between_checkpoints_writes_one(tmp_path, in_process, signals):
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=10", "schedule.checkpoint_every=4")
    signal_at(job, 2, signal.SIGTERM)
    assert job.execute().status == "preempted"
    assert checkpoint.load(tmp_path)["step"] == 3  # not a checkpoint step: written because of the signal


def test_without_checkpoints_a_preempted_run_says_it_starts_over(tmp_path, in_process, signals):
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=10", "checkpoint=false")
    signal_at(job, 2, signal.SIGTERM)
    rec = job.execute()
    assert (
        rec.status == "preempted"
        and "no checkpoint (checkpoint=false, or a smoke run): a relaunch starts over" in rec.message
    )
    assert not (tmp_path / checkpoint.FILENAME).exists()


def test_the_signal_goes_on_to_the_handler_before_ours(signals):
    """Under submitit, its own handler requeues the job (through hydra-submitit-launcher's checkpoint
    hook): after the record is written, the signal is handed to it, then the process exits."""
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        with preemption.catching():
            signal.raise_signal(signal.SIGUSR2)
            assert preemption.requested() == signal.SIGUSR2 and seen == []  # noted only: the step goes on
        assert signal.getsignal(signal.SIGUSR2) is not preemption._note  # outside training, the earlier handler again
        with pytest.raises(SystemExit) as exit_:
            preemption.hand_over()
        assert seen == [signal.SIGUSR2] and exit_.value.code == 128 + signal.SIGUSR2
        assert preemption.requested() is None
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_second_signal_does_at_once_what_it_would_have_done(signals):
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        with preemption.catching():
            signal.raise_signal(signal.SIGUSR2)
            assert seen == []
            signal.raise_signal(signal.SIGUSR2)  # asked again: no more waiting for the step
            assert seen == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_submitits_signal_is_handed_over_even_after_a_sigterm(signals):
    """SLURM may send SIGTERM and submitit's USR2 both: the USR2 handler is the one that requeues."""
    seen = []
    before = {
        sig: signal.signal(sig, lambda signum, frame: seen.append(signum)) for sig in (signal.SIGTERM, signal.SIGUSR2)
    }
    try:
        with preemption.catching():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGUSR2)  # another kind: noted too, not acted on
        assert preemption.requested() == signal.SIGUSR2 and seen == []
        with pytest.raises(SystemExit):
            preemption.hand_over()
        assert seen == [signal.SIGUSR2]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.slow  # a real process signalled mid-run; the in-process preemption test stays fast
def test_the_command_line_exits_with_the_signals_status_after_writing_the_record(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpt.runner.cli",
            TINY,
            "schedule=smoke",
            "schedule.steps=100000",
            "schedule.log_every=1",
            "checkpoint=true",  # a smoke run's are off by default
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log, deadline = tmp_path / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and not (log.exists() and '"train"' in log.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    rec = read_record(tmp_path)
    assert rec["status"] == "preempted" and checkpoint.load(tmp_path)["step"] == rec["steps"]
    assert "SIGTERM received: stopping after this step" in err and ": preempted" in out
    assert not (tmp_path / ".lock").read_text()  # released


@pytest.mark.slow
def test_a_sigterm_to_the_whole_job_spares_the_data_loader_workers(tmp_path):
    """SLURM signals every process of a job: the loader's worker processes ignore it, so the run
    still stops at a step with a checkpoint instead of failing on a dead worker."""
    from .test_imagefolder import make_folder

    root = make_folder(tmp_path / "images", per_class=8, size=32)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mpt.runner.cli", TINY, "data=imagefolder", f"data.root={root}",
                             "data.num_workers=2", "schedule=smoke", "schedule.batch_size=4", "schedule.steps=100000",
                             "schedule.log_every=1", "checkpoint=true", f"hydra.run.dir={run_dir}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    log, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and not (log.exists() and log.read_text().count('"train"') >= 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # the main process and its two workers
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    rec = read_record(run_dir)
    assert rec["status"] == "preempted", rec["message"]
    assert checkpoint.load(run_dir)["step"] == rec["steps"] >= 3


# --- a second launch of the same run -------------------------------------------------------------


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process holding the run folder's lock, as a twin launch that is running."""
    run_dir.mkdir(parents=True, exist_ok=True)
    code = (
        "import sys, time; from pathlib import Path; from mpt.runner.run_lock import RunLock;"
        " RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow  # three processes, one held at a barrier
def test_a_second_launch_of_a_running_run_says_so_and_the_sweep_moves_on(tmp_path):
    sweep = tmp_path / "runs"

    def folder(precision: str) -> Path:  # device=cpu: the name is the same anywhere
        return sweep / folder_name(
            ["mobilenet_v3_small", precision, "none", "synthetic", "smoke"], "cpu", 1, 0, "schedule.steps=1"
        )

    busy = folder("fp32")
    twin = hold_lock(busy)
    try:
        r = mpt_run(
            "-m",
            TINY,
            "precision=fp32,bf16",
            "schedule=smoke",
            "schedule.steps=1",
            "checkpoint=false",
            "device=cpu",
            f"hydra.sweep.dir={sweep}",
            cwd=ROOT,
        )
    finally:
        twin.kill()
        twin.wait()
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        f"mpt-run: {busy}: already running (pid {twin.pid} on host {os.uname().nodename}); skipped"
        in r.stderr.splitlines()
    )
    assert sorted(p.name for p in busy.iterdir()) == [".lock"]  # nothing written beside the twin's files
    assert read_record(folder("bf16"))["status"] == "ok"

    r = mpt_run(
        TINY,
        "precision=fp32",
        "schedule=smoke",
        "schedule.steps=1",
        "checkpoint=false",
        "device=cpu",
        f"hydra.run.dir='{busy}'",
        cwd=ROOT,
    )
    assert (
        r.returncode == 0 and f"taking over its lock from pid {twin.pid} on host" in r.stdout
    )  # the twin died holding it
    assert read_record(busy)["status"] == "ok"


def test_a_lock_is_exclusive_and_a_dead_holders_lock_is_taken_over(tmp_path):
    twin = hold_lock(tmp_path)
    with pytest.raises(AlreadyRunning, match=rf"^pid {twin.pid} on host "):
        RunLock(tmp_path).acquire()
    twin.send_signal(signal.SIGKILL)
    twin.wait()
    lock = RunLock(tmp_path)
    assert lock.acquire() == f"pid {twin.pid} on host {os.uname().nodename}"
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert RunLock(tmp_path).acquire() is None  # released cleanly: nobody to take over from


# --- a full disk ----------------------------------------------------------------------------------


class FullDisk:
    """A file on a disk that fills up after `room` more bytes: the write that crosses it writes what
    fits and raises ENOSPC, as write(2) does."""

    def __init__(self, f, room: int):
        self._f, self.room = f, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self._f.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def fills_the_disk(monkeypatch, name: str, room: int, after: int = 0) -> None:
    """From the `after`+1-th write of file `name` on, the disk holds `room` more bytes of it."""
    real, opened = os.fdopen, []

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith(f".{name}."):
            opened.append(1)
            if len(opened) > after:
                return FullDisk(f, room)
        return f

    monkeypatch.setattr(os, "fdopen", fdopen)


def test_a_checkpoint_that_fills_the_disk_leaves_the_previous_one_and_ends_the_run_as_an_error(
    tmp_path, in_process, monkeypatch
):
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=6", "schedule.checkpoint_every=2")
    fills_the_disk(
        monkeypatch, checkpoint.FILENAME, room=1_000_000, after=1
    )  # torch.save's own writer meets the full disk
    rec = job.execute()
    assert rec.status == "error"
    assert rec.message == f"WriteError: could not write {tmp_path / checkpoint.FILENAME}: No space left on device"
    assert read_record(tmp_path)["status"] == "error"
    monkeypatch.undo()
    assert checkpoint.load(tmp_path)["step"] == 2  # the previous checkpoint, whole
    assert (
        sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != ".lock") == []
    )  # no temporary left
    assert {r["step"] for r in log_rows(tmp_path) if r["kind"] == "train"} == set(range(4))


def test_a_record_that_cannot_be_written_leaves_the_previous_one_whole(tmp_path, in_process, monkeypatch, capsys):
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=2", "checkpoint=false")
    job.save_record()
    fills_the_disk(monkeypatch, "result.json", room=100)  # every later record: 100 bytes fit
    rec = job.execute()
    monkeypatch.undo()
    assert (
        rec.status == "error"
        and rec.message == f"WriteError: could not write {tmp_path / 'result.json'}: No space left on device"
    )
    assert read_record(tmp_path)["status"] == "running"  # the last record written, whole: a relaunch redoes the run
    assert (
        f"mpt-run: error: could not write {tmp_path / 'result.json'}: No space left on device"
        in capsys.readouterr().err
    )
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_log_that_fills_the_disk_ends_the_run_as_an_error_naming_it(tmp_path, in_process):
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=3", "schedule.log_every=1", "checkpoint=false")
    job.logbook.metrics._file.close()
    job.logbook.metrics._file = open(
        "/dev/full", "a"
    )  # every flush: No space left on device, and the close after it too
    rec = job.execute()
    assert rec.status == "error"
    assert rec.message == f"WriteError: could not write {tmp_path / 'metrics.jsonl'}: No space left on device"
    assert read_record(tmp_path)["status"] == "error"


# --- Ctrl-C ---------------------------------------------------------------------------------------


def test_ctrl_c_finishes_the_step_checkpoints_it_and_resumes(tmp_path, in_process, signals):
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=8", "schedule.checkpoint_every=4")
    signal_at(job, 5, signal.SIGINT)
    rec = job.execute()
    assert rec.status == "preempted" and rec.steps == 6 and checkpoint.load(tmp_path)["step"] == 6
    assert rec.message.startswith("SIGINT at step 6: stopped after it, with a checkpoint at that step")
    with pytest.raises(SystemExit) as exit_:  # no KeyboardInterrupt traceback after a clean stop
        preemption.hand_over()
    assert exit_.value.code == 128 + signal.SIGINT
    assert build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=8", "schedule.checkpoint_every=4").step == 6


def test_a_second_ctrl_c_stops_at_once_and_the_record_says_what_resumes(tmp_path, in_process, signals):
    job = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=10", "schedule.checkpoint_every=4")
    losses = job.task.train_losses

    def twice(batch):
        if job.step == 5:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        return losses(batch)

    job.task.train_losses = twice
    with pytest.raises(KeyboardInterrupt):
        job.execute()
    rec = read_record(tmp_path)
    assert rec["status"] == "preempted" and rec["steps"] == 5 and rec["checkpoint_step"] == 4
    assert rec["message"] == "SIGINT twice at step 5: stopped at once; the checkpoint at step 4 resumes"
    assert checkpoint.load(tmp_path)["step"] == 4


# --- a static scale that never fits ---------------------------------------------------------------


def test_a_static_scale_that_overflows_every_step_ends_the_run_as_diverged(tmp_path, in_process):
    args = [TINY, "precision=mixed", "scale=static", "schedule=smoke", "stats.trace_overflow=false"]
    rec = build_run(
        tmp_path / "k", *args, "scale.value=1e9", "schedule.steps=20", "scale.max_consecutive_skips=3"
    ).execute()
    assert rec.status == "diverged" and rec.diverged_at_step == 2 and rec.loss_scale["model"]["skipped_steps"] == 3
    assert (
        rec.message
        == "static scale 1e+09 overflowed every step for 3 steps; lower scale.value (scale.max_consecutive_skips=3)"
    )
    # Fewer steps than the limit, every one skipped: trained nothing, so not `ok` either.
    rec = build_run(tmp_path / "all", *args, "scale.value=1e9", "schedule.steps=2").execute()
    assert rec.status == "diverged" and rec.loss_scale["model"]["skipped_steps"] == rec.steps == 2
    assert rec.message == (
        "skipped every one of its 2 steps: the gradients overflowed FP16 at the static scale 1e+09; lower scale.value"
    )
    # The control: a scale that fits trains, and the same settings end `ok`.
    rec = build_run(tmp_path / "fits", *args, "scale.value=8", "schedule.steps=2").execute()
    assert rec.status == "ok" and rec.loss_scale["model"]["skipped_steps"] == 0


# --- a relaunch onto a full disk ------------------------------------------------------------------


def test_a_static_scale_that_keeps_overflowing_warns_once_before_its_limit(tmp_path, in_process, caplog):
    args = [TINY, "precision=mixed", "scale=static", "schedule=smoke", "stats.trace_overflow=false"]
    run = build_run(tmp_path, *args, "scale.value=1e9", "schedule.steps=6", "scale.warn_consecutive_skips=2")
    with caplog.at_level("WARNING", logger="mpt"):
        rec = run.execute()
    warned = [r.getMessage() for r in caplog.records if "overflowed every step for" in r.getMessage()]
    assert warned == [
        "static scale 1e+09 overflowed every step for 2 steps, each skipped; lower scale.value "
        "(the run ends as diverged at 100: scale.max_consecutive_skips)"
    ]
    assert rec.loss_scale["model"]["skipped_steps"] == 6  # warned, not stopped


def test_a_relaunch_that_cannot_write_its_folder_says_so_in_one_line(tmp_path):
    args = [TINY, "schedule=smoke", "schedule.steps=2", f"hydra.run.dir={tmp_path}"]
    assert mpt_run(*args, "schedule.steps=1", cwd=ROOT).returncode == 0
    before = (tmp_path / "result.json").read_bytes()
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").symlink_to("/dev/full")  # every write to the lock file fails, as on a full disk
    r = mpt_run(*args, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"mpt-run: error: could not write {tmp_path / '.lock'}: ") and line.endswith(
        "; the run folder's files are as they were"
    )
    assert (tmp_path / "result.json").read_bytes() == before


def test_an_ignored_sigint_stays_ignored_while_a_run_trains(signals):
    """A job started in the background of a script inherits an ignored SIGINT: the parent's Ctrl-C
    is not meant for it, and catching must not turn it into a preemption."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with preemption.catching():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is preemption._note  # the others are still caught
            signal.raise_signal(signal.SIGINT)
            assert preemption.requested() is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_resumed_static_scale_does_not_warn_again_for_the_skips_before_its_checkpoint():
    from mpt.precision.scaler import StaticScaler

    first = StaticScaler(1e9, max_consecutive_skips=100, warn_consecutive_skips=2)
    for _ in range(3):
        first.update(True)
    assert first.warned
    resumed = StaticScaler(1e9, max_consecutive_skips=100, warn_consecutive_skips=2)
    resumed.load_full_state_dict(first.full_state_dict())
    assert resumed.warned
    fresh = StaticScaler(1e9, max_consecutive_skips=100, warn_consecutive_skips=5)
    fresh.load_full_state_dict(first.full_state_dict())
    assert not fresh.warned  # 3 in a row: below its threshold
