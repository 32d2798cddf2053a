"""The chart's security on its rendered manifests: every pod passes the "restricted" Pod Security
Standard with a read-only root, the NetworkPolicies admit exactly the peers they should, secrets come
only from existing Secrets or cert-manager, and the certificates carry the names the clients check."""

from __future__ import annotations

import copy

import pytest

from conduit_engine.entrypoints import cli as engine_cli
from conduit_gateway import cli as gateway_cli
from tests.deploy import chart_render, envoy_config, pod_security
from tests.deploy.chart_render import component, find
from tests.deploy.paths import CHART
from tests.deploy.strict_yaml import load

pytestmark = pytest.mark.deploy

WORKLOADS = ("Deployment", "StatefulSet")
DEFAULTS = load((CHART / "values.yaml").read_text())


@pytest.fixture(scope="module", params=list(chart_render.VALUES_FILES))
def release(request):
    values = chart_render.values(request.param)
    return request.param, values, chart_render.manifests(chart_render.render(values))


def pods(objects):
    return [(o["metadata"]["name"], o["spec"]["template"]) for o in objects if o["kind"] in WORKLOADS]


def test_every_pod_meets_the_restricted_pod_security_standard(release):
    _, _, objects = release
    assert len(pods(objects)) >= 2
    for name, template in pods(objects):
        assert pod_security.violations(template["spec"]) == [], name
        for container in template["spec"]["containers"]:
            # The only writable places are emptyDirs (a read-only root needs /tmp at least).
            writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
            empty_dirs = {v["name"] for v in template["spec"]["volumes"] if "emptyDir" in v}
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "/tmp" in writable
            assert {mounts[path] for path in writable} <= empty_dirs, name


