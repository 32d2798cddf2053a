"""The services' import structure: no import cycles anywhere, the engine's packages import only in the
direction of its layout (core ← engine ← entrypoints; executor → worker → models/layers/ops), and the
torch-free packages load no torch."""

from __future__ import annotations

import pytest

from tests.support.import_graph import cycles, import_graph, module_files
from tests.support.imports import assert_not_loaded

pytestmark = pytest.mark.unit

# Engine package → the engine packages it must never import (module-level, function-local or type-only).
FORBIDDEN = {
    "core": {
        "engine",
        "executor",
        "worker",
        "entrypoints",
        "kv_transfer",
        "telemetry",
        "models",
        "layers",
        "ops",
    },
    "engine": {"entrypoints", "worker", "layers", "ops"},
    "executor": {"engine", "entrypoints"},
    "worker": {"core", "engine", "executor", "entrypoints"},
    "models": {"core", "engine", "executor", "worker", "entrypoints"},
    "layers": {"core", "engine", "executor", "worker", "entrypoints"},
    "ops": {"core", "engine", "executor", "worker", "entrypoints", "models", "layers"},
    "kv_transfer": {"engine", "executor", "worker", "entrypoints"},
}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "conduit_engine" and len(parts) > 2 else None


def test_no_module_imports_itself_back():
    found = cycles(import_graph())
    assert not found, "import cycles (each through these modules): " + "; ".join(" ↔ ".join(c) for c in found)


def test_the_cycle_finder_sees_type_only_and_local_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    # The real graph holds the engine's lazily imported executors (function-local imports).
    assert "conduit_engine.executor.in_process" in import_graph()["conduit_engine.executor.factory"]


def test_engine_packages_import_in_the_layouts_direction():
    wrong = []
    for module, targets in import_graph().items():
        package = _package(module)
        for target in targets:
            if _package(target) in FORBIDDEN.get(package or "", set()):
                wrong.append(f"{module} → {target}")
    assert not wrong, "imports against the layout: " + ", ".join(sorted(wrong))


def test_core_and_engine_load_no_torch():
    modules = sorted(
        m for m in module_files() if m.startswith(("conduit_engine.core", "conduit_engine.engine"))
    )
    assert "conduit_engine.engine.llm_engine" in modules and "conduit_engine.core.scheduler" in modules
    assert_not_loaded("\n".join(f"import {m}" for m in modules), "torch")


def test_the_host_side_step_modules_load_no_torch():
    # The plain-Python parts of a step that the engine thread runs, and the sampling plan they build.
    assert_not_loaded(
        "import conduit_engine.executor.step_batch, conduit_engine.worker.step_inputs\n"
        "import conduit_engine.sampling.plan, conduit_engine.sampling.seeds, conduit_engine.models.facts",
        "torch",
    )
