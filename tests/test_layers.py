"""The package's layering: each module imports only its own layer and the ones below it."""

from __future__ import annotations

import ast
from pathlib import Path

import mpt

PACKAGE = Path(mpt.__file__).parent

# Bottom first. A module may import its own layer and any below; never one above.
LAYERS = [
    {"mpt.config", "mpt.distributed", "mpt.files", "mpt.host_memory", "mpt.preemption", "mpt.provenance"},
    {"mpt.precision"},
    {"mpt.datasets"},
    {"mpt.models"},
    {"mpt.runner"},
    {"mpt.report"},
    {"mpt.api"},
]


def layer_of(module: str) -> int:
    for i, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return i
    raise AssertionError(f"{module}: in no layer of tests/test_layers.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, source: str | None = None) -> set[str]:
    """Every mpt module the file imports, at the top or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("mpt")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("mpt"):
                continue
            if node.module is None or target in ("mpt", "mpt.precision"):  # `from . import x`: x may be a module
                out |= {f"{target}.{a.name}" for a in node.names}
            else:
                out.add(target)
    return out


def modules() -> list[Path]:
    # The top package's __init__ holds set-up and mpt.api's names, imported at first use; configs/ holds no code.
    return sorted(
        p
        for p in PACKAGE.rglob("*.py")
        if "configs" not in p.relative_to(PACKAGE).parts and p != PACKAGE / "__init__.py"
    )


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in modules():
        own = layer_of(module_name(path))
        for target in imported(path):
            if target != "mpt" and layer_of(target) > own:
                upward.append(f"{module_name(path)} imports {target}")
    assert upward == []


def test_the_check_resolves_relative_and_nested_imports():
    probe = PACKAGE / "datasets" / "probe.py"
    source = (
        "from ..runner.record import now_iso\n"
        "def f():\n"
        "    from .. import preemption\n"
        "    from ..precision import cuda_autocast\n"
    )
    assert imported(probe, source) == {"mpt.runner.record", "mpt.preemption", "mpt.precision.cuda_autocast"}
    assert layer_of("mpt.runner.record") > layer_of(module_name(probe))


def test_every_module_is_in_a_layer():
    for path in modules():
        layer_of(module_name(path))


def import_graph() -> dict[str, set[str]]:
    """Each module's mpt imports, at the top or inside a function, as modules of the tree."""
    names = {module_name(p) for p in modules()}
    graph = {}
    for path in modules():
        targets = set()
        for t in imported(path):
            while t and t not in names:  # `from .x import y`: y is a name in module x
                t = t.rpartition(".")[0]
            if t and t != module_name(path):
                targets.add(t)
        graph[module_name(path)] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: modules that reach themselves, each circle once, by depth-first search."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            circle = path[path.index(node) :]
            if set(circle) not in [set(c) for c in found]:
                found.append(circle)
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_module_imports_itself_round_a_circle():
    """Deferred imports count: one inside a function is still a circle the layering hides."""
    assert circles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
