"""Figure names: short, readable, and never shared by two figures; the documents' links to figures resolve."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from mpt.report import naming
from mpt.report.naming import NAME_LIMIT, Figure, FigureIndex, device_word, figure_name, mode_word

from .conftest import ROOT

# The example: a cell whose variant made a 150-character name.
LONG = ",".join(
    [
        "data.resize_ratio=1.0",
        "data.root=…dfb24ef6/cifar10",
        "data.val_split=test",
        "schedule.batch_size=64",
        "schedule.eval_batches=None",
    ]
)
PLAIN = re.compile(r"^[A-Za-z0-9._+-]+_[0-9a-f]{8}\.png$")


def test_a_cells_figure_is_named_by_its_model_data_schedule_and_tag():
    figure = Figure("loss", "resnet50", "imagefolder", "short", LONG)
    assert figure_name(figure) == f"loss_resnet50_imagefolder_short_{naming.tag(figure)}.png"
    assert figure_name(Figure("loss", "resnet50", "imagefolder", "short")) != figure_name(figure)


def test_figures_differing_only_in_variant_get_different_names_and_every_name_fits():
    kinds = [
        "loss",
        "loss_scale",
        "lost_updates",
        "grads_activation",
        "grads_over_training_activation",
        "grads_over_training_weight",
        "atlas_hist_activation_grad",
        "atlas_mxfp8_e4m3",
        "throughput",
    ]
    models = ["resnet50", "biglstm_tiny", "mobilenet_v3_small", "gnmt_small", "dcgan64", "x" * 80]
    cells = [
        ("", "", ()),
        ("Mixed + LS (dynamic), seed 0", "discriminator", (mode_word("mixed", "dynamic"), "disc", "s0")),
        ("FP16 + LS (static 128), seed 12", "model", (mode_word("fp16_modmom", "static", 128.0), "", "s12")),
        ("NVIDIA H100 80GB HBM3, batch 256, 224 px", "", (device_word("NVIDIA H100 80GB HBM3"), "b256", "224px")),
    ]
    variants = ["", LONG, LONG.replace("64", "32"), "optim.lr=0.01", "optim.lr=0.010", "y" * 300]
    described, names = set(), set()
    for kind in kinds:
        for model in models:
            for data in ("imagefolder", "text_corpus", "parallel_text"):
                for cell, network, words in cells:
                    for variant in variants:
                        figure = Figure(kind, model, data, "short", variant, cell, network, words)
                        name = figure_name(figure)
                        assert len(name) <= NAME_LIMIT and PLAIN.match(name), name
                        assert name.startswith(naming.kind_word(kind)[:12])
                        described.add(figure.description())
                        names.add(name)
    assert len(names) == len(described) == len(kinds) * len(models) * 3 * len(cells) * len(variants)


def test_words_are_shortened_never_the_tag_and_a_records_odd_names_stay_plain():
    cell, words = ("Mixed, seed 0", "discriminator"), ("mixed", "disc", "s0")
    figure = Figure("grads_over_training_activation", "biglstm_tiny", "text_corpus", "paper", LONG, *cell, words)
    name = figure_name(figure)
    assert name.startswith("grads_over_training_act_") and name.endswith(f"_{naming.tag(figure)}.png")
    assert len(name) <= NAME_LIMIT
    # One run's figure keeps its mode and seed where they fit.
    run = Figure("grads_weight", "ssd", "voc", "smoke", "", "Mixed, dynamic, seed 2", "model", ("mixed-dyn", "", "s2"))
    assert figure_name(run) == f"grads_wt_ssd_voc_smoke_mixed-dyn_s2_{naming.tag(run)}.png"
    crafted = Figure("grads_weight", "resnet50", "synthetic", "smoke", "", "", "../../etc", ("fp32", "a/../b", "s0"))
    assert PLAIN.match(figure_name(crafted)) and ".." not in figure_name(crafted)
    assert device_word("Intel(R) Xeon(R) Processor @ 2.50GHz") == "Xeon-2.50GHz"
    assert mode_word("mixed", "static", 8.0) == "mixed-s8" and mode_word("fp32", "none") == "fp32"


def test_two_descriptions_whose_tags_collide_still_get_two_names(monkeypatch, tmp_path):
    real = naming.tag
    monkeypatch.setattr(naming, "tag", lambda figure, salt=0: "0badc0de" if not salt else real(figure, salt))
    index = FigureIndex()
    first = Figure("loss", "resnet50", "synthetic", "smoke", "a=1")
    second = Figure("loss", "resnet50", "synthetic", "smoke", "a=2")
    index.add(index.path(tmp_path, first), first)
    # The same figure keeps its own name; another description whose tag collides draws again.
    assert index.path(tmp_path, first).name == "loss_resnet50_synthetic_smoke_0badc0de.png"
    assert index.path(tmp_path, second).name != index.path(tmp_path, first).name


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md"]


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_to_a_figure_resolves(doc: Path):
    text = doc.read_text()
    # Markdown links and images, and HTML images: every relative target ending in .png exists.
    targets = re.findall(r"\]\(<?([^)\s>]+\.png)>?(?:\s+\"[^\"]*\")?\)", text)
    targets += re.findall(r"<img[^>]+src=\"([^\"]+\.png)\"", text)
    for target in targets:
        if re.match(r"^[a-z]+://", target):
            continue
        assert (doc.parent / target.split("#")[0]).resolve().is_file(), f"{doc.name}: broken link {target}"
    # A report's figures named in code, whole or by pattern (`figures/loss_*.png`, `grads_act_*`):
    # some committed figure matches.
    committed = [p.name for p in (ROOT / "results").rglob("figures/*.png")]
    for span in re.findall(r"`([^`\n]+)`", text):
        named = re.fullmatch(
            r"(?:[\w./-]*figures/)?((?:loss|shift|samples|grads|lost_updates|atlas|throughput)_[\w*<>.+-]*)", span
        )
        if not named or not ("*" in span or span.endswith(".png")):
            continue
        glob = re.sub(r"<[^>]*>", "*", named[1])
        glob += "" if glob.endswith((".png", "*")) else "*"
        assert fnmatch.filter(committed, glob), f"{doc.name}: no committed figure is {span}"
