"""The suite's layers as pytest markers, and the collection check that every test belongs to exactly one.

The markers are registered in pyproject.toml (`--strict-markers` refuses any other); each test module
declares its layer with `pytestmark = pytest.mark.<layer>` at its top. `make test` runs every layer,
`make test-fast` only `unit` (in-process: no servers, no long-lived child processes). Loaded for the whole
suite by tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

LAYERS = ("unit", "integration", "deploy", "kernels")


def layers_of(marker_names: Iterable[str]) -> list[str]:
    """The layer markers among `marker_names`, each once, in LAYERS order."""
    names = set(marker_names)
    return [layer for layer in LAYERS if layer in names]


def layer_problems(items: Iterable[pytest.Item]) -> list[str]:
    """One line per collected test that has no layer marker or more than one."""
    problems = []
    for item in items:
        found = layers_of(marker.name for marker in item.iter_markers())
        if len(found) != 1:
            what = "no layer marker" if not found else f"several layer markers ({', '.join(found)})"
            problems.append(f"{item.nodeid}: {what}")
    return problems


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse to run when a collected test has no layer (or two): `-m unit` would silently drop it.

    tryfirst: it must see every test before `-m` deselects any.
    """
    problems = layer_problems(items)
    if problems:
        listing = "\n  ".join(problems)
        raise pytest.UsageError(
            f"every test needs exactly one layer marker of {', '.join(LAYERS)} "
            f"(pytestmark = pytest.mark.<layer> at the top of its module):\n  {listing}"
        )
