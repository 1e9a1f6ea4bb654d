"""Decoder language models (models/causal_lm.py): GPT-2's architecture against HuggingFace's GPT-2 in
float64, a user's own language model and a HuggingFace causal LM built from a config, each trained in
every precision mode on a corpus's windows, and their settings checked in one line."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mpt.models.causal_lm import GPT

from .conftest import build_run, compose_cfg, mpt_run, read_record, shared_data

BUILDER = Path(__file__).resolve().parent / "data" / "own_model.py"
GPT_TINY = ["model=gpt2_tiny", "model.n_layer=2", "model.bptt=16", "data=synthetic", "schedule=smoke", "device=cpu"]
OWN_LM = ["model=custom_lm", f"model.builder={BUILDER}:small_lm", "data=synthetic", "schedule=smoke", "device=cpu"]
HF_GPT2 = ["model=hf_causal_lm", "+model.hf_config.model_type=gpt2", "+model.hf_config.n_layer=1"]
HF_GPT2 += ["+model.hf_config.n_embd=32", "+model.hf_config.n_head=2", "+model.hf_config.n_positions=64"]
MODES = ["fp32", "fp16", "mixed", "fp16_modmom", "amp", "bf16", "fp8", "fp8_delayed", "mxfp8", "mxfp4"]


def scale_for(mode: str) -> list[str]:
    # the FP16-weight updates are momentum SGD's; the paper's language-model scale for them
    if mode in ("fp16", "fp16_modmom"):
        return ["scale=static", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9"]
    return ["scale=dynamic"] if mode in ("mixed", "amp") else ["scale=none"]


def test_gpt_computes_huggingfaces_gpt2_in_float64():
    """Our GPT-2 block for block, with HuggingFace's implementation as the oracle: the same weights
    (its Conv1D layers hold them transposed) give the same logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = GPT(vocab=50, n_layer=2, n_head=4, n_embd=32, context=16, dropout=0.0).double().eval()
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    theirs = transformers.GPT2LMHeadModel(config).double().eval()
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        t = theirs.transformer
        t.wte.weight.copy_(mine["wte.weight"])
        t.wpe.weight.copy_(mine["wpe.weight"])
        t.ln_f.load_state_dict(ours.ln_f.state_dict())
        for block, h in zip(ours.blocks, t.h, strict=True):
            h.ln_1.load_state_dict(block.ln_1.state_dict())
            h.ln_2.load_state_dict(block.ln_2.state_dict())
            for conv, linear in [(h.attn.c_attn, block.attn.qkv), (h.attn.c_proj, block.attn.proj),
                                 (h.mlp.c_fc, block.mlp[0]), (h.mlp.c_proj, block.mlp[2])]:  # fmt: skip
                conv.weight.copy_(linear.weight.t())
                conv.bias.copy_(linear.bias)
    ids = torch.randint(0, 50, (3, 16))
    torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-10, atol=1e-10)
    assert ours.lm_head.weight is ours.wte.weight  # tied, as GPT-2's


def test_gpt2_small_has_gpt2s_parameter_count():
    """The default shape is GPT-2 small: 124,439,808 parameters at its vocabulary and context."""
    with torch.device("meta"):
        net = GPT(vocab=50257, n_layer=12, n_head=12, n_embd=768, context=1024, dropout=0.0)
    assert sum(p.numel() for p in net.parameters()) == 124_439_808


def test_one_step_is_adams_on_the_mean_cross_entropy_per_token(tmp_path, in_process):
    run = build_run(tmp_path, *GPT_TINY, "precision=fp32", "logger=none", "optim.clip_grad_norm=null")
    net = run.task.net
    ref = copy.deepcopy(net)
    inputs, targets = next(run.data.epoch(0))
    rows = run._train_step(0, (inputs, targets))
    loss = F.cross_entropy(ref(inputs).reshape(-1, run.task.vocab), targets.reshape(-1))
    assert float(rows[0]["loss"]) == pytest.approx(float(loss), rel=1e-6)
    o = run.cfg.optim
    opt = torch.optim.Adam(ref.parameters(), lr=float(rows[0]["lr"]), betas=tuple(o.betas), weight_decay=o.weight_decay)
    loss.backward()
    opt.step()
    for ours, theirs in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_gpt_trains_in_every_precision_mode_its_embedding_still_tied(tmp_path, in_process, mode):
    run = build_run(tmp_path, *GPT_TINY, f"precision={mode}", *scale_for(mode), "logger=none")
    before = run.task.net.wte.weight.detach().float().clone()
    rec = run.execute()
    assert rec.status == "ok", rec.message
    net = run.task.net
    assert net.lm_head.weight is net.wte.weight and not torch.equal(before, net.wte.weight.detach().float())
    assert math.isfinite(rec.metrics["ppl"]) and rec.throughput["unit"] == "tokens/s"
    if mode in ("fp8", "mxfp8"):  # the attention's two batched products are quantized too
        assert rec.precision["products"]["paths"] == {"emulated": 2 * (4 + 2) + 1}


