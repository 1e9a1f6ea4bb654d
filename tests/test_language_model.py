"""bigLSTM: the sampled softmax against the full softmax, the log-uniform sampler, the Markov source's
entropy rate, text streams and the state carried between them, PTB, clipping the LSTM only, and
every precision mode end to end on a tiny config."""

from __future__ import annotations

import contextlib
import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpt.config import ConfigError
from mpt.datasets import build_data
from mpt.datasets.text_corpus import EOS, UNK, MarkovSource, Sentences, rows_of
from mpt.models import biglstm
from mpt.models.biglstm import BigLSTM, LanguageModel, log_uniform_log_prob, log_uniform_sample, sampled_softmax_loss
from mpt.precision import product_operands as ops
from mpt.precision import quantized_model as qm
from mpt.precision.engine import PrecisionEngine
from mpt.precision.formats import get_format
from mpt.precision.scaler import build_scaler
from mpt.runner.validation import validate

from .conftest import CPU, build_run, compose_cfg, mpt_run, read_record, shared_data

TINY = [
    "model=biglstm_tiny",
    "model.hidden_size=32",
    "model.proj_size=8",
    "model.num_sampled=64",
    "model.bptt=5",
    "schedule=smoke",
]


def tiny_cfg(*extra: str):
    cfg = compose_cfg(*TINY, *extra)
    validate(cfg)
    return cfg


def test_sampled_softmax_with_every_class_sampled_is_the_full_cross_entropy():
    g = torch.Generator().manual_seed(0)
    n, vocab = 12, 30
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=g)
    candidates = torch.arange(vocab)
    true = logits.gather(1, targets[:, None])[:, 0]
    # Every class a candidate once, with the same expected count: the correction cancels, the
    # target's own candidate column is an accidental hit, and what is left is the full softmax.
    for log_count in (0.0, 2.5):
        loss = sampled_softmax_loss(
            true, logits, targets, candidates, torch.full((n,), log_count), torch.full((vocab,), log_count)
        )
        assert torch.allclose(loss.double(), F.cross_entropy(logits, targets, reduction="none"), atol=1e-5)


def test_sampled_softmax_corrects_by_expected_counts_and_removes_hits():
    true, sampled = torch.tensor([1.0]), torch.tensor([[0.5, 2.0, -1.0]])
    targets, candidates = torch.tensor([4]), torch.tensor([2, 4, 7])
    true_lc, cand_lc = torch.tensor([-0.5]), torch.tensor([0.3, -0.5, 1.2])
    loss = sampled_softmax_loss(true, sampled, targets, candidates, true_lc, cand_lc)
    kept = torch.tensor([1.0 + 0.5, 0.5 - 0.3, -1.0 - 1.2])  # candidate 4 is the target: removed
    assert torch.allclose(loss, -torch.log_softmax(kept, 0)[:1], atol=1e-6)


def test_log_uniform_sampler_draws_its_distribution():
    torch.manual_seed(0)
    vocab, n = 1000, 400_000
    counts = torch.bincount(log_uniform_sample(n, vocab, CPU), minlength=vocab).double()
    probs = log_uniform_log_prob(torch.arange(vocab), vocab).double().exp()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    expected = n * probs[:20]
    assert (counts[:20] - expected).abs().max() < 5 * expected.sqrt().max()  # within 5 sigma for the likeliest ids
    assert counts.sum() == n


def test_the_correction_makes_sampled_sums_unbiased():
    # With S draws k_j and each logit corrected by log(S p(k_j)), the sum of exp over the draws is an
    # unbiased estimate of the full softmax's normalizer: the identity the sampled softmax rests on.
    # It fails if the log S or the id's own probability were left out of the correction.
    torch.manual_seed(1)
    vocab, S, trials = 50, 20, 20_000
    logits = torch.randn(vocab, dtype=torch.float64)
    draws = log_uniform_sample(S * trials, vocab, CPU).view(trials, S)
    correction = math.log(S) + log_uniform_log_prob(draws, vocab).double()
    estimate = torch.exp(logits[draws] - correction).sum(1).mean()
    assert abs(float(estimate) / float(logits.exp().sum()) - 1) < 0.02


