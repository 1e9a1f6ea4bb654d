"""The CIFAR-10 residual networks of He et al. 2016 ("Deep Residual Learning for Image Recognition",
section 4.2): 6n + 2 layers of 3x3 convolutions.

A 3x3 convolution of 16 filters, then three stages of n basic blocks (two 3x3 convolutions each)
with 16, 32 and 64 filters on maps of 32, 16 and 8 pixels, the first convolution of the second and
third stages striding by 2, then global average pooling and a 10-way fully connected layer.
Shortcuts are identities; where a stage halves the map and doubles the filters, the shortcut takes
every other pixel and pads the new channels with zeros (the paper's option A, which adds no
parameter): ResNet-20 (n = 3) has 0.27M parameters, as its Table 6 says. Convolutions have no bias
and are followed by batch-norm; weights start as He et al. 2015 ("Delving deep") describes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride = stride
        self.pad = planes - inplanes  # channels the option-A shortcut adds as zeros

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1 and self.pad == 0:
            return x
        x = x[:, :, :: self.stride, :: self.stride]
        # Zeros of x's own dtype: an FP16 network's shortcut stays FP16.
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, depth: int, num_classes: int = 10):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"depth={depth}: a CIFAR ResNet has 6n + 2 layers (20, 32, 44, 56, 110)")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        inplanes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                blocks.append(BasicBlock(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(
                    m.weight, mode="fan_out" if isinstance(m, nn.Conv2d) else "fan_in", nonlinearity="relu"
                )
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet20(num_classes: int = 10) -> CifarResNet:
    return CifarResNet(20, num_classes)


def resnet56(num_classes: int = 10) -> CifarResNet:
    return CifarResNet(56, num_classes)
