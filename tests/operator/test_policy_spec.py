"""RefitPolicy specs: defaults, selectors and the rules the 1.20 schema cannot express."""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from refit_operator.policy_spec import LabelSelector, PolicySpec, SpecError, parse_spec

TOKEN = {"tokenSecret": {"name": "t"}}


def test_defaults_map_to_the_coordinator() -> None:
    spec = parse_spec({**TOKEN, "mode": "async", "postApplyChecks": -1, "transport": "zmq"})
    cfg = spec.coordinator_config()
    assert cfg.sync is False
    assert cfg.relay_tree is True
    assert cfg.intra_cluster == "mac"  # relay to relay: MAC-only unless the policy encrypts
    assert cfg.check_samples == -1
    spec = parse_spec({**TOKEN, "security": {"intraCluster": "encrypted"}})
    assert spec.coordinator_config().intra_cluster == "encrypted"
    assert (cfg.commit_timeout_s, cfg.control_timeout_s, cfg.max_attempts) == (600.0, 60.0, 5)


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ({"transport": "s3"}, "spec.s3.bucket is required when spec.transport is s3"),
        ({"transport": "s3", "s3": {"region": "x"}}, "spec.s3.bucket"),
        ({"transport": "s3", "s3": {"bucket": "b"}}, "spec.s3.bucket is required"),
        (
            {"s3": {"endpointUrl": "http://store:8333"}},
            "spec.s3.endpointUrl http://store:8333 is plain HTTP",
        ),
        ({"s3": {"endpointUrl": "store:8333"}}, "spec.s3.endpointUrl must be http"),
        ({"s3": {"sseKmsKeyId": "k"}}, "spec.s3.sseKmsKeyId needs"),
        ({"s3": {"caBundle": {"key": "ca.pem"}}}, "spec.s3.caBundle names exactly one"),
        ({"s3": {"caBundle": {"secret": "a", "configMap": "b"}}}, "spec.s3.caBundle names"),
        ({"s3": {"caBundle": {"secret": "a", "key": ".."}}}, "spec.s3.caBundle.key"),
        ({"s3": {"caBundle": {"secret": "a", "key": "a/b"}}}, "spec.s3.caBundle.key"),
        ({"restore": {"checkpointTemplate": "/ckpt/latest"}}, "spec.restore.checkpointTemplate"),
        ({"maxAttempts": 0}, "spec.maxAttempts"),
        ({"encoding": {"zstdLevel": 40}}, "spec.encoding.zstdLevel"),
        ({"mode": "eventually"}, "spec.mode"),
        ({"verify": {"everyVersions": 2}}, "spec.verify.everyVersions needs spec.restore"),
        ({"verify": {"everyVersions": -1}}, "spec.verify.everyVersions"),
        ({"chunkBytes": "lots"}, "spec.chunkBytes"),
        ({"bucketBytes": 0}, "spec.bucketBytes"),
    ],
)
def test_errors_name_the_field(spec: dict[str, object], names: str) -> None:
    with pytest.raises(SpecError, match=names.replace(".", r"\.")):
        parse_spec({**TOKEN, **spec})


def test_an_s3_policy_gives_injection_the_store_without_secrets() -> None:
    spec = parse_spec(
        {
            **TOKEN,
            "transport": "s3",
            "s3": {
                "bucket": "payloads",
                "endpointUrl": "https://store.example:8333",
                "credentialsSecret": "s3-keys",
                "caBundle": {"configMap": "store-ca"},
                "addressingStyle": "path",
                "serverSideEncryption": "aws:kms",
                "sseKmsKeyId": "alias/refit",
            },
        }
    )
    assert spec.coordinator_config().relay_tree is False  # receivers download, no tree
    settings = spec.s3_settings()
    assert settings is not None
    store = settings.store()
    assert store["ca_bundle"] == "/etc/kuberefit/s3-ca/ca.crt"
    assert store["endpoint_url"] == "https://store.example:8333"
    assert (store["server_side_encryption"], store["sse_kms_key_id"]) == ("aws:kms", "alias/refit")
    assert "credentials_secret" not in store
    assert "access_key_id" not in store
    # What the sidecar is given must be a valid S3Config of the sidecar (same field names).
    from refit_sidecar.transport.s3 import S3Config

    assert S3Config.model_validate(store).bucket == "payloads"
    # The digest names the settings: any change is a different digest (RestartRequired).
    other = parse_spec({**TOKEN, "transport": "s3", "s3": {"bucket": "payloads"}})
    assert other.s3_settings() is not None
    assert settings.digest() != other.s3_settings().digest()  # type: ignore[union-attr]
    assert parse_spec({**TOKEN, "s3": {"bucket": "payloads"}}).s3_settings() is None  # zmq


