"""logger=wandb: the run's rows, config and pictures go to a W&B run, offline by default, one per run
folder, continued by a resumed run. A stand-in for the wandb module records what the logger asks of
it; one run goes through the real package where it is installed."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

from .conftest import TINY, build_run, compose_cfg

SMOKE = [TINY, "data=synthetic", "schedule=smoke", "schedule.steps=4", "schedule.log_every=1", "device=cpu"]


class FakeRun:
    def __init__(self, calls: dict, **kwargs):
        self.calls, self.summary = calls, {}
        calls["init"].append(kwargs)

    def define_metric(self, name, step_metric=None):
        self.calls["define"].append((name, step_metric))

    def log(self, values):
        self.calls["log"].append(values)

    def finish(self):
        self.calls["finished"] += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: dict = {"init": [], "define": [], "log": [], "finished": 0}
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec sees it installed
    module.init = lambda **kwargs: FakeRun(calls, **kwargs)  # type: ignore[attr-defined]
    module.Image = lambda path: ("image", path)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_a_run_logs_its_steps_evaluations_and_config_offline_in_its_folder(tmp_path, in_process, fake_wandb):
    rec = build_run(tmp_path, *SMOKE, "logger=wandb").execute()
    assert rec.status == "ok"
    (init,) = fake_wandb["init"]
    assert init["mode"] == "offline" and init["project"] == "mpt" and init["dir"] == str(tmp_path)
    assert init["resume"] == "allow" and "precision:" in init["config"]["config_yaml"]
    assert ("*", "step") in fake_wandb["define"] and fake_wandb["finished"] == 1
    logged = fake_wandb["log"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    # every step's loss, as metrics.jsonl has it, against its step
    assert [(v["step"], v["train/loss"]) for v in logged if "train/loss" in v] == [
        (r["step"], r["loss"]) for r in train
    ]
    assert any("eval/top1" in v and v["step"] == 4 for v in logged)
    assert any(k.startswith("throughput/images/s") for v in logged for k in v)
    assert all("step" in v for v in logged)


def test_a_resumed_run_continues_its_wandb_run(tmp_path, in_process, fake_wandb):
    args = [*SMOKE, "logger=wandb", "schedule.checkpoint_every=2"]
    build_run(tmp_path, *args).execute()
    build_run(tmp_path, *[a for a in args if not a.startswith("schedule.steps")], "schedule.steps=6").execute()
    first, second = fake_wandb["init"]
    assert first["id"] == second["id"] and second["resume"] == "allow"
    other = tmp_path / "other"
    build_run(other, *args).execute()
    assert fake_wandb["init"][2]["id"] != first["id"]  # another folder, another W&B run


def test_a_bad_mode_is_named_in_one_line():
    from mpt.config import ConfigError
    from mpt.runner.validation import validate

    with pytest.raises(ConfigError, match=r"^wandb.mode=cloud: expected one of offline, online, disabled$"):
        validate(compose_cfg(*SMOKE, "logger=wandb", "wandb.mode=cloud"))


def test_without_the_package_logger_wandb_says_how_to_install_it(monkeypatch):
    from mpt.config import ConfigError
    from mpt.runner.validation import validate

    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec raises for None: as if absent
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else object())
    with pytest.raises(
        ConfigError, match=r'^logger=wandb: the wandb package is not installed; pip install "mpt\[wandb\]"'
    ):
        validate(compose_cfg(*SMOKE, "logger=wandb"))


def test_the_real_package_keeps_an_offline_run_under_the_folder(tmp_path, in_process, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rec = build_run(tmp_path, *SMOKE, "logger=wandb").execute()
    assert rec.status == "ok"
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(offline.glob("*.wandb"))  # the run's rows, for `wandb sync`
