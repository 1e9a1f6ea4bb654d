"""Figure file names a reader can take in, and the index that says what each one stands for.

A figure's name is `<kind>_<model>_<data>_<schedule>[_<words>]_<tag>.png`, at most NAME_LIMIT
characters. `words` pick the figure out within its cell (the mode, network and seed of a run's
figure; the device and batch of a throughput figure), most telling first. The tag is a hash of the
figure's whole description (kind, model, data, schedule, cell, network and the full variant), so
two figures never share a name however their words are shortened; the report's figures.md spells
each description out. Run folders keep identity.named's longer names: this is the report's own.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

NAME_LIMIT = 60  # characters, the tag and ".png" included
INDEX_NAME = "figures.md"

# Kinds' words as file names write them: short, and the same in every name of a kind (a glob finds
# them all). figures.md spells the kind out.
KIND_WORDS = {"activation": "act", "weight": "wt"}
# A few names' long words, as every file name writes them (figures.md keeps the full name).
NETWORK_WORDS = {"model": "", "generator": "gen", "discriminator": "disc"}  # "model": a model's one network
SCALE_WORDS = {"none": "", "dynamic": "dyn", "static": "static", "auto": "auto"}
DEVICE_NOISE = {"NVIDIA", "AMD", "Intel", "R", "TM", "Processor", "CPU", "GPU", "Core", "with", "Graphics"}


@dataclass(frozen=True)
class Figure:
    """What one figure shows. `cell` says, in words, which part of its cell (mode and seed, device
    and batch) where the figure is not the whole cell's; `words` say it in the file name."""

    kind: str
    model: str
    data: str
    schedule: str
    variant: str = ""
    cell: str = ""
    network: str = ""
    words: tuple[str, ...] = ()

    def description(self) -> str:
        """The figure in one canonical line: what its tag is the hash of."""
        fields = [self.kind, self.model, self.data, self.schedule, self.cell, self.network, self.variant]
        return json.dumps(fields, ensure_ascii=False)


def tag(figure: Figure, salt: int = 0) -> str:
    """8 hex digits of the figure's whole description (`salt` > 0: another draw, for a collision)."""
    text = figure.description() + (f"#{salt}" if salt else "")
    return f"{zlib.crc32(text.encode()):08x}"


def _word(text: str) -> str:
    """`text` as part of a file name: letters, digits, `.`, `_`, `+`, `-` only, no `..`."""
    word = re.sub(r"[^A-Za-z0-9._+-]+", "-", str(text))
    return re.sub(r"\.{2,}", ".", word).strip("-._")


def kind_word(kind: str) -> str:
    """`grads_over_training_activation` -> `grads_over_training_act`."""
    return "_".join(KIND_WORDS.get(part, part) for part in _word(kind).split("_"))


def mode_word(precision: str, scale: str, scale_value: float | None = None) -> str:
    """A mode in a file name: `fp32`, `mixed-dyn`, `mixed-s128` (a static scale's value)."""
    if scale == "static" and scale_value is not None and scale_value == scale_value:  # not NaN
        suffix = f"s{scale_value:g}"
    else:
        suffix = SCALE_WORDS.get(scale, scale)
    return _word(precision + (f"-{suffix}" if suffix else ""))


def network_word(network: str) -> str:
    return NETWORK_WORDS.get(network, network)


def device_word(device: str) -> str:
    """A device in a file name, vendor and filler words left out: "NVIDIA H100 80GB HBM3" -> "H100-80GB-HBM3"."""
    kept = [w for w in re.findall(r"[A-Za-z0-9.]+", device) if w not in DEVICE_NOISE]
    return _word("-".join(kept) or device)


def _cut(words: list[str], room: int) -> list[str]:
    """`words` cut to at most `room` characters joined by "_", the longest cut first (water-filling);
    a word cut short loses the separators it then ends in."""
    if len("_".join(words)) <= room:
        return words
    letters = room - (len(words) - 1)
    longest = max(len(w) for w in words)
    for width in range(longest, 0, -1):
        if sum(min(len(w), width) for w in words) <= letters:
            break
    else:
        width = 1
    return [w[:width].rstrip("_-.+") or w[:1] for w in words]


