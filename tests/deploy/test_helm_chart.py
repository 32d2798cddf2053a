"""charts/conduit: rendered by Helm's SDK, linted strictly, every manifest validated for new Kubernetes."""

from __future__ import annotations

import copy

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from conduit_engine.entrypoints import cli as engine_cli
from conduit_gateway import cli as gateway_cli
from tests.deploy import chart_render, envoy_config
from tests.deploy.chart_render import NAMESPACE, component, find
from tests.deploy.paths import CHART

pytestmark = pytest.mark.deploy

VALUES = list(chart_render.VALUES_FILES)
KUBERNETES_VERSIONS = chart_render.newest_kubernetes_versions(2)
# Custom resources whose schemas kubernetes-validate cannot know; checked field by field below instead.
CUSTOM_KINDS = {"ServiceMonitor", "Certificate"}


@pytest.fixture(scope="module", params=VALUES)
def release(request):
    """(values name, values, rendered templates, parsed objects) for one values file."""
    values = chart_render.values(request.param)
    rendered = chart_render.render(values)
    return request.param, values, rendered, chart_render.manifests(rendered)


def _container(obj):
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    return container


# What every release renders, and what each values file adds to it.
BASE_KINDS = ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "PodDisruptionBudget"]
BASE_KINDS += ["Service", "Service", "Service", "ServiceAccount", "StatefulSet"]
ENVOY_KINDS = ["ConfigMap", "Deployment", "Service"]
MONITOR_KINDS = ["ServiceMonitor", "ServiceMonitor"]  # the gateways' and the engines'
DASHBOARD_KINDS = ["ConfigMap"]
EXTRA_KINDS = {
    "default": ["NetworkPolicy", "NetworkPolicy"],
    "gpu": ["NetworkPolicy", "NetworkPolicy"],
    "full": [*ENVOY_KINDS, *MONITOR_KINDS, *DASHBOARD_KINDS, *["NetworkPolicy"] * 3],
    "secure": [*ENVOY_KINDS, *MONITOR_KINDS, *["NetworkPolicy"] * 3, *["Certificate"] * 4],
}


def test_rendered_objects_per_values_file(release):
    name, _, _, objects = release
    assert chart_render.kinds(objects) == sorted(BASE_KINDS + EXTRA_KINDS[name])


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_strictly(release, kubernetes_version):
    _, _, _, objects = release
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, kubernetes_version, strict=True)
            continue
        problem = chart_render.validation_problem(obj, kubernetes_version)
        assert problem is None, problem


def test_kubernetes_validate_strict_catches_an_unknown_field(release):
    _, _, _, objects = release
    broken = copy.deepcopy(find(objects, "StatefulSet"))
    broken["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_strict_lint_passes(release, kubernetes_version):
    _, values, _, _ = release
    assert chart_render.lint_problems(values, kubernetes_version) == []


def test_engine_args_are_accepted_by_the_engine_cli(release):
    _, _, _, objects = release
    container = _container(find(objects, "StatefulSet"))
    args = engine_cli.build_parser().parse_args(container["args"])
    config = engine_cli.config_from_args(args)
    assert config.server.port == container["ports"][0]["containerPort"]
    assert config.server.host == "0.0.0.0"
    model_mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert config.model.path == model_mount["mountPath"]
    assert model_mount["readOnly"] is True
    threads = release[1].get("engine", {}).get("tokenizerThreads")
    assert config.scheduler.tokenizer_threads == (threads or 2)
    lora = release[1].get("engine", {}).get("lora", {})
    assert config.lora.enable_lora == lora.get("enabled", False)
    assert config.lora.lora_modules == tuple((a["name"], a["path"]) for a in lora.get("adapters", []))


def test_lora_adapters_in_values_load_at_start_from_their_volume():
    values = chart_render.values("gpu")
    container = _container(find(chart_render.manifests(chart_render.render(values)), "StatefulSet"))
    config = engine_cli.config_from_args(engine_cli.build_parser().parse_args(container["args"]))
    assert config.lora.lora_modules == (
        ("sql", "/models/lora/sql-lora"),
        ("support", "example-org/support-lora"),
    )
    assert (config.lora.max_loras, config.lora.max_lora_rank, config.lora.cpu_loras) == (2, 32, 2)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "lora")
    assert mount == {"name": "lora", "mountPath": "/models/lora", "readOnly": True}
    default = _container(find(chart_render.manifests(chart_render.render({})), "StatefulSet"))
    assert "--enable-lora" not in default["args"]
    assert all(m["name"] != "lora" for m in default["volumeMounts"])


