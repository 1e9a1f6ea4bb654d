"""The GAN task's real images: synthetic discs and a folder of image files (UTKFace faces from
../shared/data), as [B, 3, S, S] float32 in [-1, 1], shuffled per epoch and resumable mid-epoch."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from mpt.config import DATA_SCHEMAS, ConfigError
from mpt.datasets.discs import SyntheticDiscs
from mpt.datasets.image_dir import CropTooLarge, ImageDirData
from mpt.datasets.imagefolder import CorruptImage

from .conftest import CPU, shared_data

UTKFACE_FILES = 24  # enough for batches and a permutation, extracted in well under a second


def data_cfg(name: str, **fields) -> DictConfig:
    return OmegaConf.structured(DATA_SCHEMAS[name](name=name, **fields))


def schedule_cfg(batch_size: int, image_size: int) -> DictConfig:
    return OmegaConf.create({"batch_size": batch_size, "image_size": image_size})


def discs(seed: int = 0, size: int = 16, batch_size: int = 8, **fields) -> SyntheticDiscs:
    fields = {"train_samples": 40, "val_samples": 12, **fields}
    return SyntheticDiscs(data_cfg("synthetic", **fields), schedule_cfg(batch_size, size), seed=seed, device=CPU)


def image_dir(root, seed: int = 0, size: int = 32, batch_size: int = 4, **fields) -> ImageDirData:
    fields = {"root": str(root), "num_workers": 0, "val_samples": 1000, **fields}
    return ImageDirData(data_cfg("image_dir", **fields), schedule_cfg(batch_size, size), seed=seed, device=CPU)


def in_unit_range(images: torch.Tensor) -> bool:
    return images.dtype == torch.float32 and images.min() >= -1 and images.max() <= 1


def check_resume(make) -> None:
    """State taken as epoch 1 begins, loaded into a fresh source: epoch(1, start=2) is batches 2.. of
    the uninterrupted epoch 1."""
    source = make()
    list(source.epoch(0))
    first = source.epoch(1)
    batches = [next(first)]  # a generator source records its epoch-start state on the first batch
    state = source.state_dict()
    batches += list(first)
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed.epoch(1, start=2))
    assert len(rest) == len(batches) - 2 and all(torch.equal(a, b) for a, b in zip(rest, batches[2:]))


# ---------------------------------------------------------------------------- synthetic discs


def test_discs_shape_range_and_determinism():
    data = discs()
    assert data.info == {"train_samples": 40, "val_samples": 12, "resident": True}
    assert data.steps_per_epoch == 5
    batches = list(data.epoch(0))
    assert len(batches) == 5 and all(b.shape == (8, 3, 16, 16) and in_unit_range(b) for b in batches)
    val = list(data.val())
    assert [v.shape[0] for v in val] == [8, 4] and all(in_unit_range(v) for v in val)
    assert torch.equal(discs().train_images, data.train_images)  # same seed, same pixels
    assert not torch.equal(discs(seed=1).train_images, data.train_images)
    assert not torch.equal(data.train_images[:12], data.val_images)  # the reference images are other draws


def test_discs_epochs_are_permutations_in_a_new_order():
    data = discs(train_samples=32)
    e0, e1 = torch.cat(list(data.epoch(0))), torch.cat(list(data.epoch(1)))
    key = lambda x: sorted(map(tuple, x.flatten(1).tolist()))  # noqa: E731
    assert key(e0) == key(e1) == key(data.train_images.float().div(127.5).sub(1))
    assert not torch.equal(e0, e1)


def test_discs_resume_mid_epoch():
    check_resume(lambda: discs())


def test_discs_fewer_samples_than_a_batch_is_rejected():
    with pytest.raises(ConfigError, match="data.train_samples=4: fewer than one batch of schedule.batch_size=8"):
        discs(train_samples=4)


def test_each_image_holds_one_disc():
    # Noise-free, so the disc's pixels are exactly those off the background colour. A generator
    # that made noise, blobs or several shapes fails: a disc is the one shape all of whose pixels
    # lie within sqrt(area / pi) of its centroid.
    size = 32
    images = discs(size=size, train_samples=64, pixel_noise=0.0).train_images.float() / 255
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    for img in images:
        background = img.flatten(1).median(dim=1).values  # the disc covers under 40% of the image
        mask = (img - background[:, None, None]).abs().amax(0) > 0.2
        area = mask.sum().item()
        radius = (area / torch.pi) ** 0.5
        assert 0.12 * size < radius < 0.38 * size
        cy, cx = ys[mask].mean(), xs[mask].mean()
        assert ((ys[mask] - cy) ** 2 + (xs[mask] - cx) ** 2).sqrt().max() < radius + 1.5
    noisy = discs(size=size, train_samples=64).train_images.float() / 255
    assert 0.04 < (noisy - images).std() < 0.11  # pixel_noise=0.1 on the same discs, less where clamped


# ---------------------------------------------------------------------------- image folders


@pytest.fixture(scope="module")
def faces(tmp_path_factory) -> Path:
    """The first UTKFACE_FILES faces of ../shared/data/utkface.tar.gz (flat utkface/*.jpg, 200x200)."""
    out = tmp_path_factory.mktemp("utkface")
    with tarfile.open(shared_data("utkface.tar.gz"), "r|gz") as tar:  # streamed: stops reading early
        taken = 0
        for member in tar:
            if member.isfile() and member.name.lower().endswith(".jpg"):
                tar.extract(member, out, filter="data")
                taken += 1
                if taken == UTKFACE_FILES:
                    break
    return out / "utkface"


def test_faces_are_read_cropped_and_resized(faces):
    data = image_dir(faces, crop=150, batch_size=5, val_samples=10)
    assert data.info == {"train_samples": UTKFACE_FILES, "val_samples": 10, "resident": False, "num_workers": 0}
    assert data.steps_per_epoch == UTKFACE_FILES // 5
    batches = list(data.epoch(0))
    assert len(batches) == 4 and all(b.shape == (5, 3, 32, 32) and in_unit_range(b) for b in batches)
    val = list(data.val())
    assert [v.shape[0] for v in val] == [5, 5] and all(in_unit_range(v) for v in val)


def test_center_crop_matches_an_independent_oracle(faces):
    # The oracle is plain PIL: Image.crop of the central 150x150 box (25 px off each side of the
    # 200x200 face), then Image.resize with BILINEAR (which widens its filter when shrinking).
    # The loader goes through torchvision's functional API on the PIL image, so equal to 1/255.
    data = image_dir(faces, crop=150, batch_size=UTKFACE_FILES)
    batch = next(iter(data.epoch(0)))
    order = torch.randperm(UTKFACE_FILES, generator=torch.Generator().manual_seed(0))  # the batch's order
    path = data.train_loader.dataset.dataset.paths[order[0]]
    with Image.open(path) as img:
        assert img.size == (200, 200)
        oracle = img.convert("RGB").crop((25, 25, 175, 175)).resize((32, 32), Image.BILINEAR)
    expected = TF.to_tensor(oracle) * 2 - 1
    assert (batch[0] - expected).abs().max() <= 1 / 255 + 1e-6
    # Without a crop the whole (square) face is used: the same as resizing it directly.
    whole = next(iter(image_dir(faces, batch_size=UTKFACE_FILES).epoch(0)))[0]
    with Image.open(path) as img:
        direct = TF.to_tensor(TF.resize(img.convert("RGB"), [32, 32], interpolation=InterpolationMode.BILINEAR)) * 2 - 1
    assert (whole - direct).abs().max() <= 1 / 255 + 1e-6


def test_reference_set_is_a_seeded_sample_of_all_files(faces):
    def reference(seed, **fields):
        data = image_dir(faces, seed=seed, **fields)
        return data.val_loader.dataset.indices, data.info

    indices, info = reference(0, val_samples=6)
    assert info["train_samples"] == UTKFACE_FILES and info["val_samples"] == 6
    assert reference(0, val_samples=6)[0] == indices and reference(1, val_samples=6)[0] != indices
    assert indices != sorted(indices)  # not the first names in sort order
    everything, info = reference(0, val_samples=1000)  # more than the folder holds: all of it
    assert sorted(everything) == list(range(UTKFACE_FILES)) and info["val_samples"] == UTKFACE_FILES
    assert everything[:6] == indices


def test_faces_resume_mid_epoch(faces):
    check_resume(lambda: image_dir(faces, size=16, batch_size=4))


def test_faces_with_a_worker_process(faces):
    data = image_dir(faces, size=16, batch_size=8, num_workers=1)
    assert data.info["num_workers"] == 1
    in_process = list(image_dir(faces, size=16, batch_size=8).epoch(0))
    assert all(torch.equal(a, b) for a, b in zip(data.epoch(0), in_process))


def save(path: Path, mode: str = "RGB", size: tuple[int, int] = (40, 30), fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    colour = {"RGB": (200, 100, 50), "RGBA": (10, 200, 30, 128), "L": 128, "P": 3}[mode]
    Image.new(mode, size, colour).save(path, fmt)
    return path


def test_nested_folders_hidden_files_and_other_formats(tmp_path):
    save(tmp_path / "a.jpg")
    save(tmp_path / "sub" / "b.JPEG")
    save(tmp_path / "sub" / "sub2" / "c.png", mode="RGBA")
    save(tmp_path / "sub" / "sub2" / "d.png", mode="L")
    save(tmp_path / "sub" / "e.bmp", mode="P")
    save(tmp_path / ".hidden" / "f.jpg")
    save(tmp_path / "sub" / ".g.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    data = image_dir(tmp_path, size=8, batch_size=5)
    names = [str(Path(p).relative_to(tmp_path)) for p in data.train_loader.dataset.dataset.paths]
    assert names == ["a.jpg", "sub/b.JPEG", "sub/e.bmp", "sub/sub2/c.png", "sub/sub2/d.png"]
    batch = next(iter(data.epoch(0)))
    assert batch.shape == (5, 3, 8, 8) and in_unit_range(batch)
    # A plain-colour image stays that colour: grayscale 128 is grey in all three channels.
    gray = data.train_loader.dataset.dataset[4]
    assert gray.shape == (3, 8, 8) and (gray == 128).all()


def test_a_corrupt_image_is_named(tmp_path):
    for i in range(3):
        save(tmp_path / f"{i}.jpg")
    bad = tmp_path / "3.jpg"
    bad.write_bytes(
        torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes()
    )
    data = image_dir(tmp_path, size=8, batch_size=4)
    with pytest.raises(CorruptImage, match=f"corrupt image {bad}: "):
        next(iter(data.epoch(0)))


def test_a_crop_larger_than_an_image_is_named(tmp_path):
    save(tmp_path / "a.jpg", size=(64, 64))
    small = save(tmp_path / "b.jpg", size=(50, 40))
    with pytest.raises(
        ConfigError, match="data.crop=65: larger than image .*a.jpg \\(64x64\\); use a crop of at most 64"
    ):
        image_dir(tmp_path, size=8, batch_size=2, crop=65)  # the first image: before training
    data = image_dir(tmp_path, size=8, batch_size=2, crop=48)
    with pytest.raises(CropTooLarge, match=f"data.crop=48: larger than image {small} \\(50x40\\)") as e:
        next(iter(data.epoch(0)))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: root / "missing", "data.root={root}/missing: no such folder"),
        (
            lambda root: root,
            "data.root={root}: no image files at any depth \\(accepted: .jpg .jpeg .png .*any case\\); found no files",
        ),
        (
            lambda root: (root / "notes.txt").write_text("x") and root,
            "data.root={root}: no image files .*; found 1 files, none an image: notes.txt",
        ),
        (
            lambda root: [save(root / f"{i}.png") for i in range(3)] and root,
            "data.root={root}: 3 images, fewer than one batch of schedule.batch_size=4",
        ),
    ],
    ids=["missing", "empty", "only_text", "under_a_batch"],
)
def test_folder_errors_name_the_folder(tmp_path, make, message):
    with pytest.raises(ConfigError, match=message.format(root=tmp_path)) as e:
        image_dir(make(tmp_path), batch_size=4)
    assert "\n" not in str(e.value)


def test_build_data_routes_gan_sources(faces):
    from mpt.datasets import build_data

    def cfg(data: DictConfig) -> DictConfig:
        return OmegaConf.create({"data": data, "schedule": schedule_cfg(4, 16), "model": {"task": "gan"}, "seed": 0})

    assert isinstance(build_data(cfg(data_cfg("synthetic", train_samples=8, val_samples=4)), CPU), SyntheticDiscs)
    assert isinstance(build_data(cfg(data_cfg("image_dir", root=str(faces), num_workers=0)), CPU), ImageDirData)


def test_a_16_bit_grayscale_png_keeps_its_tones(tmp_path):
    """PIL's convert("RGB") clips 16-bit values to 255: a mid-grey 16-bit image would come out white."""
    import numpy as np
    from PIL import Image

    Image.fromarray(np.full((8, 8), 128 * 257, dtype=np.uint16)).save(tmp_path / "a.png")  # mid-grey, 16 bits
    for i in range(3):
        save(tmp_path / f"{i}.jpg")
    data = image_dir(tmp_path, size=8, batch_size=4)
    (index,) = [i for i, p in enumerate(data.train_loader.dataset.dataset.paths) if p.endswith("a.png")]
    assert (data.train_loader.dataset.dataset[index] == 128).all()
