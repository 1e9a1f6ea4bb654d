"""Older checkpoints and records, read as today's: the one place that knows what earlier versions wrote.

Files on disk are never rewritten. A reader passes what it loaded through `checkpoint` or `record`
and sees the current schema, so no other module keeps a branch for an older file.
"""

from __future__ import annotations

from . import identity

# Gradient statistics' parts, each added after the first checkpoints that held the statistics.
_GRAD_STATS_PARTS = ("step_hists", "lost", "lost_steps", "lost_counted", "atlas")


def checkpoint(saved: dict) -> dict:
    """A loaded checkpoint in today's schema (a new dict; the argument is not changed)."""
    saved = dict(saved)
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
