"""The README's sample summary is what mpt-run prints for the committed record it names."""

from __future__ import annotations

import re

from mpt.runner.cli import summary_lines
from mpt.runner.record import RunRecord

from .conftest import ROOT


def test_the_readmes_sample_summary_is_the_summary_of_its_committed_record():
    readme = (ROOT / "README.md").read_text()
    source = re.search(r"\(record: `(results/[^`]+)/`", readme)
    assert source, "the README names the record its sample summary is of"
    block = re.search(r"```\n(mpt-run resnet50 precision=mixed .*?)\n```", readme, flags=re.S)
    assert block, "the README shows a sample summary"
    shown = [line for line in block[1].splitlines() if not line.lstrip().startswith("record:")]
    rec = RunRecord.load(ROOT / source[1] / "result.json")
    printed = [line for line in summary_lines(rec) if not line.lstrip().startswith("record:")]
    assert shown == printed


def test_your_own_model_fits_in_twenty_lines_and_names_real_options():
    """The README's "Your own model" shows the own-model commands and the Python API in at most 20 lines;
    each command's model is a config of mpt's, and its Python parses."""
    import ast

    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^### Your own model\n(.*?)(?=^#)", readme, flags=re.S | re.M)
    assert section, "the README has a section 'Your own model'"
    lines = ("### Your own model\n" + section[1]).rstrip().splitlines()
    assert len(lines) <= 20, len(lines)
    models = re.findall(r"^mpt-run model=(\w+)", section[1], flags=re.M)
    assert {"torchvision", "timm", "custom", "custom_lm", "hf_causal_lm"} <= set(models)
    assert all((ROOT / "configs" / "model" / f"{m}.yaml").is_file() for m in models)
    python = re.search(r"```python\n(.*?)```", section[1], flags=re.S)
    assert python and "mpt.run(" in python[1] and "mpt.analyze(" in python[1]
    ast.parse(python[1])
