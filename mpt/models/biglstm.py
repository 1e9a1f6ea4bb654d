"""bigLSTM language model (Jozefowicz et al. 2016): the paper's One Billion Word model.

An embedding of the projection size, LSTM layers with output projections (nn.LSTM's proj_size),
dropout, and a softmax layer over the vocabulary. Training uses a sampled softmax: the true word's
logit against `num_sampled` negatives drawn log-uniformly over frequency-ranked ids, each logit
corrected by the log of its expected count, accidental hits removed (TensorFlow's
sampled_softmax_loss, as Jozefowicz et al. trained). Evaluation uses the full softmax.

The LSTM state carries over from one batch to the next (truncated backpropagation through time,
`model.bptt` steps), held in buffers so a checkpoint keeps it and a resumed run continues exactly.
"""

from __future__ import annotations

import math
from typing import Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from ..config import ConfigError, positive
from ..datasets.text_corpus import EVAL_STATES, PAD_TARGET
from ..distributed import Dist
from ..precision.quantized_products import BatchMatmul
from . import LossTerm, OneNetwork

EVAL_LOGITS = 2**26  # full-softmax logits per evaluation chunk (256 MiB in FP32)


def log_uniform_sample(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """n ids, with replacement, P(k) = log((k + 2) / (k + 1)) / log(vocab + 1) (TF's LogUniformCandidateSampler)."""
    u = torch.rand(n, device=device, dtype=torch.float64)
    return (torch.exp(u * math.log(vocab + 1)).floor().long() - 1).clamp_(0, vocab - 1)


def log_uniform_log_prob(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    k = ids.double()
    return (torch.log((k + 2) / (k + 1)) / math.log(vocab + 1)).log().float()


def sampled_softmax_loss(
    true_logits, sampled_logits, targets, candidates, true_log_count, sampled_log_count
) -> torch.Tensor:
    """Per-token loss: cross-entropy of the true class among [true, candidates], every logit minus
    the log of its expected count among the candidates; a candidate equal to the target is removed.
    true_logits (N,), sampled_logits (N, S), targets (N,), candidates (S,), log counts (N,) and (S,)."""
    logits = torch.cat(
        [(true_logits.float() - true_log_count)[:, None], sampled_logits.float() - sampled_log_count[None, :]], dim=1
    )
    hits = candidates[None, :] == targets[:, None]
    logits[:, 1:] = logits[:, 1:].masked_fill(hits, -torch.inf)
    return F.cross_entropy(logits, torch.zeros_like(targets), reduction="none")


class BigLSTM(nn.Module):
    """forward(stage, ...): "train" (true and sampled logits) or "nll" (full-softmax negative log-likelihood)."""

    # The LSTM state carried between batches: one row per stream (Task.stream_buffers).
    STREAM_BUFFERS = {"carry_h": 1, "carry_c": 1}
    carry_h: torch.Tensor  # buffers, registered in __init__
    carry_c: torch.Tensor

    def __init__(self, m: DictConfig, vocab: int, batch_size: int, rows: int | None = None):
        """`batch_size`: the global batch (f-lm's embedding-gradient weight); `rows`: the streams
        this process carries state for (its slice of the batch under torchrun; all of it otherwise)."""
        super().__init__()
        self.vocab = vocab
        self.embedding = nn.Embedding(vocab, m.proj_size)
        self.lstm = nn.LSTM(
            m.proj_size, m.hidden_size, num_layers=m.layers, proj_size=m.proj_size, batch_first=True, dropout=m.dropout
        )
        self.drop = nn.Dropout(m.dropout)
        self.softmax_w = nn.Parameter(torch.empty(vocab, m.proj_size))
        self.softmax_b = nn.Parameter(torch.zeros(vocab))
        self.logits = BatchMatmul()  # the softmax's product, sampled or full: FP8 and MX modes quantize it
        # model.true_logit=product: its own module, so that a delayed FP8 scale keeps its own history
        self.true_logits = BatchMatmul() if m.true_logit == "product" else None
        with torch.no_grad():
            bound = 1.0 / math.sqrt(m.proj_size)
            self.embedding.weight.uniform_(-bound, bound)
            self.softmax_w.uniform_(-bound, bound)
            # TF's LSTMCell (f-lm's): no bias but a forget-gate bias of 1 (torch's gate order: i, f, g, o)
            for name, p in self.lstm.named_parameters():
                if name.startswith("bias_"):
                    p.zero_()
                    if name.startswith("bias_ih"):
                        p[m.hidden_size : 2 * m.hidden_size] = 1.0
        # The training state carried between batches (one row per stream of the batch).
        rows = batch_size if rows is None else rows
        self.register_buffer("carry_h", torch.zeros(m.layers, rows, m.proj_size))
        self.register_buffer("carry_c", torch.zeros(m.layers, rows, m.hidden_size))
        # f-lm's gradient weighting: embedding gradients times the batch size (its `emb_grads * batch_size`)
        self.embedding.weight.register_hook(lambda g: g * batch_size)

    def forward(self, stage: str, *args):
        return getattr(self, f"_{stage}")(*args)

    def _train(self, inputs, targets, candidates):
        out, (h, c) = self.lstm(self.drop(self.embedding(inputs)), (self.carry_h, self.carry_c))
        # Assigned, not copied in place: the LSTM's backward still needs the old state.
        self.carry_h, self.carry_c = h.detach(), c.detach()
        out = self.drop(out).reshape(-1, out.shape[-1])
        flat = targets.reshape(-1)
        if self.true_logits is not None:  # each row's dot product as a (1 x P) @ (P x 1) product
            true_logits = (
                self.true_logits(out.unsqueeze(1), self.softmax_w[flat].unsqueeze(-1)).view(-1) + self.softmax_b[flat]
            )
        else:
            true_logits = (out * self.softmax_w[flat]).sum(-1) + self.softmax_b[flat]
        sampled_logits = self.logits(out, self.softmax_w[candidates].t()) + self.softmax_b[candidates]
        return true_logits, sampled_logits

    def _nll(self, inputs, targets, state):
        out, state = self.lstm(self.embedding(inputs), state)
        out, flat = out.reshape(-1, out.shape[-1]), targets.reshape(-1)
        total = torch.zeros((), dtype=torch.float32, device=out.device)
        chunk = max(1, EVAL_LOGITS // self.vocab)  # the full logits of a One Billion Word batch would not fit at once
        for i in range(0, len(flat), chunk):
            logits = self.logits(out[i : i + chunk], self.softmax_w.t()) + self.softmax_b
            total = total + F.cross_entropy(
                logits.float(), flat[i : i + chunk], reduction="sum", ignore_index=PAD_TARGET
            )
        return total, state


class LanguageModel(OneNetwork):
    sample_unit = "words"  # target tokens: the words and each sentence's </s>
    primary_metric = "ppl"
    higher_is_better = False

    def __init__(self, model_cfg: DictConfig, data_info: dict, batch_size: int, shard: Dist = Dist()):
        self.cfg = model_cfg
        self.vocab = data_info["vocab_size"]
        self.num_sampled = model_cfg.num_sampled
        self.net = BigLSTM(model_cfg, self.vocab, batch_size, rows=batch_size // shard.world_size)
        self.lstm_parameters = list(self.net.lstm.parameters())  # shared by any wrapper set_network puts on

    def clipped_parameters(self, name: str) -> list[nn.Parameter]:
        """f-lm clips the LSTM's gradients only."""
        return self.lstm_parameters

    def stream_buffers(self, name: str) -> dict[str, int]:
        return BigLSTM.STREAM_BUFFERS

    @property
    def loss_definition(self) -> str:
        b = self.cfg.bptt
        return f"sampled-softmax cross-entropy per word x {b}: summed over a window's {b} time steps, mean over streams"

    def train_losses(self, batch) -> Iterator[LossTerm]:
        inputs, targets = batch
        candidates = log_uniform_sample(self.num_sampled, self.vocab, inputs.device)
        true_logits, sampled_logits = self.net("train", inputs, targets, candidates)
        log_s = math.log(self.num_sampled)
        flat = targets.reshape(-1)
        losses = sampled_softmax_loss(true_logits, sampled_logits, flat, candidates,
                                      log_s + log_uniform_log_prob(flat, self.vocab),
                                      log_s + log_uniform_log_prob(candidates, self.vocab))  # fmt: skip
        per_word = losses.mean()
        # f-lm's objective: the mean over words times the BPTT length (a sum over time steps, a mean
        # over the batch's streams); the gradients, and so what FP16 must hold, are that large.
        yield LossTerm("model", per_word * self.cfg.bptt, {"loss_per_word": per_word.detach()})

    def count_samples(self, batch) -> int:
        return batch[1].numel()

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable,
        forward_context: Callable[[], ContextManager],
        final: bool = False,
        ranks: Dist = Dist(),
    ) -> dict[str, float]:
        """Perplexity with the full softmax. model.eval_state=carried: the state carried across the
        stream's windows from zeros, and val_cell_max, the largest |cell state| at a window's end (a
        latched cell shows as hundreds or thousands where the rest stay in the tens); sentence: each
        batch of padded sentences from zeros."""
        self.net.eval()
        carried = self.cfg.eval_state == "carried"
        total = torch.zeros((), dtype=torch.float64)
        cell_max = None  # on the device: read once, at the end
        tokens, state = 0, None
        for inputs, targets in batches:
            with forward_context():
                nll, state = self.net("nll", inputs, targets, state if carried else None)
            total += nll.double().cpu()
            if carried:
                tokens += targets.numel()
                window_max = state[1].detach().abs().amax().float()
                cell_max = window_max if cell_max is None else torch.maximum(cell_max, window_max)
            else:
                tokens += int((targets != PAD_TARGET).sum())
        self.net.train()
        # Each rank scored its streams (or its batches of sentences): the sums over ranks are the set's.
        device = next(self.net.parameters()).device
        nll = ranks.total(float(total), device)
        tokens = int(ranks.total(tokens, device))
        if tokens == 0:
            raise ValueError("evaluation saw no tokens: the validation set is empty")
        loss = nll / tokens
        metrics = {"ppl": math.exp(min(loss, 700.0)), "val_loss": loss, "val_tokens": tokens}
        if carried:  # every rank carries streams: each has a largest cell
            metrics["val_cell_max"] = ranks.largest(float(cell_max) if cell_max is not None else 0.0, device)
        return metrics


def validate(cfg: DictConfig) -> None:
    m = cfg.model
    for key in ["model.hidden_size", "model.proj_size", "model.layers", "model.num_sampled", "model.bptt"]:
        positive(cfg, key)
    if m.proj_size >= m.hidden_size:
        raise ConfigError(
            f"model.proj_size={m.proj_size}: must be smaller than model.hidden_size={m.hidden_size} "
            "(nn.LSTM's projection)"
        )
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout={m.dropout}: must be in [0, 1)")
    if m.true_logit not in ("dot", "product"):
        raise ConfigError(f"model.true_logit={m.true_logit}: expected dot or product")
    if m.eval_state not in EVAL_STATES:
        raise ConfigError(f"model.eval_state={m.eval_state}: expected {' or '.join(EVAL_STATES)}")


def build(cfg: DictConfig, data_info: dict, shard: Dist = Dist()) -> LanguageModel:
    return LanguageModel(cfg.model, data_info, batch_size=cfg.schedule.batch_size, shard=shard)
