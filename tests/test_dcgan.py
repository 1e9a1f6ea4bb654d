"""DCGAN: the two architectures, DCGAN's update against a hand-written torch loop, per-network loss
scaling, and every precision mode end to end on a tiny CPU config."""

from __future__ import annotations

import copy
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_module
from PIL import Image
from torch import nn

from mpt.config import ConfigError
from mpt.models.dcgan import GAN, Discriminator, Generator
from mpt.report.cli import build_report
from mpt.report.figures import _lines, sample_grids
from mpt.runner.train import Run
from mpt.runner.validation import validate

from .conftest import ROOT, compose_cfg, mpt_run, read_record, shared_data

TINY = [
    "model.ngf=4",
    "model.ndf=4",
    "model.sample_grid=4",
    "data.train_samples=16",
    "data.val_samples=8",
    "schedule=smoke",
    "device=cpu",
]


def layers(net: nn.Module, kind: type) -> list[nn.Module]:
    return [m for m in net.modules() if isinstance(m, kind)]


def test_the_papers_128px_network_has_its_layer_counts():
    m = compose_cfg("model=dcgan").model
    G, D = Generator(m), Discriminator(m)
    convs_t = layers(G, nn.ConvTranspose2d)
    assert len(convs_t) == 7 and len(layers(G, nn.Conv2d)) == 0  # 7 fractionally-strided convolutions
    assert (
        len(layers(G, nn.BatchNorm2d)) == 6
        and len(layers(G, nn.LeakyReLU)) == 6
        and isinstance(list(G.net)[-1], nn.Tanh)
    )
    assert len(layers(D, nn.Conv2d)) == 6 and len(layers(D, nn.Linear)) == 2  # 6 convolutions, 2 fully connected
    assert len(layers(D, nn.LeakyReLU)) == 7 and not layers(D, nn.ReLU)
    with torch.no_grad():
        images = G.eval()(torch.randn(2, m.nz))
        assert images.shape == (2, 3, 128, 128) and images.abs().max() <= 1
        assert D.eval()(images).shape == (2,)


def test_the_64px_preset_is_radfords_network():
    m = compose_cfg("model=dcgan64").model
    assert (m.nz, m.ngf, m.ndf) == (100, 64, 64)
    G, D = Generator(m), Discriminator(m)
    assert [c.out_channels for c in layers(G, nn.ConvTranspose2d)] == [512, 256, 128, 64, 3]
    assert [c.out_channels for c in layers(D, nn.Conv2d)] == [64, 128, 256, 512, 1]
    assert len(layers(G, nn.ReLU)) == 4 and not layers(G, nn.LeakyReLU)  # ReLU in G, leaky ReLU in D
    assert len(layers(D, nn.BatchNorm2d)) == 3  # none on D's input layer
    with torch.no_grad():
        assert G.eval()(torch.randn(2, 100)).shape == (2, 3, 64, 64)


def test_the_recipe_is_adam_2e4_beta1_half_for_both_networks():
    cfg = compose_cfg("model=dcgan")
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.lr_batch, list(cfg.optim.betas), cfg.optim.weight_decay) == (
        "adam",
        2e-4,
        None,
        [0.5, 0.999],
        0.0,
    )


def test_the_paper_preset_sweeps_fp32_and_mixed_without_scaling_on_an_image_folder():
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        preset = compose(
            config_name="config",
            overrides=["experiment=paper_dcgan", "data.root=/celeba", "schedule=paper"],
            return_hydra_config=True,
        )
    assert (
        preset.model.name,
        preset.data.name,
        preset.schedule.image_size,
        preset.schedule.batch_size,
        preset.schedule.steps,
    ) == (
        "dcgan",
        "image_dir",
        128,
        128,
        100_000,
    )
    assert dict(preset.hydra.sweeper.params) == {"precision": "fp32,mixed", "scale": "none"}


@pytest.mark.parametrize("override,message", [
    ("schedule.image_size=64", "schedule.image_size=64: dcgan (dcgan128) makes 128x128 images only"),
    ("model.arch=dcgan256", "model.arch=dcgan256: expected one of dcgan128, dcgan64"),
    ("precision=fp16", "use optim.name=sgd, or precision=mixed"),
    ("model.fid_samples=1", "model.fid_samples=1: FID (model.fid_weights is set) needs at least 2 images"),
])  # fmt: skip
def test_bad_gan_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(compose_cfg("model=dcgan", "schedule=smoke", "model.fid_weights=/w.pth", override))


