"""GNMT translation: the network's invariants, the loss, beam search against exhaustive search, the
lr schedule against NVIDIA's formula, parallel text on Multi30k, errors naming the problem, and every
precision mode end to end on a tiny config."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpt.config import ConfigError
from mpt.datasets import build_data
from mpt.datasets.translation import BOS, EOS, FIRST_WORD, PAD, SyntheticLanguagePair, collate
from mpt.models import build_task
from mpt.models.beam_search import beam_search
from mpt.models.gnmt import GNMT
from mpt.precision.cuda_autocast import cuda_autocast
from mpt.precision.optim import lr_factor
from mpt.runner.validation import validate

from .conftest import CPU, compose_cfg, mpt_run, read_record, shared_data

TINY = ["model=gnmt", "model.hidden_size=16", "model.encoder_layers=3", "model.decoder_layers=3", "schedule=smoke"]


def tiny_cfg(*extra: str):
    cfg = compose_cfg(*TINY, *extra)
    validate(cfg)
    return cfg


def tiny_net(vocab: int = 20, *extra: str) -> GNMT:
    torch.manual_seed(0)
    return GNMT(tiny_cfg("model.dropout=0", *extra).model, vocab).eval()


def pair(n_src: int, n_tgt: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.integers(FIRST_WORD, 20, n_src), g.integers(FIRST_WORD, 20, n_tgt)


def train_logits(net: GNMT, b) -> torch.Tensor:
    return net("train", b.src, b.src_len, b.src_len_cpu, b.tgt_in)


def test_gnmt_v2_layout_and_presets():
    net = GNMT(tiny_cfg().model, 21)
    assert [lstm.bidirectional for lstm in net.encoder.layers] == [True, False, False]
    assert [lstm.input_size for lstm in net.encoder.layers] == [16, 32, 16]
    assert [lstm.input_size for lstm in net.decoder.layers] == [32, 32]  # [output, attention context]
    assert net.padded_vocab == 24 and net.decoder.classifier.out_features == 24
    sizes = {name: (m.hidden_size, m.encoder_layers, m.encoder_bidirectional_layers, m.decoder_layers)
             for name in ["gnmt", "gnmt_nmt_one", "gnmt8"] for m in [compose_cfg(f"model={name}").model]}  # fmt: skip
    assert sizes == {"gnmt": (1024, 4, 1, 4), "gnmt_nmt_one": (512, 2, 2, 4), "gnmt8": (1024, 8, 1, 8)}
    m = compose_cfg("model=gnmt", "scale=static").model
    assert (m.static_scale, m.label_smoothing, m.dropout, m.beam_size, m.loss_reduction) == (1024, 0.1, 0.2, 5, "mean")


def test_a_sentence_translates_the_same_alone_unpadded_and_padded_in_a_batch():
    # The bidirectional layer runs on packed sequences and attention masks padding: what follows a
    # sentence in its padded row must not change its logits.
    net = tiny_net()
    short, long = pair(3, 4, 0), pair(11, 9, 1)
    alone = train_logits(net, collate([short], 1, CPU))
    batched = train_logits(net, collate([short, long], 8, CPU))
    assert torch.allclose(alone[0], batched[0, : alone.shape[1]], atol=1e-6)
    b = collate([short, long], 8, CPU)
    b.src[0, 4:] = 7  # garbage where padding was
    assert torch.allclose(train_logits(net, b)[0, :5], batched[0, :5], atol=1e-6)


def test_incremental_decoding_reproduces_teacher_forcing():
    net = tiny_net()
    b = collate([pair(5, 6, 2), pair(9, 3, 3)], 8, CPU)
    forced = train_logits(net, b)
    context, keys, mask = net("encode", b.src, b.src_len, b.src_len_cpu)
    state, steps = None, []
    for t in range(b.tgt_in.shape[1]):
        logits, state = net("step", b.tgt_in[:, t], state, context, keys, mask)
        steps.append(logits)
    assert torch.allclose(torch.stack(steps, dim=1), forced, atol=1e-5)


def test_residual_connections_from_the_third_layer():
    # With a layer's weights at zero its LSTM outputs 0: a residual layer then passes its input on,
    # a plain one outputs zeros.
    net = tiny_net()
    x = torch.randn(2, 5, 16)
    lens = torch.tensor([5, 5])
    with torch.no_grad():
        for p in net.encoder.layers[2].parameters():
            p.zero_()
        after_two = net.encoder.layers[1](net.encoder.layers[0](x)[0])[0]
        assert torch.allclose(net.encoder(x, lens), after_two, atol=1e-6)
        for p in net.encoder.layers[1].parameters():
            p.zero_()
        assert net.encoder(x, lens).abs().max() == 0


def test_decoder_residuals_from_its_third_layer():
    d = tiny_net().decoder  # the attention layer, then layers[0] (no residual), layers[1] (residual)
    x, context = torch.randn(2, 4, 16), torch.randn(2, 5, 16)
    keys, mask = d.attention.keys(context), torch.zeros(2, 5, dtype=torch.bool)
    with torch.no_grad():
        for p in d.layers[1].parameters():
            p.zero_()
        y = d.attention_rnn(x)[0]
        below = d.layers[0](torch.cat([y, d.attention(y, context, keys, mask)], dim=2))[0]
        assert torch.allclose(d(x, context, keys, mask)[0], d.classifier(below), atol=1e-6)
        for p in d.layers[0].parameters():
            p.zero_()
        assert torch.allclose(d(x, context, keys, mask)[0], d.classifier(torch.zeros_like(y)), atol=1e-6)


def test_attention_stays_in_fp16_under_autocast():
    # The (B, T, S, units) sum is the model's largest activation: an FP32 parameter in it would
    # promote it to FP32 under autocast.
    from torch.utils._python_dispatch import TorchDispatchMode

    class FourD(TorchDispatchMode):
        dtypes: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dim() == 4:
                self.dtypes.add(out.dtype)
            return out

    net = tiny_net()
    b = collate([pair(5, 6, 2), pair(9, 3, 3)], 8, CPU)
    with cuda_autocast(torch.bfloat16), FourD() as mode:  # a bf16 run's autocast on a CPU
        train_logits(net, b)
    # BF16 the attention; FP16 the LSTMs' own stacks (cuDNN's RNNs run in FP16 under CUDA's autocast)
    assert mode.dtypes == {torch.bfloat16, torch.float16}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_is_label_smoothed_cross_entropy_over_target_tokens(reduction):
    cfg = tiny_cfg("model.dropout=0", f"model.loss_reduction={reduction}", "schedule.batch_size=6")
    data = build_data(cfg, CPU)
    task = build_task(cfg, data.info)
    batch = next(iter(data.epoch(0)))
    torch.manual_seed(0)
    loss = next(task.train_losses(batch)).loss.detach()
    logp = F.log_softmax(train_logits(task.net, batch).double(), dim=-1)
    keep = batch.tgt_out != PAD
    nll = -logp.gather(-1, batch.tgt_out[..., None])[..., 0]
    eps = 0.1
    per_token = (1 - eps) * nll + eps * (-logp).mean(-1)  # smoothing spread over the whole (padded) vocabulary
    total = per_token[keep].sum()
    assert batch.tgt_tokens == int(keep.sum())
    expected = total / (batch.tgt_tokens if reduction == "mean" else batch.src.shape[0])
    assert math.isclose(float(loss), float(expected), rel_tol=1e-5)


def markov_step(table: torch.Tensor):
    """A decoder whose next-token log-probabilities depend on the last token only."""
    return lambda tokens: table[tokens], lambda rows: None


def all_hypotheses(table: torch.Tensor, max_len: int, eos: int, banned: set[int], alpha: float, const: float):
    best = None
    for n in range(1, max_len + 1):
        for seq in itertools.product(range(table.shape[0]), repeat=n):
            if (
                any(t in banned for t in seq)
                or (eos in seq[:-1])
                or (n == max_len and seq[-1] != eos)
                or (n < max_len and seq[-1] != eos)
            ):
                continue
            score, prev = 0.0, BOS
            for t in seq:
                score, prev = score + float(table[prev, t]), t
            normalized = score / ((const + n) / (const + 1)) ** alpha
            if best is None or normalized > best[0]:
                best = (normalized, list(seq[:-1]))
    return best[1]


@pytest.mark.parametrize("seed,eos_bias", [(s, b) for s in range(4) for b in (0.0, -4.0)])
def test_beam_search_with_a_wide_beam_finds_the_best_normalized_hypothesis(seed, eos_bias):
    # eos_bias < 0: a model that rarely stops, so the cap's forced ending matters (it costs the
    # model's own EOS log-probability, as in the enumeration)
    g = torch.Generator().manual_seed(seed)
    vocab, max_len = 6, 4
    logits = 3 * torch.randn(vocab, vocab, generator=g)
    logits[:, EOS] += eos_bias
    table = F.log_softmax(logits, dim=-1)
    banned = {PAD, BOS}
    step, reorder = markov_step(table)
    kept = (vocab - len(banned)) ** (max_len - 1)  # a beam this wide prunes nothing
    got = beam_search(step, reorder, 1, kept, torch.tensor([max_len]), BOS, EOS, sorted(banned), 0.6, 5.0, CPU)[0]
    assert got == all_hypotheses(table, max_len, EOS, banned, 0.6, 5.0)


def test_each_sentence_keeps_its_own_length_cap():
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(8, 8, generator=g)
    logits[:, EOS] -= 6  # long outputs: the caps bind
    table = F.log_softmax(logits, dim=-1)
    step, reorder = markov_step(table)
    together = beam_search(lambda t: table[t], reorder, 2, 3, torch.tensor([3, 7]), BOS, EOS, [PAD, BOS], 0.6, 5.0, CPU)
    alone = [
        beam_search(step, reorder, 1, 3, torch.tensor([cap]), BOS, EOS, [PAD, BOS], 0.6, 5.0, CPU)[0] for cap in (3, 7)
    ]
    assert together == alone and [len(h) for h in alone] == [2, 6]


def test_beam_of_one_is_greedy_and_banned_tokens_never_appear():
    g = torch.Generator().manual_seed(7)
    table = F.log_softmax(3 * torch.randn(8, 8, generator=g), dim=-1)
    table[:, 6] += 5  # the model likes a token that pads the vocabulary
    step, reorder = markov_step(table)
    banned = [PAD, BOS, 6, 7]
    got = beam_search(step, reorder, 1, 1, torch.tensor([10]), BOS, EOS, banned, 0.6, 5.0, CPU)[0]
    allowed = table.clone()
    allowed[:, banned] = -torch.inf
    greedy, prev = [], BOS
    for _ in range(10):
        prev = int(allowed[prev].argmax())
        if prev == EOS:
            break
        greedy.append(prev)
    assert got == greedy[:9] and not set(got) & set(banned)


def test_gnmt_lr_schedule_is_nvidias_warmup_multistep():
    # NVIDIA DeepLearningExamples, GNMT/seq2seq/train/lr_scheduler.py (WarmupMultiStepLR), as written there.
    def nvidia(it, warmup, remain, interval, decay_steps, factor):
        if it <= warmup:
            return math.exp(math.log(0.01) / warmup) ** (warmup - it)
        if it >= remain:
            return factor ** min((it - remain) // interval + 1, decay_steps)
        return 1.0

    warmup, remain, interval = 200, 3996, 501
    milestones = [remain + k * interval for k in range(4)]
    for it in list(range(0, 400)) + list(range(3900, 6200, 7)):
        assert math.isclose(
            lr_factor(it, milestones, 0.5, warmup), nvidia(it, warmup, remain, interval, 4, 0.5), rel_tol=1e-12
        )
    cfg = compose_cfg("model=gnmt", "schedule=paper")
    assert (
        cfg.optim.name,
        cfg.optim.lr,
        cfg.optim.lr_batch,
        cfg.optim.clip_grad_norm,
        cfg.schedule.batch_size,
        cfg.schedule.epochs,
    ) == (
        "adam",
        2e-3,
        None,
        5.0,
        128,
        6,
    )
    assert (cfg.schedule.lr_warmup_steps, list(cfg.schedule.lr_milestones), cfg.schedule.lr_gamma) == (
        200,
        [4.0, 4.5, 5.0, 5.5],
        0.5,
    )


def test_synthetic_pair_maps_words_and_swaps_neighbours():
    cfg = tiny_cfg("data.vocab_size=9", "data.min_len=2", "data.max_len=7")
    lang = SyntheticLanguagePair(cfg.data, seed=0)
    mapping = {}
    for _ in range(200):
        src, tgt = lang.sentence()
        assert 2 <= len(src) <= 7 and len(tgt) == len(src) and src.min() >= FIRST_WORD
        unswapped = tgt.copy()
        n = len(tgt) - len(tgt) % 2
        unswapped[0:n:2], unswapped[1:n:2] = tgt[1:n:2], tgt[0:n:2]
        for s, t in zip(src.tolist(), unswapped.tolist()):
            assert mapping.setdefault(s, t) == t  # one word, one translation
    assert len(set(mapping.values())) == len(mapping) == 9


def multi30k_cfg(*extra: str):
    root = shared_data("multi30k")
    return tiny_cfg(
        "data=parallel_text",
        f"data.root={root}",
        "data.val_split=val",
        "data.vocab_size=2000",
        "schedule.batch_size=16",
        *extra,
    )


@pytest.fixture(scope="module")
def multi30k():
    """Multi30k read, its tokenizer trained and its 29,000 pairs encoded: seconds, shared by the tests
    that only read it."""
    return build_data(multi30k_cfg(), CPU)


def test_multi30k_pairs_tokenizer_and_buckets(tmp_path, multi30k):
    cfg = multi30k_cfg()
    data = build_data(cfg, CPU, workdir=tmp_path)
    info = data.info
    assert info["train_pairs"] + info["train_pairs_dropped"] == 29000 and info["val_pairs"] == 1014
    assert info["train_pairs_dropped"] < 100 and info["vocab_size"] == 2000
    model = tmp_path / "tokenizer.model"
    assert hashlib.sha256(model.read_bytes()).hexdigest() == info["tokenizer_sha256"]
    again = multi30k  # built on its own, its tokenizer trained again from the same text: the same vocabulary
    assert again is not data and again.info["tokenizer_sha256"] == info["tokenizer_sha256"]

    refs = gzip.decompress((shared_data("multi30k") / "val.de.gz").read_bytes()).decode().splitlines()
    val = list(data.val())
    assert sorted(r for b in val for r in b.refs) == sorted(r.strip() for r in refs)
    decoded = [
        info["detokenize"](row[: n - 1].tolist()) for b in val for row, n in zip(b.tgt_out, (b.tgt_out != PAD).sum(1))
    ]
    exact = sum(d == r for d, r in zip(decoded, (r for b in val for r in b.refs)))
    assert exact / len(decoded) > 0.99  # sentencepiece is lossless up to its NFKC normalization

    width = (cfg.data.max_len + 1) / cfg.data.num_buckets
    for batch in itertools.islice(data.epoch(0), 20):
        assert batch.src.shape[1] % 8 == 0 and batch.tgt_in.shape[1] % 8 == 0 and batch.src.shape[0] == 16
        assert (batch.tgt_in[:, 0] == BOS).all() and ((batch.tgt_out == EOS).sum(1) == 1).all()
        assert torch.equal(batch.tgt_in[:, 1:] != PAD, (batch.tgt_out[:, :-1] != PAD) & (batch.tgt_out[:, :-1] != EOS))
        longest = torch.maximum(batch.src_len - 1, (batch.tgt_out != PAD).sum(1) - 1)
        assert len({min(int(n // width), cfg.data.num_buckets - 1) for n in longest}) == 1  # one bucket per batch

    # A run resumed in epoch 1 at batch 5 restores the order state saved at that epoch's start.
    assert len(list(data.epoch(0))) == data.steps_per_epoch
    second = [b.src for b in data.epoch(1)]
    state = data.state_dict()
    list(data.epoch(2))
    data.load_state_dict(state)
    resumed = [b.src for b in data.epoch(1, start=5)]
    assert len(resumed) == len(second) - 5 and all(torch.equal(a, b) for a, b in zip(resumed, second[5:]))
    assert not torch.equal(second[0], [b.src for b in data.epoch(2)][0])  # and each epoch is a new order


def test_lines_end_at_newlines_only(tmp_path):
    # Web-crawled corpora hold U+2028 and form feeds mid-sentence; str.splitlines would split there.
    src = ["one\u2028sentence", "two\x0cthree", "four"]
    for lang, lines in [("en", src), ("de", ["eins", "zwei", "vier"])]:
        for split in ["train", "val"]:
            (tmp_path / f"{split}.{lang}").write_bytes(("\r\n".join(lines) + "\r\n").encode())
    from mpt.datasets.parallel_text import read_pairs

    assert read_pairs(tmp_path, "train", "en", "de", "train_split") == (src, ["eins", "zwei", "vier"])


def test_a_resume_with_another_tokenizer_is_refused(multi30k):
    data = multi30k
    list(itertools.islice(data.epoch(0), 1))
    state = {**data.state_dict(), "tokenizer_sha256": "0" * 64}
    with pytest.raises(ConfigError, match="the checkpoint was trained with tokenizer sha256 0000"):
        data.load_state_dict(state)


@pytest.mark.parametrize(
    "setup,overrides,named",
    [
        (None, ["data.root=/nonexistent/wmt"], "data.root=/nonexistent/wmt: no such folder"),
        ("copy", ["data.val_split=newstest2014"], "holds neither newstest2014.en nor newstest2014.en.gz"),
        ("short", [], "val.de has 3: parallel files must align line by line"),
        ("gz", [], "not a readable gzip file"),
        ("latin1", [], "not UTF-8 text"),
        ("copy", ["data.tokenizer_model=ROOT/train.en"], "not a sentencepiece model"),
        ("copy", ["data.vocab_size=5000"], "data.vocab_size=5000: sentencepiece cannot train it"),
        ("empty_test", ["data.test_split=test"], "data.test_split=test: ROOT/test.en is empty (no text on any line)"),
        # an empty training side would be named as a vocabulary too large for the text
        ("empty_train", [], "data.train_split=train: ROOT/train.de is empty (no text on any line)"),
        ("blank_val", [], "data.val_split=val: ROOT/val.en is empty (no text on any line)"),
    ],
)
def test_bad_parallel_text_is_one_line_naming_the_problem(tmp_path, setup, overrides, named):
    lines = [f"a small sentence number {i} ." for i in range(40)]
    if setup:
        for split in ["train", "val"]:  # (setup "copy" and the rest start from these)
            (tmp_path / f"{split}.en").write_text("\n".join(lines) + "\n")
            (tmp_path / f"{split}.de").write_text("\n".join(lines) + "\n")
    if setup == "short":
        (tmp_path / "val.de").write_text("eins\nzwei\ndrei\n")
    if setup == "gz":
        (tmp_path / "val.en").unlink()
        (tmp_path / "val.en.gz").write_bytes(b"\x1f\x8b\x08 not really gzip")
    if setup == "empty_test":
        (tmp_path / "test.en").write_text("")
        (tmp_path / "test.de").write_text("")
    if setup == "empty_train":
        (tmp_path / "train.de").write_text("")
    if setup == "blank_val":
        (tmp_path / "val.en").write_text(" \t \n" * 40)  # whitespace only, the line count of val.de
    if setup == "latin1":
        (tmp_path / "train.de").write_bytes("Stra\xdfe\n".encode("latin-1"))
    overrides = [o.replace("ROOT", str(tmp_path)) for o in overrides]
    cfg = tiny_cfg(
        "data=parallel_text",
        f"data.root={tmp_path}",
        "data.val_split=val",
        "data.vocab_size=40",
        "schedule.batch_size=2",
        *overrides,
    )
    with pytest.raises(ConfigError) as e:
        build_data(cfg, CPU)
    message = str(e.value)
    assert named.replace("ROOT", str(tmp_path)) in message and "\n" not in message


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["model.loss_reduction=avg"], "model.loss_reduction=avg: expected one of mean, sum"),
        (["model.encoder_bidirectional_layers=5"], "model.encoder_bidirectional_layers=5"),
        (["model.decoder_layers=1"], "model.decoder_layers=1"),
        (["precision=fp16"], "cannot run optim.name=adam; use optim.name=sgd, or precision=mixed"),
        (["data=parallel_text"], "data.root is not set"),
        (
            ["data=voc", "data.root=/x"],
            "data=voc has no translation data for model=gnmt; use data=synthetic or data=parallel_text",
        ),
        (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9, 1.5]"),
    ],
)
def test_bad_translation_config_is_rejected_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg("model=gnmt", *overrides))
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # over 20 s on 2 cores: the fast tier's budget
def test_every_precision_mode_translates_end_to_end(tmp_path):
    modes = ["fp32", "tf32", "fp16", "mixed", "fp16_modmom", "amp", "bf16"]
    small = ["model.hidden_size=16", "model.encoder_layers=2", "model.decoder_layers=2", "schedule.batch_size=8"]
    # optim.name=sgd: the FP16-update modes are momentum SGD (Adam runs in the learning test below)
    result = mpt_run("-m", "model=gnmt", "schedule=smoke", *small, "optim.name=sgd", "scale=static", "checkpoint=false",
                     f"precision={','.join(modes)}", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    records = {
        r["choices"]["precision"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("*/result.json"))
    }
    assert sorted(records) == sorted(modes)
    for mode, rec in records.items():
        assert rec["status"] == "ok", (mode, rec["message"])
        assert (
            math.isfinite(rec["final_train_loss"])
            and 0 <= rec["metrics"]["bleu"] <= 100
            and rec["metrics"]["val_sentences"] > 0
        )
        assert rec["throughput"]["unit"] == "target tokens/s"
    assert (
        records["amp"]["precision"]["autocast"] == "float16"
        and records["fp16"]["precision"]["param_dtype"] == "float16"
    )

    # GNMT's own optimizer (Adam) in the modes paper_nmt runs, with the summed loss and a dynamic scale
    adam = tmp_path / "adam"
    result = mpt_run("-m", "model=gnmt", "schedule=smoke", *small, "model.loss_reduction=sum", "scale=dynamic",
                     "checkpoint=false", "precision=mixed,amp", f"hydra.sweep.dir={adam}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for rec in (json.loads(p.read_text()) for p in adam.glob("*/result.json")):
        assert rec["status"] == "ok" and rec["optim"]["name"] == "adam" and math.isfinite(rec["last_finite_train_loss"])
        assert rec["config"]["model"]["loss_reduction"] == "sum"


@pytest.mark.slow  # a learning curve: minutes on 2 cores
def test_bleu_rises_on_the_synthetic_pair_with_adam_and_warmup(tmp_path):
    args = ["model=gnmt", "model.hidden_size=48", "model.encoder_layers=2", "model.decoder_layers=2", "model.dropout=0",
            "model.beam_size=2", "data.vocab_size=12", "data.max_len=8", "optim.lr=1e-2", "schedule.batch_size=32",
            "schedule.steps=240", "schedule.eval_every=80", "schedule.eval_batches=4", "schedule.lr_warmup_steps=20",
            "schedule.lr_milestones=[200]", "schedule.lr_gamma=0.5", "checkpoint=false"]  # fmt: skip
    result = mpt_run(*args, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rec = read_record(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert (
        rec["status"] == "ok" and rec["optim"]["name"] == "adam" and rec["optim"]["lr"] == 1e-2
    )  # Adam's lr: not scaled with the batch
    # (BLEU of 8-word sentences from a model this small moves in steps: the loss is the steadier witness)
    assert evals[-1]["bleu"] > evals[0]["bleu"] + 3 and evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3
    lrs = [r["lr"] for r in rows if r["kind"] == "train"]
    assert all(math.isclose(lr, 1e-2 * lr_factor(i, [200], 0.5, 20), rel_tol=1e-9) for i, lr in enumerate(lrs))


def test_bleu_scores_each_output_against_its_own_reference(monkeypatch, multi30k):
    cfg = multi30k_cfg("model.beam_size=1")  # the model's setting: the data is the shared build's
    data = multi30k
    task = build_task(cfg, data.info)
    batches = list(itertools.islice(data.val(), 3))

    def targets(batch, _ctx):
        return [row[: int((row != PAD).sum()) - 1].tolist() for row in batch.tgt_out]

    monkeypatch.setattr(task, "translate", targets)
    perfect = task.evaluate(batches, torch.autograd.grad_mode.no_grad)
    assert (
        perfect["bleu"] > 97 and perfect["val_sentences"] == 48
    )  # (not 100: NFKC normalization changes a few characters)
    monkeypatch.setattr(task, "translate", lambda batch, ctx: targets(batch, ctx)[1:] + targets(batch, ctx)[:1])
    assert (
        task.evaluate(batches, torch.autograd.grad_mode.no_grad)["bleu"] < 10
    )  # each output scored against another sentence


@pytest.mark.slow
def test_multi30k_run_scores_the_test_split_and_keeps_its_tokenizer(tmp_path):
    root = shared_data("multi30k")
    result = mpt_run("model=gnmt", "model.hidden_size=16", "model.encoder_layers=2", "model.decoder_layers=2",
                     "model.beam_size=1", "model.max_decode_len=12", "data=parallel_text", f"data.root={root}",
                     "data.val_split=val", "data.test_split=test_2016_flickr", "data.vocab_size=1000", "schedule=smoke",
                     "schedule.batch_size=64", f"hydra.run.dir={tmp_path}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rec = read_record(tmp_path)
    assert rec["status"] == "ok" and rec["metrics"]["test_sentences"] == 1000 and rec["metrics"]["val_sentences"] == 64
    assert {"bleu", "val_loss", "test_bleu", "test_loss", "test_ppl"} <= set(rec["metrics"])
    assert rec["data"]["tokenizer_file"] == str(tmp_path / "tokenizer.model") and rec["data"]["vocab_size"] == 1000
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert (
        sp.get_piece_size() == 1000
        and sp.decode(sp.encode("Zwei Männer spielen Fußball.")) == "Zwei Männer spielen Fußball."
    )