@pytest.mark.parametrize(
    ("change", "control"),
    [
        (lambda pod: pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}}), "hostPath volumes"),
        (lambda pod: pod["securityContext"].update(runAsUser=0), "runAsUser=0"),
        (lambda pod: pod["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (
            lambda pod: pod["containers"][0]["securityContext"]["capabilities"].update(drop=[]),
            "does not drop ALL",
        ),
        (
            lambda pod: pod["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
            "adds ['SYS_ADMIN']",
        ),
        (
            lambda pod: pod["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
            "allowPrivilege",
        ),
        (lambda pod: pod["containers"][0]["securityContext"].update(privileged=True), "privileged"),
        (lambda pod: pod.update(hostNetwork=True), "host namespaces"),
        (
            lambda pod: pod["containers"][0]["securityContext"].update(readOnlyRootFilesystem=False),
            "readOnly",
        ),
    ],
)
def test_the_checker_catches_each_control(change, control):
    objects = chart_render.manifests(chart_render.render({}))
    pod = copy.deepcopy(find(objects, "StatefulSet")["spec"]["template"]["spec"])
    change(pod)
    assert any(control in problem for problem in pod_security.violations(pod))


def selected(objects, selector):
    """Names of the workloads whose pods `selector` (matchLabels) selects."""
    labels = selector["matchLabels"]
    return sorted(
        o["metadata"]["name"]
        for o in objects
        if o["kind"] in WORKLOADS and labels.items() <= o["spec"]["template"]["metadata"]["labels"].items()
    )


def split_peers(objects, peers):
    """(workloads selected by the pod-only peers, every other peer as written)."""
    own = sorted(
        name for p in peers if set(p) == {"podSelector"} for name in selected(objects, p["podSelector"])
    )
    return own, [p for p in peers if set(p) != {"podSelector"}]


def container_port_names(workload):
    return {
        p["name"]: p["containerPort"] for p in workload["spec"]["template"]["spec"]["containers"][0]["ports"]
    }


def test_engines_accept_grpc_only_from_the_stack_and_metrics_only_from_monitoring(release):
    name, values, objects = release
    np_values = values.get("networkPolicy", {})
    engine = find(objects, "StatefulSet")
    policy = find(objects, "NetworkPolicy", engine["metadata"]["name"])
    assert selected(objects, policy["spec"]["podSelector"]) == [engine["metadata"]["name"]]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = policy["spec"]["ingress"]
    own, others = split_peers(objects, grpc_rule["from"])
    envoy = ["conduit-envoy"] if values.get("envoy", {}).get("enabled") else []
    gateway = component(objects, "Deployment", "gateway")["metadata"]["name"]
    assert own == sorted([engine["metadata"]["name"], gateway, *envoy])
    assert others == np_values.get("engineClients", [])
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert "grpc" in container_port_names(engine)
    # The engines always serve metrics (engine.metrics.port): only the monitoring namespace reaches them.
    monitoring = np_values.get("monitoring", DEFAULTS["networkPolicy"]["monitoring"])["namespaceSelector"]
    assert metrics_rule == {
        "from": [{"namespaceSelector": monitoring}],
        "ports": [{"port": "metrics", "protocol": "TCP"}],
    }
    default_port = DEFAULTS["engine"]["metrics"]["port"]
    metrics_port = values.get("engine", {}).get("metrics", {}).get("port", default_port)
    assert container_port_names(engine)["metrics"] == metrics_port


def test_gateways_accept_only_envoy_the_ingress_and_monitoring_and_never_on_the_admin_port(release):
    _, values, objects = release
    gateway = component(objects, "Deployment", "gateway")
    policy = find(objects, "NetworkPolicy", gateway["metadata"]["name"])
    assert selected(objects, policy["spec"]["podSelector"]) == [gateway["metadata"]["name"]]
    rules = policy["spec"]["ingress"]
    api_rule = rules[0]
    own, others = split_peers(objects, api_rule["from"])
    assert own == (["conduit-envoy"] if values.get("envoy", {}).get("enabled") else [])
    default_clients = DEFAULTS["networkPolicy"]["gatewayClients"]
    assert others == values.get("networkPolicy", {}).get("gatewayClients", default_clients)
    for rule in rules:
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]  # never "admin"
    monitor = values.get("metrics", {}).get("serviceMonitor", {}).get("enabled", False)
    assert len(rules) == 2 if monitor else len(rules) == 1
    if values.get("envoy", {}).get("enabled"):
        envoy_policy = find(objects, "NetworkPolicy", "conduit-envoy")
        assert envoy_policy["spec"]["ingress"] == [
            {"ports": [{"port": "http", "protocol": "TCP"}, {"port": "grpc", "protocol": "TCP"}]}
        ]


def test_network_policies_can_be_switched_off():
    objects = chart_render.manifests(chart_render.render({"networkPolicy": {"enabled": False}}))
    assert "NetworkPolicy" not in chart_render.kinds(objects)


def secure():
    values = chart_render.values("secure")
    return values, chart_render.manifests(chart_render.render(values))


