"""Language-model data: tokenized sentences as continuous streams, and a Markov source of known entropy.

Batches follow Jozefowicz et al.'s training: each epoch shuffles the training sentences, joins them
(each ending with </s>) into one stream, cuts it into `batch_size` rows and walks the rows `bptt`
tokens at a time; the model carries its state from one window to the next. Validation and test
keep the file order and are read as the model's `eval_state` says: `carried`, the split cut into
rows and windows as above (f-lm's and Zaremba et al.'s evaluation), or `sentence`, whole sentences
padded into batches, each scored from a zero state. Ids are ranked by training frequency (</s> 0,
<unk> 1, then words), as the log-uniform sampler of the sampled softmax assumes.
"""

from __future__ import annotations

import glob
import math
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import torch
from omegaconf import DictConfig

from ..config import ConfigError, positive
from ..distributed import Dist
from .parallel_text import read_lines
from .sampling import EpochOrder, validate_sample_counts

EOS_TOKEN, UNK_TOKEN = "</s>", "<unk>"
EOS, UNK = 0, 1
PAD_TARGET = -100  # a padded position of a sentence batch: cross-entropy's ignore_index, no token
EVAL_STATES = ("carried", "sentence")


class Sentences:
    """Sentences of ids, flat: `ids` (int32) holds them back to back, each ending with EOS; `starts`
    (n + 1) the offsets. One Billion Word's 0.8B tokens take 3.2 GB this way."""

    def __init__(self, ids: np.ndarray, lengths: np.ndarray):
        self.ids = ids.astype(np.int32, copy=False)
        self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

    @classmethod
    def of(cls, sentences: list[np.ndarray]) -> "Sentences":
        """From one array of ids per sentence (without its EOS)."""
        ends = [np.append(s, EOS) for s in sentences]
        return cls(
            np.concatenate(ends) if ends else np.zeros(0, np.int32), np.array([len(e) for e in ends], dtype=np.int64)
        )

    @classmethod
    def join(cls, parts: list["Sentences"]) -> "Sentences":
        return cls(np.concatenate([p.ids for p in parts]), np.concatenate([np.diff(p.starts) for p in parts]))

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def stream(self, order: Optional[np.ndarray] = None) -> np.ndarray:
        """All sentences back to back, in `order` (file order if None)."""
        if order is None:
            return self.ids
        lengths = np.diff(self.starts)[order]
        new_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        # token i of the new stream is token i - new_start + old_start of the old one; int32 where
        # it fits, to keep the temporaries of a One Billion Word epoch to a few GB
        kind = np.int32 if self.tokens < 2**31 else np.int64
        pos = np.arange(self.tokens, dtype=kind)
        pos += np.repeat((self.starts[:-1][order] - new_starts).astype(kind), lengths)
        return self.ids[pos]


def rows_of(stream: np.ndarray, batch_size: int) -> np.ndarray:
    """The stream cut into batch_size rows (the remainder is dropped)."""
    width = len(stream) // batch_size
    return stream[: width * batch_size].reshape(batch_size, width)


