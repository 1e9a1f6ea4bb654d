"""Older checkpoints and records, read as today's: the one place that knows what earlier versions wrote.

Files on disk are never rewritten. A reader passes what it loaded through `checkpoint` or `record`
and sees the current schema, so no other module keeps a branch for an older file.
"""

from __future__ import annotations

from dataclasses import fields

from ..config import DATA_SCHEMAS
from . import identity

# Keys added after records were first written, with the value that reproduces how those runs
# computed. A key missing from an old config and not listed here takes the current value when it is
# compared (identity.differences): its default reproduces the old behaviour. (A bench record without
# count_flops has no MFU: relaunching redoes it.)
LEGACY_VALUES = {
    ("emulate_tensor_cores",): False,
    ("schedule", "count_flops"): False,
    ("emulate_lstm_gate_rounding",): False,
}
# Settings an older version had under another meaning. emulate_cpu_fp16_conv=true emulated FP16
# convolutions only, an arithmetic no current setting gives; false was torch's own kernels.
RENAMED = {"emulate_cpu_fp16_conv": ("emulate_tensor_cores", {False: False, True: "convolutions only"})}

# Gradient statistics' parts, each added after the first checkpoints that held the statistics.
_GRAD_STATS_PARTS = ("step_hists", "lost", "lost_steps", "lost_counted", "atlas")


def config(saved: dict) -> dict:
    """A run's saved config in today's schema (a new dict): renamed settings under their names, keys
    added since with the values the run computed with, and only its own data source's settings (a
    config saved before each source had its own schema held every source's in `data`; those of other
    sources never reached the run)."""
    out = dict(saved)
    for old, (new, values) in RENAMED.items():
        if old in out:
            out[new] = values[out.pop(old)]
    for path, value in LEGACY_VALUES.items():
        *parents, key = path
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                break
            node[part] = dict(node[part])
            node = node[part]
        else:
            node.setdefault(key, value)
    data = out.get("data")
    if isinstance(data, dict) and data.get("name") in DATA_SCHEMAS:
        own = {f.name for f in fields(DATA_SCHEMAS[data["name"]])}
        out["data"] = {k: v for k, v in data.items() if k in own}
    return out


def checkpoint(saved: dict) -> dict:
    """A loaded checkpoint in today's schema (a new dict; the argument is not changed)."""
    saved = dict(saved)
    if isinstance(saved.get("config"), dict):
        saved["config"] = config(saved["config"])
    if "memory" not in saved:  # before the steady-state peak: the run's peak alone
        saved["memory"] = {"peak_bytes": saved.pop("peak_memory_bytes", 0), "steady_peak_bytes": 0}
    if not saved.get("segments"):  # before segments: one, from the start to the checkpoint, of unknown length
        saved["segments"] = [{"from_step": 0, "to_step": saved["step"], "total_steps": None, "git": saved.get("git")}]
    saved.setdefault("nondeterministic_ops", [])  # before they were noted: none known
    saved.setdefault("device_rng", None)
    saved.setdefault("data_fingerprint", None)
    if saved.get("grad_stats"):
        saved["grad_stats"] = {**{part: {} for part in _GRAD_STATS_PARTS}, **saved["grad_stats"]}
    return saved


def record(data: dict, folder: str) -> dict:
    """A record read from its run folder (named `folder`) in today's schema (a new dict; the file is
    not changed). A value an older version never measured stays absent: only what can be known is filled."""
    if not isinstance(data, dict):
        return data  # not a record: the reader names the problem
    data = dict(data)
    if isinstance(data.get("config"), dict):
        data["config"] = config(data["config"])
    # Records before the field held their overrides in the folder's name, after "__"; later ones
    # held every override, log_every's too: the variant is the computational part of either.
    variant = data.get("variant")
    data["variant"] = identity.computational_variant(folder.partition("__")[2] if variant is None else variant)
    stats = data.get("grad_stats")
    if isinstance(stats, dict):
        stats = data["grad_stats"] = dict(stats)
        networks = stats.get("networks") or {}
        stats["networks"] = {
            net: {kind: {"steps": [], **hist} for kind, hist in kinds.items()}  # before per-step histograms: none
            for net, kinds in networks.items()
        }
        lost = stats.get("lost_updates")
        if isinstance(lost, dict) and lost.get("networks"):
            # Before FP16's own count, every count was of updates FP16 weights would lose.
            nets = {net: c if c is None else {"counted": "would_be_lost", **c} for net, c in lost["networks"].items()}
            stats["lost_updates"] = {**lost, "networks": nets}
    return data