def test_gateway_discovers_the_engine_replicas_through_the_headless_service(release):
    _, values, _, objects = release
    engine = find(objects, "StatefulSet")
    headless = find(objects, "Service", engine["spec"]["serviceName"])
    gateway = _container(component(objects, "Deployment", "gateway"))
    env = {e["name"]: "secret-value" for e in gateway.get("env", []) if "valueFrom" in e}
    config = gateway_cli.config_from_args(gateway["args"], env)
    port = headless["spec"]["ports"][0]["port"]
    # Every ready engine pod is an A record of the headless Service, so scaling needs no gateway restart.
    assert headless["spec"]["clusterIP"] == "None"
    pod_labels = engine["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    assert config.engines == ()
    assert config.engine_dns == f"{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port}"
    assert config.port == gateway["ports"][0]["containerPort"]
    assert config.api_keys == (("secret-value",) if values.get("gateway", {}).get("apiKeys") else ())


def test_engine_probes_use_grpc_health_and_startup_allows_model_loading(release):
    _, values, _, objects = release
    container = _container(find(objects, "StatefulSet"))
    port = container["ports"][0]["containerPort"]
    tls = values.get("tls", {}).get("engine", {}).get("enabled", False)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # grpc.health.v1.Health/Check SERVES only after load and warm-up. The kubelet's grpc probe is
        # plaintext: a TLS engine is probed by conduit_engine.entrypoints.health_probe with its own
        # certificate.
        if tls:
            command = container[probe]["exec"]["command"]
            assert command[:3] == ["python", "-m", "conduit_engine.entrypoints.health_probe"]
            assert command[command.index("--address") + 1] == f"127.0.0.1:{port}"
        else:
            assert container[probe]["grpc"] == {"port": port}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_engine_drains_before_it_is_killed(release):
    _, _, _, objects = release
    engine = find(objects, "StatefulSet")
    container = _container(engine)
    args = engine_cli.build_parser().parse_args(container["args"])
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    # The hook leaves rotation (SIGUSR1 to the engine, PID 1) and pauses before SIGTERM starts the drain.
    assert command[:3] == ["python", "-m", "conduit_engine.entrypoints.pre_stop"]
    pre_stop = float(command[command.index("--sleep") + 1])
    grace = engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop > 0
    # The drain's end hands the remaining streams back: a margin after preStop + drain.
    assert grace >= pre_stop + args.drain_seconds + 5


def test_gpu_values_request_gpus_and_run_on_gpu_nodes():
    objects = chart_render.manifests(chart_render.render(chart_render.values("gpu")))
    engine = find(objects, "StatefulSet")
    container = _container(engine)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine_cli.build_parser().parse_args(container["args"]).device == "cuda"
    pod = engine["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_default_values_run_on_cpu_without_gpu_resources():
    objects = chart_render.manifests(chart_render.render({}))
    container = _container(find(objects, "StatefulSet"))
    args = engine_cli.build_parser().parse_args(container["args"])
    assert (args.device, args.tensor_parallel_size) == ("cpu", 1)
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


def _shm(engine) -> dict:
    (volume,) = [v for v in engine["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    (mount,) = [m for m in _container(engine)["volumeMounts"] if m["name"] == "dshm"]
    assert mount["mountPath"] == "/dev/shm"
    return volume["emptyDir"]


def test_tensor_parallel_size_sets_the_flag_the_gpus_and_shared_memory():
    # full-values: tensorParallelSize 2 with gpu.count 1 and no shmSizeLimit.
    engine = find(chart_render.manifests(chart_render.render(chart_render.values("full"))), "StatefulSet")
    container = _container(engine)
    assert engine_cli.build_parser().parse_args(container["args"]).tensor_parallel_size == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert _shm(engine) == {"medium": "Memory", "sizeLimit": "2Gi"}
    # On the CPU the workers share the pod's cores: no GPU, the flag and 4Gi of /dev/shm for 4 ranks.
    cpu = find(
        chart_render.manifests(chart_render.render({"engine": {"tensorParallelSize": 4}})), "StatefulSet"
    )
    assert engine_cli.build_parser().parse_args(_container(cpu)["args"]).tensor_parallel_size == 4
    assert "nvidia.com/gpu" not in _container(cpu)["resources"].get("limits", {})
    assert _shm(cpu) == {"medium": "Memory", "sizeLimit": "4Gi"}
    # An explicit size wins.
    gpu = find(chart_render.manifests(chart_render.render(chart_render.values("gpu"))), "StatefulSet")
    assert _shm(gpu) == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_a_gpu_count_that_contradicts_the_tensor_parallel_size_is_refused():
    values = {
        "engine": {
            "tensorParallelSize": 2,
            "gpu": {"enabled": True, "count": 4, "resourceName": "nvidia.com/gpu"},
        }
    }
    with pytest.raises(
        helm.HelmRenderError, match=r"engine.gpu.count \(4\) must be 1 or engine.tensorParallelSize \(2\)"
    ):
        chart_render.render(values)


def test_engine_has_a_headless_service_for_discovery_and_a_clusterip_for_clients(release):
    _, _, _, objects = release
    engine = find(objects, "StatefulSet")
    headless = find(objects, "Service", engine["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    client_service = find(objects, "Service", engine["metadata"]["name"])
    assert client_service["spec"]["type"] == "ClusterIP"
    assert "clusterIP" not in client_service["spec"]
    for service in (headless, client_service):
        assert service["spec"]["ports"][0]["appProtocol"] == "grpc"


def test_services_and_budgets_select_the_pods_and_name_real_ports(release):
    _, _, _, objects = release
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    selectors = [(o, o["spec"]["selector"]) for o in objects if o["kind"] == "PodDisruptionBudget"]
    selectors += [(o, {"matchLabels": o["spec"]["selector"]}) for o in objects if o["kind"] == "Service"]
    assert {obj["kind"] for obj, _ in selectors} == {"PodDisruptionBudget", "Service"}
    for obj, selector in selectors:
        matched = [
            w
            for w in workloads
            if selector["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, f"{obj['kind']}/{obj['metadata']['name']} selects {len(matched)} workloads"
        if obj["kind"] == "Service":
            port_names = {p["name"] for p in _container(matched[0])["ports"]}
            assert {p["targetPort"] for p in obj["spec"]["ports"]} <= port_names


def test_gateway_autoscaler_and_disruption_budget(release):
    _, _, _, objects = release
    hpa = find(objects, "HorizontalPodAutoscaler")
    gateway = find(objects, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    # The autoscaler owns the replica count.
    assert "replicas" not in gateway["spec"]
    assert hpa["spec"]["minReplicas"] >= 2
    readiness = _container(gateway)["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/health"


def test_api_keys_come_from_a_secret_and_never_from_values(release):
    _, values, _, objects = release
    assert "Secret" not in chart_render.kinds(objects)
    env = {e["name"]: e for e in _container(component(objects, "Deployment", "gateway")).get("env", [])}
    api_keys = values.get("gateway", {}).get("apiKeys")
    if api_keys:
        assert env["CONDUIT_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": api_keys["existingSecret"],
            "key": api_keys["secretKey"],
        }
    else:
        assert "CONDUIT_API_KEY" not in env


def test_envoy_config_in_the_chart_validates_and_targets_the_release_services(tmp_path):
    objects = chart_render.manifests(chart_render.render(chart_render.values("full")))
    config_map = find(objects, "ConfigMap", "conduit-envoy")
    path = tmp_path / "envoy.yaml"
    path.write_text(config_map["data"]["envoy.yaml"])
    result = envoy_config.validate(path)
    assert result.returncode == 0, result.stderr + result.stdout

    rendered = envoy_config.load(path)
    gateway_address = envoy_config.upstream_address(envoy_config.cluster(rendered, "gateway"))
    engine_address = envoy_config.upstream_address(envoy_config.cluster(rendered, "engine"))
    assert gateway_address == {
        "address": f"conduit-gateway.{NAMESPACE}.svc.cluster.local",
        "port_value": 8000,
    }
    assert engine_address == {
        "address": f"conduit-engine-headless.{NAMESPACE}.svc.cluster.local",
        "port_value": 50051,
    }
    # Apart from those two addresses it is deploy/envoy/envoy.yaml.
    gateway_address.update(address="gateway")
    engine_address.update(address="engine")
    assert rendered == envoy_config.load()

    deployment = find(objects, "Deployment", "conduit-envoy")
    container = _container(deployment)
    assert container["args"][:2] == ["-c", "/etc/envoy/envoy.yaml"]
    assert {p["containerPort"] for p in container["ports"]} == {
        envoy_config.listener(rendered, name)["address"]["socket_address"]["port_value"]
        for name in ("http_ingress", "grpc_internal")
    }


@pytest.mark.parametrize(
    ("monitor_name", "port", "scraped_service", "container_port"),
    [
        ("conduit-gateway", "http", "conduit-gateway", 8000),
        # Both engine Services match the selector; only the headless one has the metrics port, so each
        # pod (loading and draining ones too: their addresses are published) is scraped once.
        ("conduit-engine", "metrics", "conduit-engine-headless", 9500),
    ],
)
def test_service_monitors_scrape_the_gateway_and_every_engine(
    monitor_name, port, scraped_service, container_port
):
    objects = chart_render.manifests(chart_render.render(chart_render.values("full")))
    monitor = find(objects, "ServiceMonitor", monitor_name)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selected = [
        s
        for s in objects
        if s["kind"] == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (port, "/metrics", "15s")
    with_port = [s for s in selected if port in {p["name"] for p in s["spec"]["ports"]}]
    assert [s["metadata"]["name"] for s in with_port] == [scraped_service]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (service_port,) = [p for p in with_port[0]["spec"]["ports"] if p["name"] == port]
    workload = component(
        objects, "StatefulSet" if port == "metrics" else "Deployment", monitor_name.split("-")[1]
    )
    ports = {p["name"]: p["containerPort"] for p in _container(workload)["ports"]}
    assert ports[service_port["targetPort"]] == container_port


def test_an_https_gateway_is_scraped_over_https_checking_its_certificate():
    objects = chart_render.manifests(chart_render.render(chart_render.values("secure")))
    (gateway_endpoint,) = find(objects, "ServiceMonitor", "conduit-gateway")["spec"]["endpoints"]
    (certificate,) = [
        c for c in objects if c["kind"] == "Certificate" and c["metadata"]["name"].endswith("-gateway")
    ]
    assert gateway_endpoint["scheme"] == "https"
    assert gateway_endpoint["tlsConfig"] == {
        "serverName": f"conduit-gateway.{NAMESPACE}.svc.cluster.local",
        "ca": {"secret": {"name": certificate["spec"]["secretName"], "key": "ca.crt"}},
    }
    assert gateway_endpoint["tlsConfig"]["serverName"] in certificate["spec"]["dnsNames"]
    # The engines' metrics port is plain HTTP whatever their gRPC uses (the NetworkPolicy guards it).
    (engine_endpoint,) = find(objects, "ServiceMonitor", "conduit-engine")["spec"]["endpoints"]
    assert "scheme" not in engine_endpoint and "tlsConfig" not in engine_endpoint
    full = chart_render.manifests(chart_render.render(chart_render.values("full")))
    assert "scheme" not in find(full, "ServiceMonitor", "conduit-gateway")["spec"]["endpoints"][0]


def test_engine_metrics_port_and_observability_flags_reach_both_clis(release):
    name, values, _, objects = release
    engine = engine_cli.config_from_args(
        engine_cli.build_parser().parse_args(_container(find(objects, "StatefulSet"))["args"])
    ).telemetry
    gateway_container = _container(component(objects, "Deployment", "gateway"))
    # Variables from Secrets get a stand-in value each (the admin key must differ from the API keys).
    env = {e["name"]: e.get("value", f"from-secret-{e['name']}") for e in gateway_container.get("env", [])}
    gateway = gateway_cli.config_from_args(gateway_container["args"], env)
    assert engine.metrics_port == {"full": 9500, "secure": 9090}.get(name, 9400)
    assert engine.metrics_vllm_compat is (name == "full")
    otlp = "http://otel-collector.observability:4317" if name == "full" else None
    assert engine.otlp_endpoint == gateway.otlp_endpoint == otlp
    assert engine.log_format == gateway.log_format == ("json" if name == "full" else "text")
    assert not engine.log_prompts and not gateway.log_prompts


def test_admin_node_limits_reach_the_gateway_cli(release):
    name, _, _, objects = release
    container = _container(component(objects, "Deployment", "gateway"))
    env = {e["name"]: e.get("value", f"from-secret-{e['name']}") for e in container.get("env", [])}
    gateway = gateway_cli.config_from_args(container["args"], env)
    if name == "secure":  # admin keys, an allow list and a bound
        assert gateway.admin_keys and gateway.admin_port == 8001
        assert gateway.admin_node_allow == ("10.0.0.0/8", "*.svc.cluster.local")
        assert gateway.admin_max_nodes == 16
    else:  # no admin API: neither flag is rendered
        assert not gateway.admin_keys
        assert "--admin-max-nodes" not in container["args"]
        assert (gateway.admin_node_allow, gateway.admin_max_nodes) == ((), 64)


def test_admin_node_defaults_render_a_bound_and_no_allow_list():
    admin = {"gateway": {"adminKeys": {"existingSecret": "admin", "secretKey": "k"}}}
    objects = chart_render.manifests(chart_render.render(admin))
    args = _container(component(objects, "Deployment", "gateway"))["args"]
    assert args[args.index("--admin-max-nodes") + 1] == "64"
    assert "--admin-node-allow" not in args
    for obj in objects:
        assert chart_render.validation_problem(obj, KUBERNETES_VERSIONS[-1]) is None


def test_gateway_workers_reach_the_cli(release):
    _, values, _, objects = release
    container = _container(component(objects, "Deployment", "gateway"))
    env = {e["name"]: e.get("value", f"from-secret-{e['name']}") for e in container.get("env", [])}
    gateway = values.get("gateway", {})
    cpu = str(gateway.get("resources", {}).get("requests", {}).get("cpu", "250m"))
    whole_cpus = int(cpu[:-1]) // 1000 if cpu.endswith("m") else int(float(cpu))
    expected = gateway.get("workers") or max(1, whole_cpus)
    assert gateway_cli.config_from_args(container["args"], env).workers == expected


@pytest.mark.parametrize(
    ("gateway", "workers"),
    [
        ({}, 1),  # the default request, 250m
        ({"resources": {"requests": {"cpu": "2"}}}, 2),
        ({"resources": {"requests": {"cpu": 4}}}, 4),
        ({"resources": {"requests": {"cpu": "1500m"}}}, 1),
        ({"resources": {"requests": {"cpu": "3000m"}}}, 3),
        ({"resources": {"requests": {"cpu": 0.5}}}, 1),
        ({"resources": {"requests": {"memory": "1Gi"}}}, 1),  # no CPU request
        ({"workers": 3, "resources": {"requests": {"cpu": "1"}}}, 3),  # set: wins
    ],
)
def test_gateway_workers_follow_the_cpu_request_unless_set(gateway, workers):
    objects = chart_render.manifests(chart_render.render({"gateway": gateway}))
    args = _container(component(objects, "Deployment", "gateway"))["args"]
    assert args[args.index("--workers") + 1] == str(workers)


def test_notes_tell_how_to_call_it(release):
    name, _, rendered, _ = release
    notes = rendered["conduit/templates/NOTES.txt"]
    assert "port-forward service/" in notes
    assert "/v1/completions" in notes and "/v1/messages" in notes
    assert ("conduit-envoy" in notes) == (name in ("full", "secure"))
    assert ("https://127.0.0.1:8080/v1/completions" in notes) == (name == "secure")


def test_shipped_values_files_satisfy_the_schema():
    with helm.Chart.load(CHART) as chart:
        for name in VALUES:
            chart.validate_schema(chart_render.values(name))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"engine": {"replicas": -1}}, "/engine/replicas"),
        ({"gateway": {"replicas": 0}}, "/gateway/replicas"),
        ({"gateway": {"workers": 0}}, "/gateway/workers"),
        ({"gateway": {"workers": "2"}}, "/gateway/workers"),
        ({"engine": {"dtype": "float64"}}, "/engine/dtype"),
        ({"engine": {"gpu": {"count": "one"}}}, "/engine/gpu/count"),
        ({"engine": {"tensorParallelSize": 0}}, "/engine/tensorParallelSize"),
        (
            {"gateway": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}},
            "targetCPUUtilizationPercentage",
        ),
        # A misspelt key is refused rather than silently ignored.
        ({"engine": {"replica": 2}}, "replica"),
        # There is no place for a literal key in values.
        ({"gateway": {"apiKeys": {"existingSecret": "", "secretKey": "k", "value": "sk-123"}}}, "value"),
        ({"engine": {"metrics": {"port": 0}}}, "/engine/metrics/port"),
        ({"logging": {"format": "xml"}}, "/logging/format"),
        ({"tracing": {"otlpEndpoint": "collector:4317"}}, "/tracing/otlpEndpoint"),
        ({"gateway": {"adminMaxNodes": -1}}, "/gateway/adminMaxNodes"),
        ({"gateway": {"adminNodeAllow": "10.0.0.0/8"}}, "/gateway/adminNodeAllow"),
        ({"gateway": {"adminNodeAllow": ["unix:/x y"]}}, "/gateway/adminNodeAllow"),
    ],
)
def test_schema_rejects_bad_values(overrides, message):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match=message):
            chart.validate_schema(overrides)
        # An install renders through the same schema.
        with pytest.raises(helm.HelmValuesError):
            chart.render(overrides, name="demo", namespace=NAMESPACE)


def test_grace_period_shorter_than_drain_is_refused():
    with pytest.raises(helm.HelmRenderError, match="terminationGracePeriodSeconds"):
        chart_render.render({"engine": {"terminationGracePeriodSeconds": 100, "drainSeconds": 240}})
    # preStop 10 + drain 240 + the hand-back's 5 s margin: 254 is one short, 255 renders.
    with pytest.raises(helm.HelmRenderError, match=r"drainSeconds \+ 5 \(255\)"):
        chart_render.render({"engine": {"terminationGracePeriodSeconds": 254, "drainSeconds": 240}})
    chart_render.render({"engine": {"terminationGracePeriodSeconds": 255, "drainSeconds": 240}})


def test_values_file_documents_parse_strictly():
    # Duplicate keys in values.yaml would be silently merged by Helm.
    for path in [CHART / "values.yaml", CHART / "Chart.yaml", *sorted((CHART / "ci").glob("*.yaml"))]:
        chart_render.strict_yaml.load(path.read_text())
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["name"] == "conduit"
