"""The result record: atomic, always valid JSON, and `diverged` instead of a crash."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from mpt.config import as_plain
from mpt.files import write_json_atomic
from mpt.runner import outcomes, upgrade
from mpt.runner.identity import same_computation
from mpt.runner.record import SCHEMA_VERSION, RecordError, RunRecord
from mpt.runner.train import Run
from mpt.runner.validation import validate

from .conftest import ROOT, TINY, build_run, compose_cfg


def test_atomic_write_replaces_whole_and_leaves_no_temporaries(tmp_path):
    path = tmp_path / "result.json"
    write_json_atomic(path, {"status": "running", "loss": float("nan"), "scale": float("inf")})
    assert json.loads(path.read_text()) == {"status": "running", "loss": "nan", "scale": "inf"}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"status": "ok", "bad": object()})  # fails mid-write
    assert json.loads(path.read_text())["status"] == "running"  # the previous record is intact
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_non_finite_loss_without_scaling_is_recorded_as_diverged(tmp_path):
    cfg = compose_cfg(
        TINY,
        "precision=fp32",
        "scale=none",
        "schedule=smoke",
        "schedule.steps=6",
        "schedule.log_every=1",
        "optim.lr=1e12",
    )
    validate(cfg)
    rec = Run(cfg, tmp_path).train()
    assert rec.status == "diverged"
    assert "non-finite loss" in rec.message
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk["status"] == "diverged" and on_disk["diverged_at_step"] == rec.diverged_at_step < 6
    assert on_disk["final_train_loss"] in ("nan", "inf", "-inf")
    assert isinstance(on_disk["last_finite_train_loss"], float)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == rec.diverged_at_step and rows[-1]["loss"] in ("nan", "inf", "-inf")


def test_record_says_running_until_the_run_ends(tmp_path):
    cfg = compose_cfg(TINY, "schedule=smoke")
    validate(cfg)
    run = Run(cfg, tmp_path)
    run.save_record()
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "running"
    assert run.train().status == "ok"
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_one_is_one_line(tmp_path, in_process):
    """A ConfigError while the run is built: mpt-run prints it after 'mpt-run: error: ' and exits 2 (test_config)."""
    from mpt.config import ConfigError

    with pytest.raises(ConfigError) as e:
        build_run(tmp_path, TINY, "device=cuda")
    assert (
        str(e.value)
        == "device=cuda: no CUDA device is available here (torch.cuda.is_available() is False); use device=cpu or auto"
    )
    assert not (tmp_path / "result.json").exists()


def test_cpu_peak_memory_is_per_run_not_per_process():
    from mpt.runner.instruments.memory import peak_memory, reset_peak_memory

    cpu = torch.device("cpu")
    big = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB resident
    before = peak_memory(cpu)["peak_bytes"]
    del big
    reset_peak_memory(cpu)
    after = peak_memory(cpu)
    assert after["kind"] == "cpu_peak_rss"
    assert after["peak_bytes"] < before - 200 * 2**20  # the earlier run's peak does not carry over


@pytest.mark.parametrize("precision", ["fp32", "mixed", "fp16"])
def test_non_finite_weights_diverge_naming_the_tensor(tmp_path, precision):
    from mpt.precision.scaler import Diverged

    run = build_run(tmp_path, TINY, f"precision={precision}", "schedule=smoke", "device=cpu")
    model = run.engines["model"].model
    bn = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d))
    model.get_submodule(bn).running_var[0] = math.inf  # an FP16 statistic past 65504
    with pytest.raises(Diverged, match=rf"in model by step 7 \({bn}.running_var \(buffer\)\)$"):
        outcomes.check_weights(run.engines, run.dist, 7)
    next(model.parameters()).data[0] = math.nan
    with pytest.raises(Diverged, match=r"\(features\.0\.0\.weight \(weight\) and 1 more\)$"):
        outcomes.check_weights(run.engines, run.dist, 7)


def test_the_steady_peak_leaves_out_what_only_the_warm_up_allocated(monkeypatch):
    """A fake device whose counter behaves as CUDA's: the warm-up's spike stays in the run's peak only."""
    from mpt.runner.instruments import memory

    counter = {"peak": 0, "now": 0}

    def use(nbytes):
        counter["now"] = nbytes
        counter["peak"] = max(counter["peak"], nbytes)

    monkeypatch.setattr(
        memory, "peak_memory", lambda device: {"peak_bytes": counter["peak"], "kind": "cuda_max_memory_allocated"}
    )
    monkeypatch.setattr(memory, "reset_peak_memory", lambda device: counter.update(peak=counter["now"]))
    peaks = memory.MemoryPeaks(torch.device("cpu"))
    peaks.start()
    use(900)  # the warm-up: a benchmark's workspace
    use(300)
    assert "steady_peak_bytes" not in peaks.summary()  # no steady state yet
    peaks.steady_from_now()
    use(400)
    use(350)
    peaks.steady_from_now()  # later calls change nothing
    assert peaks.summary() == {"peak_bytes": 900, "steady_peak_bytes": 400, "kind": "cuda_max_memory_allocated"}
    resumed = memory.MemoryPeaks(torch.device("cpu"))  # a new process, from the checkpoint's state
    resumed.load_state_dict(peaks.state_dict())
    counter.update(peak=0, now=0)
    resumed.start()
    use(500)
    assert resumed.summary() == {
        "peak_bytes": 900,
        "steady_peak_bytes": 400,
        "kind": "cuda_max_memory_allocated",
    }  # still warming up
    resumed.steady_from_now()
    use(450)
    assert resumed.summary()["steady_peak_bytes"] == 500  # a reset leaves the counter at what is in use, as CUDA's does


