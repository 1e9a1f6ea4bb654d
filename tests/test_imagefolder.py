"""The ImageFolder loader: the real layout read from disk, and a clear error for each way it can be wrong."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mpt.config import ConfigError
from mpt.datasets.imagefolder import ImageFolderData

from .conftest import CPU, TINY, build_run, compose_cfg, read_record, shared_data


def make_folder(root, splits=("train", "val"), classes=("cat", "dog"), per_class=3, size=40):
    for split in splits:
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (size + i, size), color=(i * 40, 100, 200)).save(root / split / c / f"{i}.jpg")
    return root


def loader(root, *overrides, seed=0):
    cfg = compose_cfg("data=imagefolder", f"data.root={root}", "data.num_workers=0", "schedule=smoke", *overrides)
    return ImageFolderData(cfg.data, cfg.schedule, seed=seed, device=CPU)


def test_reads_the_layout_and_applies_the_crops(tmp_path):
    data = loader(make_folder(tmp_path), "schedule.image_size=32", "schedule.batch_size=2")
    assert data.info["classes"] == ["cat", "dog"] and data.info["num_classes"] == 2
    assert data.steps_per_epoch == 3  # 6 images, batch 2, drop_last
    images, labels = next(iter(data.epoch(0)))
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32 and labels.dtype == torch.int64
    val = list(data.val())
    assert sum(len(y) for _, y in val) == 6 and val[0][0].shape[-2:] == (32, 32)


def test_cifar10_mini_from_shared_data():
    root = shared_data("cifar10-mini")
    data = loader(root, "data.val_split=test", "schedule.batch_size=20")
    assert data.info["num_classes"] == 10
    assert (data.info["train_samples"], data.info["val_samples"]) == (1000, 200)
    images, _ = next(iter(data.epoch(0)))
    assert images.shape == (20, 3, 32, 32)


def test_a_run_trains_on_cifar10_mini_and_evaluates_its_whole_test_split(tmp_path, in_process):
    root = shared_data("cifar10-mini")
    job = build_run(
        tmp_path,
        TINY,
        "data=imagefolder",
        f"data.root={root}",
        "data.val_split=test",
        "data.num_workers=0",
        "schedule=smoke",
        "schedule.eval_batches=null",
        "schedule.batch_size=50",
    )
    assert job.execute().status == "ok"
    rec = read_record(tmp_path)
    assert rec["status"] == "ok"
    assert rec["data"]["num_classes"] == 10
    assert (rec["data"]["train_samples"], rec["data"]["val_samples"]) == (1000, 200)
    assert rec["metrics"]["val_samples"] == 200  # the whole test split was evaluated
    assert rec["samples"] == 150


def test_a_capped_evaluation_samples_every_class_the_same_for_every_seed(tmp_path):
    # The split lists cat's images before dog's: in file order the first batch would be all cats.
    root = make_folder(tmp_path, per_class=8)
    first = [next(iter(loader(root, "schedule.batch_size=8", seed=s).val()))[1] for s in (0, 1)]
    assert set(first[0].tolist()) == {0, 1}
    assert torch.equal(first[0], first[1])
    labels = torch.cat([y for _, y in loader(root, "schedule.batch_size=8").val()])
    assert sorted(labels.tolist()) == [0] * 8 + [1] * 8  # still every image, once


def test_missing_split_names_it(tmp_path):
    make_folder(tmp_path, splits=("train",))
    with pytest.raises(ConfigError, match=r"no 'val' folder \(found: train\)"):
        loader(tmp_path)


def test_class_folder_without_images_is_named(tmp_path):
    make_folder(tmp_path)
    (tmp_path / "train" / "empty_class").mkdir()
    with pytest.raises(ConfigError, match="empty_class"):
        loader(tmp_path)


def test_empty_root_is_named(tmp_path):
    with pytest.raises(ConfigError, match=f"data.root={tmp_path}: no 'train' folder"):
        loader(tmp_path)


def test_fewer_images_than_a_batch_is_rejected(tmp_path):
    make_folder(tmp_path, per_class=1)
    with pytest.raises(ConfigError, match="2 training images, fewer than one batch of 4"):
        loader(tmp_path, "schedule.batch_size=4")


@pytest.mark.slow
def test_a_corrupt_image_fails_the_run_naming_it_and_the_sweep_goes_on(tmp_path):
    from .conftest import ROOT, TINY, mpt_run, read_record

    bad, good = (
        make_folder(tmp_path / "bad", per_class=4, size=32),
        make_folder(tmp_path / "good", per_class=4, size=32),
    )
    corrupt = bad / "train" / "dog" / "2.jpg"
    corrupt.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    r = mpt_run(
        "-m",
        TINY,
        f"data.root={bad},{good}",
        "data=imagefolder",
        "data.num_workers=1",
        "data.verify=false",  # met mid-run, as in a long run: smoke runs look before they start
        "schedule=smoke",
        "schedule.batch_size=4",
        "schedule.steps=4",
        "checkpoint=false",
        f"hydra.sweep.dir={tmp_path}/runs",
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    records = {
        rec["config"]["data"]["root"]: rec
        for rec in (read_record(p.parent) for p in (tmp_path / "runs").glob("*/result.json"))
    }
    assert records[str(bad)]["status"] == "error"
    assert records[str(bad)]["message"].startswith(f"mpt.datasets.imagefolder.CorruptImage: corrupt image {corrupt}")
    assert "\n" not in records[str(bad)]["message"]
    assert records[str(good)]["status"] == "ok"


def test_grayscale_and_palette_images_load_as_rgb(tmp_path):
    make_folder(tmp_path, per_class=2)
    Image.new("L", (40, 40), 128).save(tmp_path / "train" / "cat" / "gray.png")
    Image.new("P", (40, 40), 3).save(tmp_path / "train" / "dog" / "palette.png")
    data = loader(tmp_path, "schedule.image_size=32", "schedule.batch_size=6")
    images, _ = next(iter(data.epoch(0)))
    assert images.shape == (6, 3, 32, 32)


def test_the_largest_seed_validation_accepts_draws_its_samples():
    """Each sample's generator is seeded from (seed, epoch, index): a seed near 2**32 must not
    overflow torch's 64-bit seeds, and two seeds still draw different samples."""
    from torch.utils.data import Dataset

    from mpt.datasets.sampling import SeededSamples

    class Noise(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(3)

    largest, small = SeededSamples(Noise(), 2**32 - 1), SeededSamples(Noise(), 7)
    assert torch.equal(largest[(2, 3)], largest[(2, 3)])  # the same key, the same draw
    assert not torch.equal(largest[(2, 3)], small[(2, 3)])


def test_a_smoke_run_names_every_unreadable_image_before_it_starts(tmp_path, in_process):
    root = make_folder(tmp_path / "data", per_class=4, size=32)
    broken = [root / "train" / "dog" / "2.jpg", root / "val" / "cat" / "1.jpg"]
    broken[0].write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    broken[1].write_bytes(broken[1].read_bytes()[:100])  # cut short, as an interrupted copy leaves it
    args = [TINY, "data=imagefolder", f"data.root={root}", "schedule=smoke", "schedule.batch_size=4"]
    with pytest.raises(ConfigError) as error:
        build_run(tmp_path / "run", *args)
    lines = str(error.value).splitlines()
    assert lines[0] == (
        "data.verify: 2 of 16 images cannot be read; fix or remove them (data.verify=false skips this check):"
    )
    assert [line.split(": ")[0] for line in lines[1:]] == [f"  corrupt image {p}" for p in sorted(broken)]
    build_run(tmp_path / "unchecked", *args, "data.verify=false", "logger=none")  # unchecked, it builds
