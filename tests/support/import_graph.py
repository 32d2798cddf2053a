"""The import graph of the services' packages, read from their source (nothing is imported).

Every import statement counts: module-level, function-local and those under `if TYPE_CHECKING:`. An
edge goes to the module an import names: `from a.b import c` goes to `a.b.c` when that is a module of
the tree, else to `a.b`.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

from tests.deploy.paths import REPO

SOURCES = sorted((REPO / "services").glob("*/src"))


def module_files() -> dict[str, Path]:
    """Dotted module name → its file, for every module of every service package."""
    modules: dict[str, Path] = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            yield f"{base}.{alias.name}"
            yield base


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module → the modules of the tree it imports (itself excluded)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = list(_imported(node, module, is_package))
            if isinstance(node, ast.ImportFrom):
                # `from a.b import c`: the submodule a.b.c if there is one, else the package a.b.
                for sub, base in zip(names[::2], names[1::2], strict=True):
                    targets.add(sub if sub in files else base)
            else:
                targets.update(names)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