def test_markov_source_entropy_rate_matches_a_long_sample():
    source = MarkovSource(words=12, end_prob=0.2, seed=3)
    tokens = np.concatenate([np.append(source.sentence(), EOS) for _ in range(4000)])
    states = np.where(tokens == EOS, 0, tokens - 1)  # ids back to chain states (</s> 0, words 1..)
    p = source.p.numpy()
    prev = np.concatenate([[0], states[:-1]])
    empirical = -np.log(p[prev, states]).mean()
    assert abs(empirical - source.entropy_rate) < 0.03
    freq = np.bincount(states, minlength=13)[1:]
    assert (np.diff(source.pi.numpy()[1:]) <= 0).all() and freq[0] == freq.max()  # ids ranked by frequency
    cfg = tiny_cfg()
    info = build_data(cfg, CPU).info
    assert math.isclose(info["ppl_floor"], math.exp(info["entropy_rate_nats"]))


def test_streams_are_shifted_windows_of_shuffled_sentences_and_resume_exactly():
    cfg = tiny_cfg("schedule.batch_size=4")
    data = build_data(cfg, CPU)
    windows = list(data.epoch(0))
    assert len(windows) == data.steps_per_epoch
    inputs = torch.cat([w[0] for w in windows], dim=1)
    targets = torch.cat([w[1] for w in windows], dim=1)
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and inputs.shape == (4, data.steps_per_epoch * 5)
    # the rows hold every training sentence (bar the cut tail), each ending with </s>
    assert int((inputs == EOS).sum()) >= len(data.train) - 4 and (inputs != UNK).all()
    second = [w[0] for w in data.epoch(1)]
    state = data.state_dict()
    list(data.epoch(2))
    data.load_state_dict(state)
    resumed = [w[0] for w in data.epoch(1, start=3)]
    assert len(resumed) == len(second) - 3 and all(torch.equal(a, b) for a, b in zip(resumed, second[3:]))
    assert not torch.equal(second[0], windows[0][0])
    s = Sentences.of([np.array([5, 6]), np.array([7])])
    assert s.stream(np.array([1, 0])).tolist() == [7, EOS, 5, 6, EOS] and rows_of(np.arange(7), 2).tolist() == [
        [0, 1, 2],
        [3, 4, 5],
    ]


def test_the_state_carries_from_one_window_to_the_next():
    cfg = tiny_cfg("model.dropout=0")
    torch.manual_seed(0)
    net = BigLSTM(cfg.model, vocab=20, batch_size=3).eval()
    x = torch.randint(0, 20, (3, 10))
    y = torch.randint(0, 20, (3, 10))
    cand = torch.arange(20)
    whole = net("train", x, y, cand)
    net.carry_h.zero_(), net.carry_c.zero_()
    first, second = net("train", x[:, :5], y[:, :5], cand), net("train", x[:, 5:], y[:, 5:], cand)
    stitched = torch.cat([first[0].view(3, 5), second[0].view(3, 5)], dim=1).reshape(-1)
    assert torch.allclose(stitched, whole[0], atol=1e-6)
    # Evaluation: the full softmax, in chunks, is the cross-entropy of the full logits.
    nll, _ = net("nll", x, y, None)
    hidden = net.lstm(net.embedding(x))[0]
    full = F.cross_entropy((hidden @ net.softmax_w.t() + net.softmax_b).reshape(-1, 20), y.reshape(-1), reduction="sum")
    assert torch.allclose(nll, full, rtol=1e-5)
    biglstm.EVAL_LOGITS, saved = 20 * 7, biglstm.EVAL_LOGITS  # 7 tokens per chunk
    try:
        assert torch.allclose(net("nll", x, y, None)[0], full, rtol=1e-5)
    finally:
        biglstm.EVAL_LOGITS = saved


