import pytest
import torch

from mpt.runner.instruments import throughput


@pytest.fixture
def clocks(monkeypatch):
    """A host clock and a device clock, and CUDA events that read the device's."""
    clock = {"host": 0.0, "device": 0.0}

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing

        def record(self, stream=None):
            self.t = clock["device"]

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1000

    monkeypatch.setattr(throughput.torch.cuda, "Event", Event)
    monkeypatch.setattr(throughput.torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(throughput, "synchronize", lambda device: None)
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock["host"])
    return clock


def run_steps(meter, clock, *, wait: float, idle: float, launch: float, work: float, steps: int = 5):
    """Each step: the host waits `wait` for its batch while the device idles `idle` for it; the
    device works `work` on the step while the host spends `launch` in it."""
    for _ in range(steps):
        clock["host"] += wait
        clock["device"] += idle
        meter.batch_ready()
        clock["device"] += work
        clock["host"] += launch
        meter.step(10, wait)


@pytest.mark.parametrize(
    "bound,wait,idle,launch,pipeline",
    [
        # The device is the bottleneck: the host blocks 0.1 s in the next batch's fetch (a full launch
        # queue), and no data work is waited for. Host waits there are not data time.
        ("device", 0.1, 0.0, 0.0, 100.0),
        # The data is: the device idles 0.3 s per step waiting for each batch.
        ("data", 0.3, 0.3, 0.1, 25.0),
    ],
)
def test_on_cuda_compute_is_the_devices_time_per_step_not_the_hosts_waits(clocks, bound, wait, idle, launch, pipeline):
    meter = throughput.ThroughputMeter(torch.device("cuda"), warmup=1, window=2, unit="images")
    run_steps(meter, clocks, wait=wait, idle=idle, launch=launch, work=0.1)
    assert meter.pipeline == pytest.approx([pipeline, pipeline])
    assert meter.compute == pytest.approx([100.0, 100.0])  # 10 images per 0.1 s of the device's work


def test_on_a_cpu_compute_is_the_wall_time_less_the_batch_waits(clocks):
    meter = throughput.ThroughputMeter(torch.device("cpu"), warmup=1, window=2, unit="images")
    run_steps(meter, clocks, wait=0.3, idle=0.0, launch=0.1, work=0.0)
    assert meter.pipeline == pytest.approx([25.0, 25.0])
    assert meter.compute == pytest.approx([100.0, 100.0])


def test_on_cuda_a_sampled_steps_span_and_a_traced_reruns_time_are_left_out(clocks):
    """Device-bound steps of 0.1 s; the third is a sampled step (left out: 0.5 s), the fifth ran
    again to trace an overflow (0.2 s of it untimed)."""
    meter = throughput.ThroughputMeter(torch.device("cuda"), warmup=1, window=2, unit="images")
    for work, sampled, untimed in [
        (0.1, False, 0.0),
        (0.1, False, 0.0),
        (0.5, True, 0.0),
        (0.1, False, 0.0),
        (0.3, False, 0.2),
        (0.1, False, 0.0),
    ]:
        clocks["host"] += 0.1  # the fetch, blocked behind the device
        meter.batch_ready()
        clocks["device"] += work
        clocks["host"] += work - 0.1
        meter.step(10, 0.1, excluded_s=work if sampled else None, untimed_s=untimed)
    assert meter.compute == pytest.approx([100.0, 100.0])


def test_on_cuda_a_step_without_its_batch_ready_is_an_error(clocks):
    meter = throughput.ThroughputMeter(torch.device("cuda"), warmup=1, window=2, unit="images")
    meter.batch_ready()
    meter.step(10, 0.0)
    with pytest.raises(RuntimeError, match="without batch_ready"):
        meter.step(10, 0.0)
