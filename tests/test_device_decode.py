"""data.decode=device: the JPEGs' bytes decoded, cropped, flipped and normalized on the run's device
(here the CPU), against the host path's PIL transforms."""

from __future__ import annotations

import shutil

import pytest
import torch

from mpt.config import ConfigError
from mpt.datasets import device_decode, imagefolder, resident_images, sampling
from mpt.datasets.device_decode import DeviceDecodedImages
from mpt.datasets.imagefolder import ImageFolderData

from .conftest import build_run, cifar_mini_run, compose_cfg, read_record, shared_data

CPU = torch.device("cpu")
# One grey level is 1/255/std, about 0.017 after ImageNet's normalization; another image is ~0.5 away.
ONE_GREY_LEVEL = 1 / 255 / min(imagefolder.IMAGENET_STD)


def cfg(*overrides: str, root=None):
    return compose_cfg(
        "data=imagefolder",
        f"data.root={root or shared_data('cifar10-mini')}",
        "data.val_split=test",
        "data.num_workers=0",
        "schedule=smoke",
        "schedule.batch_size=50",
        *overrides,
    )


@pytest.mark.parametrize("size", [24, 40])  # cropped down and up from CIFAR's 32 pixels
def test_batches_hold_the_host_paths_crops_flips_and_order(size):
    c = cfg(f"schedule.image_size={size}", "data.decode=device")
    ours, host = (
        DeviceDecodedImages(c.data, c.schedule, seed=3, device=CPU),
        ImageFolderData(c.data, c.schedule, seed=3, device=CPU),
    )
    for epoch in (0, 1):
        for (x, y), (x_host, y_host) in list(zip(ours.epoch(epoch), host.epoch(epoch), strict=True))[:3]:
            assert torch.equal(y, y_host) and x.shape == x_host.shape == (50, 3, size, size)
            per_image = (x - x_host).abs().mean(dim=(1, 2, 3))
            # the same box and flip, resampled by torchvision's tensor resize instead of PIL's
            assert per_image.max() < 0.5 * ONE_GREY_LEVEL, per_image.max()
            assert (x - x_host.roll(1, 0)).abs().mean(
                dim=(1, 2, 3)
            ).min() > 10 * ONE_GREY_LEVEL  # what a wrong box would be
    for (x, y), (x_host, y_host) in zip(ours.val(), host.val(), strict=True):
        assert torch.equal(y, y_host)
        assert (x - x_host).abs().mean() < 0.1 * ONE_GREY_LEVEL and (x - x_host).abs().max() <= 3.01 * ONE_GREY_LEVEL
    torch.testing.assert_close(ours.plain_train_images(10), host.plain_train_images(10))


def test_workers_give_what_the_main_process_gives():
    c, c1 = (
        cfg("schedule.image_size=32", "data.decode=device"),
        cfg("schedule.image_size=32", "data.decode=device", "data.num_workers=2"),
    )
    alone, shared = (
        DeviceDecodedImages(c.data, c.schedule, seed=1, device=CPU),
        DeviceDecodedImages(c1.data, c1.schedule, seed=1, device=CPU),
    )
    try:
        for (x, y), (x1, y1) in list(zip(alone.epoch(0), shared.epoch(0)))[:4]:
            assert torch.equal(x, x1) and torch.equal(y, y1)
    finally:
        shared.close()


@pytest.fixture
def corrupt_tree(tmp_path):
    root = tmp_path / "tree"
    shutil.copytree(shared_data("cifar10-mini"), root)
    first = sorted((root / "train").iterdir())[0]
    good = sorted(first.iterdir())[0]
    return root, good


def test_a_file_that_is_no_image_fails_the_run_naming_it(corrupt_tree):
    root, good = corrupt_tree
    good.write_bytes(b"not an image at all")
    c = cfg("schedule.image_size=32", "data.decode=device", root=root)
    data = DeviceDecodedImages(c.data, c.schedule, seed=0, device=CPU)
    with pytest.raises(imagefolder.CorruptImage, match=rf"^corrupt image {good}: "):
        for _ in data.epoch(0):
            pass


