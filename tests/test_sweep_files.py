"""Each `mpt-run -m` into one sweep folder keeps its own config beside Hydra's multirun.yaml (the
end-to-end check, two launches into one folder, is in test_report.py's sweep)."""

from __future__ import annotations

from datetime import datetime, timezone

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from mpt.runner.sweep_files import PerLaunchConfig, launch_file


def test_each_launch_writes_its_own_config(tmp_path):
    folder = tmp_path / "sweep"
    for lr in (0.1, 0.2):
        config = OmegaConf.create(
            {"hydra": {"sweep": {"dir": str(folder)}}, "optim": {"lr": lr}, "name": "${optim.lr}"}
        )
        PerLaunchConfig().on_multirun_start(config=config, config_name="config")
    written = sorted(folder.glob("multirun-*.yaml"))
    assert [OmegaConf.load(p).optim.lr for p in written] == [0.1, 0.2]  # names sort as the launches came
    assert "name: ${optim.lr}\n" in written[0].read_text()  # unresolved, as multirun.yaml


def test_launches_within_one_millisecond_get_distinct_names(tmp_path):
    now = datetime(2025, 3, 4, 5, 6, 7, 890123, tzinfo=timezone.utc)
    names = [launch_file(tmp_path, now).name for _ in range(11)]
    stamp = "multirun-2025-03-04T05-06-07.890Z"
    assert names[:3] == [f"{stamp}.yaml", f"{stamp}_002.yaml", f"{stamp}_003.yaml"]
    assert sorted(names) == names  # in the order the launches came, the tenth and eleventh too


def test_the_config_registers_the_callback():
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        callbacks = compose(config_name="config", return_hydra_config=True).hydra.callbacks
    assert [c["_target_"] for c in callbacks.values()] == ["mpt.runner.sweep_files.PerLaunchConfig"]
