"""Composition of every config group option, and the checks that reject bad values early."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf, open_dict

from mpt.config import ConfigError, validate_experiment
from mpt.runner.validation import validate

from .conftest import ROOT, build_run, compose_cfg, mpt_run

GROUPS = {
    "model": [
        "alexnet",
        "resnet50",
        "resnet20",
        "resnet56",
        "mobilenet_v3_small",
        "vgg16",
        "googlenet",
        "inception_v3",
        "ssd",
        "gnmt",
        "gnmt_small",
        "gnmt_nmt_one",
        "gnmt8",
        "biglstm",
        "biglstm_small",
        "biglstm_tiny",
        "dcgan",
        "dcgan64",
        "airbench94",
    ],
    "precision": [
        "fp32",
        "fp16",
        "mixed",
        "fp16_modmom",
        "amp",
        "bf16",
        "tf32",
        "fp8",
        "fp8_delayed",
        "mxfp8",
        "mxfp6",
        "mxfp4",
    ],
    "scale": ["none", "static", "dynamic", "auto"],
    "data": ["synthetic", "imagefolder", "voc", "parallel_text", "text_corpus", "image_dir"],
    "schedule": ["smoke", "short", "paper", "bench"],
}


def test_defaults_compose_to_the_main_job():
    cfg = compose_cfg()
    validate(cfg)
    assert (cfg.model.name, cfg.precision.name, cfg.scale.name, cfg.data.name, cfg.schedule.name) == (
        "resnet50",
        "fp32",
        "none",
        "synthetic",
        "short",
    )


def test_the_short_schedule_is_sized_by_the_model_and_an_override_wins():
    def shape(*overrides):
        s = compose_cfg(*overrides).schedule
        return s.batch_size, s.steps, list(s.lr_milestones), s.eval_every

    assert shape() == (32, 90, [50, 70], 30)  # the main job's: long enough to learn the synthetic task
    assert shape("model=ssd") == shape("model=gnmt_small") == (8, 24, [], 12)
    assert shape("schedule.batch_size=16", "model.short.steps=40") == (16, 40, [50, 70], 30)
    assert shape("schedule=smoke")[:2] == (4, 3)


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_validates(group, option):
    extra = {
        "imagefolder": ["data.root=/somewhere"],
        "voc": ["data.root=/somewhere", "model=ssd"],
        "parallel_text": ["data.root=/somewhere", "model=gnmt"],
        "text_corpus": ["data.root=/somewhere", "model=biglstm"],
        "image_dir": ["data.root=/somewhere", "model=dcgan"],
    }.get(option, [])
    cfg = compose_cfg(f"{group}={option}", *extra)
    validate(cfg)
    assert cfg[group].name == option
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def test_paper_schedule_is_the_models_recipe():
    cfg = compose_cfg("model=resnet50", "schedule=paper")
    assert (cfg.schedule.batch_size, cfg.schedule.epochs, list(cfg.schedule.lr_milestones)) == (256, 90, [30, 60])
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay, cfg.schedule.image_size) == (0.1, 0.9, 1e-4, 224)
    cfg = compose_cfg("model=alexnet", "schedule=paper")
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay, cfg.schedule.batch_size) == (0.01, 0.9, 5e-4, 256)


def test_dynamic_scale_defaults_are_the_papers():
    s = compose_cfg("scale=dynamic").scale
    assert (s.init, s.interval, s.growth, s.backoff) == (2.0**16, 2000, 2.0, 0.5)


def test_static_scale_defaults_to_the_models_value():
    assert compose_cfg("model=alexnet", "scale=static").model.static_scale == 1000
    assert compose_cfg("model=inception_v3", "scale=static").model.static_scale == 100


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["optim.lr=-0.1"], "optim.lr=-0.1"),
        (["schedule.batch_size=0"], "schedule.batch_size=0"),
        (["scale=static", "scale.value=0.5"], "scale.value=0.5"),
        (["scale=dynamic", "scale.init=0.5"], "scale.min"),
        (["scale=dynamic", "scale.backoff=2"], "scale.backoff=2"),
        (["scale=auto", "scale.min=0"], "scale.min"),
        (["scale=auto", "scale.beta2=1"], "scale.beta2=1"),
        (["scale=auto", "scale.std_devs=-1"], "scale.std_devs=-1"),
        (["stats.grad_hist=true", "stats.every=0"], "stats.every=0"),
        (["stats.grad_hist=true", "stats.keep=1.5"], "stats.keep=1.5"),
        (["optim.weight_decay=-1"], "optim.weight_decay=-1"),
        (["schedule.steps=null"], "schedule.steps"),
        (["model=alexnet", "schedule.image_size=32"], "schedule.image_size=32"),
        (["precision=mixed", "precision.param_dtype=float32"], "master_weights"),
        (["seed=-1"], "seed=-1: must be an integer from 0 to"),
        (["seed=4294967296"], "seed=4294967296: must be"),
    ],
)
def test_out_of_range_values_are_rejected_naming_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate(compose_cfg(*overrides))


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["model=lenet"],
            "model=lenet: no such option; choose one of airbench94, alexnet, biglstm, biglstm_small, biglstm_tiny,"
            " custom, custom_lm, dcgan, dcgan64, gnmt, gnmt8, gnmt_nmt_one, gnmt_small, googlenet, gpt2, gpt2_tiny,"
            " hf_causal_lm, inception_v3, mobilenet_v3_small, resnet20, resnet50, resnet56, ssd, timm, torchvision,"
            " vgg16",
        ),
        (
            ["precision=fp4"],
            "precision=fp4: no such option; choose one of amp, bf16, fp16, fp16_modmom, fp32, fp8, fp8_delayed, mixed,"
            " mxfp4, mxfp6, mxfp8, tf32",
        ),
        (["scale=logmax"], "scale=logmax: no such option; choose one of auto, dynamic, none, static"),
        (
            ["schedule.batch_size=abc"],
            "schedule.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (
            ["precision.param_dtype=float8"],
            "precision.param_dtype=float8: Invalid value 'float8', expected one of [float32, float16, bfloat16]",
        ),
        (["bogus=1"], "bogus: no such config key (Key 'bogus' not in 'Config')"),
        (["+bogus=1"], "+bogus=1: no such config key (mpt-run --cfg job lists them)"),
        # each data source has its own schema: another source's setting is no key of this one
        (
            ["model=ssd", "data=voc", "data.root=/x", "data.vocab_size=8"],
            "data.vocab_size: no such config key (Key 'vocab_size' not in 'VOCDataConfig')",
        ),
        (["data.crop=3"], "data.crop: no such config key (Key 'crop' not in 'SyntheticDataConfig')"),
        (["optim.lr=-1"], "optim.lr=-1.0: must be a positive number"),
        (["schedule.batch_size=0"], "schedule.batch_size=0: must be a positive number"),
        (["scale=static", "scale.value=0.5"], "scale.value=0.5: a static loss scale must be a finite number >= 1"),
        (
            ["-m", "precision=fp32,fp4"],
            "precision=fp4: no such option; choose one of amp, bf16, fp16, fp16_modmom, fp32, fp8, fp8_delayed, mixed,"
            " mxfp4, mxfp6, mxfp8, tf32",
        ),
        (["-m", "optim.lr=0.1,-1"], "optim.lr=-1.0: must be a positive number"),
        (["seed=-1"], "seed=-1: must be an integer from 0 to 2**32 - 1 = 4294967295 (numpy's seed range)"),
        (["-m", "seed=0,1,-1"], "seed=-1: must be an integer from 0 to 2**32 - 1 = 4294967295 (numpy's seed range)"),
    ],
)
def test_bad_input_on_the_command_line_is_one_line_naming_it(args, line):
    """What `mpt-run` prints after 'mpt-run: error: ' (and exits 2), before any run starts."""
    from mpt.runner.cli import preflight

    assert preflight(args) == line


@pytest.mark.parametrize("args", [["model=lenet"], ["-m", "optim.lr=0.1,-1"]], ids=["run", "sweep"])
def test_the_command_line_prints_that_line_and_starts_nothing(tmp_path, args):
    r = mpt_run(*args, f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep", cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip() == f"mpt-run: error: {preflight_line(args)}"
    assert not list(tmp_path.rglob("*"))  # nothing half-written, no run of a sweep started


def preflight_line(args: list[str]) -> str:
    from mpt.runner.cli import preflight

    return preflight(args)


def test_the_ends_of_the_seed_range_pass():
    """0 and 2**32 - 1 are seeds random, numpy and torch all take."""
    for seed in (0, 2**32 - 1):
        validate(compose_cfg(f"seed={seed}"))


def test_missing_data_root_names_the_path(tmp_path, in_process):
    """Checked where the data source is built, before any record: the command line prints it as above."""
    with pytest.raises(
        ConfigError, match="^data.root is not set: give the ImageFolder root, e.g. data.root=/data/imagenet$"
    ):
        build_run(tmp_path / "run", "data=imagefolder")
    missing = tmp_path / "no-such-imagenet"
    with pytest.raises(
        ConfigError,
        match=rf"^data.root={missing}: no such folder \(expected train/<class>/<image> and val/<class>/<image>\)$",
    ):
        build_run(tmp_path / "run", "data=imagefolder", f"data.root={missing}")
    assert not (tmp_path / "run" / "result.json").exists()


PRESETS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))


def first_cell(preset: str) -> list[str]:
    """The overrides of a preset sweep's first job: each swept value's first."""
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        params = compose(
            config_name="config", overrides=[f"experiment={preset}"], return_hydra_config=True
        ).hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])

    def first_value(o) -> str:
        return next(iter(o.sweep_string_iterator())) if o.is_sweep_override() else o.get_value_element_as_str()

    return [f"{o.key_or_group}={first_value(o)}" for o in parsed]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_experiment_preset_composes_and_its_declaration_names_real_settings(preset):
    cfg = compose_cfg(f"experiment={preset}", *first_cell(preset))
    if (
        cfg.data.name != "synthetic" and cfg.data.root is None
    ):  # the paper's presets take the data's folder from the command line
        cfg = compose_cfg(f"experiment={preset}", *first_cell(preset), "data.root=/somewhere")
    validate(cfg)
    if cfg.experiment is not None:
        from mpt.report.comparisons import Declared

        declared = Declared.from_dict(OmegaConf.to_container(cfg.experiment, resolve=True))
        assert declared.margin > 0 and declared.comparisons


def swept_seeds(preset: str) -> list[int]:
    """The seeds a preset's sweep runs."""
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        params = compose(
            config_name="config", overrides=[f"experiment={preset}"], return_hydra_config=True
        ).hydra.sweeper.params
    (seed,) = OverridesParser.create().parse_overrides([f"seed={params['seed']}"])
    return sorted(int(s) for s in seed.sweep_string_iterator())