def test_a_jpeg_whose_data_is_cut_fails_where_it_is_decoded_naming_it(corrupt_tree):
    root, good = corrupt_tree
    whole = good.read_bytes()
    good.write_bytes(whole[: len(whole) // 3])  # its header intact: the box is drawn, the decode fails
    c = cfg("schedule.image_size=32", "data.decode=device", root=root)
    data = DeviceDecodedImages(c.data, c.schedule, seed=0, device=CPU)
    with pytest.raises(imagefolder.CorruptImage, match=rf"^corrupt image {good}: "):
        for _ in data.epoch(0):
            pass


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.decode=gpu"], r"^data.decode=gpu: must be host \(PIL in the loader's workers\) or device"),
        (
            ["data.decode=device", "data.resident=true", "data.augment=cifar"],
            r"^data.decode=device with data.resident=true: ",
        ),
        (
            ["data.decode=device", "data.augment=cifar"],
            r"^data.decode=device: data.augment=cifar is not computed there",
        ),
    ],
)
def test_settings_it_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        device_decode.validate(cfg(*overrides))
    with pytest.raises(ConfigError, match=message):  # and through data=imagefolder's own check
        resident_images.validate(cfg(*overrides))


@pytest.mark.parametrize(
    "env, affinity, expected",
    [
        ({"SLURM_CPUS_PER_TASK": "6"}, range(64), 5),  # SLURM's allocation, not the node's CPUs
        ({}, range(16), 15),
        ({"LOCAL_WORLD_SIZE": "4"}, range(16), 3),  # torchrun's processes on this node share the mask
        ({"SLURM_CPUS_PER_TASK": "16", "LOCAL_WORLD_SIZE": "4"}, range(64), 3),  # and SLURM's task
        ({}, range(1), 0),  # one CPU: the main process loads
    ],
)
def test_default_workers_are_the_cpus_this_process_was_given_less_one(monkeypatch, env, affinity, expected):
    for key in ("SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sampling.os, "sched_getaffinity", lambda pid: set(affinity), raising=False)
    monkeypatch.setattr(sampling, "cgroup_cpu_quota", lambda: None)
    assert sampling.default_workers() == expected


@pytest.mark.parametrize("content, cpus", [("max 100000\n", None), ("250000 100000\n", 3), ("50000 100000\n", 1)])
def test_a_cgroup_quota_bounds_the_workers(tmp_path, monkeypatch, content, cpus):
    (tmp_path / "cpu.max").write_text(content)
    assert sampling.cgroup_cpu_quota(str(tmp_path / "cpu.max")) == cpus
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(sampling.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(sampling, "cgroup_cpu_quota", lambda: cpus)
    assert sampling.default_workers() == (63 if cpus is None else cpus - 1)


def test_iterating_it_leaves_the_global_rng_as_it_was():
    c = cfg("schedule.image_size=32", "data.decode=device")
    data = DeviceDecodedImages(c.data, c.schedule, seed=0, device=CPU)
    before = torch.get_rng_state()
    next(iter(data.epoch(0)))
    next(iter(data.val()))
    assert torch.equal(torch.get_rng_state(), before)


def test_an_empty_file_and_a_png_are_read_as_the_host_path_reads_them(corrupt_tree):
    root, good = corrupt_tree
    from PIL import Image

    png = good.with_suffix(".png")
    Image.open(good).convert("RGB").save(png)  # the same pixels, losslessly
    good.unlink()
    c = cfg("schedule.image_size=32", "data.decode=device", root=root)
    ours, host = (
        DeviceDecodedImages(c.data, c.schedule, seed=0, device=CPU),
        ImageFolderData(c.data, c.schedule, seed=0, device=CPU),
    )
    for (x, _), (x_host, _) in zip(ours.epoch(0), host.epoch(0), strict=True):
        assert (x - x_host).abs().mean(dim=(1, 2, 3)).max() < 0.5 * ONE_GREY_LEVEL
    png.write_bytes(b"")
    with pytest.raises(imagefolder.CorruptImage, match=rf"^corrupt image {png}: "):
        for _ in DeviceDecodedImages(c.data, c.schedule, seed=0, device=CPU).epoch(0):
            pass


def test_a_run_trains_on_it_and_its_record_says_where_it_decoded(tmp_path, in_process):
    job = build_run(tmp_path / "run", *cifar_mini_run("data.decode=device", "schedule.batch_size=50"))
    assert job.execute().status == "ok"
    assert read_record(tmp_path / "run")["data"]["decode"] == "device (cpu)"


@pytest.mark.gpu
def test_on_cuda_nvjpeg_gives_the_cpus_batches_within_a_grey_level():
    c = cfg("schedule.image_size=24", "data.decode=device")
    cuda, cpu = (
        DeviceDecodedImages(c.data, c.schedule, seed=2, device=torch.device("cuda")),
        DeviceDecodedImages(c.data, c.schedule, seed=2, device=CPU),
    )
    for (x, y), (x_cpu, y_cpu) in list(zip(cuda.epoch(0), cpu.epoch(0)))[:3]:
        assert x.device.type == "cuda" and torch.equal(y.cpu(), y_cpu)
        assert (x.cpu() - x_cpu).abs().mean(dim=(1, 2, 3)).max() < ONE_GREY_LEVEL  # nvJPEG's IDCT against libjpeg's
