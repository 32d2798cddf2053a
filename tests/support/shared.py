"""Where the read-only test data lives (../shared beside the checkout) and how tests ask for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def shared_dir() -> Path:
    """The ../shared folder next to the repository (it may not exist)."""
    return REPO_ROOT.parent / "shared"


def require_shared(relative: str | Path) -> Path:
    """Path of ../shared/<relative>; skips with the reason outside CI and fails when CI=true."""
    path = shared_dir() / relative
    if path.exists():
        return path
    message = f"test data {path} is missing (../shared must sit beside the checkout)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)
