"""The Kubernetes Pod Security Standards' "restricted" profile (baseline included), checked on rendered
pod specs, plus the chart's own rule that every root filesystem is read-only.

Written from the standard's published controls (kubernetes.io/docs/concepts/security/pod-security-
standards, policy version "latest"); `violations` names each failed control and where, like the
admission controller's warnings, so a test can show exactly what a manifest breaks.
"""

from __future__ import annotations

from typing import Any

# Baseline: capabilities that may be added; restricted narrows this to NET_BIND_SERVICE.
RESTRICTED_ADDABLE = {"NET_BIND_SERVICE"}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
NON_VOLUME_KEYS = {"name"}


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]


def _baseline(pod: dict[str, Any]) -> list[str]:
    problems = [f"host namespaces: {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    pod_context = pod.get("securityContext", {})
    for sysctl in pod_context.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            problems.append(f"sysctls: {sysctl['name']}")
    for volume in pod.get("volumes", []):
        if "hostPath" in volume:
            problems.append(f"hostPath volumes: {volume['name']}")
    contexts = [("pod", pod_context)] + [(c["name"], c.get("securityContext", {})) for c in containers(pod)]
    for where, context in contexts:
        selinux = context.get("seLinuxOptions", {})
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            problems.append(f"SELinux: {where}")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            problems.append(f"seccomp: {where} is Unconfined")
        if context.get("appArmorProfile", {}).get("type") == "Unconfined":
            problems.append(f"AppArmor: {where} is Unconfined")
    for container in containers(pod):
        name, context = container["name"], container.get("securityContext", {})
        if context.get("privileged"):
            problems.append(f"privileged: {name}")
        if context.get("procMount", "Default") != "Default":
            problems.append(f"procMount: {name}")
        problems += [f"hostPorts: {name}" for port in container.get("ports", []) if port.get("hostPort")]
    return problems


def _restricted(pod: dict[str, Any]) -> list[str]:
    problems = []
    for volume in pod.get("volumes", []):
        kinds = set(volume) - NON_VOLUME_KEYS
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume types: {volume['name']} is {sorted(kinds)}")
    pod_context = pod.get("securityContext", {})
    pod_seccomp = pod_context.get("seccompProfile", {}).get("type")
    for container in containers(pod):
        name, context = container["name"], container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"allowPrivilegeEscalation != false: {name}")
        if not context.get("runAsNonRoot", pod_context.get("runAsNonRoot", False)):
            problems.append(f"runAsNonRoot != true: {name}")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            problems.append(f"runAsUser=0: {name}")
        if context.get("seccompProfile", {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            problems.append(f"seccompProfile: {name}")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"capabilities: {name} does not drop ALL")
        added = set(capabilities.get("add", [])) - RESTRICTED_ADDABLE
        if added:
            problems.append(f"capabilities: {name} adds {sorted(added)}")
    return problems


def _read_only_root(pod: dict[str, Any]) -> list[str]:
    return [
        f"readOnlyRootFilesystem != true: {c['name']}"
        for c in containers(pod)
        if c.get("securityContext", {}).get("readOnlyRootFilesystem") is not True
    ]


def violations(pod: dict[str, Any]) -> list[str]:
    """Every restricted-profile control `pod` (a PodSpec) fails, and containers with a writable root."""
    return _baseline(pod) + _restricted(pod) + _read_only_root(pod)
