"""Shared fixtures: the read-only test data in ../shared (skip outside CI, fail inside CI when missing).

Also loads the layer check (tests/support/layers.py): every test is unit, integration, deploy or kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conduit_common.file_lock import exclusive_file_lock
from tests.support.shared import require_shared
from tests.support.stories import MODEL

pytest_plugins = ["pytester", "tests.support.layers"]


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return require_shared(f"models/{MODEL}")


@pytest.fixture(scope="session")
def llama2_tokenizer_path() -> Path:
    return require_shared("tokenizers/llama2")


@pytest.fixture(scope="module")
def kv_shm_exclusive(tmp_path_factory) -> Iterator[None]:
    """Hold, for the whole module, the lock every module that makes KV segments in /dev/shm takes: they
    compare /dev/shm before and after (no segment may outlive a pull), so under pytest-xdist (make test
    runs the suite's files in parallel workers) no other worker's pulls may make segments meanwhile. The
    lock file sits in the run's temporary root, which the workers share."""
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # an xdist worker: its basetemp is a folder of the shared root
        root = root.parent
    with exclusive_file_lock(root / "kv-shm.lock"):
        yield
