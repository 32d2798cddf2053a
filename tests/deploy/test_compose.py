"""docker-compose.yml, checked without a Docker engine: the real Compose CLI resolves it for each profile,
and every command, port, volume and health check agrees with the CLIs, the Dockerfiles and Envoy's config."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conduit_engine.entrypoints import cli as engine_cli
from conduit_gateway import cli as gateway_cli
from tests.deploy import dockerfiles, envoy_config, strict_yaml
from tests.deploy.paths import COMPOSE_FILE, ENVOY_CONFIG, MAKEFILE, REPO, tool

pytestmark = pytest.mark.deploy

PROFILES = {"cpu": "engine", "gpu": "engine-gpu"}
PD_ENGINES = ("prefill", "decode")


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # Variables of the caller's shell must not leak into what is being checked (`env`: the test's own).
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CONDUIT_", "COMPOSE_", "DOCKER_"))}
    env = {**clean, **(env or {})}
    return subprocess.run(
        [str(tool("docker-compose")), "--project-directory", str(REPO), "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module", params=sorted(PROFILES))
def project(request):
    """(profile, engine service name, the project as `docker compose --profile P config` resolves it)."""
    result = _compose("--profile", request.param, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return request.param, PROFILES[request.param], json.loads(result.stdout)


def test_file_parses_strictly():
    document = strict_yaml.load(COMPOSE_FILE.read_text())
    assert set(document["services"]) == {
        "engine",
        "engine-gpu",
        "gateway",
        "envoy",
        "prefill",
        "decode",
        "gateway-pd",
    }


def test_compose_rejects_an_invalid_file(tmp_path):
    # The real loader validates against the Compose schema: a wrong type is an error, not ignored.
    broken = tmp_path / "compose.yml"
    broken.write_text("services:\n  gateway:\n    image: x\n    ports: 8080\n")
    result = subprocess.run(
        [str(tool("docker-compose")), "-f", str(broken), "config"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "ports" in result.stderr


def test_each_profile_starts_one_engine_the_gateway_and_envoy(project):
    _, engine, config = project
    assert set(config["services"]) == {engine, "gateway", "envoy"}


def test_every_service_has_a_dockerfile_or_a_pinned_image(project):
    _, _, config = project
    assert len(config["services"]) == 3
    for name, service in config["services"].items():
        if "build" in service:
            assert service["build"]["context"] == str(REPO), name
            dockerfile = REPO / service["build"]["dockerfile"]
            assert dockerfile.is_file(), name
            parsed = dockerfiles.parse(dockerfile)
            assert set(service["build"].get("args", {})) <= set(parsed.global_args), name
            assert service["image"].startswith("conduit/"), name
        else:
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), name


def test_engine_command_volume_and_port_match_the_engine_cli(project):
    profile, engine, config = project
    service = config["services"][engine]
    assert service["build"]["args"]["VARIANT"] == {"cpu": "cpu", "gpu": "cuda"}[profile]
    args = engine_cli.build_parser().parse_args(service["command"])
    engine_config = engine_cli.config_from_args(args)
    assert engine_config.model.device == {"cpu": "cpu", "gpu": "cuda"}[profile]
    assert service["expose"] == [str(engine_config.server.port)]
    (volume,) = service["volumes"]
    assert volume["type"] == "bind" and volume["read_only"] is True
    assert volume["target"] == engine_config.model.path
    # The default model folder is the one `make demo-model` writes, served under its own name.
    assert volume["source"] == str(REPO / ".models" / "demo-llama")
    assert engine_config.model.served_name == "demo-llama"
    assert "demo-model:" in MAKEFILE.read_text() and ".models/demo-llama" in MAKEFILE.read_text()


def test_gpu_engine_reserves_an_nvidia_device():
    result = _compose("--profile", "gpu", "config", "--format", "json")
    service = json.loads(result.stdout)["services"]["engine-gpu"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    assert service["networks"]["default"]["aliases"] == ["engine"]


def _engine_names(config, engine: str) -> set[str]:
    service = config["services"][engine]
    aliases = (service.get("networks", {}).get("default") or {}).get("aliases", [])
    return {engine, *aliases}


def test_gateway_reaches_the_engine_the_profile_started(project):
    _, engine, config = project
    gateway = config["services"]["gateway"]
    gateway_config = gateway_cli.config_from_args(gateway["command"], gateway.get("environment") or {})
    engine_port = engine_cli.build_parser().parse_args(config["services"][engine]["command"]).port
    assert len(gateway_config.engines) == 1
    for address in gateway_config.engines:
        host, _, port = address.rpartition(":")
        assert host in _engine_names(config, engine) and int(port) == engine_port
    assert gateway["expose"] == [str(gateway_config.port)]
    # API keys and the gateway's workers come from the caller's environment; unset: none, and one.
    assert gateway["environment"] == {"CONDUIT_API_KEY": "", "CONDUIT_WORKERS": "1"}
    assert gateway_config.api_keys == () and gateway_config.workers == 1


def test_gateway_workers_come_from_the_callers_environment():
    result = _compose("--profile", "cpu", "config", "--format", "json", env={"CONDUIT_GATEWAY_WORKERS": "2"})
    assert result.returncode == 0, result.stderr
    gateway = json.loads(result.stdout)["services"]["gateway"]
    assert gateway_cli.config_from_args(gateway["command"], gateway["environment"]).workers == 2


def test_envoy_mounts_the_config_and_routes_to_the_compose_services(project):
    _, engine, config = project
    envoy = config["services"]["envoy"]
    (volume,) = envoy["volumes"]
    assert volume["source"] == str(ENVOY_CONFIG) and volume["read_only"] is True
    assert envoy["command"][:3] == ["envoy", "-c", volume["target"]]
    proxy = envoy_config.load()
    gateway_upstream = envoy_config.upstream_address(envoy_config.cluster(proxy, "gateway"))
    engine_upstream = envoy_config.upstream_address(envoy_config.cluster(proxy, "engine"))
    gateway_port = gateway_cli.config_from_args(config["services"]["gateway"]["command"], {}).port
    engine_port = engine_cli.build_parser().parse_args(config["services"][engine]["command"]).port
    assert gateway_upstream == {"address": "gateway", "port_value": gateway_port}
    assert engine_upstream["address"] in _engine_names(config, engine)
    assert engine_upstream["port_value"] == engine_port
    listener_ports = {
        envoy_config.listener(proxy, name)["address"]["socket_address"]["port_value"]
        for name in ("http_ingress", "grpc_internal")
    }
    published = envoy["ports"]
    assert {p["target"] for p in published} == listener_ports
    assert {p["published"] for p in published} == {str(p) for p in listener_ports}
    assert {p["host_ip"] for p in published} == {"127.0.0.1"}


def test_health_checks_match_the_images_and_order_the_start(project):
    _, engine, config = project
    services = config["services"]
    for name, dockerfile in (
        (engine, "services/engine/Dockerfile"),
        ("gateway", "services/gateway/Dockerfile"),
    ):
        image_check = dockerfiles.parse(REPO / dockerfile).final.one("HEALTHCHECK")
        assert services[name]["healthcheck"]["test"] == list(image_check.value), name
    # The gateway waits for a healthy engine (the one this profile runs), Envoy for a healthy gateway.
    # The other profile's engine is not running, so neither dependency may be required.
    gateway_needs = services["gateway"]["depends_on"]
    assert gateway_needs[engine]["condition"] == "service_healthy"
    assert gateway_needs[engine]["required"] is False
    # Envoy waits for the profile's gateway (gateway, or gateway-pd in profile pd).
    envoy_needs = services["envoy"]["depends_on"]
    assert set(envoy_needs) == {"gateway", "gateway-pd"}
    assert all(need == {"condition": "service_healthy", "required": False} for need in envoy_needs.values())


def test_make_compose_up_selects_an_engine_profile():
    text = MAKEFILE.read_text()
    recipe = re.search(r"^compose-up:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert recipe, "Makefile has no compose-up target"
    match = re.search(r"--profile\s+(\S+)", recipe.group(1))
    assert match, "make compose-up must pass --profile: without one Compose starts no engine"
    profile = match.group(1)
    variable = re.fullmatch(r"\$\((\w+)\)", profile)
    if variable:
        default = re.search(rf"^{variable.group(1)}\s*\?=\s*(\S+)", text, re.MULTILINE)
        assert default, f"{variable.group(1)} has no default in the Makefile"
        profile = default.group(1)
    assert profile == "cpu"


@pytest.fixture(scope="module")
def pd_project():
    """The project as `docker compose --profile pd config` resolves it."""
    result = _compose("--profile", "pd", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_pd_profile_starts_a_prefill_and_a_decode_engine_their_gateway_and_envoy(pd_project):
    assert set(pd_project["services"]) == {"prefill", "decode", "gateway-pd", "envoy"}


@pytest.mark.parametrize("role", PD_ENGINES)
def test_pd_engines_run_their_role_and_advertise_their_service_name(pd_project, role):
    service = pd_project["services"][role]
    cpu = _compose("--profile", "cpu", "config", "--format", "json")
    cpu_engine = json.loads(cpu.stdout)["services"]["engine"]
    # Built and mounted exactly like the CPU profile's engine; only the role flags differ.
    for key in ("build", "image", "volumes", "expose", "healthcheck"):
        assert service[key] == cpu_engine[key], key
    config = engine_cli.config_from_args(engine_cli.build_parser().parse_args(service["command"]))
    assert config.disaggregation.role == role
    assert config.disaggregation.advertise_address == f"{role}:{config.server.port}"
    assert service["command"][: len(cpu_engine["command"])] == cpu_engine["command"]


@pytest.mark.parametrize("transport", [None, "shm", "nixl"])
def test_pd_engines_move_kv_over_the_transport_of_conduit_kv_transport(transport):
    """Default gRPC; CONDUIT_KV_TRANSPORT reaches both engines, and the decode engine shares the prefill
    engine's IPC namespace and /dev/shm (what --kv-transport shm needs to find the same host)."""
    env = {} if transport is None else {"CONDUIT_KV_TRANSPORT": transport}
    result = _compose("--profile", "pd", "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    for role in PD_ENGINES:
        service = services[role]
        parser = engine_cli.build_parser(service["environment"])
        config = engine_cli.config_from_args(parser.parse_args(service["command"]))
        assert config.disaggregation.kv_transport == (transport or "grpc"), role
    assert services["prefill"]["ipc"] == "shareable" and services["decode"]["ipc"] == "service:prefill"
    assert services["decode"]["pid"] == "service:prefill"  # shm copies out of the prefill engine's memfd


def test_pd_gateway_pairs_the_two_engines_and_stands_in_for_the_gateway(pd_project):
    services = pd_project["services"]
    gateway = services["gateway-pd"]
    config = gateway_cli.config_from_args(gateway["command"], gateway.get("environment") or {})
    ports = {
        role: engine_cli.build_parser().parse_args(services[role]["command"]).port for role in PD_ENGINES
    }
    assert config.engines == () and config.disaggregated
    assert config.prefill_engines == (f"prefill:{ports['prefill']}",)
    assert config.decode_engines == (f"decode:{ports['decode']}",)
    assert gateway["depends_on"] == {
        role: {"condition": "service_healthy", "required": True} for role in PD_ENGINES
    }
    image_check = dockerfiles.parse(REPO / "services/gateway/Dockerfile").final.one("HEALTHCHECK")
    assert gateway["healthcheck"]["test"] == list(image_check.value)
    assert gateway["expose"] == [str(config.port)]
    assert gateway["environment"] == {"CONDUIT_API_KEY": "", "CONDUIT_WORKERS": "1"}
    # Envoy's upstreams are the names `gateway` and `engine`: the pd gateway and the decode engine.
    proxy = envoy_config.load()
    gateway_upstream = envoy_config.upstream_address(envoy_config.cluster(proxy, "gateway"))
    engine_upstream = envoy_config.upstream_address(envoy_config.cluster(proxy, "engine"))
    assert gateway_upstream == {"address": "gateway", "port_value": config.port}
    assert gateway["networks"]["default"]["aliases"] == ["gateway"]
    assert engine_upstream["address"] in _engine_names(pd_project, "decode")
    assert engine_upstream["port_value"] == ports["decode"]
