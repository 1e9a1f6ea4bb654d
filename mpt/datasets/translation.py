"""Sentence pairs as length-bucketed, padded batches, and a synthetic language pair.

Sources of token ids (datasets/parallel_text.py: files and a trained subword tokenizer; here: a
synthetic language) hand their pairs to `TranslationData`, which makes the batches. Token ids 0-3
are the same everywhere: padding, unknown, begin and end of sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig

from ..config import ConfigError, positive
from ..distributed import Dist
from .sampling import EpochOrder, validate_sample_counts

PAD, UNK, BOS, EOS = 0, 1, 2, 3
FIRST_WORD = 4
SORT_BLOCK = 8  # evaluation batches are length-sorted within blocks of this many


@dataclass
class TranslationBatch:
    src: torch.Tensor  # (B, S) source ids then EOS, padded with PAD to a multiple of pad_to_multiple
    src_len: torch.Tensor  # (B,) on the run's device, for attention masks
    src_len_cpu: torch.Tensor  # (B,) on the CPU, for packing the bidirectional layer without a device sync
    tgt_in: torch.Tensor  # (B, T) BOS then the target: the decoder's input (teacher forcing)
    tgt_out: torch.Tensor  # (B, T) the target then EOS: what the decoder must predict
    tgt_tokens: int  # non-padding entries of tgt_out (the target tokens including EOS)
    src_tokens: int
    refs: Optional[list[str]] = None  # raw reference sentences (validation), for BLEU


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def collate(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]],
    multiple: int,
    device: torch.device,
    refs: Optional[list[str]] = None,
) -> TranslationBatch:
    n = len(pairs)
    src_lens = np.array([len(s) + 1 for s, _ in pairs])
    tgt_lens = np.array([len(t) + 1 for _, t in pairs])
    src = np.full((n, round_up(int(src_lens.max()), multiple)), PAD, dtype=np.int64)
    tgt_in = np.full((n, round_up(int(tgt_lens.max()), multiple)), PAD, dtype=np.int64)
    tgt_out = tgt_in.copy()
    for i, (s, t) in enumerate(pairs):
        src[i, : len(s)], src[i, len(s)] = s, EOS
        tgt_in[i, 0], tgt_in[i, 1 : len(t) + 1] = BOS, t
        tgt_out[i, : len(t)], tgt_out[i, len(t)] = t, EOS
    lens = torch.from_numpy(src_lens)
    return TranslationBatch(
        src=torch.from_numpy(src).to(device, non_blocking=True),
        src_len=lens.to(device, non_blocking=True),
        src_len_cpu=lens,
        tgt_in=torch.from_numpy(tgt_in).to(device, non_blocking=True),
        tgt_out=torch.from_numpy(tgt_out).to(device, non_blocking=True),
        tgt_tokens=int(tgt_lens.sum()),
        src_tokens=int(src_lens.sum()),
        refs=refs,
    )


class TranslationData(EpochOrder):
    """A DataSource over tokenized pairs. Training batches come from length buckets (NVIDIA's GNMT
    BucketingSampler: a pair's bucket is its longer side's length over max_len / num_buckets), so
    a batch holds pairs of similar length and little padding; each epoch shuffles within the buckets,
    drops each bucket's incomplete last batch, and shuffles the batches. Validation pairs go in
    source-length order, each batch with its raw references."""

    def __init__(
        self,
        train: list[tuple[np.ndarray, np.ndarray]],
        val: list[tuple[np.ndarray, np.ndarray]],
        val_refs: list[str],
        detokenize: Callable[[list[int]], str],
        info: dict,
        data: DictConfig,
        schedule: DictConfig,
        multiple: int,
        seed: int,
        device: torch.device,
        shard: Dist = Dist(),
    ):
        self.shard = shard  # under torchrun: this rank's slice of each global batch
        self.train, self.val_pairs, self.val_refs = train, val, val_refs
        self.test_pairs: Optional[list[tuple[np.ndarray, np.ndarray]]] = None
        self.test_refs: list[str] = []
        self.batch_size, self.multiple, self.device = schedule.batch_size, multiple, device
        longest = np.array([max(len(s), len(t)) for s, t in train], dtype=np.int64)
        bucket = np.minimum(longest * data.num_buckets // (data.max_len + 1), data.num_buckets - 1)
        self.buckets = [torch.from_numpy(np.flatnonzero(bucket == b)) for b in range(data.num_buckets)]
        self.steps_per_epoch = sum(len(b) // self.batch_size for b in self.buckets)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"schedule.batch_size={self.batch_size}: no length bucket holds a full batch "
                f"of the {len(train)} training pairs (bucket sizes {[len(b) for b in self.buckets]}); "
                "use a smaller batch or fewer data.num_buckets"
            )
        if not val:
            setting = "val_split=" + data.val_split if data.name == "parallel_text" else "val_samples=0"
            raise ConfigError(f"data.{setting}: no validation pairs")
        self.order = torch.Generator().manual_seed(20_000 + seed)
        self.info = {
            **info,
            "train_pairs": len(train),
            "val_pairs": len(val),
            "train_tgt_tokens": int(sum(len(t) + 1 for _, t in train)),
            "detokenize": detokenize,
            "resident": False,
        }

    def _epoch_batches(self) -> list[torch.Tensor]:
        batches = []
        for members in self.buckets:
            perm = members[torch.randperm(len(members), generator=self.order)]
            batches += [
                perm[i : i + self.batch_size] for i in range(0, len(perm) - self.batch_size + 1, self.batch_size)
            ]
        return [batches[i] for i in torch.randperm(len(batches), generator=self.order).tolist()]

    def epoch(self, epoch: int, start: int = 0) -> Iterator[TranslationBatch]:
        """One pass in a fresh random order, from batch `start` (a resumed run's position)."""
        self.begin_epoch()
        batches = self._epoch_batches()
        for idx in batches[start:]:
            idx = idx[slice(*self.shard.shard(0, len(idx)))]
            yield collate([self.train[i] for i in idx.tolist()], self.multiple, self.device)

    def state_dict(self) -> dict:
        """The epoch order's state, and the vocabulary's identity."""
        return {**super().state_dict(), "tokenizer_sha256": self.info.get("tokenizer_sha256")}

    def load_state_dict(self, state: dict) -> None:
        saved, now = state.get("tokenizer_sha256"), self.info.get("tokenizer_sha256")
        if saved != now:  # the same ids would mean other subwords: the checkpoint's model cannot go on
            raise ConfigError(
                f"the checkpoint was trained with tokenizer sha256 {saved}, this run's is {now} "
                "(the text or data.tokenizer_model changed); resume=false starts over"
            )
        super().load_state_dict(state)

    def val(self, limit: int | None = None) -> Iterator[TranslationBatch]:
        """This rank's part of the first `limit` validation batches (Dist.eval_batches)."""
        return self._in_length_order(self.val_pairs, self.val_refs, limit)

    def test(self) -> Optional[Iterator[TranslationBatch]]:
        """This rank's part of the test split (data.test_split), or None without one."""
        return None if self.test_pairs is None else self._in_length_order(self.test_pairs, self.test_refs)

    def _in_length_order(self, pairs, refs, limit: int | None = None) -> Iterator[TranslationBatch]:
        """Batches of similar source length, sorted within blocks of SORT_BLOCK batches in file order,
        so the first N batches (schedule.eval_batches) are a sample of the set, not its shortest."""
        block = SORT_BLOCK * self.batch_size
        batches: list[list[int]] = []
        for start in range(0, len(pairs), block):
            order = sorted(range(start, min(start + block, len(pairs))), key=lambda i: len(pairs[i][0]))
            batches += [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for b in self.shard.eval_batches(len(batches) if limit is None else min(len(batches), limit)):
            idx = batches[b]
            yield collate([pairs[j] for j in idx], self.multiple, self.device, refs=[refs[j] for j in idx])


class SyntheticLanguagePair:
    """A learnable language pair: source sentences of Zipf-distributed words; the target maps each
    word through a fixed random permutation and swaps neighbouring words (local reordering), so a
    model must attend, not copy position by position. Words are written "w<n>"."""

    def __init__(self, data: DictConfig, seed: int):
        self.words = data.vocab_size
        self.g = torch.Generator().manual_seed(30_000 + seed)
        self.mapping = torch.randperm(self.words, generator=self.g).numpy()
        self.probs = 1.0 / torch.arange(1, self.words + 1, dtype=torch.float64)
        self.min_len, self.max_len = data.min_len, data.max_len

    def sentence(self) -> tuple[np.ndarray, np.ndarray]:
        n = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=self.g))
        src = torch.multinomial(self.probs, n, replacement=True, generator=self.g).numpy()
        tgt = self.mapping[src]
        swapped = tgt.copy()
        swapped[0 : n - 1 : 2], swapped[1:n:2] = tgt[1:n:2], tgt[0 : n - 1 : 2]
        return (src + FIRST_WORD).astype(np.int64), (swapped + FIRST_WORD).astype(np.int64)

    @staticmethod
    def detokenize(ids: list[int]) -> str:
        return " ".join(f"w{i - FIRST_WORD}" for i in ids if i >= FIRST_WORD)


