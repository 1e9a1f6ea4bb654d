"""The campaigns' presets launch the runs their results hold: each committed run folder under
results/<campaign>/<name>/ (phenomena, atlas) is a job of configs/experiment/<campaign>/<name>/*.yaml,
so a relaunch of a family finds its finished runs and skips them."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser

from mpt.config import GROUPS, as_plain
from mpt.runner import identity
from mpt.runner.record import RunRecord

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "configs" / "experiment"
FAMILIES = sorted(f"{c}/{p.name}" for c in ("phenomena", "atlas") for p in (PRESETS / c).iterdir() if p.is_dir())
parser = OverridesParser.create()


def jobs(preset: str, cli: tuple[str, ...] = ("device=cpu",)) -> tuple[list[list[str]], dict]:
    """Each job's overrides, as Hydra's basic sweeper makes them: the command line, then the preset's
    params (its comma-separated values a cartesian product)."""
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={preset}", *cli], return_hydra_config=True)
    params = [parser.parse_override(f"{k}={v}") for k, v in cfg.hydra.sweeper.params.items()]
    axes = [
        [f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
        for o in params
    ]
    defaults = {g: cfg.hydra.runtime.choices[g] for g in GROUPS}
    return [[f"experiment={preset}", *cli, *job] for job in itertools.product(*axes)], defaults


def folder(job: list[str], defaults: dict) -> str:
    """The run folder's name, as mpt-run's cli.run_name gives it."""
    choices, seed, variant = dict(defaults), 0, []
    for o in parser.parse_overrides(job):
        if o.key_or_group in GROUPS:
            choices[o.key_or_group] = str(o.value())
        elif o.key_or_group == "seed":
            seed = int(o.value())
        else:
            variant.append((o.key_or_group, str(o.value())))
    return identity.folder_name((choices[g] for g in GROUPS), "cpu", 1, seed, identity.variant(variant))


def presets_of(family: str) -> list[str]:
    return [f"{family}/{p.stem}" for p in sorted((PRESETS / family).glob("*.yaml"))]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_committed_run_of_a_family_is_a_job_of_its_presets(family):
    launched = set()
    for preset in presets_of(family):
        preset_jobs, defaults = jobs(preset)
        launched |= {folder(job, defaults) for job in preset_jobs}
    committed = {p.parent.name for p in (ROOT / "results" / family).glob("*/result.json")}
    assert committed, family
    assert committed <= launched, sorted(committed - launched)[:3]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_relaunch_of_a_family_finds_its_runs_of_the_same_computation(family):
    """As mpt-run decides to skip: the record in the job's folder computed what the job would, except
    the runs made before the LSTM gate rounding, which a relaunch makes again."""
    for preset in presets_of(family):
        preset_jobs, defaults = jobs(preset)
        for job in preset_jobs:
            record = ROOT / "results" / family / folder(job, defaults) / "result.json"
            if not record.exists():
                continue
            with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
                cfg = as_plain(compose(config_name="config", overrides=job))
            differ = identity.differences(RunRecord.load(record).config or {}, cfg)
            assert set(differ) <= {"emulate_lstm_gate_rounding"}, (preset, job, differ)


def test_the_choices_a_job_is_named_by_are_those_hydra_composes():
    """folder() reads the group choices off the overrides: the detection setting sets schedule=smoke
    among its params, over the config's default (short)."""
    preset_jobs, defaults = jobs("phenomena/detection/2_static")
    assert len(preset_jobs) == 3 and defaults["schedule"] == "short"
    for job in preset_jobs:
        with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
            choices = compose(config_name="config", overrides=job, return_hydra_config=True).hydra.runtime.choices
        assert folder(job, defaults) == folder(job, {g: choices[g] for g in GROUPS})
        assert folder(job, defaults).startswith("ssd_mixed_static_voc_smoke_cpu_seed")
