"""GNMT-style translation (NVIDIA's GNMT v2, after Wu et al. 2016): the paper's NMT model.

Encoder: a shared embedding, the first `encoder_bidirectional_layers` LSTM layers bidirectional (run
on packed sequences, so the backward direction starts at each sentence's last token), the rest
unidirectional, with residual connections from the third layer on.

Decoder: the first LSTM layer reads the target embeddings; normalized Bahdanau attention over the
encoder's output is computed from its outputs for all time steps at once (GNMT v2's form, which
lets every layer run as one cuDNN call); every later layer reads [its input, attention context],
with residual connections from the third layer on; a linear classifier over the vocabulary.

The vocabulary is padded to a multiple of `pad_to_multiple` (tensor-core shapes); the padding ids
are never targets and are barred from decoding. The loss is label-smoothed cross-entropy in FP32.
"""

from __future__ import annotations

import math
from typing import Callable, ContextManager, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..config import ConfigError, positive
from ..datasets.translation import BOS, EOS, PAD, TranslationBatch, round_up
from ..distributed import Dist
from ..precision.quantized_products import BatchMatmul
from . import LossTerm, OneNetwork
from .beam_search import beam_search


class BahdanauAttention(nn.Module):
    """Additive attention with GNMT's normalization: score = g * v/|v| . tanh(Wq q + Wk k + b)."""

    def __init__(self, query_size: int, key_size: int, units: int):
        super().__init__()
        self.linear_q = nn.Linear(query_size, units, bias=False)
        self.linear_k = nn.Linear(key_size, units, bias=False)
        self.linear_att = nn.Parameter(torch.empty(units))
        self.normalize_scalar = nn.Parameter(torch.full((1,), 1.0 / math.sqrt(units)))
        self.normalize_bias = nn.Parameter(torch.zeros(units))
        self.weigh = BatchMatmul()  # the context's weighted sum: a product FP8 and MX modes quantize

    def keys(self, context: torch.Tensor) -> torch.Tensor:
        return self.linear_k(context)

    def forward(
        self, query: torch.Tensor, context: torch.Tensor, keys: torch.Tensor, pad_mask: torch.Tensor
    ) -> torch.Tensor:
        """query (B, Tq, Hq), context (B, S, C), keys (B, S, U), pad_mask (B, S) True at padding -> (B, Tq, C)."""
        q = self.linear_q(query)
        v = self.linear_att / self.linear_att.norm() * self.normalize_scalar
        # the bias in the keys' dtype: under autocast an FP32 parameter would promote this, the
        # largest activation of the model (B x Tq x S x units), to FP32
        scores = torch.tanh(q.unsqueeze(2) + keys.unsqueeze(1) + self.normalize_bias.to(keys.dtype)).matmul(
            v
        )  # (B, Tq, S)
        scores = scores.masked_fill(pad_mask.unsqueeze(1), torch.finfo(scores.dtype).min)
        return self.weigh(F.softmax(scores, dim=-1).to(context.dtype), context)


class Encoder(nn.Module):
    def __init__(self, hidden: int, layers: int, bidirectional_layers: int, dropout: float):
        super().__init__()
        self.layers = nn.ModuleList()
        size = hidden
        for i in range(layers):
            bidirectional = i < bidirectional_layers
            self.layers.append(nn.LSTM(size, hidden, batch_first=True, bidirectional=bidirectional))
            size = 2 * hidden if bidirectional else hidden
        self.out_size = size
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, lengths_cpu: torch.Tensor) -> torch.Tensor:
        for i, lstm in enumerate(self.layers):
            inp = self.dropout(x)
            if lstm.bidirectional:
                packed = pack_padded_sequence(inp, lengths_cpu, batch_first=True, enforce_sorted=False)
                out, _ = pad_packed_sequence(lstm(packed)[0], batch_first=True, total_length=x.shape[1])
            else:
                out, _ = lstm(inp)
            x = out + x if i >= 2 and out.shape == x.shape else out  # (a layer that changes the width has none)
        return x


