"""charts/conduit with disaggregation.enabled: a prefill and a decode StatefulSet, each with its headless
Service, disruption budget and NetworkPolicy, and the gateway discovering both pools; validated like the
other renders (strict kubernetes-validate, strict lint, the restricted Pod Security Standard, the CLIs
parsing every command line), also with mTLS and a token on every gRPC hop (engine to engine included)."""

from __future__ import annotations

import helm_python as helm
import pytest

from conduit_engine.entrypoints import cli as engine_cli
from conduit_gateway import cli as gateway_cli
from tests.deploy import chart_render, envoy_config, pod_security
from tests.deploy.chart_render import NAMESPACE, component, find
from tests.deploy.paths import CHART
from tests.deploy.strict_yaml import load

pytestmark = pytest.mark.deploy

VALUES = CHART / "ci" / "disaggregation-values.yaml"
KUBERNETES_VERSIONS = chart_render.newest_kubernetes_versions(2)
POOLS = {"prefill": 2, "decode": 3}  # replicas in the values file


@pytest.fixture(scope="module")
def values():
    return load(VALUES.read_text())


@pytest.fixture(scope="module")
def objects(values):
    return chart_render.manifests(chart_render.render(values))


def _container(obj):
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    return container


def _engine_config(statefulset):
    """The engine's config from the StatefulSet's args, $(POD_IP) expanded as the kubelet does."""
    container = _container(statefulset)
    env = {item["name"]: item for item in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    args = [arg.replace("$(POD_IP)", "10.1.2.3") for arg in container["args"]]
    return engine_cli.config_from_args(engine_cli.build_parser().parse_args(args))


def test_two_pools_replace_the_engine_statefulset(objects):
    kinds = ["ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler", "ServiceAccount"]
    # Per engine pool: a StatefulSet, a headless Service, a disruption budget and a NetworkPolicy.
    kinds += 2 * ["StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    # The engines' ClusterIP Service, the gateway's and Envoy's Services, budget and policies.
    kinds += ["Service", "Service", "Service", "PodDisruptionBudget", "NetworkPolicy", "NetworkPolicy"]
    assert chart_render.kinds(objects) == sorted(kinds)
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "StatefulSet"} == {
        "conduit-prefill",
        "conduit-decode",
    }


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_strictly(objects, kubernetes_version):
    assert [
        problem for obj in objects if (problem := chart_render.validation_problem(obj, kubernetes_version))
    ] == []


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_strict_lint_passes(values, kubernetes_version):
    assert chart_render.lint_problems(values, kubernetes_version) == []


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_each_pool_runs_its_role_and_advertises_its_pod_address(objects, pool):
    statefulset = component(objects, "StatefulSet", pool)
    assert statefulset["spec"]["replicas"] == POOLS[pool]
    config = _engine_config(statefulset)
    assert config.disaggregation.role == pool
    assert config.disaggregation.advertise_address == "10.1.2.3:50051"
    assert config.disaggregation.lease_seconds == 45
    assert config.disaggregation.kv_transport == "nixl"
    assert config.model.device == "cuda" and config.cache.enable_prefix_caching
    if pool == "prefill":
        assert config.scheduler.max_num_batched_tokens == 8192
        assert _container(statefulset)["resources"]["requests"]["cpu"] == "4"
    else:
        assert config.scheduler.max_num_seqs == 128
        assert _container(statefulset)["resources"]["requests"]["cpu"] == "2"  # engine.resources
    assert _container(statefulset)["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Its headless Service and disruption budget select exactly its pods.
    pods = statefulset["spec"]["template"]["metadata"]["labels"]
    headless = find(objects, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"].items() <= pods.items()
    assert headless["spec"]["ports"][0]["targetPort"] == _container(statefulset)["ports"][0]["name"]
    budget = component(objects, "PodDisruptionBudget", pool)
    assert budget["spec"]["selector"]["matchLabels"] == statefulset["spec"]["selector"]["matchLabels"]
    other = component(objects, "StatefulSet", "decode" if pool == "prefill" else "prefill")
    assert not headless["spec"]["selector"].items() <= other["spec"]["template"]["metadata"]["labels"].items()


def test_the_gateway_discovers_each_pool_through_its_headless_service(objects):
    gateway = _container(component(objects, "Deployment", "gateway"))
    config = gateway_cli.config_from_args(gateway["args"], {})
    assert config.disaggregated and config.engines == () and config.engine_dns is None
    for pool, target in (("prefill", config.prefill_engine_dns), ("decode", config.decode_engine_dns)):
        headless = find(objects, "Service", f"conduit-{pool}-headless")
        assert (
            target
            == f"conduit-{pool}-headless.{NAMESPACE}.svc.cluster.local:{headless['spec']['ports'][0]['port']}"
        )


def test_internal_clients_and_envoy_reach_the_decode_engines(objects, tmp_path):
    decode_pods = component(objects, "StatefulSet", "decode")["spec"]["template"]["metadata"]["labels"]
    client_service = find(objects, "Service", "conduit-engine")
    assert client_service["spec"]["type"] == "ClusterIP"
    assert client_service["spec"]["selector"].items() <= decode_pods.items()
    config_map = find(objects, "ConfigMap", "conduit-envoy")
    path = tmp_path / "envoy.yaml"
    path.write_text(config_map["data"]["envoy.yaml"])
    assert envoy_config.validate(path).returncode == 0
    engine = envoy_config.upstream_address(envoy_config.cluster(envoy_config.load(path), "engine"))
    assert engine == {
        "address": f"conduit-decode-headless.{NAMESPACE}.svc.cluster.local",
        "port_value": 50051,
    }


def test_notes_name_both_pools(values):
    notes = chart_render.render(values)["conduit/templates/NOTES.txt"]
    assert "2 prefill and 3 decode engine replicas" in notes
    assert "statefulset/conduit-prefill" in notes and "statefulset/conduit-decode" in notes


def test_values_file_satisfies_the_schema_and_bad_pools_are_refused(values):
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        for overrides, message in [
            ({"disaggregation": {"prefill": {"replicas": 0}}}, "/disaggregation/prefill/replicas"),
            ({"disaggregation": {"leaseSeconds": 0}}, "/disaggregation/leaseSeconds"),
            ({"disaggregation": {"kvTransport": "rdma"}}, "/disaggregation/kvTransport"),
            ({"disaggregation": {"decode": {"replica": 2}}}, "replica"),
            ({"disaggregation": {"enabled": "yes"}}, "/disaggregation/enabled"),
        ]:
            with pytest.raises(helm.HelmValuesError, match=message):
                chart.validate_schema(overrides)


def test_the_kv_transport_defaults_to_grpc_on_both_pools_with_grpc_only_network_rules():
    values = {"disaggregation": {"enabled": True}}
    objects = chart_render.manifests(chart_render.render(values))
    for pool in POOLS:
        statefulset = component(objects, "StatefulSet", pool)
        assert _engine_config(statefulset).disaggregation.kv_transport == "grpc"
        policy = find(objects, "NetworkPolicy", statefulset["metadata"]["name"])
        assert [rule["ports"][0]["port"] for rule in policy["spec"]["ingress"]] == ["grpc", "metrics"]


def test_every_pod_meets_the_restricted_pod_security_standard(objects):
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            spec = obj["spec"]["template"]["spec"]
            assert pod_security.violations(spec) == [], obj["metadata"]["name"]


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_each_pool_accepts_grpc_from_the_gateway_envoy_and_both_pools(objects, pool):
    statefulset = component(objects, "StatefulSet", pool)
    policy = find(objects, "NetworkPolicy", statefulset["metadata"]["name"])
    pods = statefulset["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pods.items()
    grpc_rule, metrics_rule, ucx_rule = policy["spec"]["ingress"]  # the values run NIXL
    peers = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in grpc_rule["from"]}
    # Decode engines pull from prefill engines (PullKv) and release on them (ReleaseKv).
    assert peers == {"gateway", "envoy", "prefill", "decode"}
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    # The metrics port: the monitoring namespace only, as for colocated engines.
    monitoring = load((CHART / "values.yaml").read_text())["networkPolicy"]["monitoring"]["namespaceSelector"]
    assert metrics_rule == {
        "from": [{"namespaceSelector": monitoring}],
        "ports": [{"port": "metrics", "protocol": "TCP"}],
    }
    # NIXL: UCX's connections, on any port, from the engine pools only.
    assert "ports" not in ucx_rule
    ucx_peers = {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in ucx_rule["from"]
    }
    assert ucx_peers == {"prefill", "decode"}


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_each_pool_serves_metrics_on_its_named_port_through_its_headless_service(objects, pool):
    statefulset = component(objects, "StatefulSet", pool)
    config = _engine_config(statefulset).telemetry
    ports = {port["name"]: port["containerPort"] for port in _container(statefulset)["ports"]}
    assert config.metrics_port == ports["metrics"] == 9400
    headless = find(objects, "Service", statefulset["spec"]["serviceName"])
    (metrics,) = [port for port in headless["spec"]["ports"] if port["name"] == "metrics"]
    assert metrics == {
        "name": "metrics",
        "port": 9400,
        "targetPort": "metrics",
        "protocol": "TCP",
        "appProtocol": "http",
    }
    # The clients' ClusterIP Service (the decode pods) names no metrics port: each pod is scraped once.
    client_service = find(objects, "Service", "conduit-engine")
    assert [port["name"] for port in client_service["spec"]["ports"]] == ["grpc"]


def test_a_service_monitor_per_pool_scrapes_the_metrics_port_of_exactly_its_pods(values):
    monitored = {**values, "metrics": {"serviceMonitor": {"enabled": True}}}
    objects = chart_render.manifests(chart_render.render(monitored))
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceMonitor"}
    assert sorted(monitors) == ["conduit-decode", "conduit-gateway", "conduit-prefill"]
    services = [o for o in objects if o["kind"] == "Service"]
    for pool in POOLS:
        spec = monitors[f"conduit-{pool}"]["spec"]
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (endpoint,) = spec["endpoints"]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        # The Services it selects that name a metrics port: the pool's headless Service only.
        selected = [
            s["metadata"]["name"]
            for s in services
            if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
            and any(port["name"] == "metrics" for port in s["spec"]["ports"])
        ]
        assert selected == [f"conduit-{pool}-headless"]


def test_with_mtls_and_a_token_every_engine_dials_the_others_securely(values):
    secure = load((CHART / "ci" / "secure-values.yaml").read_text())
    objects = chart_render.manifests(chart_render.render({**secure, **values, "envoy": secure["envoy"]}))
    for pool in POOLS:
        config = _engine_config(component(objects, "StatefulSet", pool))
        assert config.disaggregation.role == pool
        security = config.security
        assert security.tls_cert and security.tls_client_ca and security.auth_token_file
        # Towards the other engines: their CA, its own certificate (mTLS), the shared name, the token.
        assert security.engine_tls_ca and security.engine_tls_cert and security.engine_auth_token_file
        assert security.engine_tls_server_name == f"conduit-decode-headless.{NAMESPACE}.svc.cluster.local"
    (certificate,) = [
        o for o in objects if o["kind"] == "Certificate" and o["metadata"]["name"].endswith("engine")
    ]
    assert security.engine_tls_server_name in certificate["spec"]["dnsNames"]
    assert "client auth" in certificate["spec"]["usages"]
