"""torch.compile for the networks a task trains through (compile.backend, compile.mode): its
settings' checks, the compiling, and what the record says dynamo made of it."""

from __future__ import annotations

from typing import cast

from omegaconf import DictConfig

from ..config import COMPILE_MODES, ConfigError
from ..models import Task


def validate(cfg: DictConfig) -> None:
    """Raises ConfigError naming the first bad setting of `compile` (cfg: the whole run config)."""
    if cfg.compile.mode is not None:
        if cfg.compile.mode not in COMPILE_MODES:
            raise ConfigError(f"compile.mode={cfg.compile.mode}: expected one of {', '.join(COMPILE_MODES)}")
        if cfg.compile.backend != "inductor":
            raise ConfigError(
                f"compile.mode={cfg.compile.mode}: modes are inductor's; "
                f"set compile.backend=inductor (got {cfg.compile.backend})"
            )
    if cfg.compile.backend is not None:
        from torch._dynamo import list_backends  # only when asked for: torch loads in seconds

        known = list_backends(exclude_tags=())
        if cfg.compile.backend not in known:
            raise ConfigError(
                f"compile.backend={cfg.compile.backend}: no such torch.compile backend; "
                f"choose one of {', '.join(known)}"
            )
    if cfg.compile.backend is not None and cfg.schedule.count_flops:
        import torch

        # runner/instruments/flops.py: the counted step runs the networks eager
        if not hasattr(torch.compiler, "set_stance"):
            raise ConfigError(
                f"compile.backend={cfg.compile.backend} with schedule.count_flops=true: "
                "counting FLOPs beside torch.compile needs torch>=2.6 "
                f"(torch.compiler.set_stance), this is {torch.__version__}; set schedule.count_flops=false"
            )
    if cfg.compile.backend is not None and cfg.stats.grad_hist:
        # The histograms come from hooks installed on sampled steps only, which would recompile the graph.
        raise ConfigError(
            f"compile.backend={cfg.compile.backend} with stats.grad_hist=true: "
            "gradient histograms need the eager networks; set one of them off"
        )


def compile_networks(task: Task, c: DictConfig) -> None:
    """The task trains and evaluates through torch.compile'd networks (after DDP's wrapper, as
    torch recommends); the engine keeps the module itself, whose parameters they share."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    # A fresh cache per run: the runs of a sweep share the process, and an earlier run's graphs
    # would count against this one's recompile limit and in its record's graph counts.
    torch._dynamo.reset()
    counters.clear()
    for name, net in task.networks().items():
        # a module compiled is a module (an OptimizedModule); the stub says any callable
        task.set_network(name, cast(torch.nn.Module, torch.compile(net, backend=c.backend, mode=c.mode)))


def compile_summary(c: DictConfig) -> dict:
    """What torch.compile made of the run's networks (dynamo's counters, reset when they were
    compiled), and where it captured no graph, why not."""
    from torch._dynamo.utils import counters

    graphs, frames = int(counters["stats"]["unique_graphs"]), dict(counters["frames"])
    out = {
        "backend": c.backend,
        "mode": c.mode,
        "unique_graphs": graphs,
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "frames": frames,
    }
    if graphs == 0:
        reasons = [reason for reason, _ in (counters["graph_break"] + counters["unimplemented"]).most_common(3)]
        out["why_no_graph"] = (
            "no frame reached dynamo: the networks ran eager (a stance, a dispatch mode, or a frame marked skipped)"
            if not frames.get("total")
            else f"dynamo saw {frames['total']} frames and captured no graph"
            + (f": {'; '.join(reasons)}" if reasons else "")
        )
    return out
