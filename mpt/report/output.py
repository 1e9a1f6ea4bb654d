"""Where the report writes. A file name made from a record's content (a choice, a network's name)
is one plain name inside --out: a crafted or broken record must not place a file elsewhere. Every
file is written whole or not at all (mpt/files.py), so a report cut short leaves the previous
tables and figures as they were."""

from __future__ import annotations

import os
from pathlib import Path

from ..files import write_text_atomic


class UnsafeName(ValueError):
    """A name taken from a record could leave its folder; the message names it."""


RULE = "a plain name: no /, \\, .., NUL, and no leading ."


def plain(value: object) -> bool:
    """Whether `value` can be one file name component as it is."""
    if not isinstance(value, str) or value == "" or value.startswith("."):
        return False
    return ".." not in value and not any(c in value for c in "/\\\0")


def target(folder: Path, *parts: str) -> Path:
    """`folder / parts...`, each part a plain name; raises UnsafeName otherwise. The joined path is
    checked to lie inside `folder` as well, whatever the parts passed."""
    for part in parts:
        if not plain(part):
            raise UnsafeName(f"{part!r} is not {RULE}")
    path = folder.joinpath(*parts)
    # abspath, not resolve: the last part may be a symlink an earlier report left; the atomic
    # rename replaces the link itself, never what it points to.
    if not Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder)):
        raise UnsafeName(f"{path} lies outside {folder}")
    return path


def write_text(folder: Path, *parts: str, text: str) -> Path:
    path = target(folder, *parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return path
