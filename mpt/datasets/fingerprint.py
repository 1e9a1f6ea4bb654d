"""What a data folder holds, as one hash: every file's path below it and its size.

A run moved to another copy of its data (another mount, a node's local disk) computes what it did
before; a folder with other files, or files of other sizes, may not. Names and sizes are what a
copy keeps and what a walk reads without opening a file: one stat per file, not a read of every
byte (a network file system's cold cache makes that slower than a local disk's). A run reads it
once per launch, on rank 0, at its first checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fingerprint(root: Path) -> str | None:
    """`sha256:<hex>` of the sorted (relative path, size) of every file below `root`; None if it is
    not a folder (a file that cannot be listed has nothing to compare)."""
    if not root.is_dir():
        return None
    entries = []
    for folder, _, files in os.walk(root, followlinks=True):
        for name in files:
            path = Path(folder, name)
            try:
                size = path.stat().st_size
            except OSError:  # a dangling link: its name still says what the folder holds
                size = -1
            entries.append(f"{path.relative_to(root).as_posix()}\t{size}")
    digest = hashlib.sha256("\n".join(sorted(entries)).encode())
    return f"sha256:{digest.hexdigest()}"
