"""`mpt-run`: compose the config with Hydra, validate it, train, leave one record, print a summary."""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from importlib import resources
from pathlib import Path
from typing import cast

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .. import preemption
from ..config import GROUPS, ConfigError, as_plain, register_configs
from ..distributed import LaunchError, from_env, leave, teardown
from ..files import remove_stale_temporaries, write_text_atomic
from . import identity
from .checkpoint import FILENAME as CHECKPOINT
from .checkpoint import CorruptCheckpoint
from .record import RecordError, RunRecord
from .run_lock import AlreadyRunning, RunLock

log = logging.getLogger("mpt")


OPEN = ("model.kwargs.", "model.hf_config.")  # keys under these take new names (+model.kwargs.width=64)


def overrides() -> list[tuple[str, str | None]]:
    """The command line's overrides beyond the group choices and the seed, as (key, value) with
    values as Hydra parses them; a deletion's value is None."""
    parsed = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    out = []
    for o in parsed:
        if o.key_or_group in GROUPS or o.key_or_group == "seed":
            continue
        prefix = "~" if o.is_delete() else "+" if o.is_add() else ""
        out.append((prefix + o.key_or_group, None if o.is_delete() else str(o.value())))
    return out


def device_type(name: str) -> str:
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name.split(":")[0]


def run_name(seed: int, device: str, model: str | None = None) -> str:
    """The run folder's name (identity.folder_name), from Hydra's view of the command line. `model`:
    the model's name where it is not its option's (model=torchvision's architecture, model=custom's
    builder, model=timm's name)."""
    choices = {**HydraConfig.get().runtime.choices}
    if model is not None:
        choices["model"] = model
    world = from_env().world_size  # torchrun's or a SLURM step's: every rank names the same folder
    return identity.folder_name(
        (choices[g] for g in GROUPS), device_type(device), world, seed, identity.variant(overrides())
    )


def group_options(group: str) -> str:
    """A config group's options as installed, for `--help`."""
    return ", ".join(
        sorted(
            p.name.removesuffix(".yaml")
            for p in resources.files("mpt.configs").joinpath(group).iterdir()
            if p.name.endswith(".yaml")
        )
    )


OmegaConf.register_new_resolver("mpt_run_name", run_name, use_cache=False)
OmegaConf.register_new_resolver("mpt_options", group_options)
register_configs()


def previous_record(run_dir: Path) -> RunRecord | None:
    """The folder's record, or None: no record, or one this version cannot read (the run is redone)."""
    path = run_dir / "result.json"
    if not path.exists():
        return None
    try:
        return RunRecord.load(path)
    except RecordError as e:
        print(f"mpt-run: warning: {e}; running again", file=sys.stderr, flush=True)
        return None


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def explain_skips(s: dict) -> str:
    initial = s.get("initial_skips")  # absent from records made before it was counted, as is "initial"
    if not s["skipped_steps"] or initial is None:
        return ""
    if initial == s["steps"]:  # no step fitted: nothing was found, whatever the scale did
        if s["min"] < s["initial"]:  # min counts the scale the next step would use: the scale fell to it
            return f": every one; the gradients never fit FP16, the scale falling from {s['initial']:g} to {s['min']:g}"
        return f": every one; the gradients never fit FP16 at {s['initial']:g}"
    later = s["skipped_steps"] - initial
    falls = s["min"] < s["initial"]
    how = (
        f"the scale falling from {s['initial']:g} until the gradients fit FP16"
        if falls
        else "until the gradients fit FP16 at this scale"
    )
    parts = [f"the first {initial}, {how}"] if initial else []
    parts += [f"{later} later, each an overflow at the scale of its step"] if later else []
    return ": " + "; ".join(parts)