def test_token_secret_is_required() -> None:
    with pytest.raises(SpecError, match=r"spec\.tokenSecret"):
        parse_spec({})


def test_label_selector_semantics() -> None:
    sel = LabelSelector.model_validate(
        {
            "matchLabels": {"app": "rollout"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "canary", "operator": "DoesNotExist"},
                {"key": "zone", "operator": "NotIn", "values": ["bad"]},
                {"key": "gpu", "operator": "Exists"},
            ],
        }
    )
    base = {"app": "rollout", "tier": "a", "gpu": "h200"}
    assert sel.matches(base)
    assert sel.matches({**base, "zone": "good"})
    assert not sel.matches({**base, "zone": "bad"})
    assert not sel.matches({**base, "canary": "1"})
    assert not sel.matches({**base, "tier": "c"})
    assert not sel.matches({k: v for k, v in base.items() if k != "gpu"})
    assert not sel.matches({**base, "app": "trainer"})
    assert LabelSelector().matches({})


def test_sizes_default_to_auto_and_take_units() -> None:
    """`auto` (the CRD's default) lets every trainer sidecar size chunks from the checkpoint;
    a size may be written as Kubernetes quantities are."""
    spec = parse_spec(TOKEN)
    assert (spec.chunk_bytes, spec.bucket_bytes) == ("auto", "auto")
    spec = parse_spec({**TOKEN, "chunkBytes": "64Mi", "bucketBytes": 1 << 27})
    assert (spec.chunk_bytes, spec.bucket_bytes) == (64 << 20, 128 << 20)


# --- the CRD and the model: one meaning, checked both ways ----------------------------------

CRD = Path(__file__).resolve().parents[2] / "crds" / "refit.kuberefit.io_refitpolicies.yaml"


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (also through `X | None`), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _bounds(field: FieldInfo) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for meta in field.metadata:
        if getattr(meta, "ge", None) is not None:
            out["minimum"] = meta.ge
        if getattr(meta, "le", None) is not None:
            out["maximum"] = meta.le
    return out


def _differences(model: type[BaseModel], schema: dict[str, Any], path: str) -> list[str]:
    """Where the CRD schema at `path` and `model` disagree: field names, defaults, enums and
    bounds (what `parse_spec` assumes of specs the API server admitted)."""
    props = schema.get("properties") or {}
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    out = [f"{path}.{k}: in the CRD, not in {model.__name__}" for k in props.keys() - fields]
    out += [f"{path}.{k}: in {model.__name__}, not in the CRD" for k in fields.keys() - props]
    for key in sorted(fields.keys() & props.keys()):
        field, node, where = fields[key], props[key], f"{path}.{key}"
        if typing.get_origin(field.annotation) is list:
            item = _model_of(typing.get_args(field.annotation)[0])
            if item is not None:
                out += _differences(item, node.get("items") or {}, f"{where}[*]")
            continue
        nested = _model_of(field.annotation)
        if nested is not None:
            out += _differences(nested, node, where)
            continue
        literal = typing.get_origin(field.annotation) is typing.Literal
        if literal and set(node.get("enum", [])) != set(typing.get_args(field.annotation)):
            out.append(f"{where}: enum {node.get('enum')} vs {field.annotation}")
        if "default" in node and not field.is_required():
            default = field.get_default(call_default_factory=True)
            if node["default"] != default:
                out.append(f"{where}: default {node['default']!r} vs {default!r}")
        for bound, value in _bounds(field).items():
            if node.get(bound) != value:
                out.append(f"{where}: {bound} {node.get(bound)} vs {value}")
    return out


def test_the_crd_schema_and_the_spec_model_agree() -> None:
    crd = yaml.safe_load(CRD.read_text())
    [version] = crd["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert _differences(PolicySpec, spec, "spec") == []
    # The check sees a difference when there is one.
    changed = copy.deepcopy(spec)
    changed["properties"]["maxAttempts"]["default"] = 6
    del changed["properties"]["paused"]
    assert _differences(PolicySpec, changed, "spec") == [
        "spec.paused: in PolicySpec, not in the CRD",
        "spec.maxAttempts: default 6 vs 5",
    ]