@pytest.mark.parametrize(
    "exc,status,text",
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "oom",
            "out of memory at schedule.batch_size=4; try a smaller batch",
        ),
        (RuntimeError("something broke\nsecond line"), "error", "RuntimeError: something broke"),
        (
            None,
            "oom",
            "out of memory at schedule.batch_size=4; try a smaller batch (RuntimeError: [enforce fail at alloc_cpu.cpp",
        ),
    ],
    ids=["cuda-oom", "error", "cpu-oom"],
)
def test_a_failure_is_recorded_not_raised(tmp_path, exc, status, text):
    cfg = compose_cfg(TINY, "schedule=smoke", "checkpoint=false")
    validate(cfg)
    run = Run(cfg, tmp_path)

    def fails(batch):
        if exc is None:
            torch.empty(2**48, dtype=torch.uint8)  # a real allocation failure: 256 TiB is beyond any address space
        raise exc
        yield

    run.task.train_losses = fails
    rec = run.execute()
    assert rec.status == status and rec.message.startswith(text) and "\n" not in rec.message
    assert json.loads((tmp_path / "result.json").read_text())["status"] == status


def test_a_mode_the_device_cannot_run_is_one_clear_error(monkeypatch):
    from mpt.config import ConfigError
    from mpt.precision.engine import check_device_support

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    with pytest.raises(
        ConfigError, match=r"^precision=bf16: Tesla V100-SXM2-16GB has no bfloat16 support; use fp16, mixed or amp$"
    ):
        check_device_support(compose_cfg("precision=bf16").precision, torch.device("cuda"))
    check_device_support(compose_cfg("precision=mixed").precision, torch.device("cuda"))  # FP16 modes are fine there


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("resnet50_fp32_none", ["precision=fp32", "scale=none"]),
        ("resnet50_mixed_dynamic", ["precision=mixed", "scale=dynamic"]),
    ],
)
def test_records_of_an_older_version_match_the_config_that_computes_the_same(name, overrides):
    # Real records of the main job made by an older version, before keys added since (data.class_names,
    # emulate_tensor_cores, model.short, ...), when schedule=short was 24 steps of batch 8 for every
    # model. A key they lack takes the value that reproduces how they ran: for FP16 products on a CPU,
    # torch's native kernels, so today's default (emulated) is a different computation for mixed only.
    saved = json.loads((Path(__file__).parent / "data" / "older_records" / f"{name}.json").read_text())["config"]
    assert (
        "emulate_tensor_cores" not in saved and "emulate_cpu_fp16_conv" not in saved and "short" not in saved["model"]
    )
    saved = upgrade.config(saved)  # as a record or checkpoint is read
    then = [
        *overrides,
        "schedule.batch_size=8",
        "schedule.steps=24",
        "schedule.lr_milestones=[]",
        "schedule.eval_every=12",
    ]
    assert same_computation(saved, as_plain(compose_cfg(*then, "emulate_tensor_cores=false")))
    assert same_computation(saved, as_plain(compose_cfg(*then))) == (name == "resnet50_fp32_none")
    assert not same_computation(saved, as_plain(compose_cfg(*then, "emulate_tensor_cores=false", "optim.lr=0.2")))
    assert not same_computation(
        saved, as_plain(compose_cfg(*overrides, "emulate_tensor_cores=false"))
    )  # today's short run is longer


