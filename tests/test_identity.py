"""Run identity: one list decides the folder a run has and whether a saved config is the same run."""

from __future__ import annotations

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from mpt.config import as_plain
from mpt.runner.identity import (
    MAX_NAME,
    computational_key,
    folder_name,
    same_computation,
    short_variant,
    variant,
    variant_parts,
)

from .conftest import compose_cfg

CHOICES = ["dcgan64", "fp32", "none", "image_dir", "short"]
# The overrides of the committed UTKFace DCGAN runs, whose old folder names reached 290 characters.
DCGAN = [
    "data.num_workers=1",
    "data.root=/tmp/utk/utkface",
    "data.val_samples=256",
    "model.ndf=32",
    "model.ngf=32",
    "schedule.batch_size=64",
    "schedule.checkpoint_every=300",
    "schedule.eval_every=300",
    "schedule.steps=1200",
]


def variant_of(*overrides: str) -> str:
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return variant(
        (
            (
                ("~" if o.is_delete() else "+" if o.is_add() else "") + o.key_or_group,
                None if o.is_delete() else str(o.value()),
            )
            for o in parsed
        )
    )


def test_a_run_without_overrides_is_named_by_its_choices_alone():
    assert folder_name(CHOICES, "cpu", 1, 0, "") == "dcgan64_fp32_none_image_dir_short_cpu_seed0"
    assert folder_name(CHOICES, "cuda", 2, 3, "") == "dcgan64_fp32_none_image_dir_short_cudax2_seed3"


def test_a_long_variant_gives_a_short_name_that_pastes_back_as_a_value():
    name = folder_name(CHOICES, "cpu", 1, 0, variant_of(*DCGAN))
    assert len(name) <= MAX_NAME < 120
    assert not any(c in name for c in ",=/ '\"[]{}()")  # no sweep separator, no path, nothing Hydra would parse
    assert name.startswith("dcgan64_fp32_none_image_dir_short_cpu_seed0__")
    # A Hydra value: the name parses back as one plain string.
    (o,) = OverridesParser.create().parse_overrides([f"hydra.run.dir=results/runs/{name}"])
    assert not o.is_sweep_override() and o.value() == f"results/runs/{name}"


def test_distinct_computations_have_distinct_folders_and_a_relaunch_the_same_one():
    a = folder_name(CHOICES, "cpu", 1, 0, variant_of(*DCGAN))
    b = folder_name(CHOICES, "cpu", 1, 0, variant_of(*DCGAN[:-1], "schedule.steps=1300"))
    c = folder_name(CHOICES, "cpu", 1, 0, variant_of(*DCGAN[:-1], "data.root=/tmp/utk/other"))
    assert len({a, b, c}) == 3
    assert a == folder_name(CHOICES, "cpu", 1, 0, variant_of(*reversed(DCGAN)))  # order does not matter
    assert variant_of("optim.lr=1e-1") == variant_of("optim.lr=0.1")  # values as Hydra parses them


def test_settings_that_drive_or_log_a_run_neither_name_it_nor_make_it_another_run():
    assert variant_of(*DCGAN) == variant_of(
        *DCGAN, "schedule.log_every=3", "schedule.throughput_window=2", "device=cpu", "force=true"
    )
    assert "checkpoint_every" not in variant_of(*DCGAN)
    for key in [
        "schedule.log_every",
        "schedule.checkpoint_every",
        "schedule.throughput_warmup",
        "resume",
        "checkpoint",
        "hydra.run.dir",
        "experiment",
    ]:
        assert not computational_key(key), key
    for key in ["schedule.steps", "optim.lr", "data.root", "+model.extra", "~stats"]:
        assert computational_key(key), key
    saved = as_plain(compose_cfg("schedule.log_every=3", "schedule.checkpoint_every=7"))
    assert same_computation(saved, as_plain(compose_cfg()))
    assert not same_computation(saved, as_plain(compose_cfg("schedule.steps=9")))


@pytest.mark.parametrize(
    "text,parts",
    [
        ("", []),
        ("optim.lr=0.2", ["optim.lr=0.2"]),
        ("data.class_names=['a', 'b'],data.root=/x,~stats", ["data.class_names=['a', 'b']", "data.root=/x", "~stats"]),
    ],
)
def test_a_variant_splits_at_its_top_level_commas(text, parts):
    assert variant_parts(text) == parts


def test_the_short_form_keeps_the_last_word_of_each_key_and_hashes_paths():
    assert short_variant("optim.lr=0.2,schedule.steps=1200") == "lr-0.2_steps-1200"
    short = short_variant("data.root=/tmp/utk/utkface")
    assert short.startswith("root-h") and len(short) == len("root-h") + 8
    assert short_variant("data.class_names=['raccoon']") == "class_names-raccoon"
