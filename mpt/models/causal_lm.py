"""Decoder language models, trained on a corpus's windows with the full softmax: GPT-2's architecture
at any size (`model=gpt2_tiny`, arch gpt), a user's network (`model=custom_lm model.builder=...`), or a
HuggingFace causal LM built from a local folder's config or a config given inline (`model=hf_causal_lm`,
`transformers` an optional extra; nothing is downloaded).

A batch is (inputs, targets), each (streams, model.bptt) token ids from datasets/text_corpus.py; a
network maps the inputs to one logit per vocabulary word and position (or an object whose `.logits`
holds them, as a HuggingFace model returns). The loss is the cross-entropy per token, the mean over the
batch's tokens (nanoGPT's). Each window is scored on its own: nothing carries from one to the next, so
a window's first tokens see little context (evaluation as nanoGPT's, not a sliding window).
"""

from __future__ import annotations

import math
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..config import ConfigError, positive
from ..datasets.text_corpus import EVAL_STATES, PAD_TARGET
from ..distributed import Dist
from ..precision.quantized_products import BatchMatmul
from . import LossTerm, OneNetwork, builders

ARCHS = ("gpt", "custom", "hf")


class CausalSelfAttention(nn.Module):
    """GPT-2's attention. Its two batched products are modules, so that the FP8 and MX modes quantize
    them and the atlas sees the scores' and the attention weights' operands; the softmax runs in the
    network's dtype, as the paper's FP16 network would run it."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, context: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.scores, self.mix = BatchMatmul(), BatchMatmul()
        self.attn_drop, self.resid_drop = nn.Dropout(dropout), nn.Dropout(dropout)
        self.mask: torch.Tensor
        self.register_buffer("mask", torch.ones(context, context, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        att = self.scores(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = self.mix(self.attn_drop(att), v).transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x)), the MLP 4x wide with GELU."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, context: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, context)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (Radford et al. 2019): learned token and position embeddings, n_layer pre-norm blocks, a
    final layer-norm and an output layer tied to the token embedding. GPT-2's initialization: weights
    N(0, 0.02), each residual branch's last layer N(0, 0.02 / sqrt(2 n_layer)), biases zero."""

    def __init__(self, vocab: int, n_layer: int, n_head: int, n_embd: int, context: int, dropout: float):
        super().__init__()
        self.context = context
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(context, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, context) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def hf_model(m: DictConfig, vocab: int) -> nn.Module:
    """A HuggingFace causal LM, randomly initialized from a local folder's config.json (`model.path`) or
    from `model.hf_config` (its `model_type` and settings), its vocabulary the corpus's; or, with
    `model.pretrained=true`, the folder's own weights, where its vocabulary is the corpus's."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise ConfigError('model=hf_causal_lm: transformers is not installed (pip install "mpt[hf]")') from None
    given = OmegaConf.to_container(m.hf_config, resolve=True) if m.hf_config else {}
    assert isinstance(given, dict)
    settings = {str(k): v for k, v in given.items()}
    if m.path is not None:
        config = transformers.AutoConfig.from_pretrained(m.path, local_files_only=True, **settings)
    else:
        kind = settings.pop("model_type", None)
        if kind is None:
            raise ConfigError("model.hf_config: names no model_type (e.g. gpt2, llama); or give model.path")
        config = transformers.AutoConfig.for_model(kind, **settings)
    if m.pretrained:
        if config.vocab_size != vocab:
            raise ConfigError(
                f"model.pretrained=true: {m.path}'s vocabulary has {config.vocab_size} entries, the corpus's {vocab}; "
                "its weights fit only its own tokenizer's ids (model.pretrained=false trains it from scratch)"
            )
        return transformers.AutoModelForCausalLM.from_pretrained(m.path, local_files_only=True, **settings)
    config.vocab_size = vocab
    return transformers.AutoModelForCausalLM.from_config(config)


def network(m: DictConfig, vocab: int) -> nn.Module:
    if m.arch == "gpt":
        return GPT(vocab, m.n_layer, m.n_head, m.n_embd, m.bptt, m.dropout)
    if m.arch == "hf":
        return hf_model(m, vocab)
    kwargs = OmegaConf.to_container(m.kwargs, resolve=True)
    assert isinstance(kwargs, dict)
    return builders.build(m.builder, kwargs, vocab, size_argument="vocab_size")


def logits_of(out: Any) -> torch.Tensor:
    """A network's logits: its output, or the `.logits` of a HuggingFace model's output."""
    return out if isinstance(out, torch.Tensor) else out.logits


class CausalLanguageModel(OneNetwork):
    sample_unit = "tokens"
    primary_metric = "ppl"
    higher_is_better = False

    def __init__(self, model_cfg: DictConfig, data_info: dict):
        self.cfg = model_cfg
        self.vocab = data_info["vocab_size"]
        self.net = network(model_cfg, self.vocab)

    @property
    def loss_definition(self) -> str:
        return "cross-entropy per token (full softmax), mean over the batch's tokens"

    def _nll(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        logits = logits_of(self.net(inputs))
        if logits.shape[:2] != inputs.shape or logits.shape[-1] != self.vocab:
            raise ValueError(
                f"{self.cfg.name}: logits of shape {tuple(logits.shape)} for inputs {tuple(inputs.shape)}; "
                f"expected (streams, positions, vocabulary) = {(*inputs.shape, self.vocab)}"
            )
        return F.cross_entropy(
            logits.float().reshape(-1, self.vocab), targets.reshape(-1), reduction=reduction, ignore_index=PAD_TARGET
        )

    def train_losses(self, batch) -> Iterator[LossTerm]:
        inputs, targets = batch
        yield LossTerm("model", self._nll(inputs, targets, "mean"))

    def count_samples(self, batch) -> int:
        return int((batch[1] != PAD_TARGET).sum())

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable,
        forward_context: Callable[[], ContextManager],
        final: bool = False,
        ranks: Dist = Dist(),
    ) -> dict[str, float]:
        """Perplexity: exp of the mean negative log-likelihood per token, each window on its own."""
        self.net.eval()
        total, tokens = torch.zeros((), dtype=torch.float64), 0
        for inputs, targets in batches:
            with forward_context():
                total += self._nll(inputs, targets, "sum").double().cpu()
            tokens += int((targets != PAD_TARGET).sum())
        self.net.train()
        device = next(self.net.parameters()).device
        nll = ranks.total(float(total), device)
        tokens = int(ranks.total(tokens, device))
        if tokens == 0:
            raise ValueError("evaluation saw no tokens: the validation set is empty")
        loss = nll / tokens
        return {"ppl": math.exp(min(loss, 700.0)), "val_loss": loss, "val_tokens": tokens}


def validate(cfg: DictConfig) -> None:
    m = cfg.model
    if m.arch not in ARCHS:
        raise ConfigError(f"model.arch={m.arch}: expected one of {', '.join(ARCHS)}")
    positive(cfg, "model.bptt")
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout={m.dropout}: must be in [0, 1)")
    if m.eval_state not in EVAL_STATES:
        raise ConfigError(f"model.eval_state={m.eval_state}: expected {' or '.join(EVAL_STATES)}")
    if m.arch == "gpt":
        for key in ["model.n_layer", "model.n_head", "model.n_embd"]:
            positive(cfg, key)
        if m.n_embd % m.n_head:
            raise ConfigError(f"model.n_head={m.n_head}: must divide model.n_embd={m.n_embd}")
    if m.kwargs and m.arch != "custom":
        raise ConfigError(f"model.kwargs: model={m.name} is built by {'mpt' if m.arch == 'gpt' else 'its config'}")
    if m.arch == "custom":
        if m.builder is None:
            raise ConfigError("model.builder: not given; model=custom_lm needs model.builder=" + builders.FORM)
        builders.resolve(m.builder)
    elif m.builder is not None:
        raise ConfigError(f"model.builder={m.builder} under model={m.name}: use model=custom_lm")
    if m.arch == "hf" and m.path is None and not m.hf_config:
        raise ConfigError("model=hf_causal_lm: give model.path (a local folder with config.json) or model.hf_config")
    if m.pretrained and (m.arch != "hf" or m.path is None):
        raise ConfigError("model.pretrained=true: only with model=hf_causal_lm and a model.path to load weights from")


def build(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> CausalLanguageModel:
    return CausalLanguageModel(cfg.model, data_info)
