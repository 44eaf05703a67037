"""Rules of the house that the code must keep: no import cycle between the package's modules
(not even one hidden under TYPE_CHECKING), algorithm/ free of I/O layers, a file that holds
one concept (never a long one), a folder small enough to read, and docs/architecture.md's tree
of modules the same as the code's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"
ARCHITECTURE = SOURCE.parent / "docs" / "architecture.md"
# A file holds one concept: splitting one to stay under a line count scatters it (issue 26),
# so the cap is only a backstop against a file that grew a second concept.
MAX_LINES = 1000
MAX_PACKAGE_ENTRIES = 15  # modules and subpackages in one folder, __init__.py not counted


def modules() -> dict[str, Path]:
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


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
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def graph() -> dict[str, set[str]]:
    return module_graph(SOURCE)


def test_the_cycle_finder_finds_a_cycle_and_nothing_else() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_sees_a_cycle_under_type_checking(tmp_path: Path) -> None:
    package = tmp_path / "diloco"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from diloco import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diloco.a import A\n"
    )
    assert cycles(module_graph(tmp_path)) == [["diloco.a", "diloco.b"]]


def test_no_module_imports_itself_back_through_others() -> None:
    assert cycles(graph()) == []


def test_the_algorithm_layer_imports_no_io_layer() -> None:
    for name, edges in graph().items():
        if name.startswith("diloco.algorithm"):
            outside = {e for e in edges if not e.startswith("diloco.algorithm")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_no_source_file_is_past_one_concept() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in modules().values()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_no_package_holds_more_than_a_reader_can_take_in() -> None:
    crowded = {}
    for init in SOURCE.joinpath("diloco").rglob("__init__.py"):
        entries = [
            child
            for child in init.parent.iterdir()
            if child.name != "__init__.py"
            and (child.suffix == ".py" or child.joinpath("__init__.py").exists())
        ]
        if len(entries) > MAX_PACKAGE_ENTRIES:
            crowded[str(init.parent.relative_to(SOURCE))] = len(entries)
    assert crowded == {}


def documented_modules(text: str) -> set[str]:
    """The module paths the "Layers" tree of docs/architecture.md names: an entry is a line
    indented 2, 4, 6 or 8 spaces that starts with `name.py` or `name/` (or several, comma
    separated); its indentation places it under the folder above it."""
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    named: set[str] = set()
    folders: dict[int, str] = {}
    entry = re.compile(r"((?:[a-z_][a-z0-9_]*(?:\.py|/))(?:, [a-z_][a-z0-9_]*(?:\.py|/))*)(\s|$)")
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip(" "))
        found = entry.match(line.lstrip(" "))
        if found is None or indent not in (2, 4, 6, 8):
            continue
        level = indent // 2 - 1
        for name in found.group(1).split(", "):
            path = "/".join([*(folders[i] for i in range(level)), name.rstrip("/")])
            if name.endswith("/"):
                folders[level] = name.rstrip("/")
            else:
                named.add(path)
    return named


def test_the_documented_tree_reads_folders_and_entries() -> None:
    text = """## Layers

```
src/diloco/
  server/
    app.py           the app
                     continued, not_a_module.py
    rounds/          a folder
      admission.py, round.py  two at once
  cli.py           typer
```
"""
    assert documented_modules(text) == {
        "server/app.py",
        "server/rounds/admission.py",
        "server/rounds/round.py",
        "cli.py",
    }


def test_architecture_md_names_every_module_and_no_other() -> None:
    root = SOURCE / "diloco"
    real = {
        str(path.relative_to(root)) for path in root.rglob("*.py") if path.name != "__init__.py"
    }
    named = documented_modules(ARCHITECTURE.read_text())
    assert sorted(real - named) == [], "modules docs/architecture.md does not name"
    assert sorted(named - real) == [], "docs/architecture.md names modules that do not exist"


def test_every_function_architecture_md_points_to_exists() -> None:
    """`path.py::Name` or `path.py::Class.method` in the doc (the life of a round names one
    per step): the module exists and defines each name of the dotted path."""
    root = SOURCE / "diloco"
    text = ARCHITECTURE.read_text()
    pointers = set(re.findall(r"([a-z0-9_/]+\.py)::([A-Za-z_][A-Za-z0-9_.]*)", text))
    assert len(pointers) > 20
    missing = []
    for path, dotted in sorted(pointers):
        source = root / path
        if not source.is_file():
            missing.append(f"{path} (no such module)")
            continue
        scope: list[ast.stmt] = ast.parse(source.read_text()).body
        for name in dotted.rstrip(".").split("."):
            found = next(
                (
                    node
                    for node in scope
                    if (
                        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                        and node.name == name
                    )
                    or (
                        isinstance(node, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                    )
                ),
                None,
            )
            if found is None:
                missing.append(f"{path}::{dotted}")
                break
            scope = getattr(found, "body", [])
    assert missing == []


ROUND_STEPS = ("admit", "fold", "decide", "step", "persist", "publish")
MAX_ROUND_FUNCTION_LINES = 100


def round_functions(text: str) -> dict[str, tuple[str, str]]:
    """The "Life of a round" table: round kind -> (module path, Class.function)."""
    section = text.split("## Life of a round", 1)[1].split("\n## ", 1)[0]
    found = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        pointer = re.match(r"`([a-z_/]+\.py)::([A-Za-z_.]+)`", cells[1]) if len(cells) > 2 else None
        if pointer is not None:
            found[cells[0]] = (pointer.group(1), pointer.group(2))
    return found


def test_each_round_kind_reads_in_one_short_function_naming_its_steps() -> None:
    """Issue 26: a newcomer reads a round top to bottom in one function of under ~100 lines
    whose text names the six steps in order (the doc's table says which function)."""
    functions = round_functions(ARCHITECTURE.read_text())
    assert set(functions) == {"sync round", "streaming fragment round", "async arrival"}
    for kind, (path, dotted) in functions.items():
        class_name, function_name = dotted.split(".")
        tree = ast.parse((SOURCE / "diloco" / path).read_text())
        owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
        function = next(
            n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == function_name
        )
        assert function.end_lineno is not None
        length = function.end_lineno - function.lineno + 1
        assert length < MAX_ROUND_FUNCTION_LINES, f"{kind}: {dotted} is {length} lines"
        text = ast.get_source_segment((SOURCE / "diloco" / path).read_text(), function) or ""
        places = [text.find(f"{number}. {step}") for number, step in enumerate(ROUND_STEPS, 1)]
        assert -1 not in places, f"{kind}: {dotted} does not name every step: {places}"
        assert places == sorted(places), f"{kind}: {dotted} names its steps out of order"


def test_the_round_table_reader_finds_each_kind() -> None:
    text = """## Life of a round

| round kind | the function | steps 1-2 |
|---|---|---|
| sync round | `server/rounds/barrier.py::BarrierRounds.complete_round` (one) | `Intake.submit` |

## Next
| other | `server/x.py::X.y` | no |
"""
    assert round_functions(text) == {
        "sync round": ("server/rounds/barrier.py", "BarrierRounds.complete_round")
    }
