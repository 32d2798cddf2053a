"""Where the deployment artifacts and the tools that check them live."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENVOY_CONFIG = REPO / "deploy" / "envoy" / "envoy.yaml"
CHART = REPO / "charts" / "conduit"
COMPOSE_FILE = REPO / "docker-compose.yml"
ENGINE_DOCKERFILE = REPO / "services" / "engine" / "Dockerfile"
GATEWAY_DOCKERFILE = REPO / "services" / "gateway" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
MAKEFILE = REPO / "Makefile"

# Console scripts of the tools installed in the running virtualenv (requirements.txt pins them).
BIN = Path(sys.executable).parent


def tool(name: str) -> Path:
    """Path of a tool installed next to this Python (envoy, docker-compose, hadolint)."""
    path = BIN / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make venv` (requirements.txt installs {name})")
    return path
