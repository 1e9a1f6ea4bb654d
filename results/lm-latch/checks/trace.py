"""Per-window trace of a bigLSTM evaluation, on a checkpoint's weights, optionally perturbed."""
import sys, math, contextlib
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from mpt.datasets import build_data
from mpt.models import build_task

ck = torch.load(sys.argv[1], weights_only=True)
trials = int(sys.argv[2]); rel = float(sys.argv[3])
cfg = OmegaConf.create(ck["config"]); cfg.model.eval_state = "carried"
data = build_data(cfg, torch.device("cpu"))
task = build_task(cfg, data.info)
sd = ck["engines"]["model"]["model"]
net = task.net
net.eval()

@torch.no_grad()
def trace(batches):
    rows, state = [], None
    for inputs, targets in batches:
        out, state = net.lstm(net.embedding(inputs), state)
        logits = out.reshape(-1, out.shape[-1]) @ net.softmax_w.t() + net.softmax_b
        nll = F.cross_entropy(logits, targets.reshape(-1), reduction="none")
        rows.append((float(nll.sum()), nll.numel(), float(state[0].abs().max()), float(state[1].abs().max()), float(logits.max()), float(nll.max())))
    return rows

g = torch.Generator().manual_seed(0)
for trial in range(trials):
    net.load_state_dict(sd)
    if trial:
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.mul_(1 + rel * torch.randn(p.shape, generator=g))
    rows = trace(data.val())
    tot = sum(r[0] for r in rows); tok = sum(r[1] for r in rows)
    worst = max(range(len(rows)), key=lambda i: rows[i][0])
    print(f"trial {trial}: val ppl {math.exp(tot/tok):.1f}, max|c| {max(r[3] for r in rows):.1f}, max logit {max(r[4] for r in rows):.1f}, "
          f"worst window {worst} nll/token {rows[worst][0]/rows[worst][1]:.2f}", flush=True)
    if math.exp(tot / tok) > 300:
        for i, r in enumerate(rows):
            print(i, [round(x, 2) for x in r])
