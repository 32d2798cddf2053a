"""What the suite needs from the machine, and the one rule for when it is missing: the read-only test data
(../shared beside the checkout) and tools such as nvcc. Outside CI a test without them skips with the
reason; with CI=true it fails, so CI can never pass by skipping."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def skip_or_fail(message: str) -> NoReturn:
    """Skip the test with `message` outside CI; fail it when CI=true."""
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def shared_dir() -> Path:
    """The ../shared folder next to the repository (it may not exist)."""
    return REPO_ROOT.parent / "shared"


def require_shared(relative: str | Path) -> Path:
    """Path of ../shared/<relative>; skips with the reason outside CI and fails when CI=true."""
    path = shared_dir() / relative
    if not path.exists():
        skip_or_fail(f"test data {path} is missing (../shared must sit beside the checkout)")
    return path


def require_executable(name: str, needed_for: str) -> str:
    """Path of the program `name` on PATH; skips (fails with CI=true) naming what cannot run without it."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} not found on PATH: {needed_for}")
    return path
