"""Parallel text on disk: <root>/<split>.<lang>, or <split>.<lang>.gz, one sentence per line, line i
of the source file translating line i of the target file (WMT16 en-de and Multi30k both come so).
Splits: data.train_split, data.val_split (evaluated during training) and, optionally,
data.test_split (evaluated once, in full, at the end).

The subword vocabulary is a sentencepiece BPE model trained on both sides of the training text (one
shared vocabulary, as GNMT's joint BPE), or a given .model file. The run saves the model it used
beside its record, so its outputs can be decoded again later. Sentencepiece keeps whitespace in its
pieces, so decoding gives detokenized text that BLEU compares with the raw references.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from omegaconf import DictConfig

from ..config import ConfigError, positive
from ..distributed import Dist
from ..files import write_bytes_atomic
from .translation import BOS, EOS, PAD, UNK, TranslationData, validate_pairs

TOKENIZER_FILE = "tokenizer.model"


def split_file(root: Path, split: str, lang: str) -> Path:
    for path in (root / f"{split}.{lang}", root / f"{split}.{lang}.gz"):
        if path.is_file():
            return path
    raise ConfigError(
        f"data.root={root}: holds neither {split}.{lang} nor {split}.{lang}.gz "
        "(set by data.*_split and data.src_lang/tgt_lang)"
    )


def read_lines(path: Path) -> list[str]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise ConfigError(f"{path}: not a readable gzip file ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    # Lines end at "\n" only: str.splitlines would also split at U+2028, U+0085, form feeds and the
    # like, which web-crawled corpora (WMT's CommonCrawl) hold mid-sentence, and misalign the pairs.
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def refuse_empty(path: Path, lines: list[str], setting: str) -> None:
    """An empty or whitespace-only file is named as such: further on it would surface as a batch too
    large for the split or a vocabulary too large for the text."""
    if not any(line.strip() for line in lines):
        raise ConfigError(f"{setting}: {path} is empty (no text on any line)")


def read_pairs(root: Path, split: str, src_lang: str, tgt_lang: str, key: str) -> tuple[list[str], list[str]]:
    """The split's source and target lines; `key` names its setting (train_split, ...) in errors."""
    src_path, tgt_path = split_file(root, split, src_lang), split_file(root, split, tgt_lang)
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    for path, lines in [(src_path, src), (tgt_path, tgt)]:
        refuse_empty(path, lines, f"data.{key}={split}")
    if len(src) != len(tgt):
        raise ConfigError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: parallel files must align line by line"
        )
    return [s.strip() for s in src], [t.strip() for t in tgt]


def train_tokenizer(lines: list[str], vocab_size: int, sentences: int, seed: int) -> bytes:
    import io

    import sentencepiece as spm

    spm.set_random_generator_seed(seed)  # the sample of `sentences` lines it trains on
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=proto, model_type="bpe", vocab_size=vocab_size,
            character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
            input_sentence_size=sentences, shuffle_input_sentence=True,
            num_threads=min(16, os.cpu_count() or 1), minloglevel=2,
        )  # fmt: skip
    except RuntimeError as e:
        # e.g. "Vocabulary size is too high (8000). Please set it to a value <= 7112."
        reason = str(e).strip().splitlines()[-1]
        raise ConfigError(
            f"data.vocab_size={vocab_size}: sentencepiece cannot train it on this text ({reason})"
        ) from None
    return proto.getvalue()


def load_tokenizer(proto: bytes, source: str):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"{source}: not a sentencepiece model ({e})") from None
    ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    if ids != (PAD, UNK, BOS, EOS):
        raise ConfigError(
            f"{source}: its pad, unk, bos, eos ids are {ids}; this project's batches need {(PAD, UNK, BOS, EOS)} "
            "(train it with pad_id=0 unk_id=1 bos_id=2 eos_id=3)"
        )
    return sp


