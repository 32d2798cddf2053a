"""Import hygiene checks: what a fresh interpreter loads for a given import."""

from __future__ import annotations

import subprocess
import sys


def assert_not_loaded(statements: str, *modules: str) -> None:
    """Run `statements` in a fresh interpreter and fail if any of `modules` was imported by them."""
    code = (
        f"import sys\n{statements}\nloaded = {set(modules)!r} & set(sys.modules)\nassert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