def validate_pairs(cfg: DictConfig) -> None:
    """What every source of sentence pairs needs."""
    for key in ["data.vocab_size", "data.max_len", "data.num_buckets"]:
        positive(cfg, key)


def validate(cfg: DictConfig) -> None:
    """The synthetic language pair's settings."""
    validate_sample_counts(cfg)
    validate_pairs(cfg)
    d = cfg.data
    if d.vocab_size < 2:
        raise ConfigError(f"data.vocab_size={d.vocab_size}: a synthetic language needs at least 2 words")
    if not 1 <= d.min_len <= d.max_len:
        raise ConfigError(f"data.min_len={d.min_len}, data.max_len={d.max_len}: need 1 <= min_len <= max_len")


def synthetic_translation(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> TranslationData:
    d = cfg.data
    lang = SyntheticLanguagePair(d, cfg.seed)
    train = [lang.sentence() for _ in range(d.train_samples)]
    val = [lang.sentence() for _ in range(d.val_samples)]
    refs = [lang.detokenize(t.tolist()) for _, t in val]
    info = {"vocab_size": FIRST_WORD + d.vocab_size, "tokenizer": "synthetic words"}
    return TranslationData(
        train, val, refs, lang.detokenize, info, d, cfg.schedule, cfg.model.pad_to_multiple, cfg.seed, device, shard
    )