def validate(cfg: DictConfig) -> None:
    validate_pairs(cfg)
    positive(cfg, "data.tokenizer_sentences")
    d = cfg.data
    if d.root is None:
        raise ConfigError("data.root is not set: data=parallel_text needs the folder holding <split>.<lang>[.gz] files")
    if d.src_lang == d.tgt_lang:
        raise ConfigError(f"data.src_lang={d.src_lang} equals data.tgt_lang: translation needs two languages")


def parallel_text(
    cfg: DictConfig, device: torch.device, workdir: Optional[Path] = None, resuming: bool = False, shard: Dist = Dist()
) -> TranslationData:
    """`shard`: under torchrun, rank 0 trains the tokenizer and writes it into `workdir`; the
    other ranks wait for it and read it, so every rank encodes with the same vocabulary."""
    d = cfg.data
    root = Path(d.root).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.root={d.root}: no such folder")
    train_src, train_tgt = read_pairs(root, d.train_split, d.src_lang, d.tgt_lang, "train_split")
    val_src, val_tgt = read_pairs(root, d.val_split, d.src_lang, d.tgt_lang, "val_split")
    # read before the tokenizer trains, so that a bad test file stops the run at once
    test = read_pairs(root, d.test_split, d.src_lang, d.tgt_lang, "test_split") if d.test_split is not None else None

    if d.tokenizer_model is not None:
        path = Path(d.tokenizer_model).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.tokenizer_model={d.tokenizer_model}: no such file")
        proto, origin = path.read_bytes(), str(path)
    elif resuming and workdir is not None and (workdir / TOKENIZER_FILE).is_file():
        # the vocabulary the checkpoint's model was trained with (its sha256 is checked on restore)
        proto, origin = (workdir / TOKENIZER_FILE).read_bytes(), "trained on the training text, kept by the run"
    elif shard.is_main:
        proto, origin = (
            train_tokenizer(train_src + train_tgt, d.vocab_size, d.tokenizer_sentences, cfg.seed),
            "trained on the training text",
        )
    else:
        proto, origin = None, "trained on the training text by rank 0"
    if workdir is not None and shard.is_main:
        assert proto is not None  # the main rank has read or trained it
        write_bytes_atomic(workdir / TOKENIZER_FILE, proto)
    if shard.enabled:
        shard.barrier()  # rank 0's vocabulary is on disk
        if proto is None:
            assert workdir is not None  # the run passes its folder; the ranks share the tokenizer there
            proto = (workdir / TOKENIZER_FILE).read_bytes()
    assert proto is not None  # only a rank other than 0 lacked it, and it has read it
    sp = load_tokenizer(proto, origin)

    def encode(lines: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in sp.encode(lines)]

    train, dropped = [], 0
    for s, t in zip(encode(train_src), encode(train_tgt)):
        if 0 < len(s) <= d.max_len and 0 < len(t) <= d.max_len:
            train.append((s, t))
        else:
            dropped += 1
    val = list(zip(encode(val_src), encode(val_tgt)))

    def detokenize(ids: list[int]) -> str:
        return sp.decode([i for i in ids if i > EOS])

    info = {
        "vocab_size": sp.get_piece_size(),
        "tokenizer": f"sentencepiece bpe ({origin})",
        "tokenizer_file": str(workdir / TOKENIZER_FILE) if workdir is not None else None,
        "tokenizer_sha256": hashlib.sha256(proto).hexdigest(),
        "train_pairs_dropped": dropped,  # empty, or longer than data.max_len subwords
        "val_split": d.val_split,
    }
    data = TranslationData(
        train, val, val_tgt, detokenize, info, d, cfg.schedule, cfg.model.pad_to_multiple, cfg.seed, device, shard
    )
    if test is not None:
        data.test_pairs, data.test_refs = list(zip(encode(test[0]), encode(test[1]))), test[1]
        data.info.update(test_split=d.test_split, test_pairs=len(test[0]))
    return data
