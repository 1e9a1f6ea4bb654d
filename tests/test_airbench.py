"""Jordan 2024's airbench94 and its recipe: the network against the paper's description, each piece of
the recipe against an independent computation (numpy, float64, the paper's formulas), and a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mpt.config import ConfigError, validate
from mpt.datasets.imagefolder import ImageFolderData
from mpt.models import build_task
from mpt.models import validate as validate_model
from mpt.models.airbench import WHITEN_EPS, Airbench94
from mpt.precision.engine import PrecisionEngine
from mpt.precision.lookahead import Lookahead
from mpt.precision.optim import triangle_factor
from mpt.precision.scaler import build_scaler

from .conftest import CPU, build_run, compose_cfg, read_record

AIRBENCH = ("model=airbench94", "data=synthetic", "schedule=short")


def test_the_network_has_the_papers_layers_and_sizes():
    net = Airbench94()
    # whitening 2x2x3 -> 24 (+ bias); blocks 24->64, 64->256, 256->256, two 3x3 convolutions each;
    # batch-norm scale and bias per channel; a 256 x 10 head without bias
    convs = [(24, 64), (64, 64), (64, 256), (256, 256), (256, 256), (256, 256)]
    expected = 24 * 3 * 2 * 2 + 24 + sum(9 * a * b for a, b in convs) + 2 * sum(b for _, b in convs) + 256 * 10
    assert sum(p.numel() for p in net.parameters()) == expected == 1_972_792
    frozen = 24 * 3 * 2 * 2 + sum(b for _, b in convs)  # the whitening filters and the batch-norm scales
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == expected - frozen
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    norms = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 6 and all(m.eps == 1e-12 and m.momentum == pytest.approx(0.4) for m in norms)


def test_each_convolution_starts_as_the_identity_on_its_first_filters():
    net = Airbench94()
    conv = net.blocks[1].conv1  # 64 -> 256
    x = torch.randn(1, 64, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(conv(x)[:, :64], x)


def _patch_covariance(images: np.ndarray) -> np.ndarray:
    """Every 2x2 patch of (N, 3, H, W) images, flattened channel-major, and their uncentred covariance."""
    n, c, h, w = images.shape
    rows = [images[:, :, i : i + 2, j : j + 2].reshape(n, -1) for i in range(h - 1) for j in range(w - 1)]
    patches = np.concatenate(rows)
    return patches.T @ patches / len(patches)


def test_whitening_filters_decorrelate_the_training_patches():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 1, 9, 9, generator=g)
    # correlated channels and neighbouring pixels: a mixed, smoothed signal
    images = F.avg_pool2d(torch.cat([base, 0.5 * base + torch.randn(64, 2, 9, 9, generator=g)], 1), 2, stride=1)
    net = Airbench94()
    net.init_whitening(images)
    filters = net.whiten.weight.detach().double().reshape(24, -1).numpy()
    cov = _patch_covariance(images.double().numpy())
    eig = np.linalg.eigvalsh(cov)[::-1]
    # filter i of the first 12 is v_i / sqrt(l_i + eps): F C F^T = diag(l / (l + eps)); the last 12 are the negatives
    np.testing.assert_allclose(filters[:12] @ cov @ filters[:12].T, np.diag(eig / (eig + WHITEN_EPS)), atol=1e-5)
    np.testing.assert_allclose(filters[12:], -filters[:12])


def test_test_time_augmentation_weighs_the_six_views_as_the_paper():
    cfg = compose_cfg(*AIRBENCH)
    task = build_task(cfg, {"num_classes": 10})
    torch.manual_seed(0)
    task.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))  # linear: the views' logits add
    x = torch.randn(2, 3, 8, 8)
    xn = x.numpy()
    padded = np.pad(xn, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="reflect")
    views = {"plain": xn, "up_left": padded[..., :8, :8], "down_right": padded[..., 2:, 2:]}
    weights = {"plain": 0.25, "up_left": 0.125, "down_right": 0.125}  # each, and as much again mirrored
    with torch.no_grad():
        expected = sum(
            w * (task.net(torch.from_numpy(views[k].copy())) + task.net(torch.from_numpy(views[k][..., ::-1].copy())))
            for k, w in weights.items()
        )
        torch.testing.assert_close(task._tta_logits(x), expected)


def test_the_loss_is_label_smoothed_and_summed_over_the_batch():
    task = build_task(compose_cfg(*AIRBENCH), {"num_classes": 10})
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 3, 9, 3])
    term = next(task.train_losses((images, labels)))
    with torch.no_grad():
        logp = torch.log_softmax(task.net(images).double(), 1)
    # (1 - e) * -log p(y) + e * mean over classes of -log p(c), summed over the batch
    expected = (0.8 * -logp[torch.arange(4), labels] + 0.2 * -logp.mean(1)).sum()
    torch.testing.assert_close(term.loss.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_triangle_runs_through_its_three_points():
    for total in (476, 10, 7):
        ours = [triangle_factor(i, total, (0.2, 0.23, 0.07)) for i in range(total + 1)]
        np.testing.assert_allclose(
            ours, np.interp(np.arange(total + 1), [0, int(0.23 * total), total], [0.2, 1.0, 0.07]), atol=1e-12
        )


class _Bn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2, bias=False)
        self.norm = nn.BatchNorm1d(2)


def test_batch_norm_biases_step_at_64x_the_lr_with_the_same_decay_by_nesterov():
    cfg = compose_cfg("model=airbench94", "schedule=short", "schedule.batch_size=4")
    net = _Bn()
    w0, b0 = net.lin.weight.detach().double().clone(), torch.tensor([0.5, -0.25], dtype=torch.float64)
    with torch.no_grad():
        net.norm.bias.copy_(b0)
    engine = PrecisionEngine(net, cfg, build_scaler(cfg), [], CPU, total_steps=10)
    lr, m, wd = cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay
    gw, gb = torch.randn(2, 3, dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64)
    ref = {"w": [w0.clone(), torch.zeros_like(w0), lr, wd], "b": [b0.clone(), torch.zeros_like(b0), lr * 64, wd / 64]}
    for _ in range(3):
        net.lin.weight.grad, net.norm.bias.grad = gw.float().clone(), gb.float().clone()
        engine.scheduler.step = lambda: None  # the lr held: this test is the groups', not the schedule's
        assert engine.step()
        for key, grad in (("w", gw), ("b", gb)):
            p, buf, r, d = ref[key]
            g = grad + d * p
            buf.mul_(m).add_(g)
            p.sub_(r * (g + m * buf))  # torch's Nesterov: w -= lr * (g + m * buf)
        assert ref["w"][2] * ref["w"][3] == pytest.approx(ref["b"][2] * ref["b"][3])  # the same decay per step
    torch.testing.assert_close(net.lin.weight.double(), ref["w"][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(net.norm.bias.double(), ref["b"][0], rtol=1e-6, atol=1e-7)


def test_lookahead_follows_the_papers_rule():
    la = Lookahead(compose_cfg("model=airbench94").optim.lookahead, total_steps=40)
    w = torch.zeros(3, dtype=torch.float64)
    ema_ref, changed = None, []
    for step in range(1, 41):
        epoch = (step - 1) // 8  # 8 steps an epoch: averaging from step 25 on (epoch 3)
        w += 1.0  # the update
        expected = w.clone()
        if epoch >= 3 and step % 5 == 0:
            if ema_ref is None:
                ema_ref = w.clone()
            else:
                rho = 0.95**5 * (step / 40) ** 3
                ema_ref = rho * ema_ref + (1 - rho) * w
                expected = ema_ref.clone()
        changed.append(la.after_step(step, epoch, [w]))
        torch.testing.assert_close(w, expected)
    assert [s for s, c in zip(range(1, 41), changed) if c] == [30, 35, 40]  # 25 only starts the average
    w += 7.0
    assert la.settle([w])
    torch.testing.assert_close(w, ema_ref)


def test_the_whitening_bias_stops_training_after_its_epochs():
    task = build_task(compose_cfg(*AIRBENCH), {"num_classes": 10})
    task.begin_epoch(2)
    assert task.frozen_parameters("model") == []
    task.begin_epoch(3)
    assert [id(p) for p in task.frozen_parameters("model")] == [id(task.net.whiten.bias)]


def _asymmetric_folder(root, n=8):
    for c in ("a", "b"):
        (root / "train" / c).mkdir(parents=True)
        (root / "test" / c).mkdir(parents=True)
        for i in range(n):
            img = np.zeros((32, 32, 3), np.uint8)
            img[:, :16] = 200  # the left half bright: a flip moves it right
            Image.fromarray(img).save(root / "train" / c / f"{i}.png")
            Image.fromarray(img).save(root / "test" / c / f"{i}.png")
    return root


def test_alternating_flips_mirror_each_image_the_other_way_each_epoch(tmp_path):
    cfg = compose_cfg(
        "model=airbench94",
        "data=imagefolder",
        f"data.root={_asymmetric_folder(tmp_path)}",
        "data.val_split=test",
        "data.augment=airbench",
        "data.num_workers=0",
        "schedule=smoke",
        "schedule.image_size=32",
        "schedule.batch_size=16",
    )
    data = ImageFolderData(cfg.data, cfg.schedule, seed=0, device=CPU)
    samples = data.train_loader.dataset
    flipped = [
        [bool(samples[(e, i)][0][:, :, :14].mean() < samples[(e, i)][0][:, :, 18:].mean()) for i in range(16)]
        for e in range(4)
    ]
    assert 0 < sum(flipped[0]) < 16  # the first epoch's coins differ
    for e in range(1, 4):
        assert flipped[e] == [f != bool(e % 2) for f in flipped[0]]


def test_airbench_settings_are_checked():
    for bad, named in [
        (("model=airbench94", "model.tta=3"), "model.tta=3"),
        (("model=resnet20", "model.whiten_bias_epochs=3"), "model.whiten_bias_epochs=3"),
        (("model=airbench94", "model.loss_reduction=max"), "model.loss_reduction=max"),
    ]:
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            validate_model(compose_cfg(*bad))
    for bad, named in [
        (("model=airbench94", "optim.name=adam"), "optim.nesterov=true"),
        (("model=airbench94", "optim.momentum=0"), "optim.nesterov=true"),
        (("model=airbench94", "schedule.lr_shape=cosine"), "schedule.lr_shape=cosine"),
        (("model=airbench94", "schedule=paper", "schedule.lr_triangle=[0.2,1.5,0.1]"), r"schedule.lr_triangle"),
        (("model=airbench94", "optim.norm_bias_lr_scale=0"), "optim.norm_bias_lr_scale=0"),
    ]:
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            validate(compose_cfg(*bad))


def test_a_mixed_run_of_airbench_trains_averages_and_scores_with_tta(tmp_path, in_process, monkeypatch):
    # 4 steps an epoch, 7 steps: averaging from step 2 of epoch 0 every 2 steps, the whitening bias
    # trained in epoch 0 only; the last step (7) is no averaging step, so only the run's end settles it
    calls: list[tuple[int, int]] = []
    after_step = Lookahead.after_step
    monkeypatch.setattr(
        Lookahead,
        "after_step",
        lambda self, step, epoch, tensors: calls.append((step, epoch)) or after_step(self, step, epoch, tensors),
    )
    run = build_run(
        tmp_path,
        *AIRBENCH,
        "precision=mixed",
        "scale=static",
        "scale.value=1",
        "optim.lookahead.start_epoch=0",
        "optim.lookahead.every=2",
        "model.whiten_bias_epochs=1",
        "schedule.lr_shape=triangle",
        "schedule.lr_milestones=[]",
        "data.train_samples=64",
        "data.val_samples=32",
        "schedule.batch_size=16",
        "schedule.steps=7",
        "schedule.eval_every=7",
        "schedule.log_every=1",
    )
    net = run.task.base
    # the whitening is the training images' (set before the engine rounded it to FP16)
    reference = Airbench94()
    reference.init_whitening(run.data.plain_train_images(5000))
    torch.testing.assert_close(net.whiten.weight, reference.whiten.weight.to(net.whiten.weight.dtype))
    bias_after_epoch0 = None
    for step in run.steps():
        if step == 4:
            bias_after_epoch0 = net.whiten.bias.detach().clone()
    assert calls == [(s, (s - 1) // 4) for s in range(1, 8)]
    assert bias_after_epoch0 is not None and torch.equal(net.whiten.bias, bias_after_epoch0)  # frozen from epoch 1
    engine = run.engines["model"]
    assert engine.lookahead is not None and engine.lookahead.ema is not None
    buffers = [b for b in engine.model.buffers() if b.is_floating_point()]
    assert (
        len(engine.lookahead.ema) == len(engine.update.written()) + len(buffers) and buffers
    )  # batch-norm's statistics too
    # the run's end settled the weights onto the average: masters, their FP16 copies and the statistics
    for t, e in zip([*engine.update.written(), *buffers], engine.lookahead.ema):
        assert torch.equal(t, e)
    for p, m in engine.update.low_pairs:
        assert torch.equal(p, m.to(p.dtype))
    # the lr of each step is the triangle's (read from the per-step log)
    run.save_record()
    lrs = [
        r["lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"
    ]
    expected = cfg_lr(run) * np.interp(np.arange(7), [0, int(0.23 * 7), 7], [0.2, 1.0, 0.07])
    np.testing.assert_allclose(lrs, expected, rtol=1e-6)


def cfg_lr(run) -> float:
    return float(run.cfg.optim.lr)


def test_a_run_of_airbench_ends_with_a_record_scored_with_tta_and_only_its_last_evaluation_uses_it(
    tmp_path, in_process
):
    run = build_run(
        tmp_path,
        *AIRBENCH,
        "data.train_samples=32",
        "data.val_samples=16",
        "schedule.batch_size=8",
        "schedule.steps=3",
        "schedule.eval_every=1",
    )
    scored: list[tuple[int, int]] = []  # (step, images scored with the augmentation)
    tta = run.task._tta_logits
    run.task._tta_logits = lambda images: scored.append((run.step, images.shape[0])) or tta(images)
    assert run.execute().status == "ok"
    rec = read_record(tmp_path)
    assert rec["status"] == "ok" and 0 <= rec["metrics"]["top1"] <= 1 and rec["metrics"]["val_samples"] == 16
    assert scored == [(3, 8), (3, 8)]  # the two validation batches of the final evaluation, none before


@pytest.mark.parametrize("modified", [False, True])
def test_fp16_weights_step_by_nesterov_as_the_formula_rounded_to_fp16(modified):
    from mpt.precision.optim import FP16MomentumSGD, momentum_headroom

    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(64, generator=g).half()
    grads = [torch.randn(64, generator=g).half() for _ in range(4)]
    p = nn.Parameter(w0.clone())
    lr, m, wd, S = 0.05, 0.85, 0.01, 8.0
    opt = FP16MomentumSGD([p], lr=lr, momentum=m, weight_decay=wd, modified=modified, nesterov=True)
    w, buf, h = w0.double(), torch.zeros(64, dtype=torch.float64), momentum_headroom(m)
    for grad in grads:
        p.grad = (grad.float() * S).half()  # arrives scaled
        opt.step(grad_scale=S)
        gd = (grad.float() * S).half().double() / S + wd * w
        if modified:  # G kept times h*S in FP16; the step looks ahead along it
            G = (buf / (h * S)) * m + gd
            buf = (G * h * S).half().double()
            step = -lr * (gd + m * G)
        else:
            v = buf * m - lr * gd
            buf = v.half().double()
            step = m * v - lr * gd
        w = (w + step).half().double()
        # one FP16 ulp: the oracle rounds once from float64, the update from FP32 registers
        torch.testing.assert_close(p.detach().double(), w, rtol=0, atol=float(torch.finfo(torch.float16).eps) * 4)
    assert not torch.equal(p.detach(), w0)
