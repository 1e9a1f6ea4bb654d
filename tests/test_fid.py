"""FID: the Fréchet distance against scipy's sqrtm formula, the Gaussian statistics against numpy,
the FID-Inception blocks against an independent pooling oracle, and load_inception on both kinds of
weights file (written here with random weights: nothing is downloaded) and on bad files.

Inception at 299x299 costs ~0.3 s per image on CPU, so the network tests use 2 images per forward.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models import inception as tv_inception

from mpt.config import ConfigError
from mpt.models.fid import (
    FIDInceptionA,
    FIDInceptionC,
    FIDInceptionE,
    GaussianStats,
    fid_inception_v3,
    frechet_distance,
    load_inception,
)

CPU = torch.device("cpu")


def _stats(x: np.ndarray | torch.Tensor) -> GaussianStats:
    s = GaussianStats()
    s.update(torch.as_tensor(x))
    return s


def _scipy_fid(x: np.ndarray, y: np.ndarray) -> float:
    """The reference formula, as pytorch-fid and the TF code compute it."""
    from scipy import linalg  # a dev dependency: the oracle must run, not skip

    mu1, mu2 = x.mean(0), y.mean(0)
    s1, s2 = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    covmean = linalg.sqrtm(s1 @ s2)
    covmean = np.real(covmean)  # imaginary parts are rounding
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


# ---- Fréchet distance and Gaussian statistics ------------------------------------------------


@pytest.mark.parametrize("d,n,seed", [(16, 50, 0), (32, 120, 1), (64, 200, 2)])
def test_frechet_distance_matches_scipy_sqrtm(d: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    # Two differently shaped distributions (correlated Gaussian vs skewed, non-negative like ReLU features).
    x = rng.standard_normal((n, d)) @ rng.standard_normal((d, d)) * 0.5 + rng.standard_normal(d)
    y = rng.gamma(2.0, size=(n + 13, d)) @ np.abs(rng.standard_normal((d, d))) * 0.3
    ref = _scipy_fid(x, y)
    got = frechet_distance(_stats(x), _stats(y))
    assert ref > 1.0
    assert got == pytest.approx(ref, rel=1e-6)
    assert frechet_distance(_stats(y), _stats(x)) == pytest.approx(ref, rel=1e-6)


def test_identical_sets_give_zero() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((100, 32)) @ rng.standard_normal((32, 32))
    a, b = _stats(x), _stats(x.copy())
    assert abs(frechet_distance(a, b)) < 1e-8 * float(torch.trace(a.cov()))


def test_mean_shift_gives_squared_norm_of_shift() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((150, 40)) @ rng.standard_normal((40, 40)) * 0.3
    v = rng.standard_normal(40) * 0.2
    # Same covariance, so the trace term vanishes exactly: d² = |v|².
    assert frechet_distance(_stats(x), _stats(x + v)) == pytest.approx(float(v @ v), rel=1e-7)


def test_cached_square_root_is_used_symmetrically_and_dropped_on_update() -> None:
    rng = np.random.default_rng(13)
    x = rng.standard_normal((80, 20)) @ rng.standard_normal((20, 20))
    y = rng.gamma(2.0, size=(90, 20))
    extra = rng.standard_normal((30, 20)) + 1.0
    reference, fake = _stats(x), _stats(y)
    first = frechet_distance(fake, reference)  # caches fake's square root
    # reference's square root is used when only it is cached, fake's when it is the first argument.
    assert frechet_distance(reference, fake) == pytest.approx(first, rel=1e-9)
    assert frechet_distance(_stats(x), fake) == pytest.approx(_scipy_fid(x, y), rel=1e-6)
    fake.update(torch.from_numpy(extra))
    assert frechet_distance(reference, fake) == pytest.approx(_scipy_fid(x, np.concatenate([y, extra])), rel=1e-6)


def test_gaussian_stats_in_chunks_match_numpy_of_the_whole() -> None:
    gen = torch.Generator().manual_seed(5)
    # float32 input with a large mean: the float64 accumulation must not cancel digits away.
    x = torch.randn(300, 24, generator=gen) * torch.linspace(0.1, 3.0, 24) + 100.0
    stats = GaussianStats()
    start = 0
    for size in (1, 0, 57, 100, 142):
        stats.update(x[start : start + size])
        start += size
    whole = x.double().numpy()
    assert stats.n == 300
    assert stats.mean().dtype == stats.cov().dtype == torch.float64
    np.testing.assert_allclose(stats.mean().numpy(), whole.mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats.cov().numpy(), np.cov(whole, rowvar=False), rtol=1e-9, atol=1e-12)


def test_frechet_distance_rejects_too_few_samples_and_mismatched_sizes() -> None:
    x = torch.randn(10, 8)
    with pytest.raises(ValueError, match="at least 2"):
        frechet_distance(_stats(x[:1]), _stats(x))
    with pytest.raises(ValueError, match="feature sizes differ"):
        frechet_distance(_stats(x), _stats(torch.randn(10, 9)))
    stats = _stats(x)
    with pytest.raises(ValueError):
        stats.update(torch.randn(4, 9))
    bad = x.clone()
    bad[0, 0] = float("nan")
    assert np.isnan(frechet_distance(_stats(bad), _stats(x)))


# ---- FID-Inception blocks --------------------------------------------------------------------


def _randomize_bn(module: nn.Module, gen: torch.Generator) -> None:
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen) * 0.1)


def _oracle_avg_pool(x: torch.Tensor) -> torch.Tensor:
    """3x3/stride-1 mean over the in-image neighbours only (the padding not counted), via unfold."""
    n, c, h, w = x.shape
    sums = F.unfold(F.pad(x, (1, 1, 1, 1)), 3).view(n, c, 9, h * w).sum(2)
    counts = F.unfold(F.pad(torch.ones(1, 1, h, w), (1, 1, 1, 1)), 3).sum(1)
    return (sums / counts).view(n, c, h, w)


def _oracle_max_pool(x: torch.Tensor) -> torch.Tensor:
    n, c, h, w = x.shape
    padded = F.pad(x, (1, 1, 1, 1), value=float("-inf"))
    return F.unfold(padded, 3).view(n, c, 9, h * w).amax(2).view(n, c, h, w)


@pytest.mark.parametrize(
    "make_fid,make_tv,channels,oracle",
    [
        (
            lambda: FIDInceptionA(192, pool_features=32),
            lambda: tv_inception.InceptionA(192, pool_features=32),
            192,
            _oracle_avg_pool,
        ),
        (
            lambda: FIDInceptionC(768, channels_7x7=128),
            lambda: tv_inception.InceptionC(768, channels_7x7=128),
            768,
            _oracle_avg_pool,
        ),
        (lambda: FIDInceptionE(1280), lambda: tv_inception.InceptionE(1280), 1280, _oracle_avg_pool),
        (lambda: FIDInceptionE(2048, max_pool=True), lambda: tv_inception.InceptionE(2048), 2048, _oracle_max_pool),
    ],
    ids=["A-avg", "C-avg", "E-avg", "E-max"],
)
def test_fid_block_differs_from_torchvision_and_matches_pool_oracle(make_fid, make_tv, channels, oracle) -> None:
    gen = torch.Generator().manual_seed(6)
    tv_block = make_tv()
    _randomize_bn(tv_block, gen)
    fid_block = make_fid()
    fid_block.load_state_dict(tv_block.state_dict(), strict=True)  # the same key names as torchvision's
    tv_block.eval(), fid_block.eval()
    x = torch.randn(2, channels, 6, 6, generator=gen)

    with torch.no_grad():
        fid_out = fid_block(x)
        tv_out = tv_block(x)
        # Oracle: torchvision's block with only its pool branch's input replaced by the oracle's pooling.
        hook = tv_block.branch_pool.register_forward_pre_hook(lambda module, args: (oracle(x),))
        try:
            expected = tv_block(x)
        finally:
            hook.remove()

    assert fid_out.shape == tv_out.shape
    assert (fid_out - tv_out).abs().max() > 1e-2
    torch.testing.assert_close(fid_out, expected, rtol=1e-5, atol=1e-5)


# ---- load_inception --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fid_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FID-kind state dict with random weights, its BN statistics set so activations stay O(1)."""
    torch.manual_seed(7)
    net = fid_inception_v3()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = 1.0  # running statistics := this batch's
    net.train()
    with torch.no_grad():
        net(torch.rand(3, 3, 96, 96) * 2 - 1)
    _randomize_bn_affine(net, torch.Generator().manual_seed(8))
    path = tmp_path_factory.mktemp("fid") / "pt_inception-random.pth"
    torch.save(net.state_dict(), path)
    return path


