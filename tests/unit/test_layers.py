"""The layers import only downward, and no module imports itself back through another.

Layers, lowest first (docs/design.md): ``bridge.core`` → ``bridge.db`` → ``bridge.tasktable`` →
``bridge.reference`` → ``bridge.bus`` → ``bridge.capture`` | ``bridge.flags`` → ``event_scheduler`` |
``legacy_poller`` → ``bridge.reconcile`` → ``bridge.rollout`` → ``bridge.app`` → ``bridge.serve`` →
``bridge.cli`` → ``pollbridge``. A module may import its own group and any lower layer; two groups on
the same rank (capture and flags; the scheduler and the poller) may not import each other. Imports
inside functions count the same as module-level ones; only ``if TYPE_CHECKING:`` blocks are exempt.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bridge", "event_scheduler", "legacy_poller", "pollbridge")

# (group, rank): a module belongs to the longest group that prefixes its name.
LAYERS: dict[str, int] = {
    "bridge": 0,  # the package root holds only the version
    "bridge.core": 0,
    "bridge.db": 1,
    "bridge.tasktable": 2,
    "bridge.reference": 3,
    "bridge.bus": 4,
    "bridge.capture": 5,
    "bridge.flags": 5,
    "event_scheduler": 6,
    "legacy_poller": 6,
    "bridge.reconcile": 7,
    "bridge.rollout": 8,
    "bridge.app": 9,
    "bridge.serve": 10,
    "bridge.cli": 11,
    "pollbridge": 12,
}


def group_of(module: str) -> str:
    best = ""
    for group in LAYERS:
        if (module == group or module.startswith(group + ".")) and len(group) > len(best):
            best = group
    if not best:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and docs/design.md")
    return best


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        base = ROOT / package
        if not base.is_dir():
            continue
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports (a name imported from a package counts as its submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in known else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    found.add(alias.name)
    found.discard(module)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_every_import_goes_downward() -> None:
    wrong = []
    for module, targets in sorted(graph().items()):
        own = group_of(module)
        for target in sorted(targets):
            theirs = group_of(target)
            if theirs == own or (theirs == "bridge" and target == "bridge"):
                continue
            if LAYERS[theirs] >= LAYERS[own]:
                wrong.append(f"{module} ({own}, rank {LAYERS[own]}) imports {target} ({theirs}, rank {LAYERS[theirs]})")
    assert not wrong, "imports that do not go downward:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    edges = graph()
    # A package's __init__ importing its own submodules is how a package exposes them, not a cycle
    # (its submodules never import the package's __init__ back: that is what the check below finds).
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if target not in edges:
                continue
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target):], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, expected", [
    ("from bridge.core.errors import ConfigError\n", {"bridge.core.errors"}),
    ("def f():\n    from bridge.cli.main import cli\n", {"bridge.cli.main"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bridge.app.runall import RunAll\n", set()),
])
def test_the_checker_sees_imports_at_every_level(source: str, expected: set[str], tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    known = modules()
    assert imports_of("bridge.db.example", path, known) == expected


def test_bridge_keeps_few_modules_at_its_top_level() -> None:
    top = sorted(p.name for p in (ROOT / "bridge").glob("*.py"))
    assert top == ["__init__.py"], top
