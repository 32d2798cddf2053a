"""charts/conduit's responses.store: the memory default, an external Redis with its password from a
Secret, and the optional single-replica Redis in the chart; each renders, validates strictly, lints, and
hands the gateway flags its CLI accepts."""

from __future__ import annotations

import pytest

from conduit_gateway import cli as gateway_cli
from tests.deploy import chart_render
from tests.deploy.chart_render import NAMESPACE, component

pytestmark = pytest.mark.deploy

KUBERNETES_VERSION = chart_render.newest_kubernetes_versions(1)[0]
BUNDLED = {
    "responses": {
        "store": "redis",
        "redis": {"enabled": True},
        "redisPassword": {"existingSecret": "conduit-redis"},
    }
}
EXTERNAL = {"responses": {"store": "redis", "redisUrl": "rediss://redis.example:6380/2", "ttlSeconds": 600}}


def _render(values: dict) -> list[dict]:
    objects = chart_render.manifests(chart_render.render(values))
    for obj in objects:
        assert chart_render.validation_problem(obj, KUBERNETES_VERSION) is None
    assert chart_render.lint_problems(values, KUBERNETES_VERSION) == []
    return objects


def _gateway_config(objects: list[dict]):
    (container,) = component(objects, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    return container, gateway_cli.config_from_args(container["args"], {})


def test_default_is_the_memory_store_without_redis():
    objects = _render({})
    _, config = _gateway_config(objects)
    assert (config.response_store, config.response_store_ttl_s) == ("memory", 3600.0)
    assert config.response_store_max_bytes == 268435456
    assert not [obj for obj in objects if obj["metadata"]["name"].endswith("-redis")]


def test_an_external_redis_is_passed_as_its_url():
    objects = _render(EXTERNAL)
    _, config = _gateway_config(objects)
    assert (config.response_store, config.response_store_ttl_s) == ("rediss://redis.example:6380/2", 600.0)
    assert config.response_store_password_file is None
    assert not [obj for obj in objects if obj["metadata"]["name"].endswith("-redis")]


def test_the_bundled_redis_serves_the_gateways_only_with_the_password_from_a_secret():
    objects = _render(BUNDLED)
    container, config = _gateway_config(objects)
    assert config.response_store == f"redis://demo-conduit-redis.{NAMESPACE}.svc.cluster.local:6379/0"
    assert config.response_store_password_file == "/etc/conduit/redis/password"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "redis-password")
    assert mount == {"name": "redis-password", "mountPath": "/etc/conduit/redis", "readOnly": True}

    redis = component(objects, "Deployment", "redis")
    spec = redis["spec"]
    assert spec["replicas"] == 1
    (server,) = spec["template"]["spec"]["containers"]
    assert server["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert server["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "conduit-redis", "key": "redis-password"}
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    service = component(objects, "Service", "redis")
    assert service["spec"]["ports"][0]["port"] == 6379
    policy = component(objects, "NetworkPolicy", "redis")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"


def test_redis_without_a_url_or_the_bundled_one_is_refused():
    with pytest.raises(Exception, match="responses.redisUrl or responses.redis.enabled"):
        chart_render.render({"responses": {"store": "redis"}})


def test_notes_warn_when_several_gateway_pods_keep_their_own_memory_store():
    notes = chart_render.render({})["conduit/templates/NOTES.txt"]  # autoscaled: 2 to 10 pods
    assert "each gateway pod keeps its own stored" in notes
    single = {"gateway": {"replicas": 1, "autoscaling": {"enabled": False}}}
    assert "keeps its own" not in chart_render.render(single)["conduit/templates/NOTES.txt"]
    assert "shared by every gateway pod" in chart_render.render(BUNDLED)["conduit/templates/NOTES.txt"]