class Decoder(nn.Module):
    def __init__(self, hidden: int, context_size: int, layers: int, dropout: float, vocab: int):
        super().__init__()
        self.attention_rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.attention = BahdanauAttention(hidden, context_size, hidden)
        self.layers = nn.ModuleList(nn.LSTM(hidden + context_size, hidden, batch_first=True) for _ in range(layers - 1))
        self.classifier = nn.Linear(hidden, vocab)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, context, keys, pad_mask, state: Optional[torch.Tensor] = None):
        """x (B, T, H) embedded inputs; state (layers, 2, B, H) as returned, or None for zeros.
        Returns logits (B, T, V) and the new state."""

        def initial(i):
            return (
                None
                if state is None
                else (state[i, 0].unsqueeze(0).contiguous(), state[i, 1].unsqueeze(0).contiguous())
            )

        y, hc = self.attention_rnn(self.dropout(x), initial(0))
        states = [hc]
        attn = self.attention(y, context, keys, pad_mask)
        for i, lstm in enumerate(self.layers):
            out, hc = lstm(self.dropout(torch.cat([y, attn], dim=2)), initial(i + 1))
            states.append(hc)
            y = out + y if i >= 1 else out  # residual from the decoder's third layer
        return self.classifier(y), torch.stack([torch.stack([h[0], c[0]]) for h, c in states])


class GNMT(nn.Module):
    """forward(stage, ...): "train" (teacher-forced logits), "encode" and "step" (for decoding). One
    entry point, so the precision engine's casts at the model's boundary cover every use."""

    def __init__(self, m: DictConfig, vocab_size: int):
        super().__init__()
        self.padded_vocab = round_up(vocab_size, m.pad_to_multiple)
        self.embedding = nn.Embedding(self.padded_vocab, m.hidden_size, padding_idx=PAD)  # shared by both languages
        self.encoder = Encoder(m.hidden_size, m.encoder_layers, m.encoder_bidirectional_layers, m.dropout)
        self.decoder = Decoder(m.hidden_size, self.encoder.out_size, m.decoder_layers, m.dropout, self.padded_vocab)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.split(".")[-1].startswith("bias_hh"):
                    p.zero_()  # NVIDIA's init_lstm_: one of an LSTM's two (summed) biases starts at zero
                elif "normalize_" not in name:
                    p.uniform_(-m.init_weight, m.init_weight)
            self.embedding.weight[PAD].zero_()

    def forward(self, stage: str, *args):
        return getattr(self, f"_{stage}")(*args)

    def _encode(self, src, src_len, src_len_cpu):
        context = self.encoder(self.embedding(src), src_len_cpu)
        pad_mask = torch.arange(src.shape[1], device=src.device)[None, :] >= src_len[:, None]
        return context, self.decoder.attention.keys(context), pad_mask

    def _train(self, src, src_len, src_len_cpu, tgt_in):
        context, keys, pad_mask = self._encode(src, src_len, src_len_cpu)
        return self.decoder(self.embedding(tgt_in), context, keys, pad_mask)[0]

    def _step(self, tokens, state, context, keys, pad_mask):
        logits, state = self.decoder(self.embedding(tokens[:, None]), context, keys, pad_mask, state)
        return logits[:, 0], state