def summary_lines(rec: RunRecord) -> list[str]:
    assert rec.environment is not None and rec.run_dir is not None  # a record this process's run made
    c = rec.choices
    lines = [
        f"mpt-run {c['model']} precision={c['precision']} scale={c['scale']} data={c['data']} "
        f"schedule={c['schedule']}: {rec.status}"
    ]
    if rec.message:
        lines.append(f"  message:    {rec.message}")
    # Per-class APs stay in the record; the summary keeps to the means.
    metrics = {k: v for k, v in rec.metrics.items() if k != "step" and not k.startswith("ap_")}
    if metrics:
        lines.append(
            "  metrics:    " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()) + f" (step {rec.metrics['step']})"
        )
    if rec.final_train_loss is not None:
        what = f" ({rec.train_loss_definition})" if rec.train_loss_definition else ""
        lines.append(f"  train loss: {rec.final_train_loss:.4g} after {rec.steps} steps{what}")
    tp = rec.throughput or {}  # none for a run that failed before measuring
    if tp.get("pipeline") is not None:
        emulated = ""
        if rec.environment.get("device_type") == "cpu":  # fp32 and tf32 (FP32 on a CPU) emulate nothing
            fp32 = (rec.precision or {}).get("name") in ("fp32", "tf32")
            emulated = "; a CPU's, in FP32" if fp32 else "; a CPU's: its low-precision arithmetic emulated"
        lines.append(
            f"  throughput: {tp['pipeline']:.4g} {tp['unit']} "
            f"(compute only {tp['compute']:.4g}; median of {tp['windows']} windows{emulated})"
        )
    if rec.mfu and rec.mfu.get("value") is not None:
        assert rec.flops is not None  # an MFU value is computed from the FLOP count
        sample = rec.flops["sample_unit"].removesuffix("s")
        lines.append(
            f"  mfu:        {rec.mfu['value'] * 100:.1f}% of {rec.mfu['peak_tflops']:g} TFLOP/s "
            f"({rec.mfu['math']}; {rec.flops['per_sample'] / 1e9:.4g} GFLOP per {sample})"
        )
    mem = rec.memory or {}
    steady = f", {_fmt_bytes(mem['steady_peak_bytes'])} after the warm-up" if mem.get("steady_peak_bytes") else ""
    lines.append(
        f"  memory:     {_fmt_bytes(mem.get('peak_bytes'))} peak{steady} "
        f"({mem.get('kind')}) on {rec.environment['device_name']}"
    )
    for name, s in (rec.loss_scale or {}).items():
        lines.append(
            f"  loss scale: [{name}] final {s['final']:g}, min {s['min']:g}, "
            f"skipped {s['skipped_steps']}/{s['steps']} steps{explain_skips(s)}"
        )
    saved = Path(rec.run_dir) / CHECKPOINT
    if (
        rec.checkpoint_step is not None and saved.exists()
    ):  # what a run leaves besides its record (checkpoint=false: none)
        lines.append(f"  checkpoint: {_fmt_bytes(saved.stat().st_size)} at step {rec.checkpoint_step} ({saved})")
    lines.append(f"  record:     {Path(rec.run_dir) / 'result.json'}")
    return lines


LAST_RUN_DIR: Path | None = None  # the folder of the run launch() made last (mpt.run reads its record)
LAST_REFUSAL: Exception | None = None  # why launch() last stopped before running (mpt.run raises it)


@hydra.main(version_base="1.3", config_path="pkg://mpt.configs", config_name="config")
def launch(cfg: DictConfig) -> str:
    global LAST_RUN_DIR, LAST_REFUSAL
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    run_dir = LAST_RUN_DIR = Path(HydraConfig.get().runtime.output_dir)
    # Rank 0 owns the folder under torchrun or in a SLURM step; the other ranks write nothing into it.
    lock = RunLock(run_dir) if from_env().is_main else None
    try:
        took_over = lock.acquire() if lock else None
    except AlreadyRunning as e:
        LAST_REFUSAL = RuntimeError(f"{run_dir}: already running ({e})")
        print(f"mpt-run: {run_dir}: already running ({e}); skipped", file=sys.stderr, flush=True)
        if multirun and not from_env().enabled:
            return "already running"
        sys.exit(1)
    except OSError as e:  # writing the holder's name on a full disk: nothing of the run's was touched
        _cannot_write(e, run_dir / ".lock")
    if took_over:
        print(f"mpt-run: {run_dir}: taking over its lock from {took_over}, which is no longer running", flush=True)
    file_log = None
    try:
        try:
            file_log = _own_the_folder(run_dir) if lock else None
        except OSError as e:
            _cannot_write(e, run_dir)
        status, stop = _run_locked(cfg, run_dir, multirun, owner=lock is not None)
    finally:
        if file_log is not None:
            logging.getLogger().removeHandler(file_log)
            file_log.close()
        if lock:
            lock.release()
    if stop:  # preempted: the sweep goes no further
        teardown()  # under torchrun every rank stopped at the same step and takes this path
        preemption.hand_over()
    if from_env().launcher == "slurm" and os.environ.get("SUBMITIT_EXECUTOR"):
        # A task of hydra-submitit-launcher's job: submitit, not main(), ends the process once this
        # one run returns, so the ranks leave the group here, together, as main() has them do.
        teardown()
    return status