class LMData(EpochOrder):
    """A DataSource of (inputs, targets) windows, each (batch_size, bptt), targets one token ahead."""

    def __init__(
        self,
        train: Sentences,
        val: Sentences,
        test: Optional[Sentences],
        info: dict,
        batch_size: int,
        bptt: int,
        seed: int,
        device: torch.device,
        shard: Dist = Dist(),
        eval_state: str = "carried",
    ):
        self.shard = shard  # under torchrun: this rank's rows (streams) of each global batch
        self.eval_state = eval_state  # how val and test are read (EVAL_STATES)
        self.train, self.val_sentences, self.test_sentences = train, val, test
        self.batch_size, self.bptt, self.device = batch_size, bptt, device
        self.steps_per_epoch = (train.tokens // batch_size - 1) // bptt
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"schedule.batch_size={batch_size}: {train.tokens} training tokens make rows shorter than "
                f"model.bptt={bptt} + 1; use a smaller batch or bptt"
            )
        for split, sentences in [("val_split", val), ("test_split", test)]:
            if sentences is not None and sentences.tokens // batch_size < 2:
                raise ConfigError(
                    f"data.{split}: its {sentences.tokens} tokens do not give each of "
                    f"schedule.batch_size={batch_size} rows two tokens"
                )
        self.order = torch.Generator().manual_seed(20_000 + seed)
        self.info = {
            **info,
            "train_sentences": len(train),
            "train_tokens": train.tokens,
            "val_tokens": val.tokens,
            "resident": False,
        }
        if test is not None:
            self.info["test_tokens"] = test.tokens

    def _windows(self, rows: np.ndarray, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for t in range(start * self.bptt, rows.shape[1] - 1, self.bptt):
            span = (
                torch.from_numpy(np.ascontiguousarray(rows[:, t : t + self.bptt + 1]))
                .to(self.device, non_blocking=True)
                .long()
            )
            yield span[:, :-1], span[:, 1:]

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over the training sentences in a fresh order, from window `start` (a resumed run's position)."""
        order = torch.randperm(len(self.train), generator=self.begin_epoch()).numpy()
        rows = rows_of(self.train.stream(order), self.batch_size)[slice(*self.shard.shard(0, self.batch_size))]
        windows = self._windows(rows, start)
        for _ in range(start, self.steps_per_epoch):  # full windows only, so every step has batch_size x bptt targets
            yield next(windows)

    def _sentence_batches(
        self, sentences: Sentences, batches: Iterable[int]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches number `batches` of batch_size sentences at a time, in file order: inputs </s> w1 .. wn,
        targets w1 .. wn </s>, padded at the end (inputs with </s>, targets with PAD_TARGET). Every
        token is a target once, as in the carried stream (whose first token alone is none)."""
        lengths = np.diff(sentences.starts)
        for k in batches:
            first = k * self.batch_size
            last = min(first + self.batch_size, len(sentences))
            width = int(lengths[first:last].max())
            targets = np.full((last - first, width), PAD_TARGET, dtype=np.int64)
            for row, (a, b) in enumerate(zip(sentences.starts[first:last], sentences.starts[first + 1 : last + 1])):
                targets[row, : b - a] = sentences.ids[a:b]
            inputs = np.full_like(targets, EOS)
            inputs[:, 1:] = np.where(targets[:, :-1] == PAD_TARGET, EOS, targets[:, :-1])
            yield torch.from_numpy(inputs).to(self.device), torch.from_numpy(targets).to(self.device)

    def _evaluation(
        self, sentences: Sentences, limit: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's part of the first `limit` evaluation batches: of padded sentences, the batches
        of Dist.eval_batches; of the carried stream, this rank's rows (streams) of every window, as
        in training, since a stream's state runs through its windows in order."""
        if self.eval_state == "sentence":
            count = -(-len(sentences) // self.batch_size)
            return self._sentence_batches(
                sentences, self.shard.eval_batches(count if limit is None else min(count, limit))
            )
        rows = rows_of(sentences.stream(), self.batch_size)[slice(*self.shard.shard(0, self.batch_size))]
        return islice(self._windows(rows), limit)

    def val(self, limit: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._evaluation(self.val_sentences, limit)

    def test(self) -> Optional[Iterator[tuple[torch.Tensor, torch.Tensor]]]:
        """This rank's part of the test split (data.test_split), or None without one."""
        return None if self.test_sentences is None else self._evaluation(self.test_sentences)


# --- text files


def split_files(root: Path, pattern: str, key: str) -> list[Path]:
    files = sorted(Path(p) for p in glob.glob(str(root / pattern)) if Path(p).is_file())
    if not files:
        raise ConfigError(f"data.{key}={pattern}: matches no file under {root}")
    return files


def words_of(line: str) -> list[str]:
    """Tokens split at ASCII spaces and tabs only: str.split would also split at no-break and other
    Unicode spaces, which tokenized corpora keep inside tokens."""
    return [w for w in line.replace("\t", " ").split(" ") if w]


def file_sentences(path: Path, index: dict[str, int]) -> Sentences:
    """One file's sentences as ids: only one file's strings are held at a time."""
    sentences = [w for w in map(words_of, read_lines(path)) if w]
    lengths = np.fromiter((len(w) + 1 for w in sentences), dtype=np.int64, count=len(sentences))
    ids = np.fromiter(
        (index.get(t, UNK) for w in sentences for t in (*w, EOS_TOKEN)), dtype=np.int32, count=int(lengths.sum())
    )
    return Sentences(ids, lengths)


def count_words(files: list[Path]) -> Counter:
    counts: Counter = Counter()
    for f in files:
        for line in read_lines(f):
            counts.update(words_of(line))
    return counts


def build_vocabulary(counts: Counter, min_count: int, max_vocab: Optional[int]) -> list[str]:
    """</s>, <unk>, then the words seen at least min_count times, most frequent first (ties by spelling)."""
    counts = Counter(counts)
    counts.pop(EOS_TOKEN, None)
    counts.pop(UNK_TOKEN, None)  # PTB writes its own <unk>: it maps to ours
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    vocab = [EOS_TOKEN, UNK_TOKEN, *words]
    return vocab[:max_vocab] if max_vocab else vocab


# One Billion Word's own vocabulary file spells the markers so; <S> (sentence start) has no use here.
MARKERS = {"</S>": EOS_TOKEN, "<UNK>": UNK_TOKEN, "<S>": None}


def read_vocabulary(path: Path) -> list[str]:
    if not path.is_file():
        raise ConfigError(f"data.vocab_file={path}: no such file")
    words = [MARKERS.get(w, w) for w in (words_of(line)[0] for line in read_lines(path) if words_of(line))]
    seen: set[str | None] = set()  # "<S>" maps to None
    for w in words:
        if w in seen:
            raise ConfigError(f"data.vocab_file={path}: the token {w!r} is listed twice")
        seen.add(w)
    return [EOS_TOKEN, UNK_TOKEN, *(w for w in words if w not in (EOS_TOKEN, UNK_TOKEN, None))]


def validate(cfg: DictConfig) -> None:
    d = cfg.data
    if d.root is None:
        raise ConfigError("data.root is not set: data=text_corpus needs the folder its file patterns are under")
    positive(cfg, "data.min_count")
    if d.max_vocab is not None and d.max_vocab < 3:
        raise ConfigError(f"data.max_vocab={d.max_vocab}: needs at least 3 (</s>, <unk> and a word)")


def vocabulary(d: DictConfig, train_files: list[Path]) -> list[str]:
    """The ids' words: data.vocab_file's, or counted from the training files."""
    return (
        read_vocabulary(Path(d.vocab_file).expanduser())
        if d.vocab_file
        else build_vocabulary(count_words(train_files), d.min_count, d.max_vocab)
    )


def text_corpus(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> LMData:
    d = cfg.data
    root = Path(d.root).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.root={d.root}: no such folder")
    train_files = split_files(root, d.train_split, "train_split")
    val_files = split_files(root, d.val_split, "val_split")
    test_files = split_files(root, d.test_split, "test_split") if d.test_split is not None else None
    vocab = vocabulary(d, train_files)
    index = {w: i for i, w in enumerate(vocab)}

    def ids(files: list[Path], key: str) -> Sentences:
        parts = [file_sentences(f, index) for f in files]
        for f, part in zip(files, parts):
            if len(part) == 0:  # else named further on as a batch too large for the split
                raise ConfigError(f"data.{key}={d[key]}: {f} is empty (no words on any line)")
        return Sentences.join(parts)

    train_ids, val_ids = ids(train_files, "train_split"), ids(val_files, "val_split")
    info = {
        "vocab_size": len(vocab),
        "vocabulary": "from "
        + (
            str(d.vocab_file) if d.vocab_file else f"training counts (min_count {d.min_count}, max_vocab {d.max_vocab})"
        ),
        "val_oov_rate": float((val_ids.ids == UNK).mean()),
    }
    test_ids = ids(test_files, "test_split") if test_files is not None else None
    return LMData(
        train_ids,
        val_ids,
        test_ids,
        info,
        cfg.schedule.batch_size,
        cfg.model.bptt,
        cfg.seed,
        device,
        shard,
        cfg.model.eval_state,
    )


# --- a Markov source with a known entropy rate


class MarkovSource:
    """A first-order Markov chain over </s> and `words` words. After each word a sentence ends with
    probability `end_prob`; otherwise the next word comes from the current word's row, a Dirichlet(0.1)
    draw (peaked: a few likely successors). After </s> the first word comes from one more such row.
    Ids are ranked by stationary probability, like a frequency-ranked vocabulary."""

    def __init__(self, words: int, end_prob: float, seed: int):
        g = torch.Generator().manual_seed(40_000 + seed)
        rows = torch.distributions.Dirichlet(torch.full((words,), 0.1, dtype=torch.float64))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(40_000 + seed)
            successors = rows.sample((words + 1,))  # row 0: after </s>; row i: after word i
        p = torch.zeros(words + 1, words + 1, dtype=torch.float64)
        p[0, 1:] = successors[0]
        p[1:, 0] = end_prob
        p[1:, 1:] = (1 - end_prob) * successors[1:]
        pi = stationary(p)
        rank = torch.cat([torch.tensor([0]), 1 + torch.argsort(pi[1:], descending=True)])  # </s> stays 0
        self.p = p[rank][:, rank]
        self.pi = pi[rank]
        self.g = g
        # Id 1 is <unk> in every vocabulary; the source never emits it, so words are 2.. here.
        self.entropy_rate = float(
            -(self.pi[:, None] * self.p * torch.log(self.p.clamp_min(1e-300))).sum()
        )  # nats per token

    def sentence(self) -> np.ndarray:
        out: list[int] = []
        state = 0
        while True:
            state = int(torch.multinomial(self.p[state], 1, generator=self.g))
            if state == 0:
                return np.array(out, dtype=np.int64)
            out.append(state + 1)  # past <unk>


def stationary(p: torch.Tensor) -> torch.Tensor:
    pi = torch.full((p.shape[0],), 1.0 / p.shape[0], dtype=torch.float64)
    for _ in range(10_000):
        nxt = pi @ p
        if torch.allclose(nxt, pi, atol=1e-15, rtol=0):
            break
        pi = nxt
    return nxt / nxt.sum()


def validate_synthetic(cfg: DictConfig) -> None:
    """The Markov source's settings."""
    validate_sample_counts(cfg)
    positive(cfg, "data.vocab_size")
    if not 0 < cfg.data.sentence_end_prob < 1:
        raise ConfigError(f"data.sentence_end_prob={cfg.data.sentence_end_prob}: must be in (0, 1)")


def synthetic_lm(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> LMData:
    d = cfg.data
    source = MarkovSource(d.vocab_size, d.sentence_end_prob, cfg.seed)
    train = Sentences.of([source.sentence() for _ in range(d.train_samples)])
    val = Sentences.of([source.sentence() for _ in range(d.val_samples)])
    info = {
        "vocab_size": d.vocab_size + 2,
        "vocabulary": "synthetic Markov source",
        # The best any model can do: perplexity exp(entropy rate), with </s> counted as a token.
        "entropy_rate_nats": source.entropy_rate,
        "ppl_floor": math.exp(source.entropy_rate),
    }
    return LMData(
        train, val, None, info, cfg.schedule.batch_size, cfg.model.bptt, cfg.seed, device, shard, cfg.model.eval_state
    )