class Translation(OneNetwork):
    sample_unit = "target tokens"  # non-padding target tokens, EOS included
    primary_metric = "bleu"
    higher_is_better = True

    def __init__(self, model_cfg: DictConfig, data_info: dict):
        self.cfg = model_cfg
        self.vocab_size = data_info["vocab_size"]
        self.detokenize = data_info["detokenize"]
        self.net = GNMT(model_cfg, self.vocab_size)
        # never predicted: padding, the start symbol, and the ids that only pad the vocabulary
        self.banned = [PAD, BOS, *range(self.vocab_size, self.net.padded_vocab)]

    def _token_losses(self, logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
        return F.cross_entropy(
            logits.flatten(0, 1), target.flatten(), ignore_index=PAD, label_smoothing=smoothing, reduction="sum"
        )

    @property
    def loss_definition(self) -> str:
        smoothing = f"label-smoothed ({self.cfg.label_smoothing:g}) " if self.cfg.label_smoothing else ""
        if self.cfg.loss_reduction == "mean":
            return f"{smoothing}cross-entropy per target token"
        return f"{smoothing}cross-entropy summed over each sentence's target tokens, mean over sentences"

    def train_losses(self, batch: TranslationBatch) -> Iterator[LossTerm]:
        logits = self.net("train", batch.src, batch.src_len, batch.src_len_cpu, batch.tgt_in)
        total = self._token_losses(logits, batch.tgt_out, self.cfg.label_smoothing)
        # mean: per target token; sum: summed over each sentence's time steps, averaged over sentences
        # (larger gradients, so a smaller loss scale suffices)
        per = batch.tgt_tokens if self.cfg.loss_reduction == "mean" else batch.src.shape[0]
        yield LossTerm("model", total / per)

    def count_samples(self, batch: TranslationBatch) -> int:
        return batch.tgt_tokens

    def translate(self, batch: TranslationBatch, forward_context: Callable[[], ContextManager]) -> list[list[int]]:
        """Beam search (model.beam_size; 1 is greedy) for every sentence of the batch."""
        beam = self.cfg.beam_size
        with forward_context():
            context, keys, pad_mask = self.net("encode", batch.src, batch.src_len, batch.src_len_cpu)
        context, keys, pad_mask = (t.repeat_interleave(beam, dim=0) for t in (context, keys, pad_mask))
        holder: dict[str, Optional[torch.Tensor]] = {"state": None}

        def step(tokens: torch.Tensor) -> torch.Tensor:
            with forward_context():
                logits, holder["state"] = self.net("step", tokens, holder["state"], context, keys, pad_mask)
            return F.log_softmax(logits.float(), dim=-1)

        def reorder(rows: torch.Tensor) -> None:
            state = holder["state"]
            assert state is not None  # reordered after a step
            holder["state"] = state[:, :, rows]

        # per sentence, so a sentence's output does not depend on the batch it is in
        max_len = torch.clamp(2 * batch.src_len_cpu + 10, max=self.cfg.max_decode_len)
        return beam_search(step, reorder, batch.src.shape[0], beam, max_len, BOS, EOS, self.banned,
                           self.cfg.len_norm_factor, self.cfg.len_norm_const, batch.src.device)  # fmt: skip

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[TranslationBatch],
        forward_context: Callable[[], ContextManager],
        final: bool = False,
        ranks: Dist = Dist(),
    ) -> dict[str, float]:
        import sacrebleu

        self.net.eval()
        pairs: list[list[tuple[str, str]]] = []  # per batch: (hypothesis, reference)
        nll = torch.zeros((), dtype=torch.float64)
        tokens = 0
        for batch in batches:
            with forward_context():
                logits = self.net("train", batch.src, batch.src_len, batch.src_len_cpu, batch.tgt_in).float()
            nll += self._token_losses(logits, batch.tgt_out, 0.0).double().cpu()
            tokens += batch.tgt_tokens
            assert batch.refs is not None  # validation batches carry their references
            pairs.append(list(zip((self.detokenize(h) for h in self.translate(batch, forward_context)), batch.refs)))
        self.net.train()
        # Each rank translated its batches: BLEU is scored once, over every rank's sentences in the
        # set's order, and the loss from the sums over ranks.
        device = next(self.net.parameters()).device
        nll = torch.tensor(ranks.total(float(nll), device), dtype=torch.float64)
        tokens = int(ranks.total(tokens, device))
        ordered = ranks.in_batch_order(pairs)
        hyps, refs = [h for h, _ in ordered], [r for _, r in ordered]
        if not hyps:
            raise ValueError("evaluation saw no sentences: the validation set is empty")
        val_loss = float(nll) / tokens
        bleu = sacrebleu.corpus_bleu(hyps, [refs])  # 13a tokenization, case-sensitive: sacrebleu's standard
        # as NVIDIA's GNMT scores itself (sacrebleu --score-only -lc --tokenize intl), for comparing
        # with its published BLEU
        bleu_lc_intl = sacrebleu.corpus_bleu(hyps, [refs], lowercase=True, tokenize="intl")
        return {
            "bleu": bleu.score,
            "bleu_lc_intl": bleu_lc_intl.score,
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 700.0)),
            "val_sentences": len(hyps),
        }


LOSS_REDUCTIONS = ("mean", "sum")


def validate(cfg: DictConfig) -> None:
    m = cfg.model
    for key in [
        "model.hidden_size",
        "model.encoder_layers",
        "model.decoder_layers",
        "model.beam_size",
        "model.max_decode_len",
        "model.pad_to_multiple",
        "model.init_weight",
    ]:
        positive(cfg, key)
    if not 0 <= m.encoder_bidirectional_layers <= m.encoder_layers:
        raise ConfigError(
            f"model.encoder_bidirectional_layers={m.encoder_bidirectional_layers}: "
            f"must be between 0 and model.encoder_layers={m.encoder_layers}"
        )
    if m.decoder_layers < 2:
        raise ConfigError(
            f"model.decoder_layers={m.decoder_layers}: GNMT needs at least 2 (the attention layer and one above it)"
        )
    for key in ["model.dropout", "model.label_smoothing"]:
        if not 0 <= OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)}: must be in [0, 1)")
    if m.loss_reduction not in LOSS_REDUCTIONS:
        raise ConfigError(f"model.loss_reduction={m.loss_reduction}: expected one of {', '.join(LOSS_REDUCTIONS)}")
    if m.len_norm_factor < 0 or m.len_norm_const < 0:
        raise ConfigError(
            f"model.len_norm_factor={m.len_norm_factor}, model.len_norm_const={m.len_norm_const}: "
            "must be zero or positive"
        )


def build(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> Translation:
    return Translation(cfg.model, data_info)