@pytest.mark.parametrize("old,same_as_false", [(False, True), (True, False)])
def test_a_config_from_before_the_tensor_core_arithmetic_is_judged_by_what_it_ran(old, same_as_false):
    """emulate_cpu_fp16_conv=false was torch's own kernels (emulate_tensor_cores=false today); true
    emulated convolutions only, which no current setting reproduces."""
    current = as_plain(compose_cfg("precision=mixed", "emulate_tensor_cores=false"))
    saved = {k: v for k, v in current.items() if k != "emulate_tensor_cores"} | {"emulate_cpu_fp16_conv": old}
    saved = upgrade.config(saved)  # as a record or checkpoint is read
    assert same_computation(saved, current) == same_as_false
    assert not same_computation(saved, as_plain(compose_cfg("precision=mixed")))
    fp32 = as_plain(compose_cfg("precision=fp32"))  # a mode without FP16 products: the flag never mattered
    assert same_computation(
        upgrade.config({k: v for k, v in fp32.items() if k != "emulate_tensor_cores"} | {"emulate_cpu_fp16_conv": old}),
        fp32,
    )


def test_an_lstm_models_config_from_before_the_gate_rounding_is_judged_by_what_it_ran():
    """Configs saved before emulate_lstm_gate_rounding summed the emulated LSTM's gate products
    unrounded: the same computation as false today, for GNMT and bigLSTM in FP16 or BF16 with the
    emulation on; where no emulated LSTM runs, the flag changes nothing."""
    for model in ("gnmt", "biglstm_tiny"):
        for precision, matters in (("mixed", True), ("bf16", True), ("fp32", False)):
            current = as_plain(compose_cfg(f"model={model}", f"precision={precision}"))
            saved = upgrade.config({k: v for k, v in current.items() if k != "emulate_lstm_gate_rounding"})
            assert same_computation(saved, current) == (not matters), (model, precision)
            assert same_computation(
                saved,
                as_plain(compose_cfg(f"model={model}", f"precision={precision}", "emulate_lstm_gate_rounding=false")),
            )
        native = as_plain(compose_cfg(f"model={model}", "precision=mixed", "emulate_tensor_cores=false"))
        assert same_computation(
            upgrade.config({k: v for k, v in native.items() if k != "emulate_lstm_gate_rounding"}), native
        )
    resnet = as_plain(compose_cfg("model=resnet50", "precision=mixed"))
    assert same_computation(
        upgrade.config({k: v for k, v in resnet.items() if k != "emulate_lstm_gate_rounding"}), resnet
    )


def test_a_tree_copied_without_git_names_the_commit_it_was_packed_from(tmp_path, monkeypatch):
    from mpt.provenance import git_commit as cached

    git_commit = cached.__wrapped__  # the function itself, not the per-process cache

    monkeypatch.delenv("MPT_GIT_COMMIT", raising=False)
    assert git_commit(tmp_path) == {"commit": None, "dirty": None}
    monkeypatch.setenv("MPT_GIT_COMMIT", "abc123")
    monkeypatch.setenv("MPT_GIT_DIRTY", "0")
    assert git_commit(tmp_path) == {"commit": "abc123", "dirty": False, "source": "MPT_GIT_COMMIT"}
    assert git_commit(ROOT)["commit"] != "abc123"  # a real checkout answers for itself


