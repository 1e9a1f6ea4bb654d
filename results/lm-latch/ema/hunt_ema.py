"""As hunt.py, with f-lm's exponential moving average (decay 0.999) of the LSTM's weights: every
evaluation also scores val (and test) with the averaged LSTM."""
import sys, math, contextlib
from pathlib import Path
import torch
from hydra import compose, initialize_config_module
from mpt.config import register_configs
register_configs()
from mpt.runner.train import Run
from mpt.runner.validation import validate
from mpt.precision.engine import held_for_the_run

out = Path(sys.argv[1]); seed = sys.argv[2]; every = sys.argv[3]; decay = float(sys.argv[4]); extra = sys.argv[5:]
ov = ["model=biglstm_tiny", "data=text_corpus", "data.root=../shared/data/ptb", "data.train_split=ptb.train.txt*",
      "data.val_split=ptb.valid.txt*", "data.test_split=ptb.test.txt*", "data.min_count=1", "schedule.batch_size=32",
      "schedule.steps=null", "schedule.epochs=3", "schedule.lr_milestones=[1.5,2.5]", f"schedule.eval_every={every}",
      "schedule.eval_batches=null", "schedule.log_every=50", "device=cpu", f"seed={seed}", "checkpoint=false", *extra]
with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
    cfg = compose(config_name="config", overrides=ov)
validate(cfg)
out.mkdir(parents=True, exist_ok=True)
run = Run(cfg, out)
lstm = run.task.net.lstm
ema = {n: p.detach().clone() for n, p in lstm.named_parameters()}
with held_for_the_run(run.cfg, run.device):
    for step in run.steps():
        with torch.no_grad():
            for n, p in lstm.named_parameters():
                ema[n].mul_(decay).add_(p.detach(), alpha=1 - decay)
        m = run.record.metrics
        if m and m.get("step") == step:
            raw = {n: p.detach().clone() for n, p in lstm.named_parameters()}
            with torch.no_grad():
                for n, p in lstm.named_parameters():
                    p.copy_(ema[n])
            v = run.task.evaluate(run.data.val(), contextlib.nullcontext)["ppl"]
            t = run.task.evaluate(run.data.test(), contextlib.nullcontext)["ppl"]
            with torch.no_grad():
                for n, p in lstm.named_parameters():
                    p.copy_(raw[n])
            print(step, "raw val", round(m["ppl"], 1), "| ema val", round(v, 1), "test", round(t, 1), flush=True)
