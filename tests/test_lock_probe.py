"""run_lock.held: a probe from another process tells a run folder whose process lives from one
whose process was killed, without disturbing the holder."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpt.runner import run_lock
from mpt.runner.run_lock import AlreadyRunning, RunLock, held

# A process that takes the folder's lock as a run does, says so, and sleeps until it is killed.
HOLDER = """
import sys, time
from pathlib import Path
from mpt.runner.run_lock import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(120)
"""


def hold(run_dir: Path) -> subprocess.Popen:
    """A child process holding `run_dir`'s lock (returns once it holds it)."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def probe_elsewhere(run_dir: Path) -> str:
    """held() as another process sees it."""
    code = "import sys; from pathlib import Path; from mpt.runner.run_lock import held; print(held(Path(sys.argv[1])))"
    done = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.parametrize("platform", ["linux", "other"])
def test_a_killed_holder_no_longer_holds_the_lock(tmp_path, monkeypatch, platform):
    child = hold(tmp_path)
    try:
        if platform == "other":  # struct flock differs: a momentary shared lock instead of F_GETLK
            monkeypatch.setattr(run_lock.sys, "platform", "darwin")
        assert held(tmp_path) is True
        assert held(tmp_path) is True  # probing did not take the lock or drop the holder's
        with pytest.raises(AlreadyRunning, match=f"pid {child.pid} "):
            RunLock(tmp_path).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert held(tmp_path) is False


def test_a_folder_nobody_locked_is_not_held(tmp_path):
    assert held(tmp_path) is False  # no .lock at all
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
    assert held(tmp_path) is False


def test_the_holder_may_not_probe_its_own_lock(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        # Its own lock never conflicts, and closing the probe's descriptor would drop it.
        with pytest.raises(RuntimeError, match="this process has the lock file open"):
            held(tmp_path)
        assert probe_elsewhere(tmp_path) == "True"  # still held
    finally:
        lock.release()
    assert probe_elsewhere(tmp_path) == "False"


def test_a_file_system_without_locks_cannot_tell(tmp_path, monkeypatch):
    (tmp_path / ".lock").touch()

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")  # as an NFS mount without a lock daemon answers

    monkeypatch.setattr(run_lock.sys, "platform", "linux")
    monkeypatch.setattr(run_lock.fcntl, "fcntl", no_locks)
    assert held(tmp_path) is None
