"""DCGAN: a generator and a discriminator, two optimizers, one precision engine each.

Two architectures (`model.arch`):
- `dcgan128`, the paper's 128x128 face generator. The paper gives its layer counts: a generator of
  7 fractionally-strided convolutions with batch-norm and leaky ReLU, the last with tanh; a
  discriminator of 6 convolutions and 2 fully connected layers. It gives no widths, kernels or
  strides; those here follow Radford et al.'s rules: 4x4 kernels of stride 2 doubling (halving) the
  size, widths halving toward the image, no batch-norm on the discriminator's input layer or either
  network's output layer. The generator projects z to 4x4, doubles five times to 128x128, and its
  seventh layer is a stride-1 3x3 transposed convolution to RGB. The discriminator halves 128 to
  2x2 in six convolutions, then a hidden fully connected layer (batch-norm, leaky ReLU) and the logit.
- `dcgan64`, Radford et al.'s 64x64 network (the PyTorch example's): ReLU in the generator, leaky
  ReLU in the discriminator, whose last layer is a 4x4 convolution to the logit.

Training is DCGAN's alternation per batch: the discriminator's loss on real images and on detached
generated ones, its update, then the generator's non-saturating loss through the updated
discriminator. BCEWithLogitsLoss keeps the sigmoid inside the loss, where autocast runs it in FP32.

Loss scaling is per network, one scaler per loss (each network's engine owns its own), as apex's
DCGAN example does with a scaler per loss. The two losses differ in size and overflow on their own:
with a shared scale, an overflow in the discriminator's backward would halve the generator's scale
too. Apart, an overflow skips only the network whose gradients overflowed; the generator's update
never sees the discriminator's gradients at all (the discriminator is frozen while the generator's
loss is formed, so that backward writes no discriminator gradients).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..config import ConfigError, positive
from ..distributed import Dist
from ..files import write_atomic
from . import LossTerm, Task, validate_image_size
from .fid import GaussianStats, InceptionFeatures, frechet_distance, load_inception

FIXED_NOISE_SEED = 7_000  # plus the run's seed: every mode of a sweep draws the same grid
FID_NOISE_SEED = 8_000


def _act(leaky_slope: float | None) -> nn.Module:
    return nn.ReLU(inplace=True) if leaky_slope is None else nn.LeakyReLU(leaky_slope, inplace=True)


def _up(cin: int, cout: int, slope: float | None, first: bool = False) -> list[nn.Module]:
    """A fractionally-strided convolution doubling the size (or 1x1 to 4x4 first), batch-norm, activation."""
    conv = (
        nn.ConvTranspose2d(cin, cout, 4, 1, 0, bias=False)
        if first
        else nn.ConvTranspose2d(cin, cout, 4, 2, 1, bias=False)
    )
    return [conv, nn.BatchNorm2d(cout), _act(slope)]


def _down(cin: int, cout: int, slope: float, norm: bool = True) -> list[nn.Module]:
    """A stride-2 convolution halving the size, batch-norm (not on the input layer), leaky ReLU."""
    return [nn.Conv2d(cin, cout, 4, 2, 1, bias=not norm), *([nn.BatchNorm2d(cout)] if norm else []), _act(slope)]


class Generator(nn.Module):
    """z (N, nz) -> images (N, 3, S, S) in [-1, 1]."""

    def __init__(self, m: DictConfig):
        super().__init__()
        self.nz = m.nz
        if m.arch == "dcgan128":
            widths = [m.ngf * k for k in (16, 8, 4, 2, 1, 1)]  # 4, 8, 16, 32, 64, 128 pixels
            slope = m.leaky_slope
            head = [nn.ConvTranspose2d(widths[-1], 3, 3, 1, 1), nn.Tanh()]  # the seventh: stride 1 to RGB
        else:  # dcgan64: 4, 8, 16, 32 pixels, then 64 in the output layer
            widths = [m.ngf * k for k in (8, 4, 2, 1)]
            slope = None
            head = [nn.ConvTranspose2d(widths[-1], 3, 4, 2, 1), nn.Tanh()]
        layers = _up(m.nz, widths[0], slope, first=True)
        for cin, cout in zip(widths, widths[1:]):
            layers += _up(cin, cout, slope)
        self.net = nn.Sequential(*layers, *head)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z[:, :, None, None])


class Discriminator(nn.Module):
    """images (N, 3, S, S) -> logits (N,)."""

    def __init__(self, m: DictConfig):
        super().__init__()
        slope = m.leaky_slope
        if m.arch == "dcgan128":
            widths = [m.ndf * k for k in (1, 2, 4, 8, 16, 16)]  # 64, 32, 16, 8, 4, 2 pixels
            head = [
                nn.Flatten(),
                nn.Linear(widths[-1] * 2 * 2, m.d_fc_size, bias=False),
                nn.BatchNorm1d(m.d_fc_size),
                _act(slope),
                nn.Linear(m.d_fc_size, 1),
            ]
        else:  # dcgan64: 32, 16, 8, 4 pixels, then a 4x4 convolution to the logit
            widths = [m.ndf * k for k in (1, 2, 4, 8)]
            head = [nn.Conv2d(widths[-1], 1, 4, 1, 0), nn.Flatten()]
        layers = _down(3, widths[0], slope, norm=False)
        for cin, cout in zip(widths, widths[1:]):
            layers += _down(cin, cout, slope)
        self.net = nn.Sequential(*layers, *head)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images).flatten()


def init_weights(module: nn.Module, std: float) -> None:
    """Radford et al.: weights from N(0, std), batch-norm scales from N(1, std), biases zero."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            nn.init.normal_(m.weight, 1.0, std)
            nn.init.zeros_(m.bias)


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.float(), torch.full_like(logits, target, dtype=torch.float32))


