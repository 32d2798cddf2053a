"""tests/support/layers.py: a collected test without exactly one layer marker stops the run before any test
runs, also when `-m` would have deselected it."""

from __future__ import annotations

import pytest

from tests.support.layers import LAYERS

pytestmark = pytest.mark.unit

MARKERS = "".join(f"    {layer}: a layer\n" for layer in LAYERS)
INI = f"[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n{MARKERS}"
MARKED = "import pytest\n\npytestmark = pytest.mark.{layer}\n\n\ndef test_{layer}():\n    pass\n"


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeini(INI)
    return pytester.runpytest("-p", "tests.support.layers", "--strict-markers", *args)


def test_every_test_with_one_layer_runs_and_m_selects_a_layer(pytester):
    pytester.makepyfile(**{f"test_{layer}": MARKED.format(layer=layer) for layer in LAYERS})
    _run(pytester).assert_outcomes(passed=len(LAYERS))
    only_unit = _run(pytester, "-m", "unit")
    only_unit.assert_outcomes(passed=1, deselected=len(LAYERS) - 1)


def test_a_test_without_a_layer_stops_the_run(pytester):
    pytester.makepyfile(test_unit=MARKED.format(layer="unit"), test_bare="def test_bare():\n    pass\n")
    result = _run(pytester, "-m", "unit")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*every test needs exactly one layer marker*", "*test_bare.py::test_bare: no layer marker"]
    )
    result.stdout.no_fnmatch_line("*passed*")


def test_a_test_with_two_layers_stops_the_run(pytester):
    pytester.makepyfile(
        test_both=MARKED.format(layer="unit").replace("def test_unit", "@pytest.mark.kernels\ndef test_unit")
    )
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_both.py::test_unit: several layer markers (unit, kernels)"])
