"""The fast CIFAR-10 network of Jordan 2024 ("94% on CIFAR-10 in 3.29 Seconds on a Single GPU",
arXiv:2404.00498), airbench94, written from the paper's description.

- A 2x2 convolution of 24 filters without padding, its weights fixed before training to whiten the
  2x2 patches of the training images (the eigenvectors of the patches' covariance, each scaled by
  1/sqrt(eigenvalue + 5e-4), and their negatives), its bias trained; then GELU.
- Three blocks of widths 64, 256 and 256, each: a 3x3 convolution, 2x2 max-pooling, batch-norm,
  GELU, a 3x3 convolution, batch-norm, GELU. Convolutions have no bias and start as the identity
  on their first input-width filters (Dirac), the rest as torch's default. Batch-norm has no
  trained scale (fixed at 1), a trained bias, eps 1e-12 and a running average that keeps 0.6 of
  the old statistics (torch's momentum 0.4).
- 3x3 max-pooling of the final 3x3 map, a 256x10 linear layer without bias, and the logits times 1/9.

1,972,792 parameters, 1,971,352 of them trained (not the whitening filters nor the batch-norm
scales). The paper's recipe (label smoothing, the summed loss, Nesterov SGD with a 64x learning
rate for the batch-norm biases, the triangular schedule, lookahead averaging, alternating flips,
test-time augmentation) is the run's configuration (configs/model/airbench94.yaml), each piece
owned where mpt owns that concern.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

WIDTHS = (64, 256, 256)
WHITEN_KERNEL = 2
WHITEN_EPS = 5e-4  # added to each eigenvalue before it divides its eigenvector
LOGIT_SCALE = 1 / 9


def _conv(c_in: int, c_out: int) -> nn.Conv2d:
    conv = nn.Conv2d(c_in, c_out, 3, padding="same", bias=False)
    with torch.no_grad():  # the first c_in filters pass their input through: an implicit residual
        nn.init.dirac_(conv.weight[:c_in])
    return conv


def _norm(c: int) -> nn.BatchNorm2d:
    norm = nn.BatchNorm2d(c, eps=1e-12, momentum=0.4)
    norm.weight.requires_grad_(False)  # the scale stays 1: only the bias trains
    return norm


class ConvGroup(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv1, self.norm1 = _conv(c_in, c_out), _norm(c_out)
        self.conv2, self.norm2 = _conv(c_out, c_out), _norm(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(F.max_pool2d(self.conv1(x), 2)))
        return F.gelu(self.norm2(self.conv2(x)))


class Airbench94(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        width = 2 * 3 * WHITEN_KERNEL**2
        self.whiten = nn.Conv2d(3, width, WHITEN_KERNEL, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)  # set from the data by init_whitening, never trained
        with torch.no_grad():
            self.whiten_bias.zero_()
        self.blocks = nn.Sequential(
            ConvGroup(width, WIDTHS[0]), ConvGroup(WIDTHS[0], WIDTHS[1]), ConvGroup(WIDTHS[1], WIDTHS[2])
        )
        self.head = nn.Linear(WIDTHS[2], num_classes, bias=False)

    @property
    def whiten_bias(self) -> nn.Parameter:
        return cast(nn.Parameter, self.whiten.bias)  # built with bias=True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.gelu(self.whiten(x)))
        x = F.max_pool2d(x, 3).flatten(1)
        return self.head(x) * LOGIT_SCALE

    @torch.no_grad()
    def init_whitening(self, images: torch.Tensor) -> None:
        """Set the whitening filters from normalized training images (N, 3, H, W): every 2x2 patch,
        its covariance (about zero, uncentred, in FP64), and for each eigenvector v with eigenvalue
        l the filters v / sqrt(l + eps) and its negative, largest eigenvalue first."""
        w = self.whiten.weight
        c, k = w.shape[1], w.shape[2]
        patches = images.double().unfold(2, k, 1).unfold(3, k, 1)  # N, C, H', W', k, k
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k)
        covariance = patches.T @ patches / patches.shape[0]
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)  # ascending
        eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.T.flip(0)  # rows, descending
        filters = (eigenvectors / torch.sqrt(eigenvalues + WHITEN_EPS)[:, None]).reshape(-1, c, k, k)
        w.copy_(torch.cat([filters, -filters]).to(w.dtype))


def airbench94(num_classes: int = 10) -> Airbench94:
    return Airbench94(num_classes)
