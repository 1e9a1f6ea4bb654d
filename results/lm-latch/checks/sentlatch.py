import sys, torch, math
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence
from omegaconf import OmegaConf
from mpt.datasets import build_data
from mpt.models import build_task
ck = torch.load(sys.argv[1], weights_only=True)
cfg = OmegaConf.create(ck["config"]); cfg.model.eval_state = "sentence"
data = build_data(cfg, torch.device("cpu")); task = build_task(cfg, data.info)
task.net.load_state_dict(ck["engines"]["model"]["model"]); net = task.net.eval()
rows = []
with torch.no_grad():
    for inputs, targets in getattr(data, sys.argv[2])():
        lengths = (targets != -100).sum(1)
        out, _ = net.lstm(net.embedding(inputs))
        _, (h, c) = net.lstm(pack_padded_sequence(net.embedding(inputs), lengths, batch_first=True, enforce_sorted=False))
        nll = F.cross_entropy((out @ net.softmax_w.t() + net.softmax_b).flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100).view(targets.shape).sum(1)
        for i in range(len(lengths)):
            rows.append((float(c[:, i].abs().max()), float(nll[i]), int(lengths[i])))
tot = sum(r[1] for r in rows); tok = sum(r[2] for r in rows)
print("ppl", round(math.exp(tot / tok), 1), "sentences", len(rows))
for thr in [30, 50, 100]:
    sel = [r for r in rows if r[0] > thr]
    if sel:
        print(f"cell > {thr}: {len(sel)} sentences, {sum(r[2] for r in sel)} tokens, NLL/token {sum(r[1] for r in sel)/sum(r[2] for r in sel):.2f}; the rest {(tot-sum(r[1] for r in sel))/(tok-sum(r[2] for r in sel)):.2f}")
print("max cell", max(r[0] for r in rows))