def test_an_own_language_model_trains_named_after_its_builder(tmp_path):
    out = mpt_run(*OWN_LM, "precision=mixed", "scale=dynamic", "+model.kwargs.width=8",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mpt-run small_lm precision=mixed" in out.stdout and "cross-entropy per token" in out.stdout
    rec = read_record(tmp_path / "run")
    assert rec["status"] == "ok" and rec["choices"]["model"] == "small_lm"


def test_a_huggingface_causal_lm_trains_from_a_config_and_from_a_local_folder(tmp_path, in_process):
    transformers = pytest.importorskip("transformers")
    run = build_run(tmp_path / "inline", *HF_GPT2, "data=synthetic", "schedule=smoke", "device=cpu",
                    "precision=mixed", "scale=dynamic", "logger=none")  # fmt: skip
    assert type(run.task.net).__name__ == "GPT2LMHeadModel"
    assert run.task.net.config.vocab_size == run.task.vocab and run.task.net.config.n_layer == 1
    assert run.execute().status == "ok"

    folder = tmp_path / "llama"  # a config a user keeps on disk, another architecture
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=7).save_pretrained(folder)  # fmt: skip
    run = build_run(tmp_path / "path", "model=hf_causal_lm", f"model.path={folder}", "data=synthetic",
                    "schedule=smoke", "device=cpu", "precision=bf16", "logger=none")  # fmt: skip
    assert type(run.task.net).__name__ == "LlamaForCausalLM" and run.task.net.config.vocab_size == run.task.vocab
    assert run.execute().status == "ok"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=custom_lm"], "model.builder: not given; model=custom_lm needs model.builder=package.module:function"),
        (["model=gpt2_tiny", "model.n_head=3"], "model.n_head=3: must divide model.n_embd=128"),
        (["model=gpt2_tiny", "model.arch=rnn"], "model.arch=rnn: expected one of gpt, custom, hf"),
        (["model=gpt2_tiny", "+model.kwargs.width=3"], "model.kwargs: model=gpt2_tiny is built by mpt"),
        (["model=hf_causal_lm"], "model=hf_causal_lm: give model.path (a local folder with config.json)"),
        (["model=gpt2_tiny", "model.pretrained=true"], "model.pretrained=true: only with model=hf_causal_lm"),
        (["model=gpt2_tiny", "data=imagefolder"], "data=imagefolder has no causal_lm data for model=gpt2_tiny"),
    ],
)
def test_a_bad_language_model_setting_is_one_line_naming_it(overrides, message):
    from mpt.config import ConfigError
    from mpt.runner.validation import validate

    data = [] if any(o.startswith("data=") for o in overrides) else ["data=synthetic"]
    with pytest.raises(ConfigError) as error:
        validate(compose_cfg(*overrides, *data, "schedule=smoke"))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_logits_of_the_wrong_shape_are_named(tmp_path, in_process):
    run = build_run(tmp_path, "model=custom_lm", f"model.builder={BUILDER}:wrong_lm", "data=synthetic",
                    "schedule=smoke", "device=cpu", "logger=none")  # fmt: skip
    with pytest.raises(ValueError, match=r"wrong_lm: logits of shape \(4, 64, 3\) .* expected \(streams, positions"):
        run._train_step(0, next(run.data.epoch(0)))


@pytest.mark.slow
def test_gpt_learns_ptb(tmp_path):
    """On the real corpus the tiny GPT's validation perplexity falls far below the vocabulary's 10,000."""
    ptb = shared_data("ptb")
    out = mpt_run("model=gpt2_tiny", "data=text_corpus", f"data.root={ptb}", "data.train_split=ptb.train.txt*",
                  "data.val_split=ptb.valid.txt*", "data.test_split=null", "data.min_count=1", "schedule=short",
                  "schedule.steps=100", "schedule.eval_every=100", "precision=bf16", "device=cpu",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert read_record(tmp_path / "run")["metrics"]["ppl"] < 1000


def test_the_atlas_sees_attentions_operands_the_softmax_and_the_layer_norms_output(tmp_path, in_process):
    """Each batched product of attention counts its two operands (q and k; the softmax's weights and
    v), each Linear its input (a layer-norm's output for qkv, the MLP and the output layer)."""
    run = build_run(tmp_path, *GPT_TINY, "model.n_layer=1", "precision=fp32", "schedule.steps=1", "stats.every=1",
                    "stats.formats=[e4m3]", "logger=none")  # fmt: skip
    assert run.execute().status == "ok"
    layers = read_record(tmp_path)["grad_stats"]["atlas"]["networks"]["model"]["layers"]
    b, t, c = run.cfg.schedule.batch_size, run.cfg.model.bptt, run.cfg.model.n_embd
    scores, mix = layers["blocks.0.attn.scores"], layers["blocks.0.attn.mix"]
    assert scores["input"]["values"] == scores["weight"]["values"] == b * t * c  # q and k: every head's
    assert mix["input"]["values"] == b * run.cfg.model.n_head * t * t and mix["weight"]["values"] == b * t * c
    # the softmax's weights lie in [0, 1], above the causal mask's zeros
    assert 0 < mix["input"]["max_abs"] <= 1 and mix["input"]["share_zero"] > 0.4
    assert layers["blocks.0.attn.qkv"]["input"]["values"] == b * t * c  # ln_1's output
    assert {"lm_head", "blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.0.attn.proj"} <= set(layers)
