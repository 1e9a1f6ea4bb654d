"""scripts/peer_resnet50.py reads the peer's throughput from its dllogger stream as documented."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from .conftest import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("peer_resnet50", ROOT / "scripts" / "peer_resnet50.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dlll(step, data) -> str:  # dllogger's JSONStreamBackend line
    return "DLLL " + json.dumps(
        {"timestamp": "0", "datetime": "x", "elapsedtime": "0", "type": "LOG", "step": step, "data": data}
    )


def test_the_peers_steady_state_is_the_median_of_its_per_iteration_figures_after_warm_up(tmp_path):
    lines = ["DLLL " + json.dumps({"type": "METADATA", "metric": "train.total_ips", "metadata": {"unit": "images/s"}})]
    lines += [
        dlll([1, i + 1], {"train.total_ips": ips, "train.loss": 6.9})
        for i, ips in enumerate([10.0, 20.0, 100.0, 300.0, 200.0])
    ]
    lines += [dlll([1], {"train.total_ips": 126.0}), dlll([], {"train.total_ips": 126.0})]
    raport = tmp_path / "dle.json"
    raport.write_text("\n".join(lines) + "\n")
    got = load_script().dle_ips(raport, warmup=2)
    assert got == {"images_per_s": 200.0, "steps_timed": 3, "dle_epoch_mean_ips": 126.0}
    with pytest.raises(SystemExit, match="none after 5 warm-up steps"):
        load_script().dle_ips(raport, warmup=5)


def test_a_folder_without_the_peers_main_is_named(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "peer_resnet50.py"),
            "--peer",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and f"--peer {tmp_path}: no main.py there" in r.stderr


def test_a_mode_without_a_peer_recipe_is_named():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "peer_resnet50.py"), "--peer", ".", "--out", "o", "--modes", "amp,fp8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "--modes amp,fp8: expected a comma-separated subset of amp, tf32" in r.stderr
