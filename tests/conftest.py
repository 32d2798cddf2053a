"""Shared fixtures: the read-only test data in ../shared (skip outside CI, fail inside CI when missing).

Also loads the layer check (tests/support/layers.py): every test is unit, integration, deploy or kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.shared import require_shared
from tests.support.stories import MODEL

pytest_plugins = ["pytester", "tests.support.layers"]


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return require_shared(f"models/{MODEL}")


@pytest.fixture(scope="session")
def llama2_tokenizer_path() -> Path:
    return require_shared("tokenizers/llama2")
