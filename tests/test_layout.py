"""docs/layout.md against the tree: the page docs/make_layout.py writes from the modules' docstrings, and a docstring
for every module to write it from."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .conftest import ROOT
from .test_layers import LAYERS

PACKAGE = ROOT / "mpt"

# Modules found without a docstring when this test was written; their owners are adding one. The list only shrinks:
# a module missing here fails the test below, and so does one listed here that has its docstring now.
NO_DOCSTRING_YET = {"mpt/precision/__init__.py", "mpt/runner/__init__.py"}


def load_generator():
    spec = importlib.util.spec_from_file_location("make_layout", ROOT / "docs" / "make_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_layout = load_generator()


def test_the_page_is_what_the_generator_writes():
    message = make_layout.first_difference(make_layout.render(PACKAGE), (ROOT / "docs" / "layout.md").read_text())
    assert message is None, message


def test_every_module_has_a_docstring_that_opens_with_a_sentence():
    offenders = set()
    for path in make_layout.modules(PACKAGE):
        if path == PACKAGE / "__init__.py" and not path.read_text().strip():
            continue  # an empty top-level package says nothing, and needs to say nothing
        if not make_layout.is_sentence(make_layout.module_summary(path)):
            offenders.add(path.relative_to(ROOT).as_posix())
    new = sorted(offenders - NO_DOCSTRING_YET)
    assert new == [], f"modules whose docstring does not open with a sentence (or that have none): {new}"
    done = sorted(NO_DOCSTRING_YET - offenders)
    assert done == [], f"these open with a sentence now: drop them from NO_DOCSTRING_YET (tests/test_layout.py): {done}"


def test_the_floors_are_the_layers_of_test_layers():
    assert [{m for m in members if m != "mpt"} for _, members in make_layout.FLOORS] == LAYERS


def test_the_summary_is_the_first_sentence_of_the_first_paragraph():
    summary = make_layout.summary
    assert summary("Data sources. Each yields batches.") == "Data sources."
    wrapped = "A model (Jozefowicz et al. 2016): the\n  paper's. More.\n\nDetails."
    assert summary(wrapped) == "A model (Jozefowicz et al. 2016): the paper's."
    assert summary("The loop. `train` runs it.") == "The loop."
    assert summary("data.resident=true: images kept on the device") == "data.resident=true: images kept on the device"
    assert summary(None) is None and summary("  \n") is None
    assert make_layout.is_sentence("Throughput.") and make_layout.is_sentence("Sets (`a`, `b`).")
    assert not make_layout.is_sentence("Parallel text on disk, one line") and not make_layout.is_sentence(None)
    assert not make_layout.is_sentence(".")


def write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'"""{text}"""\n' if text else "")


def section(page: str, floor: int) -> str:
    """The lines of one floor's section of a page, its heading aside."""
    start = page.index(f"### Floor {floor}:")
    end = page.find("\n#", start + 1)
    return page[page.index("\n", start) : end if end >= 0 else None]


def test_a_module_added_to_a_tree_lands_in_its_floor_and_makes_the_page_stale(tmp_path, capsys):
    package = tmp_path / "mpt"
    write(package / "__init__.py")
    write(package / "files.py", "Writing files whole.")
    write(package / "precision" / "__init__.py", "Precision.")
    write(package / "precision" / "engine.py", "The precision engine.\n\nMore about it.")
    write(package / "runner" / "__init__.py", "The runner.")
    write(package / "runner" / "train.py", "The training loop.")
    write(package / "report" / "__init__.py", "The report.")
    write(package / "configs" / "__init__.py")  # no code: left out
    page = tmp_path / "layout.md"
    page.write_text(make_layout.render(package))
    assert make_layout.main(["--check", "--package", str(package), "--page", str(page)]) == 0
    assert "`mpt/precision/engine.py`: The precision engine.\n" in section(page.read_text(), 2)
    assert "configs" not in section(page.read_text(), 1)

    write(package / "runner" / "instruments" / "__init__.py", "Instruments.")
    write(package / "runner" / "instruments" / "probe.py", "A probe, measured.")
    write(package / "runner" / "logbook.py")  # no docstring yet
    write(package / "config.py", "Typed configuration.")
    new = make_layout.render(package)
    runner = section(new, 5).splitlines()
    logbook, train = "- `mpt/runner/logbook.py`: (no docstring)", "- `mpt/runner/train.py`: The training loop."
    assert runner.index(logbook) < runner.index(train)
    nested = runner.index("- `mpt/runner/instruments/`")
    assert runner[nested + 1 :] == [
        "  - `mpt/runner/instruments/__init__.py`: Instruments.",
        "  - `mpt/runner/instruments/probe.py`: A probe, measured.",
    ]
    assert "- `mpt/config.py`: Typed configuration." in section(new, 1).splitlines()
    assert "probe" not in section(new, 6)

    assert make_layout.main(["--check", "--package", str(package), "--page", str(page)]) == 1
    assert capsys.readouterr().err == f"{make_layout.STALE} (first difference at mpt/config.py)\n"
    page.write_text(new)
    assert make_layout.main(["--check", "--package", str(package), "--page", str(page)]) == 0

    write(package / "plugins.py", "A module in no floor.")
    assert make_layout.main(["--package", str(package)]) == 2
    assert capsys.readouterr().err.startswith("mpt/plugins.py: in no floor")
