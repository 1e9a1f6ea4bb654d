"""mpt's process group at a world of 1, used as if there were peers: on a GPU over NCCL (collected by
`pytest -m gpu`, the GPU calls' suite) and, as its twin, on the CPU over gloo.

At a world size of 1 Dist.enabled is False, and a run skips the process group and every collective.
Here a Dist whose `enabled` is True makes a whole run take the multi-process paths itself: setup()
(on CUDA its own branch: set_device, init_process_group with NCCL and device_id), the rendezvous
variables a SLURM step gets, DistributedDataParallel, the overflow check's maximum over ranks on the
device, the log's mean, the totals, and teardown(). The test counts the all-reduces that go through
the group, and an infinite loss in the second step shows the overflow's reduction deciding the skip."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from mpt.distributed import Dist, teardown
from mpt.precision import engine as precision
from mpt.runner import train

from .conftest import TINY, build_run, process_settings_kept
from .test_distributed import train_losses


@dataclass(frozen=True)
class Joined(Dist):
    """One process that goes through the process group as a rank among peers would."""

    @property
    def enabled(self) -> bool:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_world_of_one_through_the_process_group(device, tmp_path, monkeypatch):
    expected_backend = "nccl" if device == "cuda" else "gloo"
    # A SLURM step's variables: setup() sets MASTER_ADDR from the node list (undone after the test).
    monkeypatch.setenv("MASTER_ADDR", "unset after the test")
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("SLURM_STEP_NODELIST", "localhost")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    joined = Joined(launcher="slurm")
    monkeypatch.setattr(train, "from_env", lambda: joined)

    reductions: list[tuple[str, str]] = []  # (op, device type) of each all-reduce through the group
    all_reduce = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        assert dist.get_backend() == expected_backend
        reductions.append((str(op).rsplit(".", 1)[-1], tensor.device.type))
        return all_reduce(tensor, op, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counted)
    calls = {"backward": 0}
    backward = precision.PrecisionEngine.backward

    def overflow_in_step_two(self, loss):
        calls["backward"] += 1
        return backward(self, loss * float("inf") if calls["backward"] == 2 else loss)

    monkeypatch.setattr(precision.PrecisionEngine, "backward", overflow_in_step_two)
    try:
        with process_settings_kept():
            run = build_run(
                tmp_path,
                TINY,
                f"device={device}",
                "precision=mixed",
                "scale=dynamic",
                "scale.init=1024",
                "schedule=smoke",
                "schedule.steps=3",
                "schedule.batch_size=4",
                "schedule.log_every=1",
                "data.train_samples=16",
                "checkpoint=false",
                "logger=none",
            )
            # set-up: the group, on the run's device
            assert dist.is_initialized() and dist.get_backend() == expected_backend and dist.get_world_size() == 1
            assert run.device == (torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))
            assert dist.get_rank() == 0 and os.environ["MASTER_ADDR"] == "localhost"
            assert isinstance(run.task.networks()["model"], torch.nn.parallel.DistributedDataParallel)
            rec = run.execute()
            # the steps: the injected overflow skipped, the scale halved, training went on
            assert rec.status == "ok", rec.message
            assert rec.loss_scale["model"]["skipped_steps"] == 1 and rec.loss_scale["model"]["final"] == 512
            assert len(train_losses(tmp_path)) == 3
            assert rec.distributed["world_size"] == 1 and rec.distributed["backend"] == expected_backend
            # the overflow check's maximum went through the group, on the device (NCCL reduces nothing else)
            assert ("MAX", device) in reductions and ("SUM", device) in reductions
            # the reductions the command line makes between runs (cli: the preemption flag; the totals)
            assert joined.any(True, run.device) and not joined.any(False, run.device)
            assert joined.total(2.5, run.device) == 2.5 and joined.largest(3.0, run.device) == 3.0
            flags = torch.tensor([0.0, float("inf")], device=run.device)
            assert torch.equal(joined.reduce_max(flags.clone()), flags)
            rows = torch.arange(6.0, device=run.device).reshape(3, 2)
            assert torch.equal(joined.gather(rows, 0), rows)
    finally:
        teardown()
    assert not dist.is_initialized()
