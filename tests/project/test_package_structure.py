"""The package's shape, checked statically (AST): no import cycle, no module over
``MAX_MODULE_LINES`` lines outside ``muon_plugin/kernels``, one class per name.

The import graph has an edge for every ``muon_plugin`` import in a module, function-level ones
too (a lazy import is still a dependency): ``from a.b import c`` points at the module ``a.b.c``
when there is one, else at ``a.b`` (a package points at its ``__init__``). Each check runs on
the package and, to show that it can fail, on a small package written here with the fault.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "muon_plugin"

MAX_MODULE_LINES = 400
"""One file, one responsibility: a module longer than this is split by responsibility. The
kernels (Triton sources with their launch and tuning code) are exempt."""


def modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` (a package by its own name)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    found = modules(package)
    root = package.name
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package ``level - 1`` above this one
                    parent = here[: len(here) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                if base.split(".")[0] != root:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in found else base)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == root}
        graph[name] = {t for t in targets if t in found and t != name}
    return graph


def import_cycles(package: Path) -> list[list[str]]:
    """The import graph's cycles: each strongly connected set of two or more modules, as a
    path through it (Tarjan's algorithm, iterative)."""
    graph = import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        sccs.append(sorted(members))
    return [_cycle_path(graph, members) for members in sccs]


def _cycle_path(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest cycle through the first of ``members`` (one strongly connected set)."""
    first, inside = members[0], set(members)
    parents: dict[str, str] = {}
    queue = deque([first])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node] & inside):
            if target == first:
                path = [node]
                while path[-1] != first:
                    path.append(parents[path[-1]])
                return [*reversed(path), first]
            if target not in parents:
                parents[target] = node
                queue.append(target)
    raise AssertionError(f"not strongly connected: {members}")


def long_modules(package: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path: lines`` of each module over ``limit`` lines, outside ``<package>/kernels``."""
    out = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "kernels":
            continue
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out.append(f"{path.relative_to(package.parent)}: {lines} lines")
    return out


def repeated_class_names(package: Path) -> dict[str, list[str]]:
    """Each module-level class name defined in more than one module, with those modules."""
    where: dict[str, list[str]] = defaultdict(list)
    for name, path in modules(package).items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    return {cls: names for cls, names in where.items() if len(names) > 1}


def write_package(root: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``root`` made of ``files`` (relative path -> source)."""
    for rel, source in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "pkg"


def test_the_package_has_no_import_cycle() -> None:
    assert len(modules(PACKAGE)) > 60
    cycles = import_cycles(PACKAGE)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycles_are_found_through_lazy_relative_and_package_imports(tmp_path: Path) -> None:
    pkg = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "def f():\n    from pkg.sub import c\n",  # lazy
            "sub/__init__.py": "from .c import X\n",  # relative
            "sub/c.py": "import pkg.a\nX = 1\n",
            "d.py": "from pkg.sub import X\n",  # the package: its __init__
            "e.py": "import os\nfrom pkg.d import *\n",
        },
    )
    assert import_cycles(pkg) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    graph = import_graph(pkg)
    assert graph["pkg.sub"] == {"pkg.sub.c"} and graph["pkg.d"] == {"pkg.sub"}
    assert graph["pkg.e"] == {"pkg.d"}
    (pkg / "a.py").write_text("")
    assert import_cycles(pkg) == []


def test_no_module_is_over_the_line_limit_outside_the_kernels() -> None:
    too_long = long_modules(PACKAGE)
    assert not too_long, (
        f"modules over {MAX_MODULE_LINES} lines (split them by responsibility):\n"
        + "\n".join(too_long)
    )


def test_long_modules_are_found(tmp_path: Path) -> None:
    body = "x = 1\n" * 5
    pkg = write_package(tmp_path, {"__init__.py": "", "a.py": body, "kernels/k.py": body})
    assert long_modules(pkg, limit=4) == ["pkg/a.py: 5 lines"]
    assert long_modules(pkg, limit=5) == []


def test_one_class_per_name() -> None:
    repeated = repeated_class_names(PACKAGE)
    assert not repeated, "class names defined in several modules: " + "; ".join(
        f"{cls} in {', '.join(where)}" for cls, where in sorted(repeated.items())
    )


def test_repeated_class_names_are_found(tmp_path: Path) -> None:
    pkg = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "class Plan:\n    class Config: ...\n",
            "b.py": "class Plan: ...\nclass Other:\n    class Config: ...\n",
        },
    )
    assert repeated_class_names(pkg) == {"Plan": ["pkg.a", "pkg.b"]}  # nested ones are scoped


BENCHMARK = PACKAGE.parent / "scripts" / "bench"
"""The benchmark behind ``scripts/benchmark.py``: not part of the package, held to its rules."""


def test_the_benchmark_package_keeps_the_same_rules() -> None:
    assert len(modules(BENCHMARK)) > 10
    assert not import_cycles(BENCHMARK), import_cycles(BENCHMARK)
    too_long = long_modules(BENCHMARK)
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(too_long)
    assert not repeated_class_names(BENCHMARK), repeated_class_names(BENCHMARK)