def figure_name(figure: Figure, limit: int = NAME_LIMIT, salt: int = 0) -> str:
    """`<kind>_<model>_<data>_<schedule>[_<words>]_<tag>.png`, at most `limit` characters: the
    figure's words left out from the last one, then model, data and schedule cut, then the kind;
    never the tag."""
    end = f"_{tag(figure, salt)}.png"
    room = limit - len(end)
    kind = kind_word(figure.kind)
    core = [w for w in (_word(figure.model), _word(figure.data), _word(figure.schedule)) if w]
    words = [w for w in map(_word, figure.words) if w]

    def joined(parts: list[str]) -> str:
        return "_".join(p for p in parts if p)

    while words and len(joined([kind, *core, *words])) > room:
        words.pop()
    available = room - len(kind) - 1  # for model, data and schedule
    if core and len(joined(core)) > available:
        core = _cut(core, available) if available >= 2 * len(core) - 1 else [w[:1] for w in core]
    stem = joined([kind, *core, *words])
    if len(stem) > room:
        stem = stem[:room].rstrip("_-.+")
    return stem + end


class FigureIndex:
    """The figures of one report, by path: names them, keeps every name to one description, and
    writes figures.md."""

    def __init__(self) -> None:
        self.figures: dict[Path, Figure] = {}

    def path(self, folder: Path, figure: Figure) -> Path:
        """Where `figure` goes in `folder`: its name, or, should two descriptions' tags collide in one
        report, the next draw of the tag for the later one (drawn in the report's fixed order)."""
        salt = 0
        while True:
            path = folder / figure_name(figure, salt=salt)
            if self.figures.get(path, figure) == figure:
                return path
            salt += 1

    def add(self, path: Path, figure: Figure) -> None:
        self.figures[path] = figure

    def get(self, path: Path) -> Figure | None:
        return self.figures.get(path)


COLUMNS = ["figure", "tag", "kind", "model", "data", "schedule", "cell", "network", "variant"]


def _cell(text: str) -> str:
    """A value in a Markdown table cell: pipes escaped, one line."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    if not text:
        return ""
    fence = "``" if "`" in text else "`"
    return f"{fence}{_cell(text)}{fence}" if fence == "`" else f"{fence} {_cell(text)} {fence}"


def render_index(figures: Iterable[tuple[Path, Figure]], relative_to: Path) -> str:
    """figures.md: one row per figure written, its name linked, and the whole description its tag
    stands for."""
    lines = [
        "# Figures",
        "",
        "Each figure's name is `<kind>_<model>_<data>_<schedule>[_<mode, network, seed or setup>]_<tag>.png`,",
        f"its words shortened to keep it within {NAME_LIMIT} characters (act: activation, wt: weight;"
        " in a run's figure the mode is the precision, then the scale: dyn dynamic, s128 static 128; gen, disc:"
        " a GAN's generator, discriminator). The tag, 8 hex digits, is the CRC-32 of the figure's whole"
        " description below (kind, model, data, schedule, cell, network and the full variant): what the"
        " name leaves out, this table says.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for path, figure in figures:
        link = path.relative_to(relative_to).as_posix()
        name = path.name
        tag_match = re.search(r"_([0-9a-f]{8})\.png$", name)
        row = [
            f"[{name}]({link})",
            tag_match[1] if tag_match else "",
            figure.kind,
            figure.model,
            figure.data,
            figure.schedule,
            _cell(figure.cell),
            figure.network,
            _code(figure.variant),
        ]
        lines.append("| " + " | ".join(_cell(v) if i not in (0, 6, 8) else v for i, v in enumerate(row)) + " |")
    return "\n".join(lines) + "\n"
