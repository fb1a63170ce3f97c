"""The package's own import graph, read from its source with ``ast`` (function-level imports too).

Inductor's FX graph cache keys a rewritten graph on the code that produced it
(``backend.GiftGraphPass.uuid``). Every module the pass imports, directly or not, can put code
into the graph or run when it runs, so the key hashes exactly that closure
(:func:`source_files`), derived here rather than kept by hand. tests/test_package_shape.py
checks the package's layering on the same graph.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
_ROOT = PACKAGE.name


def module_name(path: Path) -> str:
    """``passes/gift_collectives.py`` -> ``"passes.gift_collectives"`` (relative to the package)."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def module_path(name: str) -> Path | None:
    """The file of package module ``name`` (a module file, or a subpackage's ``__init__.py``)."""
    base = PACKAGE.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imports(path: Path) -> set[str]:
    """The package modules a file imports, anywhere in it. ``from gift_compile.x import y``
    names the submodule ``x.y`` when there is one, else the module ``x``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == _ROOT:
            base = node.module.removeprefix(_ROOT).lstrip(".")
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if module_path(candidate) is not None else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix(f"{_ROOT}.") for a in node.names if a.name.startswith(f"{_ROOT}.")}
    return {m for m in found if m and module_path(m) is not None}


def import_graph() -> dict[str, set[str]]:
    """``{module: the package modules it imports}`` for every module but the ``__init__`` files."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    return {name: {m for m in imports(path) if m in modules} for name, path in modules.items()}


@functools.cache
def closure(module: str) -> tuple[str, ...]:
    """``module`` and every package module it imports, transitively, sorted."""
    graph, seen, todo = import_graph(), set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    return tuple(sorted(seen))


def source_files(module: str) -> list[Path]:
    """The files of :func:`closure` (what a change to must invalidate ``module``'s compiled graphs)."""
    return [module_path(name) for name in closure(module)]


__all__ = ["PACKAGE", "closure", "import_graph", "imports", "module_name", "module_path", "source_files"]
