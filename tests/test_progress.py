"""What a run shows while it trains, and a sweep's run count."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from mpt.runner.cli import sweep_size
from mpt.runner.progress import Progress


def rows(step, loss, scale, overflow, group="model"):
    return [
        {"kind": "train", "step": step, "group": group, "lr": 0.1, "scale": scale, "overflow": overflow, "loss": loss}
    ]


def test_without_a_terminal_it_prints_plain_lines_with_eta_loss_scale_skips_and_rate(capsys):
    readings = iter([0.0, 10.0, 20.0, 40.0])  # construction, then one reading per update
    p = Progress(
        "run 2/6",
        total=100,
        start=0,
        skipped={"model": 1},
        unit="images/s",
        interactive=False,
        every_s=15,
        clock=lambda: next(readings),
    )
    p.update(10, rows(9, 2.5, 1024.0, True), rate=None)  # at 10 s: too soon after the start
    p.update(20, rows(19, 2.25, 512.0, False), rate=123.4)  # at 20 s: printed
    p.update(100, rows(99, float("nan"), 512.0, False), rate=130.0)  # the end is always printed
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "run 2/6: step 20/100 (20%), ETA 1m20s, loss 2.25, scale 512, skipped 2; 123.4 images/s",
        "run 2/6: step 100/100 (100%), loss nan, scale 512, skipped 2; 130 images/s",
    ]


def test_on_a_terminal_one_tqdm_line_per_run_and_each_network_of_a_gan(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    p = Progress("mpt-run", total=10, start=4, skipped={}, unit="images/s", interactive=True)
    p.update(7, rows(6, 1.5, 8.0, None, "discriminator") + rows(6, 0.7, 8.0, True, "generator"), rate=50.0)
    p.close()
    text = err.getvalue()
    assert (
        "7/10" in text
        and "discriminator loss 1.5, scale 8, skipped 0; generator loss 0.7, scale 8, skipped 1; 50 images/s" in text
    )


def test_on_a_terminal_a_log_line_gets_its_own_line_and_the_console_handler_is_put_back(monkeypatch):
    tty = io.StringIO()  # stdout and stderr on one terminal: the log's handler and the bar
    monkeypatch.setattr(sys, "stdout", tty)
    monkeypatch.setattr(sys, "stderr", tty)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(console)
    try:
        p = Progress("mpt-run", total=10, start=0, skipped={}, unit="images/s", interactive=True)
        p.update(7, rows(6, 1.5, 8.0, False), rate=50.0)
        logging.getLogger("mpt").warning("diverged at step 7")
        p.close()
        assert console in root.handlers
    finally:
        root.removeHandler(console)
    lines = tty.getvalue().splitlines()  # \r ends a line too: the bar redraws over itself
    assert "diverged at step 7" in lines, lines
    assert any("7/10" in line for line in lines)


@pytest.mark.parametrize(
    "args,runs",
    [(["-m", "precision=fp32,mixed", "scale=none", "seed=0,1,2"], 6), (["-m", "seed=range(4)"], 4),
     (["-m", "experiment=naruse_fp16"], 18), (["-m", "experiment=naruse_fp16", "model=alexnet"], 6),
     (["-m", "experiment=naruse_fp16", "seed=0,1"], 36)],
)  # fmt: skip
def test_a_sweeps_run_count_is_hydras(args, runs):
    assert sweep_size(args) == runs