def _cannot_write(e: OSError, where: Path) -> None:
    """One line for a run folder that cannot be written before the run starts (a full disk): the
    record, checkpoint and log already there stay as they were."""
    cause = e.strerror or str(e)
    text = (
        str(e)
        if str(e).startswith("could not write")
        else f"could not write {getattr(e, 'filename', None) or where}: {cause}"
    )
    print(f"mpt-run: error: {text}; the run folder's files are as they were", file=sys.stderr, flush=True)
    sys.exit(1)


def _own_the_folder(run_dir: Path) -> logging.Handler:
    """The job log, opened by the lock's holder only (config.yaml has hydra.output_subdir: null and
    a console-only job log), so a second launch of the run writes nothing into the folder."""
    remove_stale_temporaries(run_dir)  # the lock's holder is the folder's only writer
    handler = logging.FileHandler(run_dir / f"{HydraConfig.get().job.name}.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def _save_hydra_files(cfg: DictConfig, run_dir: Path) -> None:
    """Hydra's files, by the lock's holder, for a run that goes ahead: a skipped run's stay as its
    record's run wrote them (a relaunch with another log_every would otherwise rewrite committed files)."""
    hydra_cfg = cast(DictConfig, HydraConfig.instance().cfg)  # the whole config with its hydra node (stub: HydraConf)
    saved = run_dir / ".hydra"
    saved.mkdir(exist_ok=True)
    write_text_atomic(saved / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text_atomic(saved / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
    write_text_atomic(saved / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def _run_locked(cfg: DictConfig, run_dir: Path, multirun: bool, owner: bool) -> tuple[str, bool]:
    """The run's status, and whether a preemption signal asks the process to stop. `owner`: this
    process holds the folder's lock (rank 0)."""
    global LAST_REFUSAL
    from .outcomes import failure  # torch and torchvision load after Hydra has parsed the command line
    from .train import Run
    from .validation import validate

    previous = previous_record(run_dir)
    final = previous is not None and previous.status in (
        "ok",
        "diverged",
    )  # results; a failed, preempted or unfinished run is redone
    if final and not cfg.force:
        assert previous is not None  # final: there is a record
        if identity.same_computation(previous.config or {}, as_plain(cfg)):
            print(
                f"{said()}{run_dir} already has a record with status {previous.status}; "
                "skipped (force=true runs it again)",
                flush=True,
            )
            return "skipped", False
        changed = ", ".join(identity.differences(previous.config or {}, as_plain(cfg))[:4])
        print(
            f"{said()}{run_dir} has a {previous.status} record of a different config ({changed}); running again",
            flush=True,
        )
    if owner:
        try:
            _save_hydra_files(cfg, run_dir)
        except OSError as e:
            _cannot_write(e, run_dir)
    try:
        validate(cfg)
        job = Run(cfg, run_dir, variant=identity.variant(overrides()), label=run_label())
        if multirun and job.dist.is_main:
            print(f"mpt-run: {run_label()}: {run_dir.name}", flush=True)
    except ConfigError as e:  # before any training: one line, no record
        LAST_REFUSAL = e
        print(f"mpt-run: error: {e}", file=sys.stderr)
        if multirun:
            return "invalid", False
        sys.exit(2)
    except (
        Exception
    ) as e:  # setting up failed (out of memory moving the model, an unreadable checkpoint): still a record
        if isinstance(e, CorruptCheckpoint):  # a file to look into, not a bug: its one line says all
            log.error("setting up the run failed: %s", e)
        else:
            log.exception("setting up the run failed")
        status, message = failure(e, cfg.schedule.batch_size)
        rec = RunRecord.partial(
            status, message, str(run_dir), {g: cfg[g].name for g in GROUPS}, cfg.seed, as_plain(cfg)
        )
        if from_env().is_main:  # the lock's holder
            try:
                rec.write(run_dir / "result.json")
            except OSError as write_error:  # the disk is full: the record on disk stays as it was
                print(f"mpt-run: error: {write_error}", file=sys.stderr)
        print(f"mpt-run: {rec.status}: {rec.message}", file=sys.stderr)
        if multirun and not from_env().enabled:
            return rec.status, False
        sys.exit(1)
    rec = job.execute()  # a crash is recorded as `error` (or `oom`); a sweep goes on to its next run
    if job.dist.is_main:
        print("\n".join(summary_lines(rec)), flush=True)
    # Under torchrun a failed rank exits so that torchrun stops the others, which would wait for it
    # (srun does with --kill-on-bad-exit=1, as configs/hydra/launcher/slurm.yaml asks).
    if rec.status in ("error", "oom") and (not multirun or job.dist.enabled):
        sys.exit(1)
    stop = preemption.requested() is not None
    if job.dist.enabled:  # one decision for all ranks, whichever got the signal
        stop = job.dist.any(stop, job.device)
    return rec.status, stop


# Flags after which Hydra prints or does something other than train: it gets the command line as is.
_PASS_THROUGH = {
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--cfg",
    "-c",
    "--shell-completion",
    "-sc",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--config-dir",
    "-cd",
    "--package",
    "-p",
    "--experimental-rerun",
    "--resolve",
}


def preflight(args: list[str]) -> str | None:
    """Compose and validate every configuration the command line asks for (each value of a sweep)
    before Hydra starts anything, so a bad value is one line naming it and no run begins."""
    if any(a.split("=")[0] in _PASS_THROUGH for a in args):
        return None
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    from .validation import validate

    words = [a for a in args if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(words)
    except OverrideParseException as e:
        return str(e).splitlines()[0]
    if {"-m", "--multirun"} & set(args):
        # A preset's sweep (hydra.sweeper.params) is part of every run of `mpt-run -m`: its values
        # first, the command line's replacing those of the same key, as Hydra's sweeper does.
        given = {o.get_key_element() for o in parsed}
        try:
            preset = [w for w in _preset_params(words, parsed) if w.split("=")[0] not in given]
        except Exception:  # noqa: BLE001  # a command line that does not compose: the checks below name its fault
            preset = []
        words = preset + words
        parsed = OverridesParser.create().parse_overrides(words)
    plain, sweeps = [], []
    for text, o in zip(words, parsed):
        if o.key_or_group.split(".")[0].split("/")[0] == "hydra":
            continue
        # an added key only where a config holds free arguments (a model's builder's keyword arguments)
        if o.is_add() and o.key_or_group not in GROUPS + ("experiment",) and not o.key_or_group.startswith(OPEN):
            return f"{text}: no such config key (mpt-run --cfg job lists them)"
        if o.is_sweep_override():
            sweeps.append((o, [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]))
        else:
            plain.append(text)
    candidates = [plain + [values[0] for _, values in sweeps]]
    for i, (_, values) in enumerate(sweeps):
        for v in values[1:]:
            candidates.append(plain + [vs[0] if j != i else v for j, (_, vs) in enumerate(sweeps)])
    for overrides in candidates:
        try:
            with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
                validate(compose(config_name="config", overrides=overrides))
        except MissingConfigException as e:
            found = re.search(r"Could not find '([^/']+)/([^']+)'", str(e))
            if not found:
                return str(e).splitlines()[0]
            group, option = found.groups()
            choices = re.findall(r"^\t(\S+)$", str(e).split("Config search path")[0], flags=re.M)
            return f"{group}={option}: no such option; choose one of {', '.join(choices)}"
        except ConfigCompositionException as e:
            cause = str(e.__cause__ or e).splitlines()[0]
            key = re.search(r"(?:override|override ')\s*'?([^\s']+)", str(e))
            if "Could not override" in str(e):
                return f"{key.group(1) if key else str(e)}: no such config key ({cause})"
            return f"{str(e).removeprefix('Error merging override ')}: {cause}"
        except ConfigError as e:
            return str(e)
    return None


def _preset_params(words: list[str], parsed: list) -> list[str]:
    """The `key=value` items of the sweep a preset named on the command line sets (none without one)."""
    if not any(o.key_or_group == "experiment" for o in parsed):
        return []
    from hydra import compose, initialize_config_module

    plain = [w for w, o in zip(words, parsed) if not o.is_sweep_override() and not o.key_or_group.startswith("hydra")]
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        params = (
            compose(config_name="config", overrides=plain, return_hydra_config=True).hydra.sweeper.get("params") or {}
        )
    return [f"{k}={v}" for k, v in params.items()]


def sweep_size(args: list[str]) -> int | None:
    """How many runs `mpt-run -m` makes of these arguments: the product of the sweep's value counts,
    a preset's sweep (hydra.sweeper.params) narrowed by the command line, as Hydra's sweeper does."""
    from hydra import compose, initialize_config_module

    words = [a for a in args if not a.startswith("-")]
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(words)
    counts = {}
    plain = [w for w, o in zip(words, parsed) if not o.is_sweep_override() and not o.key_or_group.startswith("hydra")]
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        preset = (
            compose(config_name="config", overrides=plain, return_hydra_config=True).hydra.sweeper.get("params") or {}
        )
    # Later overrides of a key replace earlier ones, the preset's first: a plain model=alexnet narrows it.
    for o in [*parser.parse_overrides([f"{k}={v}" for k, v in preset.items()]), *parsed]:
        counts[o.get_key_element()] = len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
    return math.prod(counts.values())


def sweep_runs(args: list[str]) -> list[tuple[Path, str]]:
    """The run folders `mpt-run -m` would make of these arguments, in its order, each with what is
    there: the status of its record, or `to run`. Each job's overrides are Hydra's sweeper's: a
    preset's sweep (hydra.sweeper.params) narrowed by the command line, the last key varying fastest."""
    import itertools

    from hydra import compose, initialize_config_module

    words = [a for a in args if not a.startswith("-")]
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(words)
    plain = [w for w, o in zip(words, parsed) if not o.is_sweep_override() and not o.key_or_group.startswith("hydra")]
    with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
        preset = compose(config_name="config", overrides=plain, return_hydra_config=True).hydra.sweeper.get("params")
    texts = [f"{k}={v}" for k, v in (preset or {}).items()] + words
    by_key: dict[str, list[str]] = {}  # a later override of a key replaces the earlier one, in its place
    for text, o in zip(texts, parser.parse_overrides(texts)):
        key = o.get_key_element()
        by_key[key] = [f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [text]
    runs = []
    for job in itertools.product(*by_key.values()):
        with initialize_config_module(config_module="mpt.configs", version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(job), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # the folder's name reads the job's choices and overrides there
        folder = Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir)
        record = previous_record(folder)
        job_cfg = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])  # the config launch() gets
        if record is None:
            runs.append((folder, "to run"))
        elif record.status not in ("ok", "diverged"):  # failed, preempted or still running: run or resumed again
            runs.append((folder, f"to run (record: {record.status})"))
        elif job_cfg.force:
            runs.append((folder, "to run (force=true)"))
        elif not identity.same_computation(record.config or {}, as_plain(job_cfg)):
            runs.append((folder, "to run (config changed)"))
        else:  # a result of this config: the sweep skips it, as _run_locked decides
            runs.append((folder, f"done ({record.status})"))
    return runs


SWEEP_SIZE: int | None = None  # set by main() for `mpt-run -m`: run i/N


def run_label() -> str:
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return "mpt-run"
    return f"run {hc.job.num + 1}" + (f"/{SWEEP_SIZE}" if SWEEP_SIZE else "")


def said() -> str:
    """The prefix of a line about this run: `mpt-run: ` and, in a sweep, which run it is."""
    label = run_label()
    return "mpt-run: " if label == "mpt-run" else f"mpt-run: {label}: "


def main() -> None:
    global SWEEP_SIZE
    try:
        place = from_env()  # the launcher's variables (torchrun's, a SLURM step's), read before anything starts
    except LaunchError as e:
        print(f"mpt-run: error: {e}", file=sys.stderr)
        sys.exit(2)
    problem = preflight(sys.argv[1:])
    if problem:
        print(f"mpt-run: error: {problem}", file=sys.stderr)
        sys.exit(2)
    if "--dry-run" in sys.argv[1:] and not {"-m", "--multirun"} & set(sys.argv[1:]):
        print("mpt-run: error: --dry-run lists a sweep's runs: use it with -m", file=sys.stderr)
        sys.exit(2)
    if "--dry-run" in sys.argv[1:]:  # the runs a command would make, and which are done; nothing runs
        runs = sweep_runs([a for a in sys.argv[1:] if a != "--dry-run"])
        print(f"mpt-run: dry run: {len(runs)} run(s), {sum(s.startswith('done') for _, s in runs)} done", flush=True)
        for folder, status in runs:
            print(f"  {status:<26} {folder}", flush=True)
        return
    if {"-m", "--multirun"} & set(sys.argv[1:]) and not any(a.split("=")[0] in _PASS_THROUGH for a in sys.argv[1:]):
        try:
            SWEEP_SIZE = sweep_size(sys.argv[1:])
        except Exception:  # a sweep this count does not understand still runs, labelled run i
            SWEEP_SIZE = None
    if not place.enabled:
        try:
            launch()
        except KeyboardInterrupt:  # Ctrl-C outside training, or twice in it (the record says where it stopped)
            print("mpt-run: interrupted (SIGINT)", file=sys.stderr, flush=True)
            sys.exit(128 + 2)
        return
    try:
        launch()
    except KeyboardInterrupt:  # Ctrl-C twice: this rank stops at once, and torchrun (or srun) the others
        print("mpt-run: interrupted (SIGINT)", file=sys.stderr, flush=True)
        leave(128 + 2)
    except SystemExit as e:  # a failed rank (no teardown: its peers may be stuck waiting for it), or a preempted one
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        leave(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
    teardown()
    leave(0)


if __name__ == "__main__":
    main()
