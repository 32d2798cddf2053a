"""The engine and gateway Dockerfiles, checked without a Docker engine: BuildKit's parser, hadolint, and the
facts the images rely on (stages, user, health check, context contents, pins shared with the pyprojects)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from conduit_common.env_flags import env_name, long_flags
from conduit_engine.entrypoints import cli as engine_cli
from conduit_engine.ops import kernel_loader
from conduit_gateway import cli as gateway_cli
from tests.deploy import dockerfiles
from tests.deploy.paths import DOCKERIGNORE, ENGINE_DOCKERFILE, GATEWAY_DOCKERFILE, REPO, tool

pytestmark = pytest.mark.deploy

PROTOC = (
    "-m grpc_tools.protoc -Iprotos --python_out=protos/python/gen --grpc_python_out=protos/python/gen "
    "--pyi_out=protos/python/gen protos/conduit/engine/v1/engine.proto"
)
IMAGES = {
    "engine": (ENGINE_DOCKERFILE, REPO / "services" / "engine"),
    "gateway": (GATEWAY_DOCKERFILE, REPO / "services" / "gateway"),
}


def _pyproject(service: Path) -> dict:
    return tomllib.loads((service / "pyproject.toml").read_text())


def _pin(requirements: list[str], name: str) -> str:
    (pin,) = [r for r in requirements if re.split(r"[=<>\[ ;]", r, maxsplit=1)[0] == name]
    return pin


def _default_port(image: str) -> int:
    if image == "engine":
        return engine_cli.build_parser().get_default("port")
    return gateway_cli.build_parser().get_default("port")


@pytest.fixture(params=sorted(IMAGES))
def image(request):
    path, service = IMAGES[request.param]
    return request.param, dockerfiles.parse(path), service


def test_hadolint_passes():
    result = subprocess.run(
        [str(tool("hadolint")), "--no-color", str(ENGINE_DOCKERFILE), str(GATEWAY_DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_and_the_final_stage_runs_unprivileged(image):
    name, parsed, service = image
    assert len(parsed.stages) >= 3  # uv, build, runtime
    final = parsed.final
    assert final.name == "runtime"
    user = final.one("USER").value[0]
    uid, _, gid = user.partition(":")
    # Numeric ids let Kubernetes' runAsNonRoot verify the user without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    assert final.all("RUN") and f"--uid {uid}" in final.run_lines()[0]
    (entrypoint,) = final.one("ENTRYPOINT").value
    assert entrypoint in _pyproject(service)["project"]["scripts"]
    assert entrypoint == f"conduit-{name}"
    assert final.one("EXPOSE").value == (str(_default_port(name)),)
    assert final.one("STOPSIGNAL").value == ("SIGTERM",)


def test_final_stage_ships_no_build_tools(image):
    _, parsed, _ = image
    final = parsed.final
    for line in final.run_lines():
        assert not re.search(r"\b(apt-get|apt|pip|uv|gcc|make|curl|wget)\b", line), line
    copied_from_build = [c.value[0] for c in final.all("COPY") if "--from=build" in c.flags]
    # The runtime gets the virtualenv (and the standalone CPython), never uv or the protoc virtualenv.
    assert set(copied_from_build) <= {"/opt/venv", "/opt/python"}
    assert "/opt/venv" in copied_from_build
    assert not [c for c in final.all("COPY") if "--from=uv" in c.flags]


def test_build_stage_generates_the_stubs_and_installs_the_packages(image):
    name, parsed, _ = image
    build = parsed.stage("build")
    lines = build.run_lines()
    assert any(PROTOC in line for line in lines), (
        "the build stage must run grpc_tools.protoc like `make proto`"
    )
    requirements = (REPO / "requirements.txt").read_text().split()
    assert any(_pin(requirements, "grpcio-tools") in line for line in lines)
    install = [line for line in lines if "./protos/python" in line]
    assert len(install) == 1 and f"./services/{name}" in install[0]


def test_health_check_probes_the_port_the_cli_listens_on(image):
    name, parsed, _ = image
    health = parsed.final.one("HEALTHCHECK")
    command = list(health.value)
    assert command[:3] == ["CMD", "python", "-c"]
    flags = dict(flag.removeprefix("--").split("=", 1) for flag in health.flags)
    assert set(flags) == {"interval", "timeout", "start-period", "retries"}
    env = parsed.final.env()
    assert env["CONDUIT_PORT"] == str(_default_port(name))
    assert "os.environ.get('CONDUIT_PORT'" in command[3]
    if name == "engine":
        assert "grpc_health" in command[3] and "SERVING" in command[3]
        # Loading a large model takes minutes; failures before that do not count.
        assert int(flags["start-period"].removesuffix("s")) >= 300
    else:
        assert "/health" in command[3]


def test_environment_defaults_are_cli_variables(image):
    name, parsed, _ = image
    if name == "engine":
        known = {engine_cli.env_name(flag) for flag, *_ in engine_cli.FLAGS} | {"CONDUIT_KERNELS_DIR"}
    else:
        known = {env_name(flag) for flag, _ in long_flags(gateway_cli.build_parser())}
    conduit_vars = {k for k in parsed.final.env() if k.startswith("CONDUIT_")}
    assert conduit_vars and conduit_vars <= known


def test_engine_image_cuda_by_default_with_a_cpu_variant():
    parsed = dockerfiles.parse(ENGINE_DOCKERFILE)
    assert parsed.global_args["VARIANT"] == "cuda"
    assert re.fullmatch(r"nvidia/cuda:12\.[\d.]+-runtime-ubuntu[\d.]+", parsed.global_args["CUDA_IMAGE"])
    assert parsed.stage("runtime-cuda").base == "${CUDA_IMAGE}"
    assert parsed.stage("runtime-cpu").base == "${CPU_IMAGE}"
    assert parsed.final.base == "runtime-${VARIANT}"
    assert parsed.final.env()["CONDUIT_DEVICE"] == "${VARIANT}"

    engine = _pyproject(IMAGES["engine"][1])["project"]
    torch_pin = _pin(engine["dependencies"], "torch")
    build = parsed.stage("build")
    (torch_line,) = [line for line in build.run_lines() if "torch==" in line]
    assert torch_pin in torch_line
    assert 'cpu) index="${TORCH_INDEX_CPU}"' in torch_line
    build_args = {
        c.value[0].split("=", 1)[0]: c.value[0].split("=", 1)[1]
        for c in build.all("ARG")
        if "=" in c.value[0]
    }
    assert build_args["TORCH_INDEX_CPU"] == "https://download.pytorch.org/whl/cpu"
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", build_args["TORCH_INDEX_CUDA"])
    # The cuda variant installs the engine's cuda12 extra: CuPy for CUDA 12.
    assert any('extra="[cuda12]"' in line for line in build.run_lines())
    assert [d.split("==")[0] for d in engine["optional-dependencies"]["cuda12"]] == ["cupy-cuda12x"]


def test_engine_image_installs_nixl_as_the_make_targets_do():
    """--kv-transport nixl needs the NIXL wheel in the image: the pin of requirements-nodeps.txt, with
    --no-deps (its torch requirement would replace the variant's torch)."""
    nodeps = [
        line
        for line in (REPO / "requirements-nodeps.txt").read_text().splitlines()
        if not line.startswith("#")
    ]
    pin = _pin(nodeps, "nixl-cu12")
    build = dockerfiles.parse(ENGINE_DOCKERFILE).stage("build")
    (line,) = [line for line in build.run_lines() if "nixl-cu12" in line]
    assert pin in line and "--no-deps" in line


def test_engine_image_carries_the_kernels_and_mounts_the_model():
    final = dockerfiles.parse(ENGINE_DOCKERFILE).final
    env = final.env()
    (kernels_copy,) = [c.value for c in final.all("COPY") if c.value[0] == "kernels/"]
    assert kernels_copy[1].rstrip("/") == env["CONDUIT_KERNELS_DIR"]
    patterns = dockerfiles.ignore_patterns(DOCKERIGNORE)
    for source in (*kernel_loader.KERNEL_SOURCES, "common.cuh"):
        assert (REPO / "kernels" / source).is_file(), source
        assert dockerfiles.in_context(f"kernels/{source}", patterns), source
    # The model is never baked in: it is a volume, and CONDUIT_MODEL points into it.
    (volume,) = final.one("VOLUME").value
    assert env["CONDUIT_MODEL"].startswith(volume + "/")


def test_gateway_image_has_no_torch():
    parsed = dockerfiles.parse(GATEWAY_DOCKERFILE)
    instructions = " ".join(" ".join(c.value) for stage in parsed.stages for c in stage.commands)
    assert "torch" not in instructions and "cupy" not in instructions
    gateway = _pyproject(IMAGES["gateway"][1])["project"]
    assert not [d for d in gateway["dependencies"] if d.startswith(("torch", "cupy"))]
    assert parsed.global_args["PYTHON_IMAGE"].startswith("python:3.11-slim")


def _context_files() -> list[str]:
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv", "node_modules")]
        files += [Path(root, n).relative_to(REPO).as_posix() for n in names]
    return files


def test_dockerignore_sends_the_sources_and_nothing_else():
    patterns = dockerfiles.ignore_patterns(DOCKERIGNORE)
    sent = [f for f in _context_files() if dockerfiles.in_context(f, patterns)]
    allowed = (
        "kernels/",
        "protos/conduit/",
        "protos/python/",
        "services/common/",
        "services/engine/",
        "services/gateway/",
    )
    assert sent and all(f.startswith(allowed) for f in sent), [f for f in sent if not f.startswith(allowed)]
    for path in (
        ".venv/bin/python",
        ".models/demo-llama/model.safetensors",
        "tests/conftest.py",
        "protos/python/gen/conduit/engine/v1/engine_pb2.py",
        "charts/conduit/values.yaml",
        "services/engine/src/conduit_engine/entrypoints/__pycache__/cli.cpython-311.pyc",
        "services/engine/src/conduit_engine.egg-info/PKG-INFO",
        "services/engine/Dockerfile",
    ):
        assert not dockerfiles.in_context(path, patterns), path
    # Every COPY from the context finds files there.
    for path in (ENGINE_DOCKERFILE, GATEWAY_DOCKERFILE):
        sources = [
            copy.value[0].rstrip("/")
            for stage in dockerfiles.parse(path).stages
            for copy in stage.all("COPY")
            if not any(flag.startswith("--from=") for flag in copy.flags)
        ]
        assert sources, f"{path.name} copies nothing from the context"
        for source in sources:
            assert any(f == source or f.startswith(source + "/") for f in sent), f"{path.name}: {source}"
    assert "services/engine/src/conduit_engine/entrypoints/cli.py" in sent
    assert "protos/conduit/engine/v1/engine.proto" in sent


def test_dockerignore_matcher_follows_buildkit_rules():
    patterns = ["*", "!src/", "**/__pycache__", "src/skip.txt"]
    assert dockerfiles.in_context("src/a/b.py", patterns)
    assert not dockerfiles.in_context("src/a/__pycache__/b.pyc", patterns)
    assert not dockerfiles.in_context("src/skip.txt", patterns)
    assert not dockerfiles.in_context("other/file", patterns)
