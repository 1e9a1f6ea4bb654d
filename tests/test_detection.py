"""SSD300 and its data: VOC XML in both layouts, SSD augmentation, errors naming the problem, and
every precision mode end to end on a tiny config."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from mpt.config import ConfigError
from mpt.datasets import build_data
from mpt.datasets.voc import CorruptAnnotation
from mpt.runner.validation import validate

from .conftest import CPU, build_run, compose_cfg, mpt_run, read_record, shared_data

RACCOON = [
    "data=voc",
    "data.train_sets=[train_labels.csv]",
    "data.val_sets=[test_labels.csv]",
    "data.class_names=[raccoon]",
    "data.num_workers=0",
]


def voc_cfg(root: Path, *extra: str):
    cfg = compose_cfg("model=ssd", *RACCOON, f"data.root={root}", "schedule=smoke", *extra)
    validate(cfg)
    return cfg


def csv_objects(file: Path) -> dict[str, list[list[float]]]:
    objects: dict[str, list[list[float]]] = {}
    with open(file, newline="") as f:
        for row in csv.DictReader(f):
            objects.setdefault(Path(row["filename"]).stem, []).append(
                [float(row[k]) for k in ("width", "height", "xmin", "ymin", "xmax", "ymax")]
            )
    return objects


def test_raccoon_flat_layout_reads_every_split_image_and_object():
    root = shared_data("raccoon")
    data = build_data(voc_cfg(root), CPU)
    train, test = csv_objects(root / "train_labels.csv"), csv_objects(root / "test_labels.csv")
    assert data.info["train_samples"] == len(train) and data.info["val_samples"] == len(test)
    assert data.info["train_objects"] == sum(map(len, train.values()))
    assert data.info["val_objects"] == sum(map(len, test.values()))

    # Validation: resized to 300x300, boxes scaled from VOC's inclusive corners (x1 - 1, ..., x2).
    images, targets = next(iter(data.val()))
    assert (
        images.shape == (4, 3, 300, 300) and images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1
    )
    first = data.val_loader.dataset.annotations[0].image.stem
    expected = torch.tensor(
        [[(x1 - 1) * 300 / w, (y1 - 1) * 300 / h, x2 * 300 / w, y2 * 300 / h] for w, h, x1, y1, x2, y2 in test[first]]
    )
    assert torch.allclose(targets[0]["boxes"], expected, atol=1e-3)
    assert targets[0]["labels"].tolist() == [1] * len(expected) and not targets[0]["difficult"].any()

    # Training: augmented (crops, flips, zoom-out), every surviving box inside the image and non-degenerate.
    images, targets = next(iter(data.epoch(0)))
    assert images.shape == (4, 3, 300, 300)
    for t in targets:
        b = t["boxes"]
        assert set(t) == {"boxes", "labels"} and len(b) == len(t["labels"])
        assert (
            (b[:, 2:] > b[:, :2]).all() and (b >= 0).all() and (b <= 300).all()
        )  # (a crop may keep no box: ~1% of samples)


def test_training_augmentation_is_seeded_per_sample():
    root = shared_data("raccoon")
    a = next(iter(build_data(voc_cfg(root), CPU).epoch(0)))
    b = next(iter(build_data(voc_cfg(root), CPU).epoch(0)))
    c = next(iter(build_data(voc_cfg(root, "seed=1"), CPU).epoch(0)))
    assert torch.equal(a[0], b[0]) and all(torch.equal(x["boxes"], y["boxes"]) for x, y in zip(a[1], b[1]))
    assert not torch.equal(a[0], c[0])


def make_devkit(tmp_path: Path, raccoon: Path) -> Path:
    """A VOCdevkit with VOC2007 and VOC2012 made of raccoon files; one VOC2012 object marked difficult."""
    ids = sorted(p.stem for p in (raccoon / "annotations").glob("*.xml"))[:12]
    split = {"VOC2007": ids[:4], "VOC2012": ids[4:8], "VOC2007-test": ids[8:12]}
    root = tmp_path / "VOCdevkit"
    for year in ("VOC2007", "VOC2012"):
        for sub in ("Annotations", "JPEGImages", "ImageSets/Main"):
            (root / year / sub).mkdir(parents=True)
    for year, names in [("VOC2007", split["VOC2007"] + split["VOC2007-test"]), ("VOC2012", split["VOC2012"])]:
        for i in names:
            shutil.copy(raccoon / "annotations" / f"{i}.xml", root / year / "Annotations" / f"{i}.xml")
            (root / year / "JPEGImages" / f"{i}.jpg").symlink_to(raccoon / "images" / f"{i}.jpg")
    (root / "VOC2007/ImageSets/Main/trainval.txt").write_text("\n".join(split["VOC2007"]) + "\n")
    (root / "VOC2007/ImageSets/Main/test.txt").write_text("\n".join(split["VOC2007-test"]) + "\n")
    (root / "VOC2012/ImageSets/Main/trainval.txt").write_text("\n".join(split["VOC2012"]) + "\n")
    marked = root / "VOC2012/Annotations" / f"{split['VOC2012'][0]}.xml"
    marked.write_text(marked.read_text().replace("<difficult>0</difficult>", "<difficult>1</difficult>", 1))
    return root


def test_devkit_layout_joins_years_and_difficult_objects_are_flagged(tmp_path):
    root = make_devkit(tmp_path, shared_data("raccoon"))
    base = [
        "model=ssd",
        "data=voc",
        f"data.root={root}",
        "data.class_names=[raccoon]",
        "data.num_workers=0",
        "schedule=smoke",
    ]
    cfg = compose_cfg(*base, "data.val_sets=[VOC2007/test,VOC2012/trainval]")
    validate(cfg)
    data = build_data(cfg, CPU)
    assert data.info["train_samples"] == 8 and data.info["val_samples"] == 8  # VOC2007 + VOC2012 trainval
    val = data.val_loader.dataset
    assert sum(val[i][1]["difficult"].sum().item() for i in range(len(val))) == 1  # evaluation sees it, flagged

    # Training keeps the difficult object by default (as SSD did) and drops it with keep_difficult=false.
    def training_objects(*extra):
        train = build_data(compose_cfg(*base, *extra), CPU).train_loader.dataset.dataset  # SeededSamples wraps it
        marked = next(i for i, a in enumerate(train.annotations) if any(a.difficult))
        train.transform = lambda image, target: (image, target)  # no augmentation: every box survives
        return len(train[marked][1]["labels"]), len(train.annotations[marked].labels)

    kept, annotated = training_objects()
    dropped, _ = training_objects("data.keep_difficult=false")
    assert kept == annotated and dropped == annotated - 1
    info = build_data(compose_cfg(*base, "data.keep_difficult=false"), CPU).info
    assert info["train_objects"] == data.info["train_objects"] - 1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.root=/no/such/folder"], "data.root=/no/such/folder: no such folder"),
        (["data.class_names=[dog]"], "object class 'raccoon' is not in data.class_names (dog)"),
        (["data.train_sets=[missing.csv]"], "no split file"),
        (["data.class_names=[raccoon,raccoon]"], "a class is listed twice"),
        (["model.input_convention=bgr"], "model.input_convention=bgr: expected one of unit_variance, caffe"),
    ],
)
def test_bad_voc_settings_are_named(overrides, message):
    root = shared_data("raccoon")
    cfg = compose_cfg("model=ssd", *RACCOON, f"data.root={root}", "schedule=smoke", *overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg)
        build_data(cfg, CPU)


def test_corrupt_annotation_is_named(tmp_path):
    raccoon = shared_data("raccoon")
    root = tmp_path / "flat"
    shutil.copytree(raccoon / "annotations", root / "annotations")
    (root / "images").symlink_to(raccoon / "images")
    shutil.copy(raccoon / "train_labels.csv", root / "train_labels.csv")
    shutil.copy(raccoon / "test_labels.csv", root / "test_labels.csv")
    victim = (
        root / "annotations" / f"{Path(next(csv.DictReader(open(root / 'train_labels.csv')))['filename']).stem}.xml"
    )
    victim.write_text(victim.read_text()[:200])
    with pytest.raises(CorruptAnnotation, match=f"corrupt annotation {victim}"):
        build_data(voc_cfg(root), CPU)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model=ssd", "data=imagefolder"],
            "data=imagefolder has no detection data for model=ssd; use data=synthetic or data=voc",
        ),
        (["model=resnet50", "data=voc", "data.root=/x"], "data=voc has no classification data for model=resnet50"),
        (["model=ssd", "schedule.image_size=512"], "schedule.image_size=512: ssd takes 300x300 images only"),
        (["model=ssd", "data=voc", "data.root=/x", "data.class_names=[]"], "data.class_names is empty"),
    ],
)
def test_detection_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(compose_cfg(*overrides))


def test_ssd_defaults_and_the_table2_preset():
    cfg = compose_cfg("model=ssd", "scale=static", "schedule=paper")
    validate(cfg)
    assert cfg.model.static_scale == 8 and cfg.schedule.batch_size == 32 and cfg.schedule.steps == 120_000
    assert cfg.schedule.epochs is None and list(cfg.schedule.lr_milestones) == [80_000, 100_000]
    assert cfg.optim.lr * 32 / 256 == pytest.approx(1e-3) and cfg.optim.weight_decay == 5e-4
    voc = compose_cfg("model=ssd", "data=voc")
    assert list(voc.data.train_sets) == ["VOC2007/trainval", "VOC2012/trainval"] and list(voc.data.val_sets) == [
        "VOC2007/test"
    ]
    assert len(voc.data.class_names) == 20 and voc.data.keep_difficult
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        preset = compose(config_name="config", overrides=["experiment=paper_table2"], return_hydra_config=True)
    assert preset.model.name == "ssd"
    assert dict(preset.hydra.sweeper.params) == {"precision": "fp32,mixed", "scale": "none,static"}


MODES = ["fp32", "tf32", "fp16", "mixed", "fp16_modmom", "amp", "bf16"]


@pytest.mark.slow
def test_every_precision_mode_trains_and_evaluates_ssd_on_cpu(tmp_path):
    tiny = [
        "model=ssd",
        "scale=static",
        "schedule=smoke",
        "schedule.batch_size=1",
        "schedule.steps=2",
        "data.train_samples=2",
        "data.val_samples=2",
        "checkpoint=false",
        f"hydra.sweep.dir={tmp_path}",
    ]
    result = mpt_run("-m", f"precision={','.join(MODES)}", *tiny, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = {
        r["choices"]["precision"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("*/result.json"))
    }
    assert sorted(records) == sorted(MODES)
    for mode, r in records.items():
        assert r["status"] == "ok", (mode, r["message"])
        assert r["steps"] == 2 and r["throughput"]["unit"] == "images/s"
        assert r["scale_config"]["value"] == 8
        assert 0 <= r["metrics"]["map"] <= 1 and 0 <= r["metrics"]["map_all"] <= 1
        rows = [json.loads(line) for line in (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        train = [row for row in rows if row["kind"] == "train"]
        assert len(train) == 2 and all(
            torch.isfinite(torch.tensor([row["loss"], row["loss_box"], row["loss_cls"]])).all() for row in train
        )
    assert (
        records["fp16"]["precision"]["cpu_arithmetic"] == "emulated"
        and records["amp"]["precision"]["cpu_arithmetic"] == "emulated"
    )
    assert records["fp32"]["precision"]["cpu_arithmetic"] is None
    assert read_record(Path(records["mixed"]["run_dir"]))["precision"]["master_weights"] is True


def test_ssd_trains_in_the_papers_mode_on_voc_files_and_scores_map(tmp_path, in_process):
    """The fast tier's end-to-end SSD: mixed precision with the paper's static scale 8, on the
    raccoon set read in VOC's XML format (every precision mode is the slow test above). One step of
    two images, then the evaluation with the updated weights: a step of VGG-16 at 300x300 costs
    about 15 s of one core (the slow test runs two steps of each mode)."""
    root = shared_data("raccoon")
    job = build_run(tmp_path, "model=ssd", "precision=mixed", "scale=static", "data=voc", f"data.root={root}",
                    "data.train_sets=[train_labels.csv]", "data.val_sets=[test_labels.csv]",
                    "data.class_names=[raccoon]", "data.num_workers=0", "schedule=smoke", "schedule.batch_size=2",
                    "schedule.steps=1", "schedule.eval_batches=1", "checkpoint=false", "device=cpu")  # fmt: skip
    rec = job.execute()
    assert rec.status == "ok", rec.message
    assert rec.scale_config["value"] == 8 and rec.precision["master_weights"] is True
    assert 0 <= rec.metrics["map"] <= 1 and rec.metrics["val_samples"] == 2
    assert rec.loss_scale["model"]["steps"] == rec.steps == 1


def annotation_xml(image: str, size: tuple[int, int] | None, boxes: list[tuple[int, int, int, int]]) -> str:
    """A VOC annotation of `image` with `<size>` width x height (none if None) and one raccoon per box."""
    objects = "".join(
        f"<object><name>raccoon</name><difficult>0</difficult><bndbox><xmin>{x1}</xmin><ymin>{y1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax></bndbox></object>"
        for x1, y1, x2, y2 in boxes
    )
    dims = "" if size is None else f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>"
    return f"<annotation><filename>{image}</filename>{dims}{objects}</annotation>"


def flat_set(
    tmp_path: Path, victim_boxes: list[tuple[int, int, int, int]], size: tuple[int, int] | None = (400, 533)
) -> tuple[Path, Path]:
    """A flat VOC folder of four raccoon images whose split files train.txt and val.txt both list all
    four; raccoon-119 (400x533) gets `victim_boxes`. Returns (root, the victim's annotation)."""
    raccoon = shared_data("raccoon")
    root = tmp_path / "flat"
    (root / "annotations").mkdir(parents=True)
    (root / "images").symlink_to(raccoon / "images")
    ids = ["raccoon-1", "raccoon-10", "raccoon-11", "raccoon-119"]
    for i in ids[:3]:
        shutil.copy(raccoon / "annotations" / f"{i}.xml", root / "annotations" / f"{i}.xml")
    victim = root / "annotations" / "raccoon-119.xml"
    victim.write_text(annotation_xml("raccoon-119.jpg", size, victim_boxes))
    for split in ("train.txt", "val.txt"):
        (root / split).write_text("\n".join(ids) + "\n")
    return root, victim


def flat_cfg(root: Path, *extra: str):
    return voc_cfg(root, "data.train_sets=[train.txt]", "data.val_sets=[val.txt]", *extra)


@pytest.mark.parametrize(
    "box",
    [(16, 62, 401, 353), (0, 62, 362, 353), (16, 0, 362, 353), (16, 62, 362, 534), (450, 62, 480, 353)],
    ids=["xmax-past-width", "xmin-0", "ymin-0", "ymax-past-height", "wholly-right"],
)
def test_a_box_outside_its_image_is_a_corrupt_annotation_naming_file_and_box(tmp_path, box):
    root, victim = flat_set(tmp_path, [(211, 359, 277, 402), box])
    x1, y1, x2, y2 = box
    line = (
        f"corrupt annotation {victim}: box 2 (raccoon) xmin={x1}, ymin={y1}, xmax={x2}, ymax={y2}"
        " lies outside its 400x533 image; "
    )
    with pytest.raises(CorruptAnnotation) as caught:
        build_data(flat_cfg(root), CPU)
    assert str(caught.value) == line + "fix it, or set data.clip_boxes=true to clip such boxes"


def test_a_box_on_the_border_is_accepted(tmp_path):
    """VOC's corners are 1-based inclusive pixels: 1..width and 1..height cover the whole image."""
    root, _ = flat_set(tmp_path, [(1, 1, 400, 533)])
    data = build_data(flat_cfg(root), CPU)
    victim = next(a for a in data.val_loader.dataset.annotations if a.image.stem == "raccoon-119")
    assert victim.boxes == [[0, 0, 400, 533]] and data.info["clipped_boxes"] == data.info["dropped_boxes"] == 0


def test_without_a_size_the_box_is_checked_against_the_image_file(tmp_path):
    root, victim = flat_set(tmp_path, [(16, 62, 401, 353)], size=None)
    with pytest.raises(CorruptAnnotation, match="lies outside its 400x533 image"):
        build_data(flat_cfg(root), CPU)
    victim.write_text(annotation_xml("raccoon-119.jpg", None, [(16, 62, 400, 353)]))
    build_data(flat_cfg(root), CPU)


def test_swapped_corners_are_refused_even_with_clipping(tmp_path):
    root, victim = flat_set(tmp_path, [(362, 62, 16, 353)])
    with pytest.raises(
        CorruptAnnotation,
        match=f"corrupt annotation {victim}: box 1 \\(raccoon\\) xmin=362, .* has its corners swapped",
    ):
        build_data(flat_cfg(root, "data.clip_boxes=true"), CPU)


def test_clip_boxes_clips_drops_and_counts_and_train_and_eval_see_the_same_boxes(tmp_path):
    # box 1 inside, box 2 past the right and bottom edges, box 3 wholly below the image
    root, _ = flat_set(tmp_path, [(211, 359, 277, 402), (-5, 392, 480, 600), (198, 540, 280, 560)])
    data = build_data(flat_cfg(root, "data.clip_boxes=true"), CPU)
    # each of train.txt and val.txt lists the victim once: one clipped and one dropped box in each
    assert data.info["clipped_boxes"] == 2 and data.info["dropped_boxes"] == 2
    expected = torch.tensor(
        [[210, 358, 277, 402], [0, 391, 400, 533]], dtype=torch.float32
    )  # continuous x1 - 1, y1 - 1, x2, y2

    train, val = data.train_loader.dataset.dataset, data.val_loader.dataset  # SeededSamples wraps the training set
    k = next(i for i, a in enumerate(train.annotations) if a.image.stem == "raccoon-119")
    j = next(i for i, a in enumerate(val.annotations) if a.image.stem == "raccoon-119")
    _, evaluated = val[j]  # the evaluation's own transform: resized to 300x300
    assert torch.allclose(evaluated["boxes"], expected * torch.tensor([300 / 400, 300 / 533] * 2), atol=1e-3)
    assert evaluated["labels"].tolist() == [1, 1]
    train.transform = val.transform = lambda image, target: (image, target)  # no augmentation, no resize
    assert torch.equal(train[k][1]["boxes"], expected) and torch.equal(val[j][1]["boxes"], expected)
    assert torch.equal(train[k][1]["labels"], val[j][1]["labels"])


def test_clip_boxes_counts_are_zero_on_the_real_raccoon_set():
    """The real sample's 217 boxes all lie in their images: none is refused, none clipped."""
    data = build_data(voc_cfg(shared_data("raccoon"), "data.clip_boxes=true"), CPU)
    assert data.info["clipped_boxes"] == 0 and data.info["dropped_boxes"] == 0


@pytest.mark.slow
def test_a_run_meeting_a_box_outside_its_image_leaves_an_error_record_naming_it(tmp_path):
    root, victim = flat_set(tmp_path, [(16, 62, 401, 353)])
    args = [
        "model=ssd",
        *RACCOON,
        f"data.root={root}",
        "data.train_sets=[train.txt]",
        "data.val_sets=[val.txt]",
        "schedule=smoke",
        "device=cpu",
    ]
    r = mpt_run(*args, "checkpoint=false", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert r.returncode == 1, r.stderr[-2000:]
    rec = read_record(tmp_path / "run")
    assert rec["status"] == "error"
    assert rec["message"].startswith(
        f"CorruptAnnotation: corrupt annotation {victim}: box 1 (raccoon) xmin=16, ymin=62, xmax=401, ymax=353"
        " lies outside"
    )
    assert "\n" not in rec["message"]
