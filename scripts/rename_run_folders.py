"""Rename run folders named by an older scheme to the name mpt-run gives them now (runner/identity.py).

Only folders mpt-run named itself are renamed: those whose name starts with the run's choices,
device and seed. A folder named by hand (hydra.run.dir=...) keeps its name. The new name comes from
the record alone (its choices, seed, device and variant); no record is edited: its `run_dir` is
where it ran, and readers find a run by the folder its result.json is in.

    python scripts/rename_run_folders.py results [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpt.config import GROUPS
from mpt.runner.identity import computational_variant, folder_name


def new_name(rec: dict, old: str) -> str | None:
    """The folder's name under the current scheme, or None for a folder not named by mpt-run."""
    choices = [rec["choices"][g] for g in GROUPS]
    world = (rec.get("distributed") or {}).get("world_size") or 1
    device = (rec.get("environment") or {}).get("device_type") or str(rec["config"]["device"]).split(":")[0]
    base = folder_name(choices, device, world, rec["seed"], "")
    if not old.startswith(base):
        return None
    recorded = rec["variant"] if rec.get("variant") is not None else old.partition("__")[2]
    return folder_name(choices, device, world, rec["seed"], computational_variant(recorded))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    moves = []
    for root in args.roots:
        for record in sorted(root.rglob("result.json")):
            folder = record.parent
            name = new_name(json.loads(record.read_text()), folder.name)
            if name is not None and name != folder.name:
                moves.append((folder, folder.with_name(name)))
    targets = [new for _, new in moves]
    clash = {t for t in targets if targets.count(t) > 1 or t.exists()}
    if clash:
        sys.exit(f"rename_run_folders: these names would be taken twice or exist already: {', '.join(map(str, sorted(clash)))}")
    for old, new in moves:
        print(f"{old} -> {new.name}")
        if not args.dry_run:
            old.rename(new)


if __name__ == "__main__":
    main()
