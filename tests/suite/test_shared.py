"""tests/support/shared.py: missing test data or tools skip a test outside CI and fail it under CI=true."""

from __future__ import annotations

import pytest

from tests.support.shared import require_executable, require_shared, shared_dir

pytestmark = pytest.mark.unit


def test_require_shared_skips_outside_ci_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="is missing"):
        require_shared("no/such/thing")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="is missing"):
        require_shared("no/such/thing")
    assert shared_dir().name == "shared"


def test_require_executable_skips_outside_ci_and_fails_in_ci(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="^nvcc not found on PATH: the checks cannot run$"):
        require_executable("nvcc", "the checks cannot run")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="^nvcc not found on PATH: the checks cannot run$"):
        require_executable("nvcc", "the checks cannot run")


def test_require_executable_returns_the_path_of_a_present_tool():
    assert require_executable("sh", "nothing runs without a shell").endswith("/sh")
