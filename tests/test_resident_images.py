"""ImageFolder data kept on the device: the loader's images, order and augmentation semantics, computed
per batch on the device; crops against numpy's padding, batches against the loader's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mpt.config import ConfigError
from mpt.datasets import resident_images
from mpt.datasets.imagefolder import CIFAR10_MEAN, CIFAR10_STD, ImageFolderData, first_flips
from mpt.datasets.resident_images import ResidentImages, crop_and_flip
from mpt.distributed import Dist

from .conftest import CPU, build_run, cifar_mini_run, compose_cfg, read_record, shared_data

MEAN = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)


def cfg(tmp_path, augment: str, *overrides: str):
    return compose_cfg(
        "data=imagefolder",
        f"data.root={shared_data('cifar10-mini')}",
        "data.val_split=test",
        "data.num_workers=0",
        f"data.augment={augment}",
        "data.resize_ratio=1.0",
        "data.resident=true",
        f"data.cache_dir={tmp_path / 'cache'}",
        "schedule=smoke",
        "schedule.image_size=32",
        "schedule.batch_size=50",
        *overrides,
    )


def resident(c, seed: int = 0) -> ResidentImages:
    return ResidentImages(c.data, c.schedule, seed=seed, device=CPU)


def loader(c, seed: int = 0) -> ImageFolderData:
    return ImageFolderData(c.data, c.schedule, seed=seed, device=CPU)


@pytest.mark.parametrize("mode, np_mode", [("constant", "constant"), ("reflect", "reflect")])
def test_each_crop_is_the_window_of_the_image_numpy_pads_and_flips(mode, np_mode):
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (6, 3, 8, 8), generator=g, dtype=torch.uint8)
    pad = 2
    dy, dx = torch.randint(2 * pad + 1, (6,), generator=g), torch.randint(2 * pad + 1, (6,), generator=g)
    flip = torch.tensor([True, False, True, False, False, True])
    out = crop_and_flip(images, pad, mode, dy, dx, flip)
    assert out.dtype == torch.uint8 and out.shape == images.shape
    for i in range(6):
        padded = np.pad(images[i].numpy(), ((0, 0), (pad, pad), (pad, pad)), mode=np_mode)
        window = padded[:, int(dy[i]) : int(dy[i]) + 8, int(dx[i]) : int(dx[i]) + 8]
        expected = window[:, :, ::-1] if flip[i] else window
        assert np.array_equal(out[i].numpy(), expected), i


def test_it_holds_the_loaders_images_in_the_loaders_order(tmp_path):
    c = cfg(tmp_path, "cifar")
    res, ref = resident(c, seed=3), loader(c, seed=3)
    assert res.info["classes"] == ref.info["classes"] and res.info["resident"] is True
    assert (res.info["train_samples"], res.info["val_samples"], res.steps_per_epoch) == (1000, 200, ref.steps_per_epoch)
    for epoch in (0, 1):
        ours = [y for _, y in res.epoch(epoch)]
        theirs = [y for _, y in ref.epoch(epoch)]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    # evaluation: the same images, decoded and normalized as ToTensor and Normalize do
    for (x, y), (x_ref, y_ref) in zip(res.val(), ref.val(), strict=True):
        assert torch.equal(y, y_ref)
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(res.plain_train_images(20), ref.plain_train_images(20), rtol=0, atol=1e-6)


def windows(image: torch.Tensor, pad: int, mode: str) -> dict[tuple[int, int, bool], torch.Tensor]:
    """Every crop of the padded image and its mirror, normalized, by (dy, dx, flipped)."""
    padded = np.pad(image.numpy(), ((0, 0), (pad, pad), (pad, pad)), mode=mode)
    out = {}
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            w = torch.from_numpy(np.ascontiguousarray(padded[:, dy : dy + 32, dx : dx + 32]))
            for flipped in (False, True):
                out[dy, dx, flipped] = ((w.flip(-1) if flipped else w).float()[None] / 255 - MEAN) / STD
    return out


@pytest.mark.parametrize("augment, pad, mode", [("cifar", 4, "constant"), ("airbench", 2, "reflect")])
def test_each_training_image_is_a_crop_of_its_padded_image_flipped_as_the_recipe_says(tmp_path, augment, pad, mode):
    res = resident(cfg(tmp_path, augment), seed=5)
    coins = first_flips(1000, 5)
    order = torch.Generator().manual_seed(5)  # the loader's order: one permutation per epoch
    for epoch, (images, labels) in enumerate(next(iter(res.epoch(e))) for e in (0, 1)):
        perm = torch.randperm(1000, generator=order)
        flips, offsets = [], set()
        for i in range(16):
            index = int(perm[i])
            assert labels[i] == res.train_labels[index]
            found = [
                k
                for k, w in windows(res.train_images[index], pad, mode).items()
                if torch.allclose(w[0], images[i], rtol=0, atol=1e-6)
            ]
            assert found, (epoch, i)
            offsets.add(found[0][:2])
            flips.append(found[0][2])
            if augment == "airbench":  # the image's coin in the first epoch, the other way in the second
                assert any(flipped == (bool(coins[index]) != bool(epoch)) for *_, flipped in found), (epoch, i)
        assert len(offsets) > 3 and any(flips) and not all(flips)  # crops and flips vary across a batch


def test_a_resumed_epoch_draws_the_batches_an_uninterrupted_one_drew(tmp_path):
    c = cfg(tmp_path, "cifar")
    whole = resident(c, seed=1)
    next(iter(whole.epoch(0)))
    full = list(whole.epoch(1))
    again = resident(c, seed=1)
    again.load_state_dict(whole.state_dict())  # the order as epoch 1 began, as a checkpoint holds it
    resumed = list(again.epoch(1, start=3))
    for (x, y), (x_full, y_full) in zip(resumed, full[3:], strict=True):
        assert torch.equal(y, y_full) and torch.equal(x, x_full)


def test_the_decoded_splits_are_cached_and_a_changed_folder_is_decoded_again(tmp_path):
    root = tmp_path / "data"
    for split in ("train", "test"):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(3):  # BMP: every file of one size, whatever its pixels
                Image.new("RGB", (32, 32), color=(i * 40, 100, 200)).save(root / split / c / f"{i}.bmp")
    c = compose_cfg(
        "data=imagefolder", f"data.root={root}", "data.val_split=test", "data.num_workers=0", "data.augment=cifar",
        "data.resize_ratio=1.0", "data.resident=true", f"data.cache_dir={tmp_path / 'cache'}", "schedule=smoke",
        "schedule.image_size=32", "schedule.batch_size=2",
    )  # fmt: skip
    first = resident(c)
    cached = sorted((tmp_path / "cache").glob("*.pt"))
    assert len(cached) == 2  # train and test
    stamps = [p.stat().st_mtime_ns for p in cached]
    assert torch.equal(resident(c).train_images, first.train_images)
    assert [p.stat().st_mtime_ns for p in cached] == stamps  # read, not decoded again
    image = root / "train" / "cat" / "0.bmp"
    size = image.stat().st_size
    Image.new("RGB", (32, 32), color=(255, 0, 0)).save(image)
    assert image.stat().st_size == size
    again = resident(c)
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 3  # a new training split, the same test split
    assert again.train_images[0, :, 0, 0].tolist() == [255, 0, 0] and not torch.equal(
        again.train_images, first.train_images
    )


def test_processes_sharing_a_batch_draw_what_one_process_draws(tmp_path):
    c = cfg(tmp_path, "cifar")
    whole = resident(c, seed=2)
    parts = [ResidentImages(c.data, c.schedule, seed=2, device=CPU, shard=Dist(rank=r, world_size=2)) for r in (0, 1)]
    for batch, (x0, y0), (x1, y1) in zip(whole.epoch(0), parts[0].epoch(0), parts[1].epoch(0)):
        assert torch.equal(torch.cat([y0, y1]), batch[1]) and torch.equal(torch.cat([x0, x1]), batch[0])


def test_a_resident_source_refuses_an_augmentation_it_does_not_compute(tmp_path):
    c = cfg(tmp_path, "imagenet")
    with pytest.raises(
        ConfigError,
        match=(
            r"^data.resident=true: data.augment=imagenet is not computed on the device"
            r" \(expected cifar or airbench\)$"
        ),
    ):
        resident_images.validate(c)


def test_evaluation_batches_are_the_eval_batch_size_and_hold_the_same_images(tmp_path):
    default, larger = resident(cfg(tmp_path, "cifar")), resident(cfg(tmp_path, "cifar", "data.eval_batch_size=120"))
    assert [len(y) for _, y in default.val()] == [50, 50, 50, 50]
    assert [len(y) for _, y in larger.val()] == [120, 80]
    assert torch.equal(torch.cat([x for x, _ in larger.val()]), torch.cat([x for x, _ in default.val()]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.resident=false", "data.eval_batch_size=2000"],
            r"^data.eval_batch_size=2000: a resident source's setting; set data.resident=true or leave it null$",
        ),
        (
            ["data.eval_batch_size=0"],
            r"^data.eval_batch_size=0: must be a positive number of images, or null for schedule.batch_size$",
        ),
    ],
)
def test_an_eval_batch_size_it_cannot_use_is_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        resident_images.validate(cfg(tmp_path, "cifar", *overrides))


def test_a_run_trains_on_it_and_says_its_data_was_resident(tmp_path, in_process):
    args = cifar_mini_run(
        "data.augment=cifar", "data.resident=true", f"data.cache_dir={tmp_path / 'cache'}", "schedule.batch_size=50"
    )
    job = build_run(tmp_path / "run", *args)
    assert job.execute().status == "ok"
    record = read_record(tmp_path / "run")
    assert record["status"] == "ok" and record["data"]["resident"] is True
