"""Train like the lm phenomenon, evaluating every N steps; save the weights of any evaluation whose
val perplexity is 1.3x above the previous one's."""
import sys, math, copy
from pathlib import Path
import torch
from hydra import compose, initialize_config_module
from mpt.config import register_configs
register_configs()
from mpt.runner.train import Run
from mpt.runner.validation import validate
from mpt.precision.engine import held_for_the_run

out = Path(sys.argv[1]); seed = sys.argv[2]; every = sys.argv[3]; extra = sys.argv[4:]
ov = ["model=biglstm_tiny", "data=text_corpus", "data.root=../shared/data/ptb", "data.train_split=ptb.train.txt*",
      "data.val_split=ptb.valid.txt*", "data.test_split=ptb.test.txt*", "data.min_count=1", "schedule.batch_size=32",
      "schedule.steps=null", "schedule.epochs=3", "schedule.lr_milestones=[1.5,2.5]", f"schedule.eval_every={every}",
      "schedule.eval_batches=null", "schedule.log_every=50", "device=cpu", f"seed={seed}", "checkpoint=false", *extra]
with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
    cfg = compose(config_name="config", overrides=ov)
validate(cfg)
out.mkdir(parents=True, exist_ok=True)
run = Run(cfg, out)
prev = None
with held_for_the_run(run.cfg, run.device):
    for step in run.steps():
        m = run.record.metrics
        if m and m.get("step") == step:
            ppl = m["ppl"]
            spiked = prev is not None and ppl > 1.3 * prev
            print(step, round(ppl, 1), "SPIKE" if spiked else "", flush=True)
            if spiked:
                torch.save({"config": run.record.config, "step": step, "ppl": ppl, "prev": prev,
                            "model": copy.deepcopy(run.task.net.state_dict())}, out / f"spike_{step}.pt")
            prev = ppl if not spiked else prev
