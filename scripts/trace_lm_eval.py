"""Trace a language model's evaluation, window by window and stream by stream, on a checkpoint's weights.

    python scripts/trace_lm_eval.py RUN_DIR_OR_CHECKPOINT [--split val|test] [--out trace.csv]

Scores the split as the run's evaluation does with model.eval_state=carried (the split cut into
schedule.batch_size rows, the state carried from zeros across the windows), in FP32, and writes one
CSV row per (window, stream): the summed NLL and its tokens, the largest |cell state| and |output|
at the window's end, the largest logit, and the token whose NLL is largest. It then prints the
perplexity and every stream whose mean NLL is more than twice the median stream's, with the window
where its cell state first passed 100. A latched cell (docs/tasks-and-data.md, "Language-model
evaluation") shows as one stream whose cell state grows by about 1 a word while its NLL stays high.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from mpt.datasets import build_data
from mpt.datasets.text_corpus import split_files
from mpt.datasets.text_corpus import vocabulary as vocabulary_of
from mpt.models import build_task
from mpt.runner import checkpoint

FIELDS = ["window", "stream", "nll", "tokens", "cell_max", "output_max", "logit_max", "worst_token", "worst_nll"]


def vocabulary(cfg) -> list[str]:
    """The run's ids as words, made as its loader made them (a Markov source's ids stay numbers)."""
    d = cfg.data
    if d.name != "text_corpus":
        return []
    return vocabulary_of(d, split_files(Path(d.root).expanduser(), d.train_split, "train_split"))


def trace(path: Path, split: str) -> list[dict]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    cfg = OmegaConf.create(state["config"])
    cfg.model.eval_state = "carried"
    data = build_data(cfg, torch.device("cpu"))
    task = build_task(cfg, data.info)
    task.net.load_state_dict(state["engines"]["model"]["model"])
    net = task.net.eval()
    batches = data.val() if split == "val" else data.test()
    if batches is None:
        raise SystemExit(f"trace_lm_eval: the run has no {split} split (data.test_split is null)")
    words = vocabulary(cfg)
    rows, carried = [], None
    with torch.no_grad():
        for w, (inputs, targets) in enumerate(batches):
            out, carried = net.lstm(net.embedding(inputs), carried)
            logits = out @ net.softmax_w.t() + net.softmax_b
            nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
            cell = carried[1].abs().amax(dim=(0, 2))
            output = carried[0].abs().amax(dim=(0, 2))
            worst_nll, worst_at = nll.max(dim=1)
            for s in range(targets.shape[0]):
                token = int(targets[s, worst_at[s]])
                rows.append({
                    "window": w, "stream": s, "nll": float(nll[s].sum()), "tokens": targets.shape[1],
                    "cell_max": float(cell[s]), "output_max": float(output[s]), "logit_max": float(logits[s].max()),
                    "worst_token": words[token] if words else token, "worst_nll": float(worst_nll[s]),
                })  # fmt: skip
    return rows


def summary(rows: list[dict]) -> list[str]:
    total, tokens = sum(r["nll"] for r in rows), sum(r["tokens"] for r in rows)
    streams = sorted({r["stream"] for r in rows})
    mean = {
        s: sum(r["nll"] for r in rows if r["stream"] == s) / sum(r["tokens"] for r in rows if r["stream"] == s)
        for s in streams
    }
    median = sorted(mean.values())[len(mean) // 2]
    lines = [
        f"perplexity {math.exp(total / tokens):.1f} over {tokens} tokens, {len(streams)} streams;"
        f" median stream NLL {median:.2f} a token"
    ]
    for s in streams:
        if mean[s] > 2 * median:
            own = [r for r in rows if r["stream"] == s]
            passed = next((r["window"] for r in own if r["cell_max"] > 100), None)
            share = sum(r["nll"] for r in own) / total
            cell_max = max(r["cell_max"] for r in own)
            lines.append(
                f"stream {s}: NLL {mean[s]:.2f} a token ({share:.0%} of the split's), cell state up to {cell_max:.0f}"
                + (f", past 100 from window {passed}" if passed is not None else "")
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a run folder (its checkpoint.pt) or a checkpoint file")
    parser.add_argument("--split", choices=["val", "test"], default="val")
    parser.add_argument("--out", type=Path, help="the CSV to write (default: none)")
    args = parser.parse_args()
    path = args.path / checkpoint.FILENAME if args.path.is_dir() else args.path
    if not path.is_file():
        raise SystemExit(f"trace_lm_eval: {path}: no such checkpoint")
    rows = trace(path, args.split)
    if args.out:
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
