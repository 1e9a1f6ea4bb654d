import sys, torch, contextlib
from omegaconf import OmegaConf
from mpt.datasets import build_data
from mpt.models import build_task
ck = torch.load(sys.argv[1], weights_only=True)
for mode in ["carried", "sentence"]:
    cfg = OmegaConf.create(ck["config"]); cfg.model.eval_state = mode
    data = build_data(cfg, torch.device("cpu")); task = build_task(cfg, data.info)
    task.net.load_state_dict(ck["engines"]["model"]["model"])
    v = task.evaluate(data.val(), contextlib.nullcontext); t = task.evaluate(data.test(), contextlib.nullcontext)
    print(mode, round(v["ppl"], 1), round(t["ppl"], 1), v.get("val_cell_max"), t.get("val_cell_max"))
