"""Inflict each fault a long run can meet on real `mpt-run` processes and record what happened:
the exit code, the record's status and message, what the folder holds afterwards, and whether a
relaunch of the same command ends as an uninterrupted run does.

    python scripts/try_faults.py --out results/faults        # about 5 minutes on 2 CPU cores

The full-disk case writes into a 20 MiB tmpfs, so it needs `mount` (root, or a user namespace);
without it that case is recorded as not tried. Every run is the small classifier on synthetic data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpt.files import write_json_atomic
from mpt.provenance import environment, git_commit, now_iso

ROOT = Path(__file__).resolve().parents[1]

RUN = ["model=mobilenet_v3_small", "schedule=smoke", "schedule.steps=40", "schedule.checkpoint_every=5",
       "schedule.log_every=1", "schedule.eval_every=20", "deterministic=true", "device=cpu"]  # fmt: skip


def command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mpt.runner.cli", *RUN, *extra, f"hydra.run.dir={run_dir}"]


def cli(run_dir: Path, *extra: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(command(run_dir, *extra), cwd=ROOT, capture_output=True, text=True, timeout=900, **kw)


def train_rows(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row["kind"] == "train":
            rows.append(row)
    return rows


def record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError) as e:
        return {"status": f"unreadable ({e})"}


def checkpoint_step(run_dir: Path):
    from mpt.runner import checkpoint

    try:
        saved = checkpoint.load(run_dir)
    except Exception as e:
        return f"unreadable ({type(e).__name__})"
    return None if saved is None else saved["step"]


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int) -> None:
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(train_rows(run_dir)) >= n:
            return
        time.sleep(0.05)


def state(run_dir: Path) -> dict:
    rec = record(run_dir)
    steps_logged = len(train_rows(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
    return {"status": rec.get("status"), "message": rec.get("message"), "steps_logged": steps_logged,
            "checkpoint_step": checkpoint_step(run_dir),
            "files": sorted(p.name for p in run_dir.iterdir())}  # fmt: skip


def relaunch(run_dir: Path, reference: Path, *extra: str) -> dict:
    """The same command again: does it end as the uninterrupted run did?"""
    r = cli(run_dir, *extra)
    rec = record(run_dir)
    same = [{k: row[k] for k in ("step", "loss", "scale")} for row in train_rows(run_dir)] == \
           [{k: row[k] for k in ("step", "loss", "scale")} for row in train_rows(reference)]  # fmt: skip
    said = [line for line in r.stdout.splitlines() if line.startswith("mpt-run: resuming")]
    return {"exit_code": r.returncode, "status": rec.get("status"), "resumed_from_step": rec.get("resumed_from_step"),
            "log_equals_uninterrupted_run": same, "said": said}  # fmt: skip


def interrupted(tmp: Path, reference: Path, sig: signal.Signals) -> dict:
    run_dir = tmp / sig.name.lower()
    proc = subprocess.Popen(command(run_dir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(proc, run_dir, 12)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=600)
    return {
        "exit_code": proc.returncode,
        "after": state(run_dir),
        "stderr_tail": err.strip().splitlines()[-3:],
        "relaunch": relaunch(run_dir, reference),
    }


def second_launch(tmp: Path) -> dict:
    run_dir = tmp / "twice"
    # 400 steps: on a fast CPU the 40 of the others end before a second process has imported torch,
    # and the second launch would find a finished run instead of a running one.
    first = subprocess.Popen(
        command(run_dir, "schedule.steps=400"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_steps(first, run_dir, 3)
    files_before = sorted(p.name for p in run_dir.iterdir())
    hydra_files = {p.name: p.stat().st_mtime_ns for p in (run_dir / ".hydra").iterdir()}
    second = cli(run_dir, "schedule.steps=400")  # the same command
    hydra_untouched = hydra_files == {p.name: p.stat().st_mtime_ns for p in (run_dir / ".hydra").iterdir()}
    out, err = first.communicate(timeout=600)
    cli_log_lines = (run_dir / "cli.log").read_text().splitlines()
    return {"second_exit_code": second.returncode, "second_said": second.stderr.strip().splitlines(),
            "first_exit_code": first.returncode, "first_status": record(run_dir).get("status"), "first_pid": first.pid,
            "files_while_both_ran": files_before, "hydra_files_untouched_by_the_second": hydra_untouched,
            "first_steps_logged": len(train_rows(run_dir)),
            "cli_log_lines_from_the_second": sum("already running" in line for line in cli_log_lines)}  # fmt: skip


def full_disk(tmp: Path) -> dict:
    mount = tmp / "small_disk"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        return {"tried": False, "why": "mount -t tmpfs was refused here"}
    try:
        run_dir = mount / "run"
        r = cli(run_dir)
        after = state(run_dir)
        with open(mount / "filler", "wb", buffering=0) as f:  # the disk 100% full, then the same command again
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        again = cli(run_dir)
        onto_a_full_disk = {
            "exit_code": again.returncode,
            "stderr": again.stderr.strip().splitlines()[-3:],
            "traceback": "Traceback" in again.stderr,
            "after": state(run_dir),
        }
        return {"tried": True, "disk": "tmpfs of 20 MiB", "exit_code": r.returncode, "after": after,
                "temporaries_left": [f for f in after["files"] if f.endswith(".tmp")],
                "relaunch_onto_a_full_disk": onto_a_full_disk}  # fmt: skip
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def nan_loss(tmp: Path) -> dict:
    run_dir = tmp / "nan"
    r = cli(run_dir, "optim.lr=1e12", "scale=none")
    rec = record(run_dir)
    return {
        "exit_code": r.returncode,
        "after": state(run_dir),
        "diverged_at_step": rec.get("diverged_at_step"),
        "last_finite_train_loss": rec.get("last_finite_train_loss"),
    }


def out_of_memory(tmp: Path) -> dict:
    run_dir = tmp / "oom"
    r = cli(run_dir, "schedule.image_size=16384", "schedule.batch_size=8", "data.train_samples=8", "data.val_samples=8")
    return {"exit_code": r.returncode, "after": state(run_dir)}


def corrupt_image(tmp: Path) -> dict:
    from PIL import Image

    root = tmp / "images"
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 40), (i * 40, 80, 120)).save(root / split / c / f"{i}.jpg")
    bad = root / "train" / "dog" / "2.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    run_dir = tmp / "corrupt_image"
    r = cli(
        run_dir,
        "data=imagefolder",
        f"data.root={root}",
        "data.num_workers=1",
        "schedule.batch_size=4",
        "schedule.steps=8",
    )
    return {"exit_code": r.returncode, "corrupted": str(bad), "after": state(run_dir)}


def corrupt_checkpoint(tmp: Path, reference: Path) -> dict:
    run_dir = tmp / "corrupt_checkpoint"
    proc = subprocess.Popen(command(run_dir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_steps(proc, run_dir, 12)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    path = run_dir / "checkpoint.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut in half, as a disk error or a careless copy would
    r = cli(run_dir)
    return {"exit_code": r.returncode, "after": state(run_dir), "stderr_tail": r.stderr.strip().splitlines()[-1:],
            "relaunch_with_resume_false": relaunch(run_dir, reference, "resume=false")}  # fmt: skip


def across_a_commit(tmp: Path, reference: Path) -> dict:
    """Preempted by this checkout, relaunched from a clone one commit ahead with an uncommitted edit."""
    run_dir, ahead = tmp / "across_a_commit", tmp / "ahead"
    subprocess.run(["git", "clone", "--quiet", "--local", str(ROOT), str(ahead)], check=True)
    git = ["git", "-C", str(ahead), "-c", "user.name=drill", "-c", "user.email=drill@localhost"]
    subprocess.run([*git, "commit", "--quiet", "--allow-empty", "-m", "one commit ahead"], check=True)
    with open(ahead / "mpt" / "__init__.py", "a") as f:
        f.write("# an uncommitted edit\n")
    proc = subprocess.Popen(command(run_dir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(proc, run_dir, 12)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=600)
    after = state(run_dir)
    r = subprocess.run([sys.executable, "-m", "mpt.runner.cli", *RUN, f"hydra.run.dir={run_dir}"], cwd=ahead,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ahead)})  # fmt: skip
    rec = record(run_dir)
    same = [row["loss"] for row in train_rows(run_dir)] == [row["loss"] for row in train_rows(reference)]
    segments = [
        (s["from_step"], s["to_step"], s["git"]["commit"][:12], s["git"]["dirty"]) for s in rec.get("segments") or []
    ]
    return {"preempted": after, "relaunch_exit_code": r.returncode, "status": rec.get("status"),
            "log_equals_uninterrupted_run": same,
            "warning": [line for line in r.stdout.splitlines() if "warning" in line],
            "segments": segments}  # fmt: skip


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def planted_checkpoint(tmp: Path) -> dict:
    """A checkpoint.pt whose unpickling would run a shell command, left in a run folder."""
    import torch

    run_dir, marker = tmp / "planted", tmp / "planted_command_ran"
    run_dir.mkdir()
    torch.save(
        {"config": {}, "step": 1, "engines": {}, "rng": {}, "data": {}, "payload": _RunsCode(marker)},
        run_dir / "checkpoint.pt",
    )
    r = cli(run_dir)
    return {
        "exit_code": r.returncode,
        "stderr_tail": r.stderr.strip().splitlines()[-1:],
        "command_ran": marker.exists(),
        "after": state(run_dir),
    }


def static_scale_never_fits(tmp: Path) -> dict:
    out = {}
    for name, extra in [("every step skipped", []), ("10 in a row", ["scale.max_consecutive_skips=10"])]:
        run_dir = tmp / f"static_{len(out)}"
        r = cli(run_dir, "precision=mixed", "scale=static", "scale.value=1e9", *extra)
        rec = record(run_dir)
        summary = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("loss scale:")]
        out[name] = {"overrides": ["precision=mixed", "scale=static", "scale.value=1e9", *extra],
                     "exit_code": r.returncode, "status": rec.get("status"), "message": rec.get("message"),
                     "diverged_at_step": rec.get("diverged_at_step"), "loss_scale": rec.get("loss_scale"),
                     "summary": summary}  # fmt: skip
    return out


def longer_schedule(tmp: Path, reference: Path) -> dict:
    """A finished 40-step run relaunched with schedule.steps=60, beside an uninterrupted 60-step run;
    then with another learning rate."""
    run_dir, whole = tmp / "longer", tmp / "whole60"
    shutil.copytree(reference, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    r = cli(run_dir, "schedule.steps=60")
    cli(whole, "schedule.steps=60")
    rec = record(run_dir)
    same = [(row["step"], row["loss"]) for row in train_rows(run_dir)] == [
        (row["step"], row["loss"]) for row in train_rows(whole)
    ]
    other = cli(run_dir, "schedule.steps=60", "optim.lr=0.05")
    said = [line for line in r.stdout.splitlines() if line.startswith("mpt-run: resuming")]
    segments = [(s["from_step"], s["to_step"], s["total_steps"]) for s in rec.get("segments") or []]
    another_lr = {
        "exit_code": other.returncode,
        "said": [line for line in other.stdout.splitlines() if "aside" in line],
        "after": state(run_dir),
    }
    return {"exit_code": r.returncode, "status": rec.get("status"), "steps": rec.get("steps"), "said": said,
            "segments": segments, "log_equals_uninterrupted_60_step_run": same, "another_lr": another_lr}  # fmt: skip


def ctrl_c_twice(tmp: Path) -> dict:
    run_dir = tmp / "sigint_twice"
    proc = subprocess.Popen(command(run_dir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_steps(proc, run_dir, 12)
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    first = [proc.stderr.readline()]  # the first one noted (two pending SIGINTs would merge into one)
    while "SIGINT received" not in first[-1] and first[-1]:
        first.append(proc.stderr.readline())
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=600)
    err = "".join(first) + rest
    return {
        "exit_code": proc.returncode,
        "after": state(run_dir),
        "stderr_tail": err.strip().splitlines()[-2:],
        "traceback": "Traceback" in err,
    }


def dead_run(tmp: Path) -> dict:
    """What the report makes of a run killed with SIGKILL (its record says `running`)."""
    from mpt.report.records import load_runs

    dead = tmp / "dead"
    proc = subprocess.Popen(command(dead), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_steps(proc, dead, 12)
    live_view = [(r["status"], r.get("message")) for r in load_runs([dead]).to_dict("records")]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rows = load_runs([dead]).to_dict("records")
    return {"record_status": record(dead).get("status"), "report_while_alive": live_view,
            "report_after_sigkill": [(r["status"], r.get("message")) for r in rows],
            "checkpoint_step": checkpoint_step(dead), "record_steps": record(dead).get("steps")}  # fmt: skip


def bad_voc_box(tmp: Path) -> dict:
    """The shared raccoon sample with one box moved past its image's right edge."""
    import re

    root = tmp / "raccoon"
    shutil.copytree(ROOT.parent / "shared" / "data" / "raccoon", root)
    xml = root / "annotations" / "raccoon-17.xml"
    text = xml.read_text()
    width = int(re.search(r"<width>(\d+)</width>", text).group(1))
    xml.write_text(re.sub(r"<xmax>\d+</xmax>", f"<xmax>{width + 38}</xmax>", text, count=1))
    voc = ["model=ssd", "data=voc", f"data.root={root}", "data.train_sets=[train_labels.csv]",
           "data.val_sets=[test_labels.csv]", "data.class_names=[raccoon]", "data.num_workers=0", "schedule=smoke",
           "schedule.steps=1", "schedule.batch_size=2", "device=cpu"]  # fmt: skip
    out = {}
    for name, extra in [("refused", []), ("clipped", ["data.clip_boxes=true"])]:
        run_dir = tmp / f"voc_{name}"
        r = subprocess.run(
            [sys.executable, "-m", "mpt.runner.cli", *voc, *extra, f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        rec = record(run_dir)
        data = rec.get("data") or {}
        out[name] = {"exit_code": r.returncode, "status": rec.get("status"), "message": rec.get("message"),
                     "clipped_boxes": data.get("clipped_boxes"),
                     "dropped_boxes": data.get("dropped_boxes")}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        reference = tmp / "reference"
        r = cli(reference)
        assert r.returncode == 0, r.stderr[-2000:]
        faults = {
            "SIGKILL": interrupted(tmp, reference, signal.SIGKILL),
            "SIGTERM": interrupted(tmp, reference, signal.SIGTERM),
            "second launch": second_launch(tmp),
            "full disk": full_disk(tmp),
            "NaN loss": nan_loss(tmp),
            "out of memory": out_of_memory(tmp),
            "corrupt image": corrupt_image(tmp),
            "corrupt checkpoint": corrupt_checkpoint(tmp, reference),
            "SIGINT": interrupted(tmp, reference, signal.SIGINT),
            "SIGINT twice": ctrl_c_twice(tmp),
            "resume across a commit": across_a_commit(tmp, reference),
            "planted checkpoint": planted_checkpoint(tmp),
            "static scale that never fits": static_scale_never_fits(tmp),
            "longer schedule": longer_schedule(tmp, reference),
            "dead run": dead_run(tmp),
            "bad VOC box": bad_voc_box(tmp),
        }
        shutil.rmtree(tmp / "images", ignore_errors=True)
    import torch

    rec = {"kind": "faults", "command": " ".join(["mpt-run", *RUN]), "faults": faults,
           "environment": environment(torch.device("cpu")), "git": git_commit(ROOT),
           "created_at": now_iso()}  # fmt: skip
    write_json_atomic(args.out / "faults.json", rec)
    print(json.dumps(faults, indent=2))


if __name__ == "__main__":
    main()
