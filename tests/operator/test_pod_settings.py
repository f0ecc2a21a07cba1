"""Settings a pod keeps from its creation, compared with its policy's (pure functions over Pod
dicts and producer reports): what is reported, once per pod and difference."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from refit_operator.discovery import PodView, pod_view
from refit_operator.pod_settings import OLD_SIDECAR, FixedSettingsWatch, fixed_drift
from refit_operator.policy_spec import PolicySpec, parse_spec
from refit_protocol.producer_api import FixedSettings, ProducerStatus, StreamSettings


def _spec(**extra: Any) -> PolicySpec:
    return parse_spec({"tokenSecret": {"name": "alpha-token"}, **extra})


def _view(name: str, secret: str = "alpha-token", key: str = "token") -> PodView:
    volume = {
        "name": "kuberefit-token",
        "secret": {"secretName": secret, "items": [{"key": key, "path": key}]},
    }
    view = pod_view(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"uid-{name}",
                "annotations": {"kuberefit.io/inject": "trainer", "kuberefit.io/policy": "p"},
            },
            "spec": {"containers": [{"name": "kuberefit-sidecar"}], "volumes": [volume]},
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        }
    )
    assert view is not None
    return view


DEFAULTS = FixedSettings(chunk_bytes="auto", baseline_storage="file")


def _status(fixed: FixedSettings | None, *, current: bool = True) -> ProducerStatus:
    """A trainer sidecar's status: of this release (`current`: it reports the settings in
    effect), or of the previous one (neither settings nor fixed settings)."""
    settings = StreamSettings(zstd_level=1, shuffle=True, bucket_bytes="auto")
    return ProducerStatus(
        producer=0,
        committed_version=0,
        committed_baseline="g",
        settings=settings if current else None,
        fixed=fixed if current else None,
    )


def test_a_pod_that_matches_its_policy_has_no_drift() -> None:
    view = _view("t0")
    assert view.token_secret == ("alpha-token", "token")
    assert fixed_drift(view, _spec(), DEFAULTS) == []
    assert fixed_drift(view, _spec(), None) == []  # a rollout pod: only its token Secret


def test_each_fixed_setting_is_named() -> None:
    """A pod created before its policy got the chart's token Secret and the default chunking
    and storage; each difference names the spec field and both values."""
    spec = _spec(chunkBytes="64Mi", baseline={"storage": "memory"})
    drift = fixed_drift(_view("t0", secret="kuberefit-token"), spec, DEFAULTS)
    assert len(drift) == 3
    assert drift[0].startswith("spec.tokenSecret is alpha-token (key token)")
    assert "kuberefit-token" in drift[0]
    assert drift[1] == (
        f"spec.chunkBytes is {64 << 20}; its baseline is laid out in auto-byte export chunks"
    )
    assert drift[2] == "spec.baseline.storage is memory; its baseline is kept in file"
    other_key = fixed_drift(_view("t0", key="other"), _spec(), DEFAULTS)
    assert other_key
    assert "key other" in other_key[0]


def test_the_watch_reports_each_difference_once_and_forgets_gone_pods() -> None:
    watch = FixedSettingsWatch()
    stale, fresh = _view("t0", secret="kuberefit-token"), _view("t1")
    watch.saw(fresh, _status(FixedSettings(chunk_bytes=1 << 20, baseline_storage="file")))
    watch.saw(stale, _status(FixedSettings(chunk_bytes=1 << 20, baseline_storage="file")))
    assert watch.all_follow([stale, fresh])
    new = watch.check([stale, fresh], _spec())
    assert [v.name for v, _ in new] == ["t0", "t1"]
    assert "delete the pod" in new[0][1].lower()
    assert len(watch.current) == 2
    assert watch.current[0].startswith("t0: spec.tokenSecret")
    assert watch.check([stale, fresh], _spec()) == []  # reported already
    assert len(watch.current) == 2  # still listed for the condition
    # The policy changes to what both hold: t0's token Secret is left, reported already.
    assert watch.check([stale, fresh], _spec(chunkBytes=1 << 20)) == []
    assert [line.split(":")[0] for line in watch.current] == ["t0"]
    # t0 is recreated with the policy's Secret (a new pod): nothing left.
    assert watch.check([fresh, _view("t0-new")], _spec(chunkBytes=1 << 20)) == []
    assert watch.current == ()
    # A difference that comes back is reported again.
    assert [v.name for v, _ in watch.check([fresh], _spec())] == ["t1"]


def test_a_sidecar_of_the_previous_release_gets_no_settings_and_is_named() -> None:
    """Plans carry the stream settings only when every trainer sidecar takes them (an older
    one refuses unknown fields); the older one is reported until it is recreated."""
    watch = FixedSettingsWatch()
    old, new = _view("t0"), _view("t1")
    watch.saw(old, _status(None, current=False))
    watch.saw(new, _status(DEFAULTS))
    assert not watch.all_follow([old, new])
    assert watch.all_follow([new])
    assert fixed_drift(old, _spec(), None, follows=False) == [OLD_SIDECAR]
    (reported,) = watch.check([old, new], _spec())
    assert reported[0].name == "t0"
    assert "predates settings that follow the policy" in reported[1]


def test_a_pod_injected_for_another_transport_or_store_is_reported() -> None:
    s3 = {"transport": "s3", "s3": {"bucket": "payloads", "endpointUrl": "https://s:1"}}
    spec = _spec(**s3)
    store = spec.s3_settings()
    assert store is not None
    trainer = _view("t0")  # injected before the annotation existed: the relay tree
    assert fixed_drift(trainer, spec, DEFAULTS) == [
        "spec.transport is s3; the pod's sidecar was injected for zmq"
    ]
    same = replace(trainer, transport="s3", s3_settings=store.digest())
    assert fixed_drift(same, spec, DEFAULTS) == []
    moved = _spec(transport="s3", s3={"bucket": "payloads", "endpointUrl": "https://s:2"})
    assert fixed_drift(same, moved, DEFAULTS) == [
        "spec.s3 changed after the pod was created; its sidecar has the old settings"
    ]
    # Back to the relay tree: a trainer must be recreated, a rollout pod still has its relay.
    assert fixed_drift(same, _spec(), DEFAULTS) == [
        "spec.transport is zmq; its sidecar sends over s3"
    ]
    assert fixed_drift(replace(same, role="rollout"), _spec(), None) == []
