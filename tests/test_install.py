"""A regular install, not an editable one: the wheel holds the package and its configs, and a run
from outside the checkout composes its config from the installed copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.slow
def test_the_wheel_installs_and_runs_from_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("mpt-*.whl")
    venv = tmp_path / "venv"  # torch and the rest from this interpreter's packages: only mpt is new
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # --ignore-installed: this interpreter's mpt (an editable install) would otherwise satisfy it
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel]
    pip = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import mpt.configs; print(*mpt.configs.__path__)"], cwd=tmp_path,
                           capture_output=True, text=True, env=env)  # fmt: skip
    assert where.stdout.strip() == str(venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
                                       / "site-packages" / "mpt" / "configs"), where.stderr  # fmt: skip
    helped = subprocess.run([venv / "bin" / "mpt-run", "--help"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert helped.returncode == 0 and "mpt-run model=resnet50 precision=mixed scale=dynamic" in helped.stdout
    ran = subprocess.run(
        [venv / "bin" / "mpt-run", "model=mobilenet_v3_small", "precision=mixed", "scale=dynamic", "data=synthetic",
         "schedule=smoke", "checkpoint=false", "device=cpu", "hydra.run.dir=run"],
        cwd=tmp_path, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "ok"
