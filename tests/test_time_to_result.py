"""Time to result: the first step to the end of the final evaluation, with the evaluations before it,
the checkpoints and the statistics steps left out."""

from __future__ import annotations

import time

import pytest
import torch

from mpt.runner.instruments import RunEnd, StepDone, time_to_result

from .conftest import TINY, build_run, read_record


@pytest.fixture
def clock(monkeypatch):
    now = {"t": 0.0}
    monkeypatch.setattr(time_to_result.time, "perf_counter", lambda: now["t"])
    return now


def test_training_and_the_final_evaluation_count_and_the_rest_is_left_out(clock):
    watch = time_to_result.TimeToResult(torch.device("cpu"))
    clock["t"] = 100.0  # building the run: before the first step
    watch.start()
    clock["t"] += 3.0  # steps
    with watch.leaving_out():  # an evaluation for the log
        clock["t"] += 2.0
    clock["t"] += 1.0
    watch.leave_out(0.5)  # a sampled step, timed by the statistics
    clock["t"] += 4.0
    with watch.final():
        clock["t"] += 1.5
    with watch.leaving_out():  # the last checkpoint
        clock["t"] += 7.0
    watch.stop()
    assert watch.summary() == pytest.approx(
        {"seconds": 3.0 + 1.0 + 4.0 + 1.5 - 0.5, "final_evaluation_s": 1.5, "left_out_s": 9.5}
    )


def test_a_resumed_run_adds_the_time_before_its_checkpoint(clock):
    first = time_to_result.TimeToResult(torch.device("cpu"))
    first.start()
    clock["t"] += 5.0
    with first.leaving_out():
        clock["t"] += 1.0
        state = first.state_dict()  # the checkpoint, saved inside its own span
    clock["t"] += 30.0  # the launch dies: what it did after its checkpoint is lost with it
    second = time_to_result.TimeToResult(torch.device("cpu"))
    second.load_state_dict(state)
    clock["t"] += 60.0  # the relaunch builds the run
    second.start()
    clock["t"] += 2.0
    with second.final():
        clock["t"] += 0.5
    second.stop()
    assert second.summary() == pytest.approx({"seconds": 5.0 + 2.5, "final_evaluation_s": 0.5, "left_out_s": 0.0})


def test_until_the_final_evaluation_there_is_no_time_to_result(clock):
    watch = time_to_result.TimeToResult(torch.device("cpu"))
    watch.start()
    clock["t"] += 4.0
    watch.stop()  # preempted or diverged before the end
    assert watch.summary()["seconds"] is None


def test_a_runs_record_leaves_out_its_evaluations_and_counts_its_last(tmp_path):
    """A real run whose evaluations each sleep: those before the last are left out, the last counted."""
    nap = 0.2
    run = build_run(tmp_path, TINY, "schedule=smoke", "schedule.steps=4", "schedule.eval_every=1", "checkpoint=false")
    evaluate = run._evaluate

    def slow(step: int) -> None:
        time.sleep(nap)
        evaluate(step)

    run._evaluate = slow
    run.execute()
    timing = read_record(tmp_path)["time_to_result"]
    assert timing["left_out_s"] >= 3 * nap  # the evaluations at steps 1-3
    assert timing["final_evaluation_s"] >= nap
    assert timing["final_evaluation_s"] <= timing["seconds"] < read_record(tmp_path)["duration_s"] - 3 * nap


def test_a_final_evaluation_that_fails_gives_no_time_to_result(clock):
    watch = time_to_result.TimeToResult(torch.device("cpu"))
    watch.start()
    clock["t"] += 3.0
    with pytest.raises(RuntimeError), watch.final():
        clock["t"] += 1.0
        raise RuntimeError("out of memory")
    watch.stop()
    assert watch.summary()["seconds"] is None and watch.summary()["final_evaluation_s"] is None


def test_a_run_that_did_not_finish_ok_has_no_time_to_result_though_it_evaluated(clock):
    watch = time_to_result.TimeToResult(torch.device("cpu"))
    watch.start()
    with watch.final():
        clock["t"] += 1.0
    watch.stop()
    assert watch.summary(RunEnd(finished=False, together=True))["seconds"] is None
    assert watch.summary()["seconds"] == pytest.approx(1.0)


def checkpoint_at_the_end(clock) -> dict:
    """The state a run's checkpoint holds at its end: 5 s of training, then a final evaluation of 2 s."""
    first = time_to_result.TimeToResult(torch.device("cpu"))
    first.start()
    clock["t"] += 5.0
    with first.final():
        clock["t"] += 2.0
    with first.leaving_out():
        return first.state_dict()


def test_a_run_extended_past_its_old_end_counts_that_end_as_an_evaluation_along_the_way(clock):
    longer = time_to_result.TimeToResult(torch.device("cpu"))
    longer.load_state_dict(checkpoint_at_the_end(clock))
    longer.start()
    clock["t"] += 3.0
    longer.after_step(
        StepDone(step=7, samples=4, wait_s=0.0, sampled=False, sampled_s=None, overhead_s=None, traced_s=0.0)
    )
    with longer.final():
        clock["t"] += 1.0
    longer.stop()
    assert longer.summary() == pytest.approx({"seconds": 5.0 + 3.0 + 1.0, "final_evaluation_s": 1.0, "left_out_s": 2.0})


def test_a_checkpoint_at_the_end_that_trains_no_further_does_not_leave_its_evaluation_out(clock):
    again = time_to_result.TimeToResult(torch.device("cpu"))
    again.load_state_dict(checkpoint_at_the_end(clock))
    again.start()
    again.stop()
    assert again.summary()["left_out_s"] == pytest.approx(0.0)
