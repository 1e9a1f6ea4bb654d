"""Evaluation shared over ranks: each rank's part of the validation batches, and the metrics reduced
over ranks. The parts of every source, taken as ranks 0 and 1 of 2 (no process group: a source's
val() makes no collective), are disjoint and together are one process's batches; the 2-process runs
(slow) score what 1 process scores."""

from __future__ import annotations

import math

import pytest
import torch

from mpt.datasets import build_data
from mpt.distributed import Dist
from mpt.models.fid import GaussianStats

from .conftest import CPU, ROOT, compose_cfg, mpt_run, read_record, shared_data

WORLD = 2


def tensors(batch) -> list[torch.Tensor]:
    """A batch's per-sample tensors, whatever the task's batch type (a tuple, a GAN's tensor,
    detection's list of target dicts, a translation batch)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if hasattr(batch, "src"):  # a TranslationBatch: its padding depends on the batch, not the rank
        return [batch.src, batch.tgt_out]
    out = []
    for part in batch:
        if isinstance(part, torch.Tensor):
            out.append(part)
        else:  # detection's targets
            out += [t["boxes"] for t in part]
    return out


def parts(overrides: list[str], limit: int | None = None):
    """One process's batches, and each rank's of WORLD."""
    cfg = compose_cfg(*overrides)
    whole = list(build_data(cfg, CPU).val(limit))
    ranks = [list(build_data(cfg, CPU, shard=Dist(r, WORLD)).val(limit)) for r in range(WORLD)]
    return whole, ranks


SOURCES = {
    "synthetic images": ["model=alexnet", "data=synthetic", "data.val_samples=100", "schedule.batch_size=16"],
    "synthetic discs (GAN)": ["model=dcgan", "data=synthetic", "data.val_samples=40", "schedule.batch_size=8"],
    "synthetic shapes (SSD)": [
        "model=ssd",
        "data=synthetic",
        "data.val_samples=10",
        "data.train_samples=8",
        "schedule.batch_size=4",
    ],  # fmt: skip
    "synthetic translation": ["model=gnmt", "data=synthetic", "data.val_samples=50", "schedule.batch_size=8"],
    "sentences (LM)": [
        "model=biglstm_tiny",
        "data=synthetic",
        "model.eval_state=sentence",
        "data.val_samples=40",
        "schedule.batch_size=8",
    ],  # fmt: skip
}


@pytest.mark.parametrize("name", SOURCES)
@pytest.mark.parametrize("limit", [None, 3])
def test_the_ranks_parts_are_disjoint_and_are_one_process_batches_in_order(name, limit):
    whole, ranks = parts(SOURCES[name], limit)
    assert len(whole) >= 3 and len(whole) % WORLD == 1  # an odd count: one rank scores one more
    assert [len(p) for p in ranks] == [len(range(r, len(whole), WORLD)) for r in range(WORLD)]
    for i, batch in enumerate(whole):  # batch i is rank i mod WORLD's
        mine = ranks[i % WORLD][i // WORLD]
        for a, b in zip(tensors(batch), tensors(mine), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("loader", ["loader", "resident"])
def test_an_image_folder_loads_only_its_ranks_images(loader):
    root = shared_data("cifar10-mini")
    overrides = ["model=alexnet", "data=imagefolder", f"data.root={root}", "data.val_split=test",
                 "data.num_workers=0", "schedule.batch_size=64", "schedule.image_size=32",
                 "data.augment=cifar", f"data.resident={str(loader == 'resident').lower()}"]  # fmt: skip
    whole, ranks = parts(overrides)
    labels = torch.cat([y for _, y in whole])
    # Batch i is rank i mod 2's: re-interleaved, the ranks' labels are the whole set's, in its order.
    merged = [ranks[i % WORLD][i // WORLD] for i in range(len(whole))]
    assert torch.equal(torch.cat([y for _, y in merged]), labels)
    assert sum(len(y) for p in ranks for _, y in p) == len(labels)


def test_the_carried_stream_gives_each_rank_its_rows_of_every_window():
    overrides = ["model=biglstm_tiny", "data=synthetic", "data.val_samples=200", "schedule.batch_size=8"]
    whole, ranks = parts(overrides)
    assert len(whole) > 1 and all(len(p) == len(whole) for p in ranks)  # every rank carries its streams
    for i, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([p[i][0] for p in ranks]), x)
        assert torch.equal(torch.cat([p[i][1] for p in ranks]), y)
    capped = parts(overrides, limit=2)[1]
    assert all(len(p) == 2 for p in capped)


def test_eval_batches_and_batch_order():
    assert [list(Dist(r, 3).eval_batches(7)) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert list(Dist().eval_batches(2)) == [0, 1]
    assert Dist().in_batch_order([["a", "b"], ["c"]]) == ["a", "b", "c"]


def test_gaussian_stats_merged_from_parts_equal_one_pass_over_the_features():
    x = torch.randn(300, 5, dtype=torch.float64) * 3 + 10
    one = GaussianStats()
    for chunk in x.split(32):
        one.update(chunk)
    a, b = GaussianStats(), GaussianStats()
    for i, chunk in enumerate(x.split(32)):
        (a if i % 2 == 0 else b).update(chunk)
    merged = GaussianStats.merged([a, b, GaussianStats()])  # a rank with no features adds nothing
    assert merged.n == 300
    torch.testing.assert_close(merged.mean(), x.mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(merged.cov(), torch.cov(x.T), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(merged.cov(), one.cov(), rtol=1e-10, atol=1e-12)


# --- 2 processes (gloo) against 1: the same weights, the metric scored by each rank on its part and
# reduced, against one process's over the whole set. A rate of 1e-30 leaves every weight as it was
# initialized (an update far below half its ulp; zero biases move to ~1e-30, lost against any activation),
# where the two runs' gradients differ in their last bits.

FROZEN = ["schedule=smoke", "schedule.steps=1", "schedule.eval_batches=null", "optim.lr=1e-30", "optim.lr_batch=null",
          "checkpoint=false", "device=cpu"]  # fmt: skip
TASKS = {
    # metric: tolerance (0: bit for bit: the same batches, the same kernels, integer counts)
    "classification": (["model=alexnet", "data=synthetic", "data.val_samples=100", "schedule.batch_size=16",
                        "schedule.image_size=64"], {"top1": 0, "top5": 0, "val_samples": 0, "val_loss": 1e-12}),
    "translation": (["model=gnmt", "data=synthetic", "data.val_samples=40", "schedule.batch_size=8",
                     "model.hidden_size=32"], {"bleu": 0, "val_sentences": 0, "val_loss": 1e-12}),
    "detection": (["model=ssd", "data=synthetic", "data.val_samples=10", "data.train_samples=8",
                   "schedule.batch_size=4"], {"map": 0, "val_samples": 0}),
    # Each rank runs its streams: the same rows in a smaller product may round differently.
    "language model": (["model=biglstm_tiny", "data=synthetic", "data.val_samples=200", "schedule.batch_size=8"],
                       {"val_tokens": 0, "ppl": 1e-5, "val_cell_max": 1e-5}),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_two_ranks_score_what_one_process_scores(task, tmp_path):
    from .test_distributed import torchrun

    overrides, tolerances = TASKS[task]
    one, two = tmp_path / "one", tmp_path / "two"
    # One thread in every process, as torchrun gives its own by default: the same kernels' sums in
    # the same order, so that what differs is only how the set was shared.
    threads = {"OMP_NUM_THREADS": "1"}
    r = mpt_run(*overrides, *FROZEN, f"hydra.run.dir={one}", cwd=ROOT, env=threads)
    assert r.returncode == 0, r.stderr[-2000:]
    r = torchrun(*overrides, *FROZEN, f"hydra.run.dir={two}", env=threads)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_record(one), read_record(two)
    assert b["distributed"]["world_size"] == 2 and b["distributed"]["evaluation"] == "sharded"
    for key, rel in tolerances.items():
        x, y = a["metrics"][key], b["metrics"][key]
        assert (x == y) if rel == 0 else math.isclose(x, y, rel_tol=rel), (key, x, y)


@pytest.mark.slow
def test_a_rank_with_no_batch_to_score_does_not_wait_for_the_others(tmp_path):
    """Batch-norm with DDP's own buffer broadcast on, and one validation batch: rank 0 scores it,
    rank 1 none. DDP's first forward after training broadcasts the buffers, a collective rank 1
    never reaches: without before_evaluation's word to the wrapper, the run waits until killed."""
    from .test_distributed import torchrun

    r = torchrun("model=mobilenet_v3_small", "data=synthetic", "data.val_samples=16", "schedule.batch_size=16",
                 "distributed.broadcast_buffers=true", *FROZEN, f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rec = read_record(tmp_path)
    assert rec["metrics"]["val_samples"] == 16 and rec["distributed"]["broadcast_buffers"] is True
