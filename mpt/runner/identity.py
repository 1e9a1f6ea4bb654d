"""Run identity: which settings make a run what it is.

One list decides both questions a relaunch asks: which folder is this run's, and does the record
or checkpoint found there come from the same computation. A setting that drives, logs or cites a
run (how often it checkpoints, where a number was published) answers neither.
"""

from __future__ import annotations

import copy
import re
import zlib
from typing import Any, Iterable

# Dotted config paths (and everything under them) that change how a run is driven, logged or cited,
# not what it computes: a checkpoint or record made under other values still stands, in one folder.
NOT_COMPUTATIONAL = (
    "force",
    "resume",
    "checkpoint",
    "logger",
    "wandb",  # where a logger's view of the run goes
    "device",  # its type (cpu, cuda) names the folder; which GPU of a machine does not change a number
    "schedule.checkpoint_every",
    "schedule.log_every",
    "schedule.throughput_warmup",
    "schedule.throughput_window",
    "scale.warn_consecutive_skips",  # a warning, not a setting of the arithmetic
    "data.cache_dir",  # where decoded images are kept: the same images from any copy
    "data.verify",  # a check of the files before training, which changes nothing it trains on
    "model.static_scale_source",  # citations, not settings
    "model.recipe.source",
    "experiment",  # the comparisons a preset declares: a report's business, not the run's
)
# Command-line keys that are not config settings: Hydra's own, and a preset sweep (whose values
# reach the run through the settings it sets, each of which is judged by its own path).
NOT_SETTINGS = ("hydra", "experiment")

LSTM_TASKS = ("translation", "language_model")  # GNMT's and bigLSTM's

MAX_NAME = 119  # characters: short enough to read, paste and list; far below file systems' 255 bytes


def computational_key(key: str) -> bool:
    """Whether a dotted config path (an override's key) can change what a run computes."""
    key = key.lstrip("+~")
    if key.split(".")[0].split("/")[0] in NOT_SETTINGS:
        return False
    return not any(key == p or key.startswith(p + ".") for p in NOT_COMPUTATIONAL)


def computational(plain: dict) -> dict:
    """A plain config without the settings that do not change the computation."""
    out = copy.deepcopy(plain)
    for path in NOT_COMPUTATIONAL:
        *parents, last = path.split(".")
        node: object = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    p = out.get("precision", {})
    if not {"float16", "bfloat16"} & {
        p.get("param_dtype"),
        p.get("autocast"),
    }:  # the flags change FP16/BF16 products only
        out.pop("emulate_tensor_cores", None)
    if out.get("emulate_tensor_cores") is not True or out.get("model", {}).get("task") not in LSTM_TASKS:
        out.pop("emulate_lstm_gate_rounding", None)  # it changes emulated LSTMs only
    return out


# A run's length: a checkpoint made under another one continues the same computation up to the
# shorter end (no learning rate depends on the length; milestones are their own settings).
LENGTH = ("schedule.steps", "schedule.epochs")


def differences(saved: dict, current: dict) -> list[str]:
    """The dotted paths whose computational values differ between a config saved by a record or
    checkpoint (read through upgrade.py) and `current`, in `current`'s order. A key the saved config
    lacks, one added since with a default that reproduces how runs computed before, takes `current`'s."""
    old = computational(_with_missing_keys(saved, current))
    return _diff(old, computational(current))


def _diff(old: Any, new: Any, path: str = "") -> list[str]:
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [path]
    out = []
    for key in [*new, *(k for k in old if k not in new)]:
        inner = f"{path}.{key}" if path else str(key)
        out += _diff(old.get(key), new.get(key), inner) if key in old and key in new else [inner]
    return out


def same_computation(saved: dict, current: dict) -> bool:
    """Whether a config saved by a record or checkpoint (read through upgrade.py) computes what
    `current` does."""
    return not differences(saved, current)


# Dicts of free keys (a model's builder's keyword arguments): a key one config has and the other
# lacks is a difference there, never a setting added since.
OPEN_DICTS = ("model.kwargs",)


def _with_missing_keys(old: Any, new: Any, path: str = "") -> Any:
    if not (isinstance(old, dict) and isinstance(new, dict)) or path in OPEN_DICTS:
        return old
    filled = dict(old)
    for key, value in new.items():
        inner = f"{path}.{key}" if path else str(key)
        filled[key] = _with_missing_keys(old[key], value, inner) if key in old else value
    return filled


def variant(overrides: Iterable[tuple[str, str | None]]) -> str:
    """The computational overrides beyond the group choices and the seed, as `key=value` sorted and
    joined by commas: what sets a run apart from the others of its model, mode, data and schedule.
    `overrides` holds (key, value) with values as Hydra parses them (1e-1 and 0.1 are one variant);
    a deletion has the value None."""
    return ",".join(
        sorted(key if value is None else f"{key}={value}" for key, value in overrides if computational_key(key))
    )


def variant_parts(variant: str) -> list[str]:
    """A variant's `key=value` items (a value may hold commas inside brackets or quotes)."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(variant):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(variant[start:i])
            start = i + 1
    if variant:
        parts.append(variant[start:])
    return parts


def _short(part: str) -> str:
    """One override, short and safe in a file name and as a Hydra value: the key's last word and the
    value; a path or a long value becomes a hash of itself."""
    key, _, value = part.partition("=")
    word = key.lstrip("+~").split(".")[-1]
    if key.startswith("~"):
        return f"no-{word}"
    value = value.strip("'\"")
    if "/" in value or len(value) > 16:
        value = f"h{zlib.crc32(value.encode()):08x}"
    value = re.sub(r"[^A-Za-z0-9.+-]+", "+", value).strip("+")
    return f"{word}-{value}"


def short_variant(variant: str) -> str:
    """A variant written for people: `steps-1200_batch_size-64`. Free of commas, `=`, `/`, `~` and
    quotes, so a folder name pastes back into a command line as one plain value."""
    return "_".join(_short(p) for p in variant_parts(variant))


def tag(variant: str) -> str:
    """8 hex digits that tell variants apart where their short forms are cut or coincide."""
    return f"{zlib.crc32(variant.encode()):08x}"


def computational_variant(variant: str) -> str:
    """A variant recorded by an older version, without the settings that do not change the
    computation (records before this module named runs by every override)."""
    return ",".join(p for p in variant_parts(variant) if computational_key(p.partition("=")[0]))


def named(base: str, variant: str) -> str:
    """`base`, then, for a variant, its short form (cut to fit MAX_NAME) and its tag: a name for a
    run's folder or a figure that people can read and that distinct variants never share."""
    if not variant:
        return base
    end = f"_{tag(variant)}"
    room = MAX_NAME - len(base) - len("__") - len(end)
    kept: list[str] = []  # whole overrides only, in order, as many as fit
    for part in (_short(p) for p in variant_parts(variant)):
        if len("_".join([*kept, part])) > room:
            break
        kept.append(part)
    return f"{base}__{'_'.join(kept)}{end}" if kept else base + end


def folder_name(choices: Iterable[str], device_type: str, world_size: int, seed: int, variant: str) -> str:
    """`<model>_<precision>_<scale>_<data>_<schedule>_<device>_seed<N>`, then the variant as
    `named` writes it. Deterministic, so relaunching a sweep finds each run's earlier record."""
    device = device_type + (
        f"x{world_size}" if world_size > 1 else ""
    )  # a torchrun job: its process count names it too
    return named("_".join([*choices, device, f"seed{seed}"]), variant)