def test_configs_from_another_checkout_are_named_and_make_the_record_dirty(tmp_path, monkeypatch):
    import subprocess

    from mpt.provenance import code_identity, git_commit

    monkeypatch.delenv("MPT_GIT_COMMIT", raising=False)

    def checkout(name: str, text: str) -> Path:
        repo = tmp_path / name
        (repo / "configs").mkdir(parents=True)
        (repo / "configs" / "config.yaml").write_text(text)
        for args in (
            ["init", "-q"],
            ["add", "."],
            ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", name],
        ):
            subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
        return repo

    here, there = checkout("here", "seed: 0\n"), checkout("there", "seed: 1\n")
    git_commit.cache_clear()
    same = code_identity(here, here / "configs")
    assert same == {"commit": git_commit(here)["commit"], "dirty": False}
    mixed = code_identity(here, there / "configs")
    assert mixed["commit"] == same["commit"] and mixed["dirty"] is True
    assert mixed["configs"] == {"path": str(there / "configs"), "commit": git_commit(there)["commit"], "dirty": False}
    assert mixed["configs"]["commit"] != mixed["commit"]


def test_a_checkout_run_with_python_m_composes_from_its_own_configs(tmp_path):
    """A second checkout of the code, run from its root with `python -m` while the editable install
    points at this one, reads the configs beside its own `mpt/`: here one whose smoke schedule has 7
    steps where this checkout's has 3."""
    import os
    import shutil
    import subprocess
    import sys

    other = tmp_path / "other"
    shutil.copytree(ROOT / "mpt", other / "mpt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", other / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    smoke = other / "configs" / "schedule" / "smoke.yaml"
    assert "\nsteps: 3\n" in smoke.read_text()
    smoke.write_text(smoke.read_text().replace("\nsteps: 3\n", "\nsteps: 7\n"))
    probe = (
        "from importlib import resources\n"
        "from hydra import compose, initialize_config_module\n"
        "from mpt.config import register_configs\n"
        "register_configs()\n"
        "with initialize_config_module(config_module='mpt.configs', version_base='1.3'):\n"
        "    cfg = compose(config_name='config', overrides=['schedule=smoke'])\n"
        "print(resources.files('mpt.configs'), cfg.schedule.steps)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=other, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(other / "configs"), "7"]


COMMITTED = sorted((ROOT / "results").rglob("result.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.parent.relative_to(ROOT / "results")) for p in COMMITTED])
def test_every_committed_record_reads_as_a_run_record_and_writes_back_the_same(path, tmp_path):
    original = upgrade.record(json.loads(path.read_text()), path.parent.name)  # as today's schema reads it
    rec = RunRecord.load(path)
    # A run stopped for a time budget (a GPU call's limit, a CPU session's end) can be kept as far as
    # it went, saying where it stopped; never one that says it is still running.
    cut_off = rec.status == "preempted" and rec.preempted_at_step is not None
    assert rec.schema == SCHEMA_VERSION and (rec.status in ("ok", "diverged") or cut_off) and rec.choices["model"]
    rec.write(tmp_path / "result.json")
    assert json.loads((tmp_path / "result.json").read_text()) == original


def test_a_new_run_writes_every_field_of_the_schema_and_its_version(tmp_path):
    cfg = compose_cfg(TINY, "schedule=smoke", "schedule.steps=2", "checkpoint=true")  # checkpoint_step too
    validate(cfg)
    Run(cfg, tmp_path).train()
    written = json.loads((tmp_path / "result.json").read_text())
    optional = {
        "sample_grids",
        "diverged_at_step",
        "preempted_at_step",
        "resumed_from_step",
        "resumed_at",
    }  # a classifier that ran through
    assert set(written) == {f.name for f in fields(RunRecord)} - {"extra", "absent"} - optional
    assert written["schema"] == SCHEMA_VERSION and written["status"] == "ok" and written["epochs"] > 0


def test_keys_this_version_does_not_know_are_kept_and_a_newer_schema_is_refused(tmp_path, capsys):
    rec = RunRecord.from_dict({"status": "ok", "choices": {"model": "m"}, "added_later": {"x": 1}})
    assert rec.extra == {"added_later": {"x": 1}} and rec.to_dict() == {
        "status": "ok",
        "choices": {"model": "m"},
        "added_later": {"x": 1},
    }
    path = tmp_path / "run" / "result.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"schema": SCHEMA_VERSION + 1, "status": "ok", "choices": {"model": "m"}}))
    with pytest.raises(
        RecordError,
        match=rf"{path}: record schema {SCHEMA_VERSION + 1}; this mpt reads schema {SCHEMA_VERSION} and older",
    ):
        RunRecord.load(path)
    # mpt-report names the file in one line and writes nothing.
    from mpt.report.cli import main

    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), "--out", str(tmp_path / "report")])
    assert stop.value.code == 2 and not (tmp_path / "report").exists()
    assert capsys.readouterr().err.strip() == (
        f"mpt-report: error: {path}: record schema {SCHEMA_VERSION + 1};"
        f" this mpt reads schema {SCHEMA_VERSION} and older (update mpt to read it)"
    )


def test_a_deterministic_run_names_the_ops_torch_ran_without_a_deterministic_kernel(tmp_path, in_process):
    job = build_run(tmp_path / "det", TINY, "schedule=smoke", "checkpoint=false", "deterministic=true")
    losses = job.task.train_losses

    def with_put(batch):
        torch.zeros(4).put_(torch.tensor([1]), torch.ones(1))  # no deterministic kernel: torch warns under warn_only
        return losses(batch)

    job.task.train_losses = with_put
    with pytest.warns(UserWarning, match="put_ does not have a deterministic implementation"):
        assert job.execute().status == "ok"
    assert json.loads((tmp_path / "det" / "result.json").read_text())["nondeterministic_ops"] == [
        "put_"
    ]  # once, for 3 steps
    assert build_run(tmp_path / "free", TINY, "schedule=smoke", "checkpoint=false").execute().status == "ok"
    assert json.loads((tmp_path / "free" / "result.json").read_text())["nondeterministic_ops"] is None


def test_a_changed_record_or_sweep_file_under_results_leaves_the_tree_clean_and_code_does_not(tmp_path, monkeypatch):
    import subprocess

    from mpt.provenance import git_commit as cached

    git_commit = cached.__wrapped__
    monkeypatch.delenv("MPT_GIT_COMMIT", raising=False)
    repo = tmp_path / "repo"
    (repo / "results" / "sweep").mkdir(parents=True)
    (repo / "mpt").mkdir()
    (repo / "results" / "sweep" / "multirun.yaml").write_text("a: 1\n")
    (repo / "mpt" / "code.py").write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    (repo / "results" / "sweep" / "multirun.yaml").write_text("a: 2\n")  # a sweep rewrote it
    assert git_commit(repo / "mpt")["dirty"] is False  # asked from below the top, as the runner asks
    (repo / "mpt" / "code.py").write_text("x = 2\n")
    assert git_commit(repo / "mpt")["dirty"] is True


def test_every_pointer_a_record_carries_names_a_section_of_docs_record_md():
    import re

    source = "\n".join(p.read_text() for p in (ROOT / "mpt").rglob("*.py"))
    pointers = set(re.findall(r"docs/record\.md#([a-z0-9-]+)", source))
    headings = re.findall(r"^#+ (.+)$", (ROOT / "docs" / "record.md").read_text(), flags=re.M)
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}  # GitHub's slugs
    assert len(pointers) >= 4 and pointers <= anchors, sorted(pointers - anchors)
