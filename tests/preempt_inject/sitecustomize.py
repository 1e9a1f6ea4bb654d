"""Loaded by every Python process of tests/test_faults.py's submitit sweep (PYTHONPATH): the first
time any run reaches step MPT_TEST_PREEMPT_AT, this process sends itself submitit's preemption
signal (SIGUSR2), as a SLURM preemption would; the file MPT_TEST_PREEMPTED records that it did."""

import os

if os.environ.get("MPT_TEST_PREEMPTED"):
    import signal

    from mpt.runner import train

    marker, at = os.environ["MPT_TEST_PREEMPTED"], int(os.environ["MPT_TEST_PREEMPT_AT"])
    _train_step = train.Run._train_step

    def train_step(self, step, batch):
        if step == at and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            signal.raise_signal(signal.SIGUSR2)
        return _train_step(self, step, batch)

    train.Run._train_step = train_step
