"""The instruments' protocol: a statistic the run does not name is stepped, checkpointed, restored
and summarized like the run's own."""

from __future__ import annotations

import json

import pytest

from mpt.runner import checkpoint
from mpt.runner.instruments import Instrument, RunEnd, StepDone
from mpt.runner.train import Run
from mpt.runner.validation import validate

from .conftest import TINY, compose_cfg


class StepLog(Instrument):
    """Every step it saw, with the samples and whether the statistics sampled it."""

    key = field = "step_log"

    def __init__(self) -> None:
        self.seen: list[list] = []
        self.started = self.stopped = 0

    def start(self) -> None:
        self.started += 1

    def after_step(self, done: StepDone) -> None:
        self.seen.append([done.step, done.samples, done.sampled])

    def stop(self) -> None:
        self.stopped += 1

    def state_dict(self) -> dict:
        return {"seen": [list(s) for s in self.seen]}

    def load_state_dict(self, state: dict) -> None:
        self.seen = [list(s) for s in state["seen"]]

    def summary(self, end: RunEnd) -> dict:
        return {"seen": self.seen, "finished": end.finished, "started": self.started, "stopped": self.stopped}


class LoggedRun(Run):
    def own_instruments(self) -> list[Instrument]:
        self.step_log = StepLog()
        return [self.step_log]


def run(tmp_path, steps: int) -> LoggedRun:
    cfg = compose_cfg(
        TINY,
        "schedule=smoke",
        f"schedule.steps={steps}",
        "schedule.batch_size=4",
        "stats.grad_hist=true",
        "stats.every=2",
        "checkpoint=true",
    )
    validate(cfg)
    return LoggedRun(cfg, tmp_path)


def test_an_instrument_the_run_does_not_name_is_stepped_checkpointed_restored_and_summarized(tmp_path, in_process):
    first = run(tmp_path, 3)
    assert first.train().status == "ok"
    record = json.loads((tmp_path / "result.json").read_text())
    seen = [[0, 4, False], [1, 4, True], [2, 4, False]]  # stats.every=2 samples the second step
    assert record["step_log"] == {"seen": seen, "finished": True, "started": 1, "stopped": 1}
    saved = checkpoint.load(tmp_path)
    assert saved is not None and saved["step_log"] == {"seen": seen}

    longer = run(tmp_path, 5)  # resumes the checkpoint at step 3 under a longer schedule
    assert longer.step_log.seen == seen
    assert longer.train().status == "ok"
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["step_log"]["seen"] == [*seen, [3, 4, True], [4, 4, False]]


def test_an_instrument_a_checkpoint_predates_starts_afresh(tmp_path, in_process):
    assert (
        Run(compose_cfg(TINY, "schedule=smoke", "schedule.steps=2", "checkpoint=true"), tmp_path).train().status == "ok"
    )
    cfg = compose_cfg(TINY, "schedule=smoke", "schedule.steps=3", "checkpoint=true")
    resumed = LoggedRun(cfg, tmp_path)
    assert resumed.step == 2 and resumed.step_log.seen == []
    assert resumed.train().status == "ok"
    assert json.loads((tmp_path / "result.json").read_text())["step_log"]["seen"] == [[2, 4, False]]


@pytest.mark.parametrize("field", ["memory", "new_section"])
def test_a_record_section_is_a_field_or_a_key_of_its_own(field):
    from mpt.runner.record import RunRecord

    rec = RunRecord(status="ok", choices={})
    rec.put(field, {"x": 1})
    assert rec.to_dict()[field] == {"x": 1}
    assert (field in rec.extra) == (field == "new_section")