class GAN(Task):
    sample_unit = "images"  # real images consumed
    saves_samples = True
    primary_metric = "fid"
    higher_is_better = False

    def __init__(self, model_cfg: DictConfig, seed: int, batch_size: int, shard: Dist = Dist()):
        self.cfg = model_cfg
        self.batch_size = batch_size  # the global batch
        self.shard = shard  # under torchrun: this rank's slice of each global batch (its latents too)
        self.generator, self.discriminator = Generator(model_cfg), Discriminator(model_cfg)
        init_weights(self.generator, model_cfg.init_std)
        init_weights(self.discriminator, model_cfg.init_std)
        self.fixed_noise = torch.randn(
            model_cfg.sample_grid, model_cfg.nz, generator=torch.Generator().manual_seed(FIXED_NOISE_SEED + seed)
        )
        self.fid_seed = FID_NOISE_SEED + seed
        self.fid_extractor: InceptionFeatures | None = None
        self.real_stats: GaussianStats | None = None
        if model_cfg.fid_weights is None:
            fid = {
                "computed": False,
                "reason": "model.fid_weights is not set: FID needs a local Inception weights file "
                "(pytorch-fid's pt_inception-2015-12-05-6726825d.pth); mpt downloads nothing",
            }
        else:
            self.fid_extractor, info = load_inception(os.path.expanduser(model_cfg.fid_weights), torch.device("cpu"))
            fid = {"computed": True, **info, "generated_images": model_cfg.fid_samples}
        self.evaluation_info = {"fid": fid}  # goes into the record

    def networks(self) -> dict[str, nn.Module]:
        return {"discriminator": self.discriminator, "generator": self.generator}

    def set_network(self, name: str, module: nn.Module) -> None:
        """Train and evaluate through `module` (the network wrapped for data parallelism)."""
        setattr(self, name, module)

    @property
    def loss_definition(self) -> str:
        return "the generator's binary cross-entropy, mean over the batch (the discriminator's: metrics.jsonl)"

    def train_losses(self, real: torch.Tensor) -> Iterator[LossTerm]:
        G, D = self.generator, self.discriminator
        # The global batch's latents, drawn alike on every rank, and this rank's slice of them:
        # the same latents whatever the number of processes.
        z = torch.randn(self.batch_size, self.cfg.nz, device=real.device)[slice(*self.shard.shard(0, self.batch_size))]
        fake = G(z)
        d_real, d_fake = D(real), D(fake.detach())
        loss_real, loss_fake = _bce(d_real, 1.0), _bce(d_fake, 0.0)
        yield LossTerm(
            "discriminator",
            loss_real + loss_fake,
            {
                "loss_real": loss_real.detach(),
                "loss_fake": loss_fake.detach(),
                "d_x": torch.sigmoid(d_real.detach().float()).mean(),
                "d_g_z": torch.sigmoid(d_fake.detach().float()).mean(),
            },
        )
        # The loop has applied D's update (or skipped it); G's loss goes through the updated D.
        # Through D itself, not its data-parallel wrapper: frozen, it has no gradients to all-reduce.
        D = getattr(D, "module", D)
        D.requires_grad_(False)
        try:
            d_fake = D(fake)
            yield LossTerm("generator", _bce(d_fake, 1.0), {"d_g_z": torch.sigmoid(d_fake.detach().float()).mean()})
        finally:
            D.requires_grad_(True)

    def count_samples(self, real: torch.Tensor) -> int:
        return int(real.shape[0])

    @torch.no_grad()
    def _generate(self, z: torch.Tensor, forward_context: Callable[[], ContextManager]) -> torch.Tensor:
        with forward_context():  # the network itself: a data-parallel wrapper would sync buffers from rank 0
            return getattr(self.generator, "module", self.generator)(z).float().clamp_(-1, 1)

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[torch.Tensor],
        forward_context: Callable[[], ContextManager],
        final: bool = False,
        ranks: Dist = Dist(),
    ) -> dict[str, float]:
        """D(x) on the reference images, D(G(z)) on the fixed noise, and FID when there are weights.

        Both networks run in eval mode: batch-norm uses its running statistics, and evaluation
        leaves the training state (running statistics included) untouched."""
        G, D = self.generator, self.discriminator
        G.eval(), D.eval()
        device = next(G.parameters()).device
        if self.fid_extractor is not None:
            self.fid_extractor.to(device)
        try:
            # The reference images never change: their FID statistics are gathered once per run.
            real_stats = GaussianStats() if self.fid_extractor is not None and self.real_stats is None else None
            d_x, seen = 0.0, 0
            for real in batches:
                with forward_context():
                    d_x += float(torch.sigmoid(D(real).float()).sum())
                seen += real.shape[0]
                if real_stats is not None:
                    assert self.fid_extractor is not None  # real_stats is gathered only for FID
                    real_stats.update(self.fid_extractor(real))
            # Each rank scored its part of the reference images: the sums over ranks are the set's.
            d_x, seen = ranks.total(d_x, device), int(ranks.total(seen, device))
            if real_stats is not None:
                real_stats = GaussianStats.merged(ranks.gather_objects(real_stats))
            if seen == 0:
                raise ValueError("evaluation saw no images: the reference set is empty")
            fake = self._generate(self.fixed_noise.to(device), forward_context)
            with forward_context():
                d_g_z = float(torch.sigmoid(D(fake).float()).mean())
            metrics = {"val_d_x": d_x / seen, "val_d_g_z": d_g_z, "val_samples": seen}
            if real_stats is not None:
                self.real_stats = real_stats
            if self.fid_extractor is not None:
                metrics["fid"] = self._fid(device, forward_context, ranks)
            return metrics
        finally:
            G.train(), D.train()
            if self.fid_extractor is not None:  # off the device: its weights are no part of the model's memory
                self.fid_extractor.to("cpu")

    def _fid(self, device: torch.device, forward_context: Callable[[], ContextManager], ranks: Dist = Dist()) -> float:
        # called only with the extractor, after an evaluation has gathered the reference statistics
        assert self.fid_extractor is not None and self.real_stats is not None
        fake_stats = GaussianStats()
        g = torch.Generator().manual_seed(self.fid_seed)  # the same latents at every evaluation
        mine = set(ranks.eval_batches(-(-self.cfg.fid_samples // self.batch_size)))  # each rank its batches
        for b, start in enumerate(range(0, self.cfg.fid_samples, self.batch_size)):
            z = torch.randn(min(self.batch_size, self.cfg.fid_samples - start), self.cfg.nz, generator=g)
            if b not in mine:  # drawn all the same: the latents of a batch do not depend on the ranks
                continue
            fake = self._generate(z.to(device), forward_context)
            # Rounded to 8-bit levels, as the real images were stored and as saved samples would be.
            fake_stats.update(self.fid_extractor(torch.round((fake + 1) * 127.5) / 127.5 - 1))
        return frechet_distance(self.real_stats, GaussianStats.merged(ranks.gather_objects(fake_stats)))

    def save_samples(self, path: Path, forward_context: Callable[[], ContextManager]) -> Path:
        """The fixed-noise grid as a PNG, written atomically (generator in eval mode)."""
        from torchvision.utils import save_image

        G = self.generator
        G.eval()
        try:
            fake = self._generate(self.fixed_noise.to(next(G.parameters()).device), forward_context)
        finally:
            G.train()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(
            path,
            lambda f: save_image(
                fake.cpu() * 0.5 + 0.5, f, format="png", nrow=max(1, math.isqrt(fake.shape[0])), padding=2
            ),
        )
        return path


ARCHS = ("dcgan128", "dcgan64")


def validate(cfg: DictConfig) -> None:
    m = cfg.model
    if m.arch not in ARCHS:
        raise ConfigError(f"model.arch={m.arch}: expected one of {', '.join(ARCHS)}")
    if cfg.schedule.image_size != m.input_size:  # first: its one size says more than "at least"
        # Its strides are laid out for one size: 4x4 doubled to the output.
        raise ConfigError(
            f"schedule.image_size={cfg.schedule.image_size}: "
            f"{m.name} ({m.arch}) makes {m.input_size}x{m.input_size} images only"
        )
    validate_image_size(cfg)
    for key in [
        "model.nz",
        "model.ngf",
        "model.ndf",
        "model.d_fc_size",
        "model.init_std",
        "model.sample_grid",
        "model.fid_samples",
    ]:
        positive(cfg, key)
    if m.leaky_slope < 0:
        raise ConfigError(f"model.leaky_slope={m.leaky_slope}: must be zero or positive")
    if m.fid_weights is not None:  # a covariance needs two samples on each side
        for key in ["model.fid_samples", "data.val_samples"]:
            if OmegaConf.select(cfg, key) < 2:
                raise ConfigError(
                    f"{key}={OmegaConf.select(cfg, key)}: FID (model.fid_weights is set) needs at least 2 images"
                )


def build(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> GAN:
    return GAN(cfg.model, seed=cfg.seed, batch_size=cfg.schedule.batch_size, shard=shard)