def test_sentence_evaluation_scores_each_sentence_alone_from_a_zero_state():
    """Against float64: each sentence by itself, </s> w1 .. wn predicting w1 .. wn </s>, no padding."""
    cfg = tiny_cfg("model.dropout=0", "model.eval_state=sentence", "schedule.batch_size=5", "data.val_samples=23")
    data = build_data(cfg, CPU)
    torch.manual_seed(0)
    task = LanguageModel(cfg.model, data.info, batch_size=5)
    got = task.evaluate(data.val(), contextlib.nullcontext)
    net = copy.deepcopy(task.net).double()
    total, tokens = 0.0, 0
    starts, ids = data.val_sentences.starts, torch.from_numpy(data.val_sentences.ids).long()
    for a, b in zip(starts[:-1], starts[1:]):
        targets = ids[a:b]
        inputs = torch.cat([torch.tensor([EOS]), targets[:-1]])
        hidden = net.lstm(net.embedding(inputs[None]))[0][0]
        total += float(F.cross_entropy(hidden @ net.softmax_w.t() + net.softmax_b, targets, reduction="sum").detach())
        tokens += len(targets)
    assert got["val_tokens"] == tokens == data.val_sentences.tokens and "val_cell_max" not in got
    assert got["val_loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_a_latched_cell_shows_in_the_carried_evaluation_and_stays_in_its_sentence():
    """A cell whose gates are pinned open (f = i = 1, g = -1) loses 1 a token: carried across the
    stream, its state ends near minus the row's length; scored a sentence at a time it never holds
    more than the longest sentence."""
    cfg = tiny_cfg("model.dropout=0", "schedule.batch_size=4", "data.val_samples=200")
    data = build_data(cfg, CPU)
    task = LanguageModel(cfg.model, data.info, batch_size=4)
    h = cfg.model.hidden_size
    with torch.no_grad():  # torch's gate order: i, f, g, o
        task.net.lstm.bias_ih_l1[[0, h, 2 * h]] = torch.tensor([40.0, 40.0, -40.0])
    carried = task.evaluate(data.val(), contextlib.nullcontext)
    row = data.val_sentences.tokens // 4
    assert carried["val_cell_max"] == pytest.approx(row - 1, rel=1e-3)  # every token but a row's last is an input
    task.cfg.eval_state = data.eval_state = "sentence"
    batches = list(data.val())
    assert max(int((t != -100).sum(1).max()) for _, t in batches) < row / 4
    state_max = 0.0
    for inputs, _ in batches:
        state_max = max(state_max, float(task.net.lstm(task.net.embedding(inputs))[1][1].abs().max()))
    assert state_max <= max(b.shape[1] for b, _ in batches)


def test_validation_and_test_perplexity_of_the_same_weights_agree(tmp_path):
    """Two held-out splits from one source, scored by the same trained weights, in both evaluations:
    their perplexities differ by what two samples of about 6,000 tokens do (a few percent), where a
    latched stream would double one of them. (The weights learn what 150 steps teach: below the
    uniform 42, the vocabulary of 40 words, </s> and <unk>.)"""
    source = MarkovSource(words=40, end_prob=0.1, seed=3)
    for split, n in [("train", 3000), ("valid", 600), ("test", 600)]:
        lines = (" ".join(f"w{t}" for t in source.sentence()) for _ in range(n))
        (tmp_path / f"{split}.txt").write_text("\n".join(line for line in lines if line) + "\n")
    for mode in ["carried", "sentence"]:
        run = build_run(tmp_path / mode, *TINY, "data=text_corpus", f"data.root={tmp_path}",
                        "data.train_split=train.txt", "data.val_split=valid.txt", "data.test_split=test.txt",
                        "schedule.batch_size=16", "schedule.steps=150", "schedule.eval_every=null",
                        "schedule.eval_batches=null", "checkpoint=false", "logger=none",
                        f"model.eval_state={mode}")  # fmt: skip
        rec = run.execute()
        assert rec.status == "ok", rec.message
        m = rec.metrics
        assert m["ppl"] < 0.95 * 42 and abs(math.log(m["test_ppl"] / m["ppl"])) < 0.1, (mode, m)


def test_the_true_logit_as_a_product_is_the_diagonal_of_the_quantized_logits():
    """model.true_logit=product puts the true word's logit through a product that MXFP4 quantizes:
    it is the diagonal of the full quantized product of the outputs and the targets' softmax rows.
    The default, TensorFlow's elementwise dot product, stays unquantized beside quantized negatives."""
    mxfp4 = ops.Recipe(get_format("mxfp4"), get_format("mxfp6_e3m2"), "block", 1, 0, "max")
    nets = {}
    for true_logit in ("dot", "product"):
        torch.manual_seed(0)
        nets[true_logit] = BigLSTM(
            tiny_cfg("model.dropout=0", f"model.true_logit={true_logit}").model, vocab=40, batch_size=3
        )
    x, y = torch.randint(0, 40, (3, 5)), torch.randint(0, 40, (3, 5))
    flat = y.reshape(-1)  # the targets as the candidates: the sampled logits are the full (N x N) product

    def logits(net):
        net.carry_h.zero_(), net.carry_c.zero_()
        with torch.no_grad():
            return net("train", x, y, flat)

    (dot, _), (product, _) = logits(nets["dot"]), logits(nets["product"])
    assert torch.allclose(product, dot, rtol=1e-5, atol=1e-6)  # unquantized, one logit either way
    for net in nets.values():
        qm.QuantizedProducts(net, mxfp4)
    (dot, dot_full), (product, product_full) = logits(nets["dot"]), logits(nets["product"])
    assert torch.equal(dot_full, product_full)
    assert torch.allclose(product, product_full.diagonal(), rtol=1e-6, atol=1e-6)
    assert (
        dot - dot_full.diagonal()
    ).abs().max() > 0.05 * dot.abs().max()  # FP4's rounding, which the dot product escapes


def test_paper_size_is_jozefowicz_big_lstm():
    m = compose_cfg("model=biglstm").model
    with torch.device("meta"):
        net = BigLSTM(m, vocab=793_471, batch_size=128)
    params = sum(p.numel() for p in net.parameters())
    assert 1.75e9 < params < 1.85e9  # Jozefowicz et al., Table 1: "LSTM-8192-1024", 1.8B parameters
    assert (m.hidden_size, m.proj_size, m.layers, m.num_sampled, m.static_scale) == (8192, 1024, 2, 8192, 128)
    cfg = compose_cfg("model=biglstm", "schedule=paper")
    assert (
        cfg.optim.name,
        cfg.optim.lr,
        cfg.optim.lr_batch,
        cfg.optim.initial_accumulator,
        cfg.optim.clip_grad_norm,
    ) == ("adagrad", 0.2, None, 1.0, 10.0)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # torch's SGD on FP32 weights; the FP16 update of FP16 weights
def test_gradients_embedding_weighting_and_lstm_only_clipping(precision):
    cfg = tiny_cfg("model.dropout=0", "optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.lr=1.0",
                   "optim.lr_batch=null", "optim.clip_grad_norm=1e-3", f"precision={precision}")  # fmt: skip
    torch.manual_seed(0)
    task = LanguageModel(cfg.model, {"vocab_size": 20}, batch_size=3)  # the task names what clipping covers
    net = task.net
    x, y = torch.randint(0, 20, (3, 5)), torch.randint(0, 20, (3, 5))
    net("train", x, y, torch.arange(20))[0].sum().backward()
    emb = net.embedding.weight.grad.clone()
    net.embedding.weight.grad = None
    net.carry_h.zero_(), net.carry_c.zero_()
    unhooked = (
        net.embedding.weight.detach().clone().requires_grad_()
    )  # the hook sits on the parameter, not on this copy
    plain = torch.autograd.grad(
        torch.func.functional_call(net, {"embedding.weight": unhooked}, ("train", x, y, torch.arange(20)))[0].sum(),
        unhooked,
    )[0]
    assert torch.allclose(emb, 3 * plain) and emb.abs().max() > 0  # f-lm: embedding gradients times the batch size

    engine = PrecisionEngine(net, cfg, build_scaler(cfg), [], CPU, clipped=task.clipped_parameters("model"))
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    net.carry_h.zero_(), net.carry_c.zero_()
    engine.backward(net("train", x, y, torch.arange(20))[0].sum())
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    engine.step()
    lstm = [n for n in grads if n.startswith("lstm.")]
    norm = torch.linalg.vector_norm(torch.stack([grads[n].float().norm() for n in lstm]))
    for n, p in net.named_parameters():
        factor = 1e-3 / (norm + 1e-6) if n.startswith("lstm.") else 1.0  # only the LSTM's gradients are clipped
        expected = (before[n].float() - factor * grads[n].float()).to(
            p.dtype
        )  # (the FP16 update rounds once, on store)
        assert torch.allclose(p.detach().float(), expected.float(), atol=1e-6 if precision == "fp32" else 1e-3), n


def test_a_vocabulary_file_and_its_markers(tmp_path):
    (tmp_path / "train.txt").write_text(
        "the cat sat\nthe dog\u00a0barked\n" * 10
    )  # a no-break space stays inside its token
    (tmp_path / "valid.txt").write_text("the cat barked\n" * 20)
    (tmp_path / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nthe 3\ncat\n")  # One Billion Word's spelling
    base = [
        "data=text_corpus",
        f"data.root={tmp_path}",
        "data.train_split=train.txt",
        "data.val_split=valid.txt",
        "data.test_split=null",
        "schedule.batch_size=2",
    ]
    data = build_data(tiny_cfg(*base, f"data.vocab_file={tmp_path / 'vocab.txt'}"), CPU)
    assert data.info["vocab_size"] == 4  # </s>, <unk>, the, cat
    assert data.train.ids[:7].tolist() == [2, 3, 1, EOS, 2, 1, EOS]
    counted = build_data(tiny_cfg(*base), CPU)
    assert counted.info["vocab_size"] == 2 + 4  # the, cat, sat and "dog\u00a0barked" as one word
    (tmp_path / "short.txt").write_text("the\n")  # 2 tokens with its </s>: too few for 2 rows of 2
    with pytest.raises(
        ConfigError, match="data.test_split: its 2 tokens do not give each of schedule.batch_size=2 rows two tokens"
    ):
        build_data(tiny_cfg(*base, "data.test_split=short.txt"), CPU)
    (tmp_path / "vocab.txt").write_text("the\ncat\nthe\n")
    with pytest.raises(ConfigError, match="the token 'the' is listed twice"):
        build_data(tiny_cfg(*base, f"data.vocab_file={tmp_path / 'vocab.txt'}"), CPU)


@pytest.mark.parametrize(
    "split,text",
    [("train", ""), ("valid", " \t\n\n  \n"), ("test", ""), ("train", None)],
    ids=["empty-train", "blank-valid", "empty-test", "one-empty-train-shard"],
)
def test_an_empty_corpus_file_is_named_as_empty(tmp_path, split, text):
    """Not as a batch too large for the split: an empty training file would otherwise read
    'schedule.batch_size=2: 0 training tokens make rows shorter than ...'."""
    for name in ("train.txt", "valid.txt", "test.txt"):
        (tmp_path / name).write_text("the cat sat\nthe dog barked\n" * 10)
    empty = tmp_path / f"{split}.txt" if text is not None else tmp_path / "train.0.txt"  # a shard beside train.txt
    empty.write_text(text or "")
    key = {"train": "train_split=train*.txt", "valid": "val_split=valid.txt", "test": "test_split=test.txt"}[split]
    splits = ["data.train_split=train*.txt", "data.val_split=valid.txt", "data.test_split=test.txt"]
    cfg = tiny_cfg("data=text_corpus", f"data.root={tmp_path}", *splits, "schedule.batch_size=2")
    with pytest.raises(ConfigError) as e:
        build_data(cfg, CPU)
    assert str(e.value) == f"data.{key}: {empty} is empty (no words on any line)"


def ptb(*extra: str):
    root = shared_data("ptb")
    return tiny_cfg("data=text_corpus", f"data.root={root}", "data.train_split=ptb.train.txt*",
                    "data.val_split=ptb.valid.txt*", "data.test_split=ptb.test.txt*", "data.min_count=1",
                    "schedule.batch_size=32", *extra)  # fmt: skip


def test_ptb_reads_its_standard_vocabulary():
    data = build_data(ptb(), CPU)
    info = data.info
    assert info["vocab_size"] == 10_000 and info["train_sentences"] == 42_068
    assert info["train_tokens"] == 887_521 + 42_068  # words plus one </s> per sentence
    assert 0.04 < info["val_oov_rate"] < 0.06  # PTB's own <unk> share
    capped = build_data(ptb("data.max_vocab=500"), CPU)
    assert capped.info["vocab_size"] == 500 and capped.info["val_oov_rate"] > info["val_oov_rate"]


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["data.root=/nonexistent/1b"], "data.root=/nonexistent/1b: no such folder"),
        (["data.val_split=heldout-*"], "data.val_split=heldout-*: matches no file under"),
        (["data.vocab_file=/nonexistent/vocab.txt"], "data.vocab_file=/nonexistent/vocab.txt: no such file"),
        (["schedule.batch_size=100000"], "schedule.batch_size=100000"),
        (
            ["schedule.batch_size=50000"],
            "data.val_split: its 73760 tokens do not give each of schedule.batch_size=50000 rows two tokens",
        ),
        (["data.max_vocab=2"], "data.max_vocab=2: needs at least 3"),
    ],
)
def test_bad_text_corpus_is_one_line_naming_the_problem(overrides, named):
    with pytest.raises(ConfigError) as e:
        cfg = ptb(*overrides)
        build_data(cfg, CPU)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["model.proj_size=64"], "model.proj_size=64: must be smaller than model.hidden_size=32"),
        (["model.true_logit=matmul"], "model.true_logit=matmul: expected dot or product"),
        (["model.eval_state=window"], "model.eval_state=window: expected carried or sentence"),
        (["precision=fp16"], "cannot run optim.name=adagrad; use optim.name=sgd, or precision=mixed"),
        (["data=text_corpus"], "data.root is not set"),
        (["data.sentence_end_prob=1.5"], "data.sentence_end_prob=1.5"),
        (
            ["data=parallel_text", "data.root=/x"],
            "data=parallel_text has no language_model data for model=biglstm_tiny",
        ),
    ],
)
def test_bad_language_model_config_is_rejected_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(*TINY, *overrides))
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_every_precision_mode_runs_the_language_model_end_to_end(tmp_path):
    modes = ["fp32", "tf32", "fp16", "mixed", "fp16_modmom", "amp", "bf16"]
    result = mpt_run("-m", *TINY, "optim.name=sgd", "optim.lr=0.5", "scale=static", "checkpoint=false",
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
            and rec["metrics"]["ppl"] > 1
            and rec["throughput"]["unit"] == "words/s"
        )
        assert rec["data"]["ppl_floor"] > 1
    adagrad = tmp_path / "adagrad"  # bigLSTM's own optimizer in the modes paper_lm runs, with a dynamic scale
    result = mpt_run(
        "-m",
        *TINY,
        "scale=dynamic",
        "checkpoint=false",
        "precision=mixed,amp",
        f"hydra.sweep.dir={adagrad}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for rec in (json.loads(p.read_text()) for p in adagrad.glob("*/result.json")):
        assert (
            rec["status"] == "ok" and rec["optim"]["name"] == "adagrad" and math.isfinite(rec["last_finite_train_loss"])
        )


@pytest.mark.slow
def test_perplexity_falls_toward_the_sources_floor(tmp_path):
    args = ["model=biglstm_tiny", "schedule.batch_size=16", "schedule.steps=200", "schedule.eval_every=100",
            "schedule.eval_batches=null", "data.train_samples=4096", "checkpoint=false"]  # fmt: skip
    result = mpt_run(*args, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rec = read_record(tmp_path)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    floor = rec["data"]["ppl_floor"]
    assert rec["status"] == "ok" and rec["optim"]["name"] == "adagrad"
    assert (
        evals[-1]["ppl"] < 0.8 * evals[0]["ppl"] and evals[-1]["ppl"] > 0.9 * floor
    )  # learning, and no model beats the source


def test_the_train_loss_is_what_its_definition_says(tmp_path, in_process):
    """The logged loss is the per-word mean times the window's length, as the record's words say."""
    source = MarkovSource(words=20, end_prob=0.1, seed=1)
    for split in ("train", "valid"):
        lines = (" ".join(f"w{t}" for t in source.sentence()) for _ in range(200))
        (tmp_path / f"{split}.txt").write_text("\n".join(line for line in lines if line) + "\n")
    run = build_run(tmp_path / "run", *TINY, "data=text_corpus", f"data.root={tmp_path}", "data.train_split=train.txt",
                    "data.val_split=valid.txt", "data.test_split=null", "checkpoint=false", "logger=none")  # fmt: skip
    rows = run._train_step(0, next(run.data.epoch(0)))
    assert float(rows[0]["loss"]) == pytest.approx(5 * float(rows[0]["loss_per_word"]), rel=1e-6)
    assert run.record.train_loss_definition.startswith("sampled-softmax cross-entropy per word x 5: summed over")
