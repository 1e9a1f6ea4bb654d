"""Batched beam search with GNMT's length normalization; beam 1 is greedy decoding.

A hypothesis that has produced EOS stays in its beam, extended by EOS at no cost, so it keeps its
score and competes with the open ones until the end. At the end each sentence's hypotheses are
ranked by score / lp(Y), lp(Y) = ((c + |Y|) / (c + 1))^alpha (Wu et al. 2016, eq. 14), |Y| counting
the EOS.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


@torch.no_grad()
def beam_search(
    step: Callable[[torch.Tensor], torch.Tensor],
    reorder: Callable[[torch.Tensor], None],
    n: int,
    beam: int,
    max_len: torch.Tensor,
    bos: int,
    eos: int,
    banned: Sequence[int],
    alpha: float,
    const: float,
    device: torch.device,
) -> list[list[int]]:
    """Decode n sentences, each with `beam` hypotheses kept in rows [i*beam, (i+1)*beam).

    step(tokens): log-probabilities (n*beam, V) of the next token, given each row's last token
    (the caller keeps the decoder state). reorder(rows): row r of the new state is row rows[r] of
    the old one. max_len (n,): each sentence's cap in tokens, EOS included; at its last step an
    open hypothesis can only end (with the model's own EOS probability). Returns each sentence's
    best hypothesis without its EOS.
    """
    last_step = (max_len.to(device) - 1)[:, None, None]
    rows = torch.arange(n, device=device)[:, None] * beam
    tokens = torch.full((n * beam,), bos, dtype=torch.long, device=device)
    scores = torch.zeros(n, beam, device=device)
    scores[:, 1:] = -torch.inf  # every beam starts as the same empty hypothesis: keep one
    finished = torch.zeros(n, beam, dtype=torch.bool, device=device)
    lengths = torch.zeros(n, beam, dtype=torch.long, device=device)
    picks, parents = [], []
    eos_only = None
    for t in range(int(max_len.max())):
        logp = step(tokens).float().view(n, beam, -1)
        vocab = logp.shape[-1]
        if eos_only is None:
            eos_only = torch.full((vocab,), -torch.inf, device=device)
            eos_only[eos] = 0.0
            blocked = torch.zeros(vocab, dtype=torch.bool, device=device)
            blocked[list(banned)] = True
            not_eos = torch.arange(vocab, device=device) != eos
        logp = logp.masked_fill(blocked | (not_eos & (t >= last_step)), -torch.inf)
        logp = torch.where(finished[..., None], eos_only, logp)
        scores, index = (scores[..., None] + logp).view(n, -1).topk(beam, dim=1)
        parent, token = index // vocab, index % vocab
        was_finished = finished.gather(1, parent)
        lengths = lengths.gather(1, parent) + (~was_finished).long()
        finished = was_finished | (token == eos)
        picks.append(token)
        parents.append(parent)
        reorder((rows + parent).view(-1))
        tokens = token.view(-1)
        if bool(finished.all()):
            break
    penalty = ((const + lengths.float()) / (const + 1.0)) ** alpha
    k = (scores / penalty).argmax(dim=1, keepdim=True)
    out = torch.empty(n, len(picks), dtype=torch.long, device=device)
    for t in reversed(range(len(picks))):
        out[:, t] = picks[t].gather(1, k).squeeze(1)
        k = parents[t].gather(1, k)
    result = []
    for seq in out.tolist():
        result.append(seq[: seq.index(eos)] if eos in seq else seq)
    return result