def _randomize_bn_affine(module: nn.Module, gen: torch.Generator) -> None:
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen) * 0.2)


def _capture(net: nn.Module) -> tuple[dict[str, torch.Tensor], list]:
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        net.Conv2d_1a_3x3.register_forward_pre_hook(lambda m, args: seen.__setitem__("input", args[0].clone())),
        net.avgpool.register_forward_hook(lambda m, args, out: seen.__setitem__("pool", out.clone())),
    ]
    return seen, hooks


@pytest.mark.slow  # Inception-v3 forward at 299 px
def test_fid_kind_extracts_fp32_pool3_features_from_resized_unnormalized_input(fid_weights: Path) -> None:
    extractor, info = load_inception(str(fid_weights), CPU)
    assert info == {
        "weights": str(fid_weights),
        "sha256": hashlib.sha256(fid_weights.read_bytes()).hexdigest(),
        "network": "FID Inception (pytorch-fid pt_inception-2015-12-05)",
        "comparable": True,
    }
    json.dumps(info)
    net = extractor.net
    assert [type(getattr(net, f"Mixed_{b}")) for b in ("5b", "5c", "5d", "6b", "6c", "6d", "6e", "7b", "7c")] == [
        FIDInceptionA
    ] * 3 + [FIDInceptionC] * 4 + [FIDInceptionE] * 2
    assert not net.Mixed_7b.max_pool and net.Mixed_7c.max_pool
    extractor.train()  # must stay in eval mode regardless
    assert not any(m.training for m in extractor.modules())
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in extractor.parameters())

    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(9)) * 2 - 1
    seen, hooks = _capture(net)
    try:
        features = extractor(x)
    finally:
        for h in hooks:
            h.remove()
    assert features.shape == (2, 2048) and features.dtype == torch.float32
    assert torch.isfinite(features).all()
    assert features.std() > 1e-3 and (features[0] - features[1]).abs().max() > 1e-3
    # The network sees the [-1, 1] images as they are, resized as pytorch-fid does; the features
    # are the final pool's output.
    torch.testing.assert_close(
        seen["input"], F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False), rtol=0, atol=0
    )
    torch.testing.assert_close(features, seen["pool"].flatten(1), rtol=0, atol=0)

    assert torch.equal(extractor(x), features)  # deterministic

    with torch.autocast("cpu", dtype=torch.bfloat16):
        in_autocast = extractor(x)
        # What the test would see if the extractor let autocast in: bfloat16 convolutions.
        leaked = net(seen["input"][:1])
    assert in_autocast.dtype == torch.float32
    torch.testing.assert_close(in_autocast, features, rtol=1e-6, atol=1e-6)
    assert (leaked.float() - features[:1]).abs().max() > 1e-4


