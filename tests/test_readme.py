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
