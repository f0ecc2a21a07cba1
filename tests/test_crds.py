"""The CRDs in crds/ install on a real apiserver, default their fields, support compare-and-set
on status, and print the columns `kubectl get` shows. The Helm chart carries the same files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from refit_operator.policy_spec import PolicySpec
from refit_protocol.transports import TRANSPORT_KINDS
from tests.harness.kube import KubeCluster

REPO = Path(__file__).resolve().parents[1]
CRD_FILES = sorted((REPO / "crds").glob("*.yaml"))  # what the chart must ship
GROUP, VERSION = "refit.kuberefit.io", "v1alpha1"


@pytest.fixture
def crds(refit_crds: KubeCluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(refit_crds.api_client())


def _obj(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }


def test_refit_policy_defaults_and_validation(crds: client.CustomObjectsApi) -> None:
    created = crds.create_namespaced_custom_object(
        GROUP,
        VERSION,
        "default",
        "refitpolicies",
        _obj("RefitPolicy", "p1", {"tokenSecret": {"name": "t"}}),
    )
    spec = created["spec"]
    assert spec["transport"] == "zmq"
    assert spec["mode"] == "sync"
    assert (spec["chunkBytes"], spec["bucketBytes"]) == ("auto", "auto")  # sized from H
    assert spec["tokenSecret"] == {"name": "t", "key": "token"}
    assert spec["encoding"] == {"zstdLevel": 1, "shuffle": True}
    assert spec["baseline"] == {"storage": "file"}
    assert (spec["paused"], spec["keepTransitions"], spec["producers"]) == (False, 20, 1)
    # The operator's own defaults (refit_operator.policy_spec) are the schema's.
    from refit_operator.policy_spec import PolicySpec

    model = PolicySpec.model_validate({"tokenSecret": {"name": "t"}})
    apart = {"selector", "s3", "restore"}  # no schema defaults inside these
    assert model.model_dump(by_alias=True, exclude=apart) == {
        k: v for k, v in spec.items() if k not in apart
    }
    with pytest.raises(ApiException) as err:
        crds.create_namespaced_custom_object(
            GROUP,
            VERSION,
            "default",
            "refitpolicies",
            _obj("RefitPolicy", "p2", {"transport": "carrier-pigeon"}),
        )
    assert err.value.status == 422


def test_policy_version_status_is_compare_and_set(crds: client.CustomObjectsApi) -> None:
    pv = crds.create_namespaced_custom_object(
        GROUP, VERSION, "default", "policyversions", _obj("PolicyVersion", "p1", {"policy": "p1"})
    )
    pv["status"] = {"version": 0, "baselineId": "b0"}
    pv = crds.replace_namespaced_custom_object_status(
        GROUP, VERSION, "default", "policyversions", "p1", pv
    )
    stale = dict(pv, status={"version": 1, "baselineId": "b1-old-attempt"})
    pv["status"] = {"version": 1, "baselineId": "b1"}
    crds.replace_namespaced_custom_object_status(
        GROUP, VERSION, "default", "policyversions", "p1", pv
    )
    with pytest.raises(ApiException) as err:
        crds.replace_namespaced_custom_object_status(
            GROUP, VERSION, "default", "policyversions", "p1", stale
        )
    assert err.value.status == 409
    now = crds.get_namespaced_custom_object(GROUP, VERSION, "default", "policyversions", "p1")
    assert now["status"] == {"version": 1, "baselineId": "b1"}


def test_refit_transition_printer_columns(crds: client.CustomObjectsApi, kube: KubeCluster) -> None:
    tr = crds.create_namespaced_custom_object(
        GROUP,
        VERSION,
        "default",
        "refittransitions",
        _obj("RefitTransition", "p1-v1", {"policy": "p1", "fromVersion": 0, "toVersion": 1}),
    )
    tr["status"] = {"phase": "Streaming", "attempt": 1, "mode": "mixed", "changedPercent": "1.02%"}
    crds.replace_namespaced_custom_object_status(
        GROUP, VERSION, "default", "refittransitions", "p1-v1", tr
    )
    # What `kubectl get refittransitions` asks for: a server-side Table.
    table = kube.get_json(
        f"/apis/{GROUP}/{VERSION}/namespaces/default/refittransitions",
        accept="application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns[:9] == [
        "Name",
        "Policy",
        "From",
        "To",
        "Phase",
        "Attempt",
        "Mode",
        "Changed",
        "Wire",
    ]
    assert table["rows"][0]["cells"][:8] == ["p1-v1", "p1", 0, 1, "Streaming", 1, "mixed", "1.02%"]


def test_chart_lints_strict_and_installs_the_crds() -> None:
    """The chart renders crds/ as templates (so `helm upgrade` upgrades them), unchanged but for
    its labels and the keep annotation; `crds.keep: false` drops the annotation and
    `crds.install: false` renders none. Not Helm's crds/ directory: it never upgrades."""
    chart_dir = REPO / "charts" / "kuberefit"
    report = helm_python.lint(chart_dir, strict=True, kube_version="v1.20.2")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
    sources = {(d := yaml.safe_load(p.read_text()))["metadata"]["name"]: d for p in CRD_FILES}
    with helm_python.Chart.load(chart_dir) as chart:
        assert chart.crds == []

        def rendered(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
            out = chart.render(values, name="kr", namespace="kr-system", is_install=True)
            docs = yaml.safe_load_all(out.get("kuberefit/templates/crds.yaml", ""))
            return {d["metadata"]["name"]: d for d in docs if d}

        crds = rendered({})
        assert crds.keys() == sources.keys()
        for name, crd in crds.items():
            meta = crd.pop("metadata")
            source = dict(sources[name])
            assert meta.pop("name") == name
            assert meta.pop("annotations") == {"helm.sh/resource-policy": "keep"}
            assert meta.pop("labels")["app.kubernetes.io/instance"] == "kr"
            assert meta == {k: v for k, v in source.pop("metadata").items() if k != "name"}
            assert crd == source
        assert all(
            "annotations" not in c["metadata"] for c in rendered({"crds": {"keep": False}}).values()
        )
        assert rendered({"crds": {"install": False}}) == {}


def _schema_nodes(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """Every node `kubectl explain` documents: `node` itself, each property (recursively) and
    the `items` of an array of objects, as (JSON path, schema)."""
    out = [(path, node)]
    for name, prop in (node.get("properties") or {}).items():
        out += _schema_nodes(prop, f"{path}.{name}")
    items = node.get("items")
    if isinstance(items, dict) and (items.get("type") == "object" or "properties" in items):
        out += _schema_nodes(items, f"{path}[*]")
    return out


def test_every_schema_field_is_described() -> None:
    """`kubectl explain <kind>.spec --recursive` reads as documentation: every field says what
    it means (a pure YAML walk of the schemas)."""
    undescribed: list[str] = []
    counts: dict[str, tuple[int, int]] = {}  # plural -> (described nodes, nodes)
    for path in CRD_FILES:
        crd = yaml.safe_load(path.read_text())
        plural = crd["spec"]["names"]["plural"]
        for version in crd["spec"]["versions"]:
            root = version["schema"]["openAPIV3Schema"]
            nodes = _schema_nodes(root, "$")
            missing = [p for p, n in nodes if not str(n.get("description") or "").strip()]
            undescribed += [f"{plural}/{version['name']}: {p}" for p in missing]
            done, total = counts.get(plural, (0, 0))
            counts[plural] = (done + len(nodes) - len(missing), total + len(nodes))
    assert undescribed == [], "schema nodes without a description:\n" + "\n".join(undescribed)
    assert set(counts) == {"refitpolicies", "refittransitions", "policyversions"}
    done, total = counts["refitpolicies"]
    assert total > 50, counts  # the walk reached the nested spec and status fields
    assert done >= total, counts  # 100%: every RefitPolicy field, spec and status


def test_the_policys_transport_enum_is_the_protocols_kinds() -> None:
    """`spec.transport` accepts exactly the kinds every layer names (`refit_protocol.transports`):
    a kind added to the protocol and not to the CRD (or the reverse) fails here, not in a
    user's `kubectl apply`."""
    (policy,) = [
        d for d in (yaml.safe_load(p.read_text()) for p in CRD_FILES)
        if d["spec"]["names"]["kind"] == "RefitPolicy"
    ]  # fmt: skip
    (version,) = policy["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    transport = spec["properties"]["transport"]
    assert transport["enum"] == list(TRANSPORT_KINDS)
    assert transport["default"] == PolicySpec.model_fields["transport"].default