def test_torchvision_kind_sees_what_torchvisions_own_pretrained_pipeline_feeds_it(tmp_path: Path) -> None:
    torch.manual_seed(10)
    net = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False)
    state = net.state_dict()
    path = tmp_path / "inception_v3_google-random.pth"
    torch.save(state, path)

    extractor, info = load_inception(str(path), CPU)
    assert info["comparable"] is False
    assert info["weights"] == str(path) and "torchvision" in info["network"]
    assert type(extractor.net.Mixed_5b) is tv_inception.InceptionA
    assert type(extractor.net.Mixed_7c) is tv_inception.InceptionE

    x = torch.rand(1, 3, 40, 48, generator=torch.Generator().manual_seed(11)) * 2 - 1
    seen, hooks = _capture(extractor.net)
    try:
        features = extractor(x)
    finally:
        for h in hooks:
            h.remove()
    assert features.shape == (1, 2048) and features.dtype == torch.float32 and torch.isfinite(features).all()
    torch.testing.assert_close(features, seen["pool"].flatten(1), rtol=0, atol=0)
    # The oracle: torchvision's pretrained pipeline, ImageNet-normalized input through
    # transform_input=True (which its weights= builder forces: the weights are TF's, fed [-1, 1]).
    theirs = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False, transform_input=True)
    theirs.load_state_dict(state)
    theirs.fc = torch.nn.Identity()
    resized = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = theirs.eval()(((resized + 1) / 2 - mean) / std)
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-5)

    # The aux head never feeds the features, so a copy saved without it is accepted too.
    no_aux = tmp_path / "no_aux.pth"
    torch.save({k: v for k, v in state.items() if not k.startswith("AuxLogits.")}, no_aux)
    assert load_inception(str(no_aux), CPU)[1]["comparable"] is False


def _config_error(path: Path, *fragments: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_inception(str(path), CPU)
    message = str(err.value)
    assert message.startswith(f"model.fid_weights={path}: ")
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_weights_files_are_config_errors(tmp_path: Path, fid_weights: Path) -> None:
    _config_error(
        tmp_path / "absent.pth",
        "no such file",
        "pt_inception-2015-12-05-6726825d.pth",
        "inception_v3_google-0cc3c7bd.pth",
    )

    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(np.random.default_rng(12).bytes(4096))
    _config_error(garbage, "cannot be read", "Error")

    pickled_module = tmp_path / "module.pth"
    torch.save(nn.Linear(2, 2), pickled_module)
    _config_error(pickled_module, "weights_only", "UnpicklingError")

    resnet = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), resnet)
    _config_error(resnet, "not an Inception v3 state dict", "[1008, 2048]", "[1000, 2048]", "AuxLogits")

    state = torch.load(fid_weights, weights_only=True)
    del state["Mixed_6c.branch_pool.conv.weight"]
    truncated = tmp_path / "missing_key.pth"
    torch.save(state, truncated)
    _config_error(truncated, "missing keys Mixed_6c.branch_pool.conv.weight")


def _matmul_fp32_math() -> str:
    m = torch.backends.cuda.matmul
    return m.fp32_precision if hasattr(m, "fp32_precision") else ("tf32" if m.allow_tf32 else "ieee")


def test_the_extractor_runs_in_ieee_fp32_even_when_the_run_allows_tf32(fid_weights: Path) -> None:
    from mpt.precision.engine import set_fp32_math

    extractor, _ = load_inception(str(fid_weights), CPU)
    seen = []
    hook = extractor.net.Conv2d_1a_3x3.register_forward_hook(lambda *_: seen.append(_matmul_fp32_math()))
    try:
        set_fp32_math(True)  # what precision=tf32 sets for the whole run
        extractor(torch.zeros(1, 3, 75, 75))
        after = _matmul_fp32_math()
    finally:
        hook.remove()
        set_fp32_math(False)
    assert seen == ["ieee"] and after == "tf32"  # IEEE inside, the run's setting back afterwards
