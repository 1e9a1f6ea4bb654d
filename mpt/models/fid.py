"""Fréchet Inception Distance (FID) between generated and real images, from a local weights file.

FID (Heusel et al. 2017) fits a Gaussian to the 2048-d pool3 features of an Inception v3 network
on each image set and reports d² = |mu1 - mu2|² + Tr(S1 + S2 - 2 (S1 S2)^{1/2}).

The network's weights are only read from the file the user names (`model.fid_weights`); nothing is
downloaded, because runs happen on machines without network access and because the number only
means something if one knows exactly which network produced it (the file's sha256 goes into the
record). Two files are accepted, told apart by their state dict:

- pytorch-fid's `pt_inception-2015-12-05-6726825d.pth` (the TF Inception graph that published FIDs
  use, converted; from https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/
  pt_inception-2015-12-05-6726825d.pth): run as the FID-Inception architecture below, on the [-1, 1]
  images as they are. Only these FIDs are comparable with published ones.
- torchvision's ImageNet `inception_v3_google-0cc3c7bd.pth` (https://download.pytorch.org/models/
  inception_v3_google-0cc3c7bd.pth): plain torchvision Inception v3, also on the [-1, 1] images
  (its weights come from TF's Inception, which torchvision's `transform_input` feeds [-1, 1] too).
  Good for comparing our own runs with each other, not with the literature.

The extractor always runs in IEEE FP32, outside any autocast region and with TF32 off: FID is the
measurement, not part of the precision mode under test. The Gaussian statistics and the distance
are computed in float64.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import inception as tv_inception

from mpt.config import ConfigError
from mpt.precision.engine import ieee_fp32

FID_FILE = "pt_inception-2015-12-05-6726825d.pth"
TORCHVISION_FILE = "inception_v3_google-0cc3c7bd.pth"
ACCEPTED = (
    f"pytorch-fid's {FID_FILE} (the standard FID network) or torchvision's {TORCHVISION_FILE} "
    "(ImageNet Inception v3, FIDs not comparable with published ones)"
)
FID_NETWORK = "FID Inception (pytorch-fid pt_inception-2015-12-05)"
TORCHVISION_NETWORK = "torchvision Inception v3 (ImageNet weights): FIDs not comparable with published ones"
INPUT_SIZE = 299
FEATURES = 2048


# The TF graph's average pools ignore the zero padding (TF's SAME padding divides by the number of
# valid inputs), where torchvision's count it; the border features differ otherwise.
def _avg_pool_no_pad(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class FIDInceptionA(tv_inception.InceptionA):
    """Mixed_5b..5d as in the TF graph."""

    def _forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        branch1x1 = self.branch1x1(x)
        branch5x5 = self.branch5x5_2(self.branch5x5_1(x))
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = self.branch_pool(_avg_pool_no_pad(x))
        return [branch1x1, branch5x5, branch3x3dbl, branch_pool]


class FIDInceptionC(tv_inception.InceptionC):
    """Mixed_6b..6e as in the TF graph."""

    def _forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        branch1x1 = self.branch1x1(x)
        branch7x7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        branch7x7dbl = x
        for conv in (
            self.branch7x7dbl_1,
            self.branch7x7dbl_2,
            self.branch7x7dbl_3,
            self.branch7x7dbl_4,
            self.branch7x7dbl_5,
        ):
            branch7x7dbl = conv(branch7x7dbl)
        branch_pool = self.branch_pool(_avg_pool_no_pad(x))
        return [branch1x1, branch7x7, branch7x7dbl, branch_pool]


class FIDInceptionE(tv_inception.InceptionE):
    """Mixed_7b (average pool, padding not counted) and Mixed_7c (`max_pool=True`) as in the TF graph.

    The TF graph's last block pools its pool branch with a max pool; published FIDs include that.
    """

    def __init__(self, in_channels: int, max_pool: bool = False) -> None:
        super().__init__(in_channels)
        self.max_pool = max_pool

    def _forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        branch1x1 = self.branch1x1(x)

        branch3x3 = self.branch3x3_1(x)
        branch3x3 = torch.cat([self.branch3x3_2a(branch3x3), self.branch3x3_2b(branch3x3)], 1)

        branch3x3dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        branch3x3dbl = torch.cat([self.branch3x3dbl_3a(branch3x3dbl), self.branch3x3dbl_3b(branch3x3dbl)], 1)

        if self.max_pool:
            pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1)
        else:
            pooled = _avg_pool_no_pad(x)
        branch_pool = self.branch_pool(pooled)
        return [branch1x1, branch3x3, branch3x3dbl, branch_pool]


def fid_inception_v3() -> tv_inception.Inception3:
    """The FID-Inception architecture (randomly initialized), whose state dict is pytorch-fid's file."""
    blocks = [
        tv_inception.BasicConv2d,
        FIDInceptionA,
        tv_inception.InceptionB,
        FIDInceptionC,
        tv_inception.InceptionD,
        FIDInceptionE,
        tv_inception.InceptionAux,  # unused: aux_logits=False
    ]
    net = tv_inception.Inception3(num_classes=1008, aux_logits=False, inception_blocks=blocks, init_weights=False)
    net.Mixed_7c = FIDInceptionE(2048, max_pool=True)
    return net