def build_run(tmp_path: Path, *overrides: str) -> Run:
    cfg = compose_cfg("model=dcgan64", *TINY, "checkpoint=false", *overrides)
    validate(cfg)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Run(cfg, tmp_path)


def test_one_step_is_dcgans_update_with_torch_adam(tmp_path):
    """FP32: D's and G's updates equal the PyTorch DCGAN example's loop with torch.optim.Adam."""
    run = build_run(tmp_path, "precision=fp32")
    G, D = run.task.generator, run.task.discriminator
    G0, D0 = copy.deepcopy(G), copy.deepcopy(D)
    real = next(run.data.epoch(0))
    torch.manual_seed(123)
    rows = run._train_step(0, real)

    torch.manual_seed(123)
    opt_d = torch.optim.Adam(D0.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(G0.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    fake = G0(torch.randn(real.shape[0], 100))
    out_real, out_fake = D0(real).flatten(), D0(fake.detach()).flatten()
    err_d = bce(out_real, torch.ones_like(out_real)) + bce(out_fake, torch.zeros_like(out_fake))
    err_d.backward()
    opt_d.step()
    G0.zero_grad()
    out = D0(fake).flatten()
    err_g = bce(out, torch.ones_like(out))
    err_g.backward()
    opt_g.step()

    assert [r["group"] for r in rows] == ["discriminator", "generator"]
    assert rows[0]["loss"].item() == pytest.approx(err_d.item(), rel=1e-6) and rows[1]["loss"].item() == pytest.approx(
        err_g.item(), rel=1e-6
    )
    assert rows[0]["d_x"].item() == pytest.approx(torch.sigmoid(out_real).mean().item(), rel=1e-6)
    assert rows[1]["d_g_z"].item() == pytest.approx(torch.sigmoid(out).mean().item(), rel=1e-6)
    for ours, theirs in [(D, D0), (G, G0)]:
        for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name
    assert all(p.grad is None for p in D.parameters())  # G's backward wrote no D gradients


@pytest.mark.parametrize("mode", [
    ["precision=mixed", "scale=static", "scale.value=128"],
    ["precision=mixed", "scale=dynamic", "scale.init=128"],
    ["precision=amp", "scale=dynamic", "scale.init=128"],
    ["precision=fp16", "scale=dynamic", "scale.init=128", "optim.name=sgd", "optim.lr=0.01"],  # the FP16 update path
])  # fmt: skip
def test_an_overflow_in_the_discriminators_backward_skips_only_its_update(tmp_path, mode):
    """D's gradients overflow on the first step. D's update is skipped and counted (a dynamic scale
    halves for D alone); G's update is exactly the one it gets when D's step changes nothing, and
    it is applied."""

    def first_step(run_dir: Path, poison: bool) -> tuple[Run, dict]:
        run = build_run(run_dir, *mode)
        D = run.task.discriminator
        before = {"G": copy.deepcopy(run.task.generator.state_dict()), "D": copy.deepcopy(D.state_dict())}
        if poison:  # an inf in one D gradient, whenever a backward reaches D's weights
            list(D.parameters())[-1].register_hook(lambda g: torch.full_like(g, float("inf")))
        else:  # D's loss times zero: a first Adam or momentum-SGD step with zero gradients changes no weight
            train_losses = run.task.train_losses

            def zero_d_loss(batch):
                for term in train_losses(batch):
                    yield term if term.group == "generator" else term.__class__(term.group, term.loss * 0.0, term.parts)

            run.task.train_losses = zero_d_loss
        torch.manual_seed(5)
        run._train_step(0, next(run.data.epoch(0)))
        return run, before

    poisoned, before = first_step(tmp_path / "a", poison=True)
    control, _ = first_step(tmp_path / "b", poison=False)
    engines = poisoned.engines
    assert engines["discriminator"].scaler.history.overflows == [True]
    assert engines["generator"].scaler.history.overflows == [False]
    for name, w in poisoned.task.discriminator.named_parameters():
        assert torch.equal(w, before["D"][name]), name  # D skipped
    master_d = engines["discriminator"].master_weights()
    assert all(torch.isfinite(m).all() for m in master_d)
    changed = 0
    for name, w in poisoned.task.generator.named_parameters():
        assert torch.isfinite(w).all()
        assert torch.equal(w, dict(control.task.generator.named_parameters())[name]), name
        changed += not torch.equal(w, before["G"][name])
    assert changed > 0  # G's update was applied, not skipped with D's
    assert engines["generator"].scaler.scale == 128  # G's scale is its own
    assert engines["discriminator"].scaler.scale == (64 if "scale=dynamic" in mode else 128)


def run_tiny(tmp_path: Path, *args: str) -> Path:
    r = mpt_run("-m", "model=dcgan64", *TINY, *args, f"hydra.sweep.dir={tmp_path}", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp_path


def check_gan_record(run_dir: Path) -> dict:
    rec = read_record(run_dir)
    assert rec["status"] == "ok", rec["message"]
    assert set(rec["loss_scale"]) == {"discriminator", "generator"}  # skipped steps per network
    assert (
        rec["throughput"]["unit"] == "images/s"
        and rec["samples"] == rec["steps"] * rec["config"]["schedule"]["batch_size"]
    )
    assert (
        rec["evaluation"]["fid"]["computed"] is False
        and "model.fid_weights is not set" in rec["evaluation"]["fid"]["reason"]
    )
    assert {"val_d_x", "val_d_g_z"} <= rec["metrics"].keys() and "fid" not in rec["metrics"]
    assert [g["step"] for g in rec["sample_grids"]] == [rec["steps"]]
    with Image.open(run_dir / rec["sample_grids"][-1]["path"]) as grid:
        grid.load()
        assert (
            grid.format == "PNG" and grid.size == (2 * rec["config"]["schedule"]["image_size"] + 3 * 2,) * 2
        )  # 2x2 grid of 4, padding 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["group"] for r in train] == ["discriminator", "generator"] * rec["steps"]
    assert all({"loss", "d_x", "d_g_z", "loss_real", "loss_fake"} <= r.keys() for r in train[::2])
    assert all({"loss", "d_g_z"} <= r.keys() for r in train[1::2])
    return rec


@pytest.mark.slow
def test_every_precision_mode_trains_end_to_end_and_the_report_shows_their_grids(tmp_path):
    # dynamic from 8192: the tiny discriminator's gradients overflow FP16 at 16384 and above, and from
    # GradScaler's 65536 all 3 steps would be skipped, a run that trained nothing (diverged)
    sweep = run_tiny(tmp_path / "runs", "precision=fp32,tf32,mixed,amp,bf16", "scale=none,dynamic", "scale.init=8192")
    run_tiny(
        tmp_path / "runs",
        "precision=fp16,fp16_modmom",
        "scale=static",
        "optim.name=sgd",
        "optim.momentum=0.5",
        "optim.lr=0.01",
    )
    records = {d.name: check_gan_record(d) for d in sweep.iterdir() if (d / "result.json").exists()}
    assert len(records) == 12
    modes = {(r["choices"]["precision"], r["choices"]["scale"]) for r in records.values()}
    assert ("fp16_modmom", "static") in modes and ("mixed", "dynamic") in modes
    mixed = next(r for r in records.values() if r["choices"]["precision"] == "mixed")
    assert mixed["precision"]["master_weights"] and mixed["precision"]["param_dtype"] == "float16"

    written = build_report([sweep], tmp_path / "report", None)
    grids = [p for p in written if p.name.startswith("samples_")]
    assert len(grids) == 2  # one figure per cell: the ten modes' variant, and the SGD one
    # figures.md says which grid is which: the variant (scale.init=8192) is in its row, not in the name
    rows = [row for row in (tmp_path / "report" / "figures.md").read_text().splitlines() if "samples_" in row]
    ten_modes = next(p for p in grids if any(p.name in row and "8192" in row for row in rows))
    with Image.open(ten_modes) as fig:
        assert fig.format == "PNG" and fig.size[0] > 4 * fig.size[1]  # the modes side by side
    assert "n/a" in (tmp_path / "report" / "tables" / "accuracy.md").read_text()  # no FID without weights

    # A record copied without its pictures still makes a report.
    shutil.rmtree(next(d for d in sweep.iterdir() if (d / "samples").is_dir()) / "samples")
    assert len([p for p in build_report([sweep], tmp_path / "report2", None) if p.name.startswith("samples_")]) == 2


def test_a_gans_loss_curves_are_drawn_per_network_never_averaged():
    curves = pd.DataFrame(
        {
            "mode": ["Mixed"] * 4,
            "precision_order": 3,
            "scale_order": 0,
            "step": [0, 0, 1, 1],
            "group": ["discriminator", "generator"] * 2,
            "loss": [1.5, 0.6, 1.4, 0.7],
        }
    )
    lines = {label: rows["loss"].tolist() for label, rows in _lines(curves)}
    assert lines == {"Mixed [discriminator]": [1.5, 1.4], "Mixed [generator]": [0.6, 0.7]}
    one = curves[curves["group"] == "generator"]
    assert [label for label, _ in _lines(one)] == ["Mixed"]  # a one-network model keeps the mode as its label


def test_the_sample_figure_shows_every_seed_of_every_mode(tmp_path):
    # Each grid is one flat colour, so the figure's pixels say which grid went where.
    colours = {
        ("FP32", 0): (255, 0, 0),
        ("FP32", 1): (0, 255, 0),
        ("Mixed", 0): (0, 0, 255),
        ("Mixed", 1): (255, 255, 0),
    }
    rows = []
    for (mode, seed), colour in colours.items():
        path = tmp_path / f"{mode}{seed}.png"
        Image.new("RGB", (40, 40), colour).save(path)
        rows.append(
            {
                "model": "dcgan64",
                "data": "image_dir",
                "schedule": "short",
                "variant": None,
                "mode": mode,
                "seed": seed,
                "status": "ok",
                "precision_order": 0 if mode == "FP32" else 3,
                "scale_order": 0,
                "final_sample_grid": str(path),
                "final_sample_grid_step": 10,
            }
        )
    (figure,) = sample_grids(pd.DataFrame(rows), tmp_path / "fig")
    with Image.open(figure) as fig:
        pixels = np.asarray(fig.convert("RGB")).reshape(-1, 3)
        width, height = fig.size
    shown = {tuple(c) for c in np.unique(pixels, axis=0)}
    assert set(colours.values()) <= shown  # all four grids, not the lowest seed of each mode
    assert 0.7 < height / width < 1.3  # 2 seeds down, 2 modes across


@pytest.mark.slow  # the 64 px preset trains on real faces in the fast tier
def test_the_papers_128px_network_trains_on_real_faces(tmp_path):
    """data=image_dir reads a flat folder of face JPEGs (a sample of UTKFace), center-cropped and resized."""
    faces = tmp_path / "faces"
    faces.mkdir()
    with tarfile.open(shared_data("utkface.tar.gz")) as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(".jpg"):
                member.name = Path(member.name).name
                tar.extract(member, faces, filter="data")
                if len(list(faces.iterdir())) == 10:
                    break
    r = mpt_run(
        "model=dcgan",
        "model.ngf=2",
        "model.ndf=2",
        "model.d_fc_size=8",
        "model.sample_grid=4",
        "schedule=smoke",
        "device=cpu",
        "data=image_dir",
        f"data.root={faces}",
        "data.val_samples=4",
        "precision=mixed",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rec = check_gan_record(tmp_path / "run")
    assert rec["data"]["train_samples"] == 10 and rec["metrics"]["val_samples"] == 4


def fid_weights(path: Path) -> Path:
    from mpt.models import fid

    torch.manual_seed(0)
    net = fid.fid_inception_v3()
    torch.save(net.state_dict(), path)
    return path


@pytest.mark.slow
def test_fid_is_computed_only_from_a_named_local_weights_file(tmp_path):
    weights = fid_weights(tmp_path / "pt_inception.pth")
    run_tiny(
        tmp_path / "runs", "precision=fp32", f"model.fid_weights={weights}", "model.fid_samples=4", "data.val_samples=4"
    )
    (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if (d / "result.json").exists()]
    rec = read_record(run_dir)
    assert rec["status"] == "ok", rec["message"]
    fid = rec["evaluation"]["fid"]
    assert (
        fid["computed"] is True
        and fid["comparable"] is True
        and fid["generated_images"] == 4
        and len(fid["sha256"]) == 64
    )
    assert rec["metrics"]["fid"] > 0 and rec["primary_metric"] == "fid" and rec["higher_is_better"] is False

    missing = mpt_run(
        "model=dcgan64",
        *TINY,
        f"model.fid_weights={tmp_path / 'nope.pth'}",
        f"hydra.run.dir={tmp_path / 'x'}",
        cwd=ROOT,
    )
    assert missing.returncode != 0 and f"model.fid_weights={tmp_path / 'nope.pth'}" in missing.stderr + missing.stdout


def test_the_sample_grid_is_drawn_from_the_same_noise_in_every_mode_and_on_every_device():
    m = compose_cfg("model=dcgan64", *TINY).model
    a, b = GAN(m, seed=0, batch_size=4), GAN(m, seed=0, batch_size=4)
    assert torch.equal(a.fixed_noise, b.fixed_noise) and a.fixed_noise.device.type == "cpu"
    assert not torch.equal(a.fixed_noise, GAN(m, seed=1, batch_size=4).fixed_noise)