@pytest.mark.parametrize("preset", [p for p in PRESETS if compose_cfg(f"experiment={p}").experiment is not None])
def test_every_declared_experiment_plans_the_seeds_its_sweep_runs(preset):
    assert sorted(compose_cfg(f"experiment={preset}").experiment.seeds) == swept_seeds(preset)


def test_a_seed_outside_the_planned_pairs_and_a_plan_of_one_seed_are_refused_in_one_line():
    with pytest.raises(
        ConfigError,
        match=r"^seed=3 is not among experiment.seeds=\[0, 1, 2\], the pairs planned before the runs: run one of them$",
    ):
        validate_experiment(compose_cfg("experiment=ptb_biglstm", "seed=3"))
    validate_experiment(compose_cfg("experiment=ptb_biglstm", "seed=3", "experiment.seeds=[0,1,2,3]"))
    with pytest.raises(ConfigError, match=r"^experiment.seeds=\[0\]: must be two or more distinct seeds"):
        validate_experiment(compose_cfg("experiment=ptb_biglstm", "experiment.seeds=[0]"))


def test_a_comparison_naming_no_setting_is_refused_in_one_line():
    cfg = compose_cfg("experiment=cifar10_resnet20")
    with open_dict(cfg):
        cfg.experiment.comparisons[0].cell["precision.norm_fp23"] = True  # a typo's key, as a preset would hold it
    with pytest.raises(
        ConfigError, match=r"^experiment.comparisons\[0\].cell: precision.norm_fp23 is neither a config group"
    ):
        validate(cfg)


def test_an_experiments_declaration_is_recorded_but_names_no_folder_and_changes_no_computation():
    from mpt.runner import identity

    plain = OmegaConf.to_container(compose_cfg("experiment=cifar10_resnet20"), resolve=True)
    other = {**plain, "experiment": {**plain["experiment"], "margin": 0.01}}
    assert plain["experiment"]["margin"] == 0.003 and identity.differences(plain, other) == []


def test_the_shift_presets_dynamic_scaler_moves_its_range_with_k():
    cfg = compose_cfg(
        "experiment=cifar10_resnet20_shift",
        *first_cell("cifar10_resnet20_shift"),
        "scale=dynamic",
        "scale.shift_down=20",
    )
    validate(cfg)
    assert (cfg.scale.init, cfg.scale.max) == (2.0**36, 2.0**44)