class InceptionFeatures(nn.Module):
    """images [N, 3, H, W] in [-1, 1] -> [N, 2048] float32 pool3 features; always FP32, eval, no grad."""

    def __init__(self, net: tv_inception.Inception3) -> None:
        super().__init__()
        # Load the file first, then drop the classifier: the features are what goes into fc.
        net.fc = nn.Identity()
        net.AuxLogits = None
        self.net = net
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> InceptionFeatures:
        # In training mode BN would use batch statistics and dropout would zero features: a
        # measurement network must never leave eval mode, whoever calls .train() on it.
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"expected images [N, 3, H, W] (or [N, 1, H, W]), got {list(images.shape)}")
        device = next(self.net.parameters()).device
        with torch.autocast(device_type=device.type, enabled=False), ieee_fp32():
            x = images.to(device=device, dtype=torch.float32)
            if x.shape[1] == 1:
                # Grayscale data sets (MNIST) are measured as gray RGB images, the usual convention.
                x = x.expand(-1, 3, -1, -1)
            if x.shape[-2:] != (INPUT_SIZE, INPUT_SIZE):
                x = F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", align_corners=False)
            return self.net(x).float()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= 160 else line[:160] + "..."


def _mismatch(state: dict[str, Any], net: nn.Module) -> str:
    """What differs between a state dict and a network's, in a few words (empty when nothing)."""
    want = {k: tuple(v.shape) for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    got = {k: tuple(v.shape) for k, v in state.items() if not k.endswith("num_batches_tracked")}
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    shapes = sorted(k for k in set(want) & set(got) if want[k] != got[k])

    def few(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")

    parts = []
    if missing:
        parts.append(f"missing keys {few(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {few(unexpected)}")
    if shapes:
        parts.append("; ".join(f"{k} is {list(got[k])}, expected {list(want[k])}" for k in shapes[:3]))
    return "; ".join(parts)


def load_inception(path: str, device: torch.device) -> tuple[InceptionFeatures, dict[str, Any]]:
    """The feature extractor for the weights file at `path`, and what it is (for the run record)."""
    where = f"model.fid_weights={path}"
    local = os.path.expanduser(path)
    if not os.path.exists(local):
        raise ConfigError(f"{where}: no such file; expected a local copy of {ACCEPTED} (nothing is downloaded)")
    if not os.path.isfile(local):
        raise ConfigError(f"{where}: not a file; expected a local copy of {ACCEPTED}")
    try:
        # weights_only: a weights file must not be able to run code; pickled modules are refused here.
        state = torch.load(local, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's own text here is a multi-paragraph advice to retry with weights_only=False.
        raise ConfigError(
            f"{where}: cannot be read as a state dict by torch.load(weights_only=True) ({type(e).__name__}: "
            f"a corrupt file, or one that pickles objects other than tensors, e.g. a whole module); expected {ACCEPTED}"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"{where}: cannot be read as a state dict by torch.load(weights_only=True) "
            f"({type(e).__name__}: {_first_line(e)}); expected {ACCEPTED}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{where}: holds a {type(state).__name__}, not a state dict of tensors; expected {ACCEPTED}")

    fc = state.get("fc.weight")
    fc_shape = list(fc.shape) if isinstance(fc, torch.Tensor) else None
    has_aux = any(k.startswith("AuxLogits.") for k in state)
    if fc_shape == [1008, FEATURES] and not has_aux:
        net, network, comparable = fid_inception_v3(), FID_NETWORK, True
    elif fc_shape == [1000, FEATURES]:
        # The AuxLogits head never contributes to the features; a copy saved without it is the same network.
        net = tv_inception.Inception3(num_classes=1000, aux_logits=has_aux, transform_input=False, init_weights=False)
        network, comparable = TORCHVISION_NETWORK, False
    else:
        raise ConfigError(
            f"{where}: not an Inception v3 state dict: expected torchvision Inception3 key names with "
            f"fc.weight of shape [1008, 2048] and no AuxLogits.* keys ({FID_FILE}) or [1000, 2048] with "
            f"AuxLogits.* keys ({TORCHVISION_FILE}); got fc.weight "
            f"{'absent' if fc_shape is None else fc_shape} among {len(state)} keys"
        )
    problem = _mismatch(state, net)
    if problem:
        raise ConfigError(f"{where}: does not match the {network.split(':')[0]} architecture: {problem}")
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConfigError(
            f"{where}: does not load into the {network.split(':')[0]} architecture: {_first_line(e)}"
        ) from None

    extractor = InceptionFeatures(net).to(device=device, dtype=torch.float32)
    info = {"weights": path, "sha256": _sha256(local), "network": network, "comparable": comparable}
    return extractor, info


class GaussianStats:
    """Running mean and covariance of feature vectors, in float64 on the CPU.

    Chunks are merged with Chan et al.'s pairwise update (centered sums of squares), so the result
    does not lose digits to cancellation when the features' mean is large against their spread, as
    sum(x x^T) - n mu mu^T would.
    """

    def __init__(self) -> None:
        self.n = 0
        self._mean: torch.Tensor | None = None
        self._m2: torch.Tensor | None = None  # sum of outer products of deviations from the mean
        # cov()'s square root, kept for the next distance: the reference set's stats are compared
        # with every evaluation's, and at d=2048 the eigendecomposition is most of the cost.
        self._sqrt_cov: torch.Tensor | None = None

    def update(self, features: torch.Tensor) -> None:
        if features.dim() != 2:
            raise ValueError(f"expected features [n, d], got {list(features.shape)}")
        x = features.detach().to(device="cpu", dtype=torch.float64)
        nb = x.shape[0]
        if nb == 0:
            return
        if self._mean is not None and x.shape[1] != self._mean.shape[0]:
            raise ValueError(f"features of size {x.shape[1]} after features of size {self._mean.shape[0]}")
        mean_b = x.mean(0)
        centered = x - mean_b
        self._absorb(nb, mean_b, centered.T @ centered)

    def _absorb(self, nb: int, mean_b: torch.Tensor, m2_b: torch.Tensor) -> None:
        """Merge a chunk of nb features with mean mean_b and centered sum of squares m2_b."""
        self._sqrt_cov = None
        if self._mean is None or self._m2 is None:
            self.n, self._mean, self._m2 = nb, mean_b.clone(), m2_b.clone()
            return
        n = self.n + nb
        delta = mean_b - self._mean
        self._mean = self._mean + delta * (nb / n)
        self._m2 = self._m2 + m2_b + torch.outer(delta, delta) * (self.n * nb / n)
        self.n = n

    @classmethod
    def merged(cls, parts: list["GaussianStats"]) -> "GaussianStats":
        """The statistics of the union of `parts`' features (each rank's), by the same pairwise update."""
        out = cls()
        for p in parts:
            if p._mean is not None and p._m2 is not None:
                out._absorb(p.n, p._mean, p._m2)
        return out

    def mean(self) -> torch.Tensor:
        if self._mean is None:
            raise ValueError("no features yet")
        return self._mean.clone()

    def cov(self) -> torch.Tensor:
        if self._m2 is None or self.n < 2:
            raise ValueError(f"a covariance needs at least 2 samples, have {self.n}")
        return self._m2 / (self.n - 1)

    def sqrt_cov(self) -> torch.Tensor:
        """The PSD square root of cov() (computed once per set of features)."""
        if self._sqrt_cov is None:
            self._sqrt_cov = _psd_sqrt(self.cov())
        return self._sqrt_cov


def _psd_sqrt(s: torch.Tensor) -> torch.Tensor:
    w, v = torch.linalg.eigh(s)
    # A covariance is PSD; its negative eigenvalues are rounding (and many are ~0 when n < d).
    return (v * w.clamp(min=0).sqrt()) @ v.T


def frechet_distance(a: GaussianStats, b: GaussianStats) -> float:
    """d² between the Gaussians fitted to two feature sets (float64; NaN if either holds non-finite features)."""
    if a.n < 2 or b.n < 2:
        raise ValueError(f"the Fréchet distance needs at least 2 samples per set, have {a.n} and {b.n}")
    mu1, mu2, s1, s2 = a.mean(), b.mean(), a.cov(), b.cov()
    if mu1.shape != mu2.shape:
        raise ValueError(f"feature sizes differ: {mu1.shape[0]} and {mu2.shape[0]}")
    # A diverged generator (NaN images) gets a NaN FID in the record rather than an eigh failure.
    if not all(bool(torch.isfinite(t).all()) for t in (mu1, mu2, s1, s2)):
        return float("nan")
    # Tr((S1 S2)^{1/2}) = Tr((R S2 R)^{1/2}) with R = S1^{1/2}: R S2 R is symmetric PSD, so eigh
    # applies and no complex square root of a non-symmetric matrix (scipy's sqrtm) is needed. The
    # trace is symmetric in S1 and S2, so use whichever set already has its square root.
    if b._sqrt_cov is not None and a._sqrt_cov is None:
        r, other = b.sqrt_cov(), s1
    else:
        r, other = a.sqrt_cov(), s2
    m = r @ other @ r
    m = (m + m.T) / 2  # exactly symmetric for eigvalsh
    tr_covmean = torch.linalg.eigvalsh(m).clamp(min=0).sqrt().sum()
    diff = mu1 - mu2
    d2 = diff @ diff + torch.trace(s1) + torch.trace(s2) - 2 * tr_covmean
    # d² is a squared distance; a value below 0 can only be rounding (identical sets).
    return max(float(d2), 0.0)
