"""Shared fixtures: the read-only test data in ../shared (skip outside CI, fail inside CI when missing)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def require_shared(relative: str) -> Path:
    """Path of ../shared/<relative>; skips with the reason outside CI, fails in CI (CI=true) if absent."""
    path = SHARED / relative
    if path.exists():
        return path
    message = f"test data {path} is missing (../shared must sit beside the checkout)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return require_shared("models/stories260K")


@pytest.fixture(scope="session")
def llama2_tokenizer_path() -> Path:
    return require_shared("tokenizers/llama2")
