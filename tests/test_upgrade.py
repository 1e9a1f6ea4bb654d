"""Older checkpoints and records read as today's schema, in one place (mpt/runner/upgrade.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpt.runner import upgrade
from mpt.runner.record import RunRecord

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "results").rglob("result.json"))


def test_every_committed_record_reads_in_todays_schema():
    assert len(RECORDS) > 100  # the committed results are here to read
    for path in RECORDS:
        rec = RunRecord.load(path)
        assert isinstance(rec.variant, str), path
        stats = rec.grad_stats or {}
        for kinds in (stats.get("networks") or {}).values():
            assert all(isinstance(hist["steps"], list) for hist in kinds.values()), path
        for lost in ((stats.get("lost_updates") or {}).get("networks") or {}).values():
            assert lost is None or lost["counted"] in ("lost", "would_be_lost"), path


def test_a_record_before_the_variant_field_takes_its_folders_overrides_less_logging():
    old = {"status": "ok", "choices": {}}
    assert (
        upgrade.record(old, "resnet50_mixed_static__schedule.log_every=5,scale.value=1024")["variant"]
        == "scale.value=1024"
    )
    assert upgrade.record({**old, "variant": "schedule.log_every=5,optim.lr=0.1"}, "x")["variant"] == "optim.lr=0.1"
    assert "variant" not in old  # the dict read is not changed


def test_a_record_before_fp16s_own_count_counted_what_fp16_weights_would_lose():
    lost = {"networks": {"model": {"total": {"updated": 3}}, "other": None}}
    hist = {"total": {}}
    old = {
        "status": "ok",
        "choices": {},
        "grad_stats": {"networks": {"model": {"activation": hist}}, "lost_updates": lost},
    }
    new = upgrade.record(old, "x")
    assert new["grad_stats"]["lost_updates"]["networks"] == {
        "model": {"counted": "would_be_lost", "total": {"updated": 3}},
        "other": None,
    }
    assert new["grad_stats"]["networks"]["model"]["activation"] == {"steps": [], "total": {}}
    counted = {"networks": {"model": {"counted": "lost", "total": {}}}}
    assert (
        upgrade.record({**old, "grad_stats": {"lost_updates": counted}}, "x")["grad_stats"]["lost_updates"] == counted
    )


@pytest.mark.parametrize("has_memory", [False, True])
def test_an_older_checkpoint_reads_in_todays_schema(has_memory):
    old = {"step": 40, "git": {"commit": "abc"}, "grad_stats": {"hists": {}, "sampled_steps": []}}
    old |= {"memory": {"peak_bytes": 7, "steady_peak_bytes": 5}} if has_memory else {"peak_memory_bytes": 7}
    new = upgrade.checkpoint(old)
    assert new["memory"] == (
        {"peak_bytes": 7, "steady_peak_bytes": 5} if has_memory else {"peak_bytes": 7, "steady_peak_bytes": 0}
    )
    assert new["segments"] == [{"from_step": 0, "to_step": 40, "total_steps": None, "git": {"commit": "abc"}}]
    assert new["nondeterministic_ops"] == [] and new["device_rng"] is None and new["data_fingerprint"] is None
    assert new["grad_stats"]["atlas"] == {} and new["grad_stats"]["lost"] == {} and new["grad_stats"]["hists"] == {}
    assert "peak_memory_bytes" in old or has_memory  # the dict read is not changed


def test_an_older_config_reads_with_its_renamed_settings_legacy_values_and_own_data_source_only():
    old = {
        "emulate_cpu_fp16_conv": True,
        "schedule": {"steps": 3},
        "data": {"name": "synthetic", "train_samples": 64, "root": "/from/another/source"},
    }
    new = upgrade.config(old)
    assert new["emulate_tensor_cores"] == "convolutions only" and "emulate_cpu_fp16_conv" not in new
    assert new["schedule"] == {"steps": 3, "count_flops": False} and new["emulate_lstm_gate_rounding"] is False
    assert new["data"] == {"name": "synthetic", "train_samples": 64}  # root is no setting of data=synthetic
    assert old["schedule"] == {"steps": 3} and "emulate_cpu_fp16_conv" in old  # the dict read is not changed
    today = {"emulate_tensor_cores": True, "emulate_lstm_gate_rounding": True, "schedule": {"count_flops": True}}
    assert upgrade.config(today) == today  # a setting a config holds is never replaced