def mounts_of(workload):
    """mountPath → the Secret (name, items) mounted there, for one workload's first container."""
    spec = workload["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
    return {
        m["mountPath"]: secrets[m["name"]]
        for m in spec["containers"][0]["volumeMounts"]
        if m["name"] in secrets
    }


def test_every_secret_comes_from_an_existing_secret_or_cert_manager():
    values, objects = secure()
    assert "Secret" not in chart_render.kinds(objects)
    issued = {c["spec"]["secretName"] for c in objects if c["kind"] == "Certificate"}
    existing = {
        values["auth"]["engineToken"]["existingSecret"],
        values["gateway"]["apiKeysFile"]["existingSecret"],
        values["gateway"]["adminKeys"]["existingSecret"],
    }
    mounted = {s["secretName"] for o in objects if o["kind"] in WORKLOADS for s in mounts_of(o).values()}
    assert mounted <= issued | existing
    assert issued <= mounted  # no Certificate is left unused
    gateway = component(objects, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in gateway["env"] if "valueFrom" in e}
    assert refs == {"CONDUIT_ADMIN_KEY": {"name": "conduit-admin-keys", "key": "admin-keys"}}


def arg(args, flag):
    return args[args.index(flag) + 1]


def under_a_mount(path, mounts) -> bool:
    return any(path.startswith(mount.rstrip("/") + "/") for mount in mounts)


def test_tls_and_token_flags_point_into_the_mounted_secrets_and_the_clis_accept_them():
    _, objects = secure()
    engine = find(objects, "StatefulSet")
    engine_args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    security = engine_cli.config_from_args(engine_cli.build_parser().parse_args(engine_args)).security
    paths = [security.tls_cert, security.tls_key, security.tls_client_ca, security.auth_token_file]
    paths += [security.engine_tls_ca, security.engine_tls_cert, security.engine_tls_key]
    assert all(path is not None and under_a_mount(path, mounts_of(engine)) for path in paths)
    gateway = component(objects, "Deployment", "gateway")
    gateway_args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    env = {"CONDUIT_ADMIN_KEY": "admin-secret"}
    config = gateway_cli.config_from_args(gateway_args, env)
    paths = [
        config.tls_cert,
        config.tls_key,
        config.engine_tls_ca,
        config.engine_tls_cert,
        config.engine_tls_key,
    ]
    paths += [config.engine_auth_token_file, config.api_keys_file]
    assert all(path is not None and under_a_mount(path, mounts_of(gateway)) for path in paths)
    assert config.admin_port == container_port_names(gateway)["admin"]
    probe = gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["scheme"] == "HTTPS"


def test_the_certificates_carry_the_names_every_client_checks():
    _, objects = secure()
    certificates = {c["metadata"]["name"]: c["spec"] for c in objects if c["kind"] == "Certificate"}
    engine_cert = certificates["conduit-engine"]
    # Engines present it to each other under mTLS (PullKv), so it is a client certificate too.
    assert engine_cert["usages"] == ["server auth", "client auth"]
    assert certificates["conduit-engine-client"]["usages"] == ["client auth"]
    gateway_args = component(objects, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    engine_args = find(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert arg(gateway_args, "--engine-tls-server-name") in engine_cert["dnsNames"]
    assert arg(engine_args, "--engine-tls-server-name") in engine_cert["dnsNames"]
    config = load(find(objects, "ConfigMap", "conduit-envoy")["data"]["envoy.yaml"])
    for cluster, cert in (("engine", "conduit-engine"), ("gateway", "conduit-gateway")):
        tls = envoy_config.cluster(config, cluster)["transport_socket"]["typed_config"]
        (san,) = tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
        assert san["matcher"]["exact"] in certificates[cert]["dnsNames"]
        assert tls["sni"] == san["matcher"]["exact"]


def test_without_mtls_the_gateway_gets_only_the_engines_ca():
    values = {"tls": {"engine": {"enabled": True, "existingSecret": "engine-tls", "mtls": False}}}
    objects = chart_render.manifests(chart_render.render(values))
    mounts = mounts_of(component(objects, "Deployment", "gateway"))
    assert mounts["/etc/conduit/engine-tls"] == {
        "secretName": "engine-tls",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    assert mounts_of(find(objects, "StatefulSet"))["/etc/conduit/tls"] == {"secretName": "engine-tls"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"engine": {"enabled": True}}}, "tls.engine.existingSecret: name a Secret"),
        (
            {"tls": {"engine": {"enabled": True, "existingSecret": "e", "mtls": True}}},
            "tls.engine.clientSecret",
        ),
        (
            {"tls": {"gateway": {"enabled": True}}, "certManager": {"enabled": True}},
            "certManager.issuerRef.name",
        ),
    ],
)
def test_a_tls_part_without_its_secret_is_refused_at_render(values, message):
    with pytest.raises(chart_render.helm.HelmRenderError, match=message):
        chart_render.render(values)
