"""Rendering charts/conduit offline with helm-python-sdk (Helm's Go SDK) and indexing the manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
from kubernetes_validate import utils as kubernetes_validate_utils
from packaging.version import Version

from tests.deploy import strict_yaml
from tests.deploy.paths import CHART

RELEASE = "demo"
NAMESPACE = "llm"
# The values files every check runs on: the defaults, a GPU install, every optional part switched on, and
# every secure boundary switched on (TLS everywhere, cert-manager, token, keys file, admin port).
VALUES_FILES: dict[str, Path | None] = {
    "default": None,
    "gpu": CHART / "ci" / "gpu-values.yaml",
    "full": CHART / "ci" / "full-values.yaml",
    "secure": CHART / "ci" / "secure-values.yaml",
}


def values(name: str) -> dict[str, Any]:
    path = VALUES_FILES[name]
    return {} if path is None else strict_yaml.load(path.read_text())


def render(overrides: dict[str, Any]) -> dict[str, str]:
    """Template path → rendered text, as `helm template demo charts/conduit -n llm -f ...` would print."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(overrides, name=RELEASE, namespace=NAMESPACE, is_install=True)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render, parsed with a loader that refuses duplicate keys."""
    objects: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for document in strict_yaml.load_all(text):
            assert isinstance(document, dict), f"{path}: a document is not a mapping"
            objects.append(document)
    return objects


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (
        f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    )
    return found[0]


def component(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of `kind` labelled app.kubernetes.io/component=`name` (engine, gateway, envoy)."""
    found = [
        o
        for o in objects
        if o["kind"] == kind and o["metadata"]["labels"].get("app.kubernetes.io/component") == name
    ]
    assert len(found) == 1, f"expected one {kind} of component {name}, found {len(found)}"
    return found[0]


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objects)


def newest_kubernetes_versions(count: int = 2) -> list[str]:
    """The `count` newest Kubernetes minor versions whose schemas kubernetes-validate bundles."""
    versions = sorted(set(kubernetes_validate_utils.all_versions()), key=Version)
    return versions[-count:]


def validation_problem(obj: dict[str, Any], kubernetes_version: str) -> str | None:
    """What `kubernetes-validate --strict` finds wrong with one object, naming it and the path, or None."""
    try:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        return f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}"
    return None


def lint_problems(values: dict[str, Any], kubernetes_version: str) -> list[Any]:
    """Errors and warnings of `helm lint --strict` with these values ("icon is recommended" is only
    information, severity 1)."""
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{kubernetes_version}")
    return [*report["errors"], *(m for m in report["messages"] if m["severity"] >= 2)]
