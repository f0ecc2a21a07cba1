"""Which pods take part in a policy, and at which address (pure functions over Pod dicts)."""

from __future__ import annotations

from typing import Any

from refit_operator.discovery import discover, pod_view
from refit_operator.policy_spec import parse_spec
from refit_operator.policy_status import Observed, policy_status


def _pod(name: str, role: str, **kw: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": kw.get("uid", f"uid-{name}"),
            "labels": kw.get("labels", {}),
            "annotations": {"kuberefit.io/inject": role, "kuberefit.io/policy": "p"},
            **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if kw.get("deleting") else {}),
        },
        "spec": {
            "containers": [
                {"name": "main"},
                {
                    "name": "kuberefit-sidecar",
                    "ports": [
                        {"name": "refit-control", "containerPort": kw.get("port", 9000)},
                        {"name": "refit-relay", "containerPort": 9001},
                        {"name": "refit-relay-mac", "containerPort": 9002},
                    ],
                },
            ]
        },
        "status": {
            "phase": kw.get("phase", "Running"),
            "podIP": kw.get("ip", "10.0.0.7"),
            "containerStatuses": [
                {"name": "main", "restartCount": 5},
                {"name": "kuberefit-sidecar", "restartCount": kw.get("restarts", 0)},
            ],
        },
    }


def test_address_and_identity_from_the_pod() -> None:
    view = pod_view(_pod("r0", "rollout"))
    assert view is not None
    assert view.url == "http://10.0.0.7:9000"
    assert view.relay_endpoint == "tcp://10.0.0.7:9001"
    assert view.relay_mac_endpoint == "tcp://10.0.0.7:9002"
    assert view.incarnation == ("uid-r0", 0)  # the main container's restarts do not count
    v6 = pod_view(_pod("r1", "rollout", ip="fd00::7"))
    assert v6 is not None
    assert v6.url == "http://[fd00::7]:9000"
    restarted = pod_view(_pod("r0", "rollout", restarts=1))
    assert restarted is not None
    assert restarted.incarnation != view.incarnation


def test_a_native_sidecar_is_found_among_the_init_containers() -> None:
    """Kubernetes 1.29+: the trainer sidecar is an init container with restartPolicy Always,
    and its restarts are in initContainerStatuses."""
    pod = _pod("t0", "trainer", port=9100)
    sidecar = pod["spec"]["containers"].pop()
    pod["spec"]["initContainers"] = [{"name": "setup"}, {**sidecar, "restartPolicy": "Always"}]
    status = pod["status"]["containerStatuses"].pop()
    pod["status"]["initContainerStatuses"] = [{"name": "setup", "restartCount": 0}, status]
    view = pod_view(pod)
    assert view is not None
    assert view.url == "http://10.0.0.7:9100"
    status["restartCount"] = 2
    restarted = pod_view(pod)
    assert restarted is not None
    assert restarted.incarnation == ("uid-t0", 2)


def test_pods_without_both_annotations_are_not_members() -> None:
    pod = _pod("x", "rollout")
    del pod["metadata"]["annotations"]["kuberefit.io/policy"]
    assert pod_view(pod) is None


def test_default_ports_when_the_sidecar_names_none() -> None:
    pod = _pod("t", "trainer")
    pod["spec"]["containers"][1]["ports"] = []
    view = pod_view(pod)
    assert view is not None
    assert view.control_port == 8471
    assert view.relay_endpoint == ""


def test_discover_splits_roles_applies_selectors_and_readiness() -> None:
    spec = parse_spec(
        {
            "tokenSecret": {"name": "t"},
            "selector": {"rollout": {"matchLabels": {"app": "r"}}},
        }
    )
    pods = [
        pod_view(_pod("t0", "trainer")),
        pod_view(_pod("r1", "rollout", labels={"app": "r"})),
        pod_view(_pod("r0", "rollout", labels={"app": "r"})),
        pod_view(_pod("r2", "rollout", labels={"app": "r"}, phase="Pending")),
        pod_view(_pod("r3", "rollout", labels={"app": "r"}, deleting=True)),
        pod_view(_pod("r4", "rollout", labels={"app": "other"})),
        pod_view(_pod("x", "sidecar")),
    ]
    found = discover([p for p in pods if p is not None], spec)
    assert [p.name for p in found.trainers] == ["t0"]
    assert [p.name for p in found.rollouts] == ["r0", "r1", "r2", "r3"]
    assert [p.name for p in found.ready_rollouts] == ["r0", "r1"]
    assert [p.name for p in found.unknown_role] == ["x"]


def test_servers_spanning_several_pods_are_counted_once() -> None:
    """Pods injection labelled `kuberefit.io/server` are one vLLM server, ready when every pod
    runs; the others are a server each (the ROLLOUTS column)."""
    spec = parse_spec({"tokenSecret": {"name": "t"}})
    big0, big1 = {"kuberefit.io/server": "big-0"}, {"kuberefit.io/server": "big-1"}
    pods = [
        pod_view(_pod("big-0", "rollout", labels=big0)),
        pod_view(_pod("big-0-1", "rollout", labels=big0)),
        pod_view(_pod("big-1", "rollout", labels=big1)),
        pod_view(_pod("big-1-1", "rollout", labels=big1, phase="Pending")),
        pod_view(_pod("small", "rollout")),
    ]
    found = discover([p for p in pods if p is not None], spec)
    assert found.servers() == (2, 3)  # big-0 and small run; big-1 waits for a pod
    rendered = policy_status(
        Observed(1, rollouts=5, rollouts_ready=4, servers=3, servers_ready=2), None
    )
    assert rendered["rollouts"] == "2/3 servers (4/5 pods)"
    assert (
        policy_status(Observed(1, rollouts=2, rollouts_ready=1, servers=2), None)["rollouts"]
        == "1/2"
    )
