"""Does row 13's latch survive dropout (train mode)? max|c| over the val stream, eval vs train mode."""
import sys, torch
from omegaconf import OmegaConf
from mpt.datasets import build_data
from mpt.models import build_task
ck = torch.load(sys.argv[1], weights_only=True)
cfg = OmegaConf.create(ck["config"]); cfg.model.eval_state = "carried"
data = build_data(cfg, torch.device("cpu"))
task = build_task(cfg, data.info); task.net.load_state_dict(ck["model"]); net = task.net
@torch.no_grad()
def run(mode, seed):
    torch.manual_seed(seed); net.train(mode == "train")
    state, cmax, rowmax = None, 0.0, None
    for inputs, targets in data.val():
        x = net.drop(net.embedding(inputs))
        out, state = net.lstm(x, state)
        c = state[1].abs().amax(dim=(0, 2))
        rowmax = c if rowmax is None else torch.maximum(rowmax, c)
    return [round(float(v)) for v in rowmax]
print("eval ", run("eval", 0))
for s in range(4):
    print("train", run("train", s))
