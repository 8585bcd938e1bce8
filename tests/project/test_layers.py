"""The package's layers import only downwards (the README's "Architecture" section).

From the bottom: ``defaults`` (every choice and default) < ``kernels`` < ``orthogonalize`` <
``distributed`` < the optimizer core (functional step, thin drivers, MuonLP) <
``param_groups`` (options and class rules) < ``adapter`` (the framework adapter core) < the
framework layers (``torchtitan``, ``torchtitan03``, ``torchtune``). A module may import its
own layer and the layers below; ``muon_plugin/__init__.py`` is the public facade and may import
anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "muon_plugin"

LAYERS = {
    "defaults": 0,
    "errors": 0,
    "kernels": 1,
    "orthogonalize": 2,
    "distributed": 3,
    "qk_clip": 4,
    "param_groups": 5,
    "adapter": 6,
    "torchtitan": 7,
    "torchtitan03": 7,
    "torchtune": 7,
}
CORE = 4  # every other top-level module or package: the optimizer core


def layer_of(dotted: str) -> int:
    """The layer of ``muon_plugin.<part>...``."""
    part = dotted.split(".")[1] if "." in dotted else ""
    return LAYERS.get(part, CORE)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``muon_plugin`` import in ``path`` (function-level ones too:
    a lazy import is still a dependency)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "muon_plugin":
                names = [f"muon_plugin.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names if n.startswith("muon_plugin")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("muon_plugin")]
    return out


def test_every_import_points_down_or_sideways() -> None:
    wrong = []
    modules = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
    assert len(modules) > 40
    for path in modules:
        dotted = ".".join(("muon_plugin", *path.relative_to(PACKAGE).with_suffix("").parts))
        here = layer_of(dotted)
        for line, target in imported_modules(path):
            if layer_of(target) > here:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not wrong, "imports pointing up:\n" + "\n".join(wrong)
