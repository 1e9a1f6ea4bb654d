"""`mpt-run -m ... --dry-run`: the runs a sweep would make, in its order, each marked done or to run,
against the folders a real sweep made; nothing runs and nothing is written."""

from __future__ import annotations

from .conftest import TINY, mpt_run

SWEEP = [TINY, "data=synthetic", "schedule=smoke", "checkpoint=false", "device=cpu"]


def test_a_dry_run_lists_the_folders_the_sweep_makes_and_which_are_done(tmp_path):
    made = mpt_run("-m", *SWEEP, "precision=fp32,mixed", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-2000:]
    folders = sorted(p.name for p in (tmp_path / "sweep").iterdir() if (p / "result.json").exists())
    assert len(folders) == 2
    before = sorted(p.name for p in (tmp_path / "sweep").iterdir())

    listed = mpt_run("-m", *SWEEP, "precision=fp32,mixed,bf16", "hydra.sweep.dir=sweep", "--dry-run", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    lines = listed.stdout.strip().splitlines()
    assert lines[0] == "mpt-run: dry run: 3 run(s), 2 done"
    rows = [line.split() for line in lines[1:]]
    assert [r[-1].split("/")[-1] for r in rows[:2]] == [f for f in folders if "fp32" in f] + [
        f for f in folders if "mixed" in f
    ]  # the sweep's own order: precision as given
    assert [r[:2] for r in rows] == [["done", "(ok)"], ["done", "(ok)"], ["to", "run"]]
    assert rows[2][-1].endswith("mobilenet_v3_small_bf16_none_synthetic_smoke_cpu_seed0")
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == before  # nothing was made

    forced = mpt_run("-m", *SWEEP, "precision=fp32", "force=true", "hydra.sweep.dir=sweep", "--dry-run", cwd=tmp_path)
    assert forced.stdout.strip().splitlines()[1].split()[:3] == ["to", "run", "(force=true)"]
    single = mpt_run(*SWEEP, "--dry-run", cwd=tmp_path)
    assert single.returncode == 2 and "--dry-run lists a sweep's runs: use it with -m" in single.stderr
