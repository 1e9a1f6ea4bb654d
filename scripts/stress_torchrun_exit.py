"""Run the 2-process GNMT-on-Multi30k job of tests/test_distributed.py again and again while busy
loops hold every core, and count the runs in which a rank died (the exit abort of issue 18:
SIGABRT, "terminate called without an active exception").

    python scripts/stress_torchrun_exit.py --runs 30 --busy 2 --out /tmp/stress.json

Each failure's exit code and the last lines of its stderr go into the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def busy_loop() -> None:
    while True:
        pass


def command(run_dir: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
            "mpt.runner.cli", "model=gnmt", "model.hidden_size=16", "model.encoder_layers=2", "model.decoder_layers=2",
            "model.beam_size=1", "data=parallel_text", f"data.root={data}", "data.val_split=val", "data.vocab_size=500",
            "data.tokenizer_sentences=2000", "schedule=smoke", "schedule.batch_size=8", "schedule.steps=2",
            "schedule.eval_batches=1", "checkpoint=false", f"hydra.run.dir={run_dir}"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument(
        "--busy",
        type=int,
        default=os.cpu_count() or 2,
        help="busy-loop processes beside each run (default: one per core)",
    )
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "multi30k")
    ap.add_argument("--out", type=Path, required=True, help="the JSON summary")
    ap.add_argument(
        "--nice", type=int, default=0, help="run each job at this niceness, so the busy loops win the cores"
    )
    ap.add_argument("--stop-at-first", action="store_true", help="stop at the first failure (to reproduce)")
    args = ap.parse_args()
    if not args.data.is_dir():
        sys.exit(f"--data {args.data}: no such folder (../shared/data/multi30k)")

    loops = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for p in loops:
        p.start()
    results = []
    try:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                cmd = (
                    ["nice", "-n", str(args.nice), *command(Path(tmp) / "run", args.data)]
                    if args.nice
                    else command(Path(tmp) / "run", args.data)
                )
                r = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=900,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
                row = {"run": i, "returncode": r.returncode, "seconds": round(time.time() - t0, 1)}
                if r.returncode != 0:
                    row["stderr_tail"] = r.stderr[-20000:]
                results.append(row)
                print(f"run {i}: rc={r.returncode} in {row['seconds']} s", flush=True)
                args.out.write_text(json.dumps(summary(args, results), indent=2))
                if r.returncode != 0 and args.stop_at_first:
                    break
    finally:
        for p in loops:
            p.terminate()
    print(json.dumps({k: v for k, v in summary(args, results).items() if k != "runs"}, indent=2))


def summary(args: argparse.Namespace, results: list[dict]) -> dict:
    import platform

    import torch

    from mpt.provenance import cpu_name, git_commit

    return {
        "command": " ".join(command(Path("<tmp>/run"), args.data)),
        "git": git_commit(ROOT),
        "cpu": cpu_name(),
        "busy_processes": args.busy,
        "nice": args.nice,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "runs_done": len(results),
        "failures": sum(r["returncode"] != 0 for r in results),
        "runs": results,
    }


if __name__ == "__main__":
    main()
