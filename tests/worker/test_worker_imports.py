"""The worker package has no import cycle, not even one hidden under TYPE_CHECKING.

Every `import` and `from ... import` in the source counts, wherever it stands (module level,
inside a function, under `if TYPE_CHECKING:`); `from package import submodule` is an import
of the submodule. A cycle is a strongly connected set of two or more modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import diloco

SOURCE = Path(diloco.__file__).resolve().parent.parent  # src/


def module_graph(root: Path) -> dict[str, set[str]]:
    modules: dict[str, tuple[Path, bool]] = {}
    for path in root.joinpath("diloco").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                found = resolve(target)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_cycle_under_type_checking(tmp_path: Path) -> None:
    package = tmp_path / "diloco"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from diloco import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diloco.a import A\n"
    )
    assert cycles(module_graph(tmp_path)) == [["diloco.a", "diloco.b"]]


def test_the_worker_package_has_no_import_cycle() -> None:
    graph = module_graph(SOURCE)
    assert "diloco.worker.worker" in graph
    worker_cycles = [c for c in cycles(graph) if any(m.startswith("diloco.worker") for m in c)]
    assert worker_cycles == []
