"""RefitPolicy specs: defaults, selectors and the rules the 1.20 schema cannot express."""

from __future__ import annotations

import pytest

from refit_operator.policy_spec import LabelSelector, SpecError, parse_spec

TOKEN = {"tokenSecret": {"name": "t"}}


def test_defaults_map_to_the_coordinator() -> None:
    spec = parse_spec({**TOKEN, "mode": "async", "postApplyChecks": -1, "transport": "zmq"})
    cfg = spec.coordinator_config()
    assert cfg.sync is False
    assert cfg.relay_tree is True
    assert cfg.check_samples == -1
    assert (cfg.commit_timeout_s, cfg.control_timeout_s, cfg.max_attempts) == (600.0, 60.0, 5)


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ({"transport": "s3"}, "spec.s3.bucket is required when spec.transport is s3"),
        ({"transport": "s3", "s3": {"region": "x"}}, "spec.s3.bucket"),
        ({"transport": "s3", "s3": {"bucket": "b"}}, "spec.transport s3 is not supported"),
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
