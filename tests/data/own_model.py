"""A user's own classifier, as a user writes one: plain torch, no mpt import (tests/test_own_model.py)."""

from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, width: int):
        super().__init__()
        self.width = width
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).relu().mean((2, 3)))


def small_cnn(num_classes: int, width: int = 8) -> nn.Module:
    return SmallCNN(num_classes, width)


def not_a_module():
    return {"weights": []}


class BigramLM(nn.Module):
    """A user's own language model: each position's logits from its own token alone."""

    def __init__(self, vocab_size: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, ids):
        return self.out(self.hidden(self.embed(ids)).tanh())


def small_lm(vocab_size: int, width: int = 16) -> nn.Module:
    return BigramLM(vocab_size, width)


def wrong_lm(vocab_size: int) -> nn.Module:
    return nn.Sequential(nn.Embedding(vocab_size, 8), nn.Linear(8, 3))  # 3 logits, not one per word
