"""mpt: reproduce Mixed Precision Training (Micikevicius et al., ICLR 2018) and what came after it.

From Python: `mpt.run(overrides)` and `mpt.analyze(model, batch, loss_fn)` (mpt/api.py)."""

import os

# torch's CPU allocator backs its large tensors with transparent huge pages when this is set before
# its first allocation. A CPU training step allocates fresh multi-megabyte tensors (gradients, casts,
# optimizer temporaries) that the OS otherwise faults in 4 KiB at a time, which can cost more than
# the arithmetic done on them. Set THP_MEM_ALLOC_ENABLE=0 to keep torch's default.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _use_the_checkouts_configs() -> None:
    """In a source checkout, `mpt.configs` is the `configs/` beside this `mpt/`. An editable install
    maps the name to the tree it was installed from, so another checkout run with `python -m` would
    otherwise compose its runs from that tree's configs. Installed packages hold `mpt/configs`."""
    import importlib.util
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parent
    configs = package.parent / "configs"
    if (
        (package / "configs").exists()
        or not (configs / "config.yaml").is_file()
        or not (configs / "__init__.py").is_file()
    ):
        return
    spec = importlib.util.spec_from_file_location(
        __name__ + ".configs", configs / "__init__.py", submodule_search_locations=[str(configs)]
    )
    assert spec is not None and spec.loader is not None  # a .py path always has a spec and a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["configs"] = module


_use_the_checkouts_configs()


def __getattr__(name: str):
    """`mpt.run` and `mpt.analyze`, imported at first use: `import mpt` stays light."""
    if name in ("run", "analyze"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'mpt' has no attribute {name!r}")
