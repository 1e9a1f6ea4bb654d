"""Loaded by every Python process of tests/test_distributed.py's torchrun job (PYTHONPATH): on
rank 1 only, the second backward of the run gets an infinite loss; every rank saves its networks
and scaler at the end, for the test to compare across ranks; and a rank whose interpreter ran its
exit handlers (finalized, as it must not while gloo's threads live) leaves a file saying so."""

import os

if os.environ.get("MPT_TEST_OUT") and "RANK" in os.environ:
    import atexit

    import torch

    atexit.register(
        lambda: open(os.path.join(os.environ["MPT_TEST_OUT"], f"finalized_rank{os.environ['RANK']}"), "w").close()
    )

    from mpt.precision import engine as precision
    from mpt.runner import train

    calls = {"backward": 0}
    _backward = precision.PrecisionEngine.backward

    def backward(self, loss):
        calls["backward"] += 1
        if int(os.environ["RANK"]) == 1 and calls["backward"] == 2:
            loss = loss * float("inf")
        return _backward(self, loss)

    _train = train.Run.train

    def train_and_save(self):
        rec = _train(self)
        state = {
            name: {"model": e.model.state_dict(), "scaler": e.scaler.full_state_dict(), "masters": e.master_weights()}
            for name, e in self.engines.items()
        }
        torch.save(state, os.path.join(os.environ["MPT_TEST_OUT"], f"rank{self.dist.rank}.pt"))
        return rec

    precision.PrecisionEngine.backward = backward
    train.Run.train = train_and_save
