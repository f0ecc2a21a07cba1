"""The injection patch builder and the AdmissionReview codec (pure; the API server's own call
to the webhook is exercised by tests/test_helm_journey.py).

Patches are applied with `jsonpatch` (RFC 6902) exactly as the API server applies them, and the
injected settings are validated by the sidecars' own config models after `$(VAR)` expansion.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import jsonpatch
import pytest

from refit_operator.injection import (
    InjectionConfig,
    PolicyFacts,
    ReviewError,
    inject,
    parse_review,
    review_response,
)
from refit_operator.injection.config import TokenSecretRef
from refit_operator.policy_spec import parse_spec
from refit_protocol.pod_contract import VLLM_MIDDLEWARE, VLLM_WORKER_EXTENSION
from refit_sidecar.producer.main import ProducerProcessConfig
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.transport.s3 import S3TransportConfig
from tests.harness.pss import read_only_root_violations, restricted_violations

CFG = InjectionConfig()
POLICY = PolicyFacts(exists=True, token_secret=TokenSecretRef(name="alpha-token"), producers=2)


def _pod(
    role: str | None,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    **meta: Any,
) -> Any:
    annotations = {} if role is None else {"kuberefit.io/inject": role, "kuberefit.io/policy": "a"}
    annotations |= meta.pop("annotations", {})
    return {
        "metadata": {"generateName": "p-", "annotations": annotations, **meta},
        "spec": {
            **({"initContainers": init} if init else {}),
            "containers": containers
            or [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai",
                    "args": ["--model", "/m", "--port", "8123"],
                }
            ],
        },
    }


def _applied(pod: Any, policy: PolicyFacts = POLICY) -> Any:
    result = inject(pod, CFG, policy)
    assert result.denied is None, result.denied
    return jsonpatch.apply_patch(pod, result.patch)


def _sidecar(pod: Any) -> dict[str, Any]:
    (sidecar,) = [c for c in pod["spec"]["containers"] if c["name"] == "kuberefit-sidecar"]
    return dict(sidecar)


def _expand_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """What the kubelet does: downward-API fields, then $(VAR) from earlier variables."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            ref = e["valueFrom"].get("fieldRef")
            env[e["name"]] = fields[ref["fieldPath"]] if ref else f"<{e['valueFrom']}>"
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(e["value"]))
    return env


FIELDS = {"metadata.name": "p-abc", "status.podIP": "10.1.2.3"}


def test_pods_that_did_not_opt_in_are_never_changed() -> None:
    for pod in (_pod(None), _pod(None, annotations={"kuberefit.io/policy": "a"})):
        assert inject(pod, CFG, POLICY).patch == []


def test_rollout_injection_is_complete_and_valid() -> None:
    pod = _applied(_pod("rollout"))
    meta = pod["metadata"]
    assert meta["annotations"]["kuberefit.io/injected"] == "rollout"
    assert meta["labels"] == {"kuberefit.io/role": "rollout", "kuberefit.io/policy": "a"}
    sidecar = _sidecar(pod)
    assert sidecar["command"] == ["kuberefit", "receiver", "serve"]
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {
        "refit-control": 8470,
        "refit-relay": 8472,
        "refit-relay-mac": 8473,
    }
    env = _expand_env(sidecar, FIELDS)
    settings = ReceiverConfig.model_validate_json(env["KUBEREFIT_CONFIG"])
    assert (settings.node, settings.host, settings.port) == ("p-abc", "10.1.2.3", 8470)
    assert settings.relay is not None
    assert settings.relay.bind == "tcp://10.1.2.3:8472"
    assert settings.relay.mac_bind == "tcp://10.1.2.3:8473"  # the other relays' MAC-only port
    assert settings.applier.vllm_url == "http://127.0.0.1:8123"  # read from vLLM's --port
    assert str(settings.applier.shm_dir) == CFG.shm_dir
    assert env["KUBEREFIT_TOKEN_FILE"] == "/etc/kuberefit/token/token"
    assert (env["KUBEREFIT_LOG_FORMAT"], env["KUBEREFIT_LOG_LEVEL"]) == ("json", "info")
    vllm = pod["spec"]["containers"][0]
    assert vllm["args"][-2:] == [
        f"--worker-extension-cls={VLLM_WORKER_EXTENSION}",
        f"--middleware={VLLM_MIDDLEWARE}",
    ]
    mounts = {m["mountPath"]: m for m in vllm["volumeMounts"]}
    assert set(mounts) == {CFG.shm_dir, CFG.token_dir, CFG.vllm_bundle_dir}
    assert mounts[CFG.vllm_bundle_dir] == {
        "name": "kuberefit-vllm-bundle",
        "mountPath": CFG.vllm_bundle_dir,
        "readOnly": True,
    }
    assert {"name": "PYTHONPATH", "value": CFG.vllm_bundle_dir} in vllm["env"]
    assert {"name": "KUBEREFIT_TOKEN_FILE", "value": "/etc/kuberefit/token/token"} in vllm["env"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kuberefit-token"]["secret"]["secretName"] == "alpha-token"
    assert volumes["kuberefit-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes["kuberefit-vllm-bundle"]["emptyDir"] == {"sizeLimit": "64Mi"}
    (init,) = pod["spec"]["initContainers"]
    assert init["name"] == "kuberefit-vllm-bundle"
    assert init["image"] == CFG.image  # the sidecar image, never the user's
    assert init["command"] == ["kuberefit", "vllm-bundle", "install", CFG.vllm_bundle_dir]
    assert init["volumeMounts"] == [
        {"name": "kuberefit-vllm-bundle", "mountPath": CFG.vllm_bundle_dir}
    ]
    assert init["resources"]["limits"] == init["resources"]["requests"]  # QoS kept
    assert init["securityContext"]["runAsNonRoot"] is True
    assert "VLLM_SERVER_DEV_MODE" not in json.dumps(pod)


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_injected_containers_pass_the_restricted_standard_on_a_read_only_root(role: str) -> None:
    """Even in a pod that runs as root (many GPU images do) and sets no seccomp profile, what
    injection adds passes "restricted" and never writes its root file system: /tmp is an
    emptyDir of its own."""
    pod = _pod(role)
    pod["spec"]["securityContext"] = {"runAsUser": 0}
    patched = _applied(pod)
    ours = {"kuberefit-sidecar", "kuberefit-vllm-bundle"}
    assert restricted_violations(patched["spec"], ours) == []
    assert read_only_root_violations(patched["spec"], ours) == []
    mounts = {m["mountPath"]: m["name"] for m in _sidecar(patched)["volumeMounts"]}
    assert mounts["/tmp"] == "kuberefit-tmp"
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    assert volumes["kuberefit-tmp"] == {"name": "kuberefit-tmp", "emptyDir": {"sizeLimit": "1Gi"}}
    # The check itself fails a container that breaks a rule.
    user = patched["spec"]["containers"][0]["name"]
    assert restricted_violations(patched["spec"], {user})


def test_sidecar_pull_secrets_are_added_once() -> None:
    cfg = InjectionConfig(image_pull_secrets=["regcred", "mirror"])
    pod = _pod("rollout")
    pod["spec"]["imagePullSecrets"] = [{"name": "mirror"}]
    result = inject(pod, cfg, POLICY)
    patched = jsonpatch.apply_patch(pod, result.patch)
    assert patched["spec"]["imagePullSecrets"] == [{"name": "mirror"}, {"name": "regcred"}]
    bare = jsonpatch.apply_patch(_pod("trainer"), inject(_pod("trainer"), cfg, POLICY).patch)
    assert bare["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    assert "imagePullSecrets" not in _applied(_pod("trainer"))["spec"]  # none configured


def test_the_vllm_bundle_goes_first_on_a_pythonpath_the_pod_sets() -> None:
    vllm = {
        "name": "vllm",
        "image": "v",
        "command": ["vllm", "serve", "m"],
        "env": [{"name": "A", "value": "1"}, {"name": "PYTHONPATH", "value": "/app:/lib"}],
    }
    pod = _applied(_pod("rollout", [vllm], init=[{"name": "warm", "image": "w"}]))
    env = pod["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "PYTHONPATH"] == [
        {"name": "PYTHONPATH", "value": f"{CFG.vllm_bundle_dir}:/app:/lib"}
    ]
    # The user's init containers run first; the bundle's copy comes after them.
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["warm", "kuberefit-vllm-bundle"]
    # An empty PYTHONPATH has no `value` member (the API server omits empty strings): the
    # patch still applies (found by the property test in test_webhook_malformed.py).
    vllm["env"] = [{"name": "PYTHONPATH"}]
    env = _applied(_pod("rollout", [vllm]))["spec"]["containers"][0]["env"]
    assert env == [{"name": "PYTHONPATH", "value": CFG.vllm_bundle_dir}, *env[1:]]
    vllm["env"] = [{"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "c"}}}]
    refused = inject(_pod("rollout", [vllm]), CFG, POLICY).denied
    assert refused is not None
    assert "PYTHONPATH" in refused
    assert "plain value" in refused


def test_trainer_pods_get_no_vllm_bundle() -> None:
    pod = _applied(_pod("trainer", [{"name": "t", "image": "t", "command": ["train"]}]))
    assert "initContainers" not in pod["spec"]
    assert "kuberefit-vllm-bundle" not in json.dumps(pod)


@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_sidecar_probes_readiness_and_liveness_apart(role: str) -> None:
    """Ready means its dependencies answer (/readyz); alive means the process does (/healthz)."""
    sidecar = _sidecar(_applied(_pod(role)))
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "refit-control"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "refit-control"}


def test_injection_happens_once() -> None:
    once = _applied(_pod("rollout"))
    assert inject(once, CFG, POLICY).patch == []  # reinvocation, or a second admission
    by_hand = _pod("rollout")
    by_hand["spec"]["containers"].append({"name": "kuberefit-sidecar", "image": "x"})
    assert inject(by_hand, CFG, POLICY).patch == []


def test_trainer_injection_feeds_the_publisher() -> None:
    trainer = {"name": "train", "image": "t", "env": [{"name": "A", "value": "1"}]}
    pod = _applied(
        _pod(
            "trainer",
            [trainer, {"name": "other", "image": "o"}],
            labels={"statefulset.kubernetes.io/pod-name": "trainer-1"},
        )
    )
    sidecar = _sidecar(pod)
    assert sidecar["command"] == ["kuberefit", "producer", "serve"]
    settings = ProducerProcessConfig.model_validate_json(
        _expand_env(sidecar, FIELDS)["KUBEREFIT_CONFIG"]
    )
    assert (settings.producer, settings.producers, settings.port) == (1, 2, 8471)
    assert settings.staging is not None
    assert str(settings.staging.inbox) == f"{CFG.shm_dir}/inbox"
    env = _expand_env(pod["spec"]["containers"][0], FIELDS)
    assert env["A"] == "1"  # the user's env is kept, ours appended
    assert env["KUBEREFIT_PRODUCER_URL"] == "http://10.1.2.3:8471"
    assert env["KUBEREFIT_INBOX"] == f"{CFG.shm_dir}/inbox"
    assert "volumeMounts" not in pod["spec"]["containers"][1]  # only the paired container


def test_reference_checkpoint_mount_is_shared_read_only() -> None:
    trainer = {
        "name": "train",
        "image": "t",
        "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
    }
    pod = _pod("trainer", [trainer], annotations={"kuberefit.io/reference-checkpoint": "/ckpt/v0"})
    sidecar = _sidecar(_applied(pod))
    assert {"name": "ckpt", "mountPath": "/ckpt", "readOnly": True} in sidecar["volumeMounts"]
    settings = json.loads(_expand_env(sidecar, FIELDS)["KUBEREFIT_CONFIG"])
    assert settings["staging"]["reference_checkpoint"] == "/ckpt/v0"


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        (_pod("rollout", annotations={"kuberefit.io/container": "nope"}), "'nope'"),
        (_pod("rollout", annotations={"kuberefit.io/sidecar-cpu": "lots"}), "quantity"),
        (_pod("rollout", annotations={"kuberefit.io/shm-size-limit": "1 GB"}), "quantity"),
        (_pod("rollout", annotations={"kuberefit.io/vllm-port": "http"}), "port number"),
        (_pod("trainer", annotations={"kuberefit.io/producer-index": "5"}), "spec.producers=2"),
        (_pod("trainer", annotations={"kuberefit.io/producer-index": "x"}), "non-negative"),
        (
            _pod("trainer", annotations={"kuberefit.io/reference-checkpoint": "/elsewhere"}),
            "not under any volume mount",
        ),
    ],
)
def test_what_cannot_be_injected_is_refused_with_the_fix(pod: Any, says: str) -> None:
    before = copy.deepcopy(pod)
    result = inject(pod, CFG, POLICY)
    assert result.patch == []
    assert result.denied is not None
    assert says in result.denied
    assert pod == before


def test_own_extension_flags_are_not_repeated() -> None:
    args = [f"--worker-extension-cls={VLLM_WORKER_EXTENSION}", "--middleware", VLLM_MIDDLEWARE]
    pod = _applied(_pod("rollout", [{"name": "v", "image": "v", "args": args}]))
    assert pod["spec"]["containers"][0]["args"] == args


def test_unknown_role_and_missing_policy_are_warned_not_injected() -> None:
    assert inject(_pod("sidekick"), CFG, POLICY).warnings
    assert inject(_pod("sidekick"), CFG, POLICY).patch == []
    missing = inject(_pod("rollout"), CFG, PolicyFacts(False, CFG.default_token_secret))
    assert missing.patch
    assert "does not exist yet" in missing.warnings[0]


def _review(obj: Any, **request: Any) -> bytes:
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u1", "kind": {"kind": "Pod"}, "object": obj, **request},
    }
    return json.dumps(body).encode()


def test_review_round_trip() -> None:
    admission = parse_review(_review(_pod("rollout"), namespace="ns", dryRun=True))
    assert (admission.uid, admission.namespace, admission.dry_run) == ("u1", "ns", True)
    answer = review_response("u1", inject(admission.pod, CFG, POLICY))["response"]
    assert answer["allowed"]
    assert answer["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert jsonpatch.apply_patch(admission.posted, patch)["metadata"]["annotations"][
        "kuberefit.io/injected"
    ]
    empty = _pod("trainer")
    empty["spec"]["containers"] = []
    refused = review_response("u2", inject(empty, CFG, POLICY))
    assert refused["response"]["allowed"] is False
    assert "no containers" in refused["response"]["status"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1beta1"}).encode(),
        _review({"metadata": {}}, uid=""),
        _review({"metadata": {}}, kind={"kind": "Service"}),
    ],
)
def test_malformed_reviews_are_refused(body: bytes) -> None:
    with pytest.raises(ReviewError):
        parse_review(body)


def test_the_vllm_container_setting_pairs_rollouts_only() -> None:
    cfg = InjectionConfig(vllm_container="engine")
    trainer = _pod("trainer", [{"name": "train", "image": "t"}])
    assert inject(trainer, cfg, POLICY).denied is None
    rollout = _pod(
        "rollout", [{"name": "proxy", "image": "p"}, *_pod("rollout")["spec"]["containers"]]
    )
    rollout["spec"]["containers"][1]["name"] = "engine"
    pod = jsonpatch.apply_patch(rollout, inject(rollout, cfg, POLICY).patch)
    assert pod["spec"]["containers"][1]["args"][-1] == f"--middleware={VLLM_MIDDLEWARE}"


def test_a_mesh_proxy_put_first_is_not_paired_with() -> None:
    istio = {"name": "istio-proxy", "image": "istio/proxyv2", "args": ["proxy"]}
    pod = _applied(_pod("rollout", [istio, *_pod("rollout")["spec"]["containers"]]))
    assert pod["spec"]["containers"][0]["args"] == ["proxy"]
    assert pod["spec"]["containers"][1]["args"][-1] == f"--middleware={VLLM_MIDDLEWARE}"


@pytest.mark.parametrize(
    ("container", "says"),
    [
        ({"name": "v", "image": "vllm/vllm-openai"}, "neither command nor args"),
        ({"name": "v", "image": "v", "command": ["/bin/sh", "-c", "vllm serve m"]}, "shell"),
        (
            {"name": "v", "image": "v", "command": ["python", "-m", "huggingfaceserver"]},
            "Hugging Face runtime",
        ),
        ({"name": "v", "image": "v", "args": ["--port", "\u00b2"]}, "port number"),
        ({"name": "v", "image": "v", "args": ["--port=70000"]}, "port number"),
    ],
)
def test_vllm_flags_that_could_not_reach_vllm_are_refused(
    container: dict[str, Any], says: str
) -> None:
    result = inject(_pod("rollout", [container]), CFG, POLICY)
    assert result.denied is not None
    assert says in result.denied


def test_an_init_container_with_the_sidecar_name_is_refused() -> None:
    pod = _pod("rollout")
    pod["spec"]["initContainers"] = [{"name": "kuberefit-sidecar", "image": "x"}]
    result = inject(pod, CFG, POLICY)
    assert result.denied is not None
    assert "init container" in result.denied


def test_policy_settings_reach_the_trainer_sidecar() -> None:
    from refit_operator.injection.patch import TrainerSettings

    facts = PolicyFacts(
        True,
        TokenSecretRef(name="t"),
        producers=3,
        trainer=TrainerSettings(
            zstd_level=7,
            shuffle=False,
            export_chunk_bytes=64 << 20,
            bucket_bytes=128 << 20,
            in_memory=True,
        ),
    )
    pod = _pod(
        "trainer",
        [{"name": "train", "image": "t"}],
        labels={"batch.kubernetes.io/job-completion-index": "2"},
    )
    sidecar = _sidecar(jsonpatch.apply_patch(pod, inject(pod, CFG, facts).patch))
    text = _expand_env(sidecar, FIELDS)["KUBEREFIT_CONFIG"]
    settings = ProducerProcessConfig.model_validate_json(text)
    assert (settings.producer, settings.producers) == (2, 3)
    assert settings.pipeline.codec.zstd_level == 7
    assert settings.pipeline.codec.shuffle is False
    assert settings.pipeline.bucket_bytes == 128 << 20
    assert settings.baseline.export_chunk_bytes == 64 << 20
    assert settings.baseline.in_memory is True
    assert str(settings.baseline.directory) == f"{CFG.work_dir}/baseline"


def test_without_the_policy_a_producer_index_is_not_judged() -> None:
    pod = _pod("trainer", [{"name": "t", "image": "t"}])
    pod["metadata"]["annotations"]["kuberefit.io/producer-index"] = "3"
    unknown = PolicyFacts(False, CFG.default_token_secret)
    result = inject(pod, CFG, unknown)
    assert result.denied is None
    assert result.patch


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"ports": {"control": 9000, "relay": 9000}}, "must differ"),
        ({"workDir": "/data", "shmDir": "/data/shm"}, "overlap"),
        ({"shmDir": "relative"}, "absolute"),
    ],
)
def test_injection_settings_that_would_break_every_pod_are_refused(
    values: dict[str, Any], says: str
) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        InjectionConfig.model_validate(values)


# -- trainers that finish (Jobs) -----------------------------------------------------------------
def _trainer_settings(pod: Any) -> ProducerProcessConfig:
    text = _expand_env(_sidecar(pod), FIELDS)["KUBEREFIT_CONFIG"]
    return ProducerProcessConfig.model_validate_json(text)


@pytest.mark.parametrize(
    ("restart_policy", "mode"),
    [(None, "no"), ("Always", "no"), ("Never", "when_gone"), ("OnFailure", "when_done")],
)
def test_a_trainer_sidecar_exits_with_its_trainer_where_the_pod_ends(
    restart_policy: str | None, mode: str
) -> None:
    """Without native sidecars the sidecar is a regular container: in a Job's pod it must exit
    after the trainer, or the Job never completes (under OnFailure only after a deliberate
    end: a crashed trainer is restarted and needs its sidecar)."""
    pod = _pod("trainer", [{"name": "train", "image": "t"}])
    if restart_policy is not None:
        pod["spec"]["restartPolicy"] = restart_policy
    assert _trainer_settings(_applied(pod)).exit_with_trainer == mode


def test_native_sidecars_put_the_trainer_sidecar_among_the_init_containers() -> None:
    """Kubernetes 1.29+: an init container with restartPolicy Always starts before the trainer
    and is stopped once it exits, so the Job completes with no help. Rollout pods keep a
    regular container (they run until scaled down)."""
    native = CFG.model_copy(update={"native_sidecars": "on"})
    pod = _pod("trainer", [{"name": "train", "image": "t"}], init=[{"name": "setup", "image": "s"}])
    pod["spec"]["restartPolicy"] = "Never"
    result = inject(pod, native, POLICY)
    assert result.denied is None, result.denied
    out = jsonpatch.apply_patch(pod, result.patch)
    assert [c["name"] for c in out["spec"]["containers"]] == ["train"]
    setup, sidecar = out["spec"]["initContainers"]
    assert setup["name"] == "setup"
    assert sidecar["name"] == "kuberefit-sidecar"
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["readinessProbe"]
    assert sidecar["livenessProbe"]
    text = _expand_env(sidecar, FIELDS)["KUBEREFIT_CONFIG"]
    assert ProducerProcessConfig.model_validate_json(text).exit_with_trainer == "no"
    rollout = _applied_with(native, _pod("rollout"))
    assert [c["name"] for c in rollout["spec"]["containers"]] == ["vllm", "kuberefit-sidecar"]
    assert "restartPolicy" not in _sidecar(rollout)


def _applied_with(cfg: InjectionConfig, pod: Any) -> Any:
    result = inject(pod, cfg, POLICY)
    assert result.denied is None, result.denied
    return jsonpatch.apply_patch(pod, result.patch)


@pytest.mark.parametrize(
    ("setting", "major", "minor", "want"),
    [
        ("auto", "1", "29", "on"),
        ("auto", "1", "31+", "on"),
        ("auto", "1", "28", "off"),
        ("auto", "1", "20", "off"),
        ("auto", "", "", "off"),
        ("auto", "2", "0", "on"),
        ("off", "1", "31", "off"),
        ("on", "1", "20", "on"),
    ],
)
def test_auto_native_sidecars_follow_the_api_servers_version(
    setting: str, major: str, minor: str, want: str
) -> None:
    from refit_operator.injection.config import with_native_sidecars

    cfg = CFG.model_copy(update={"native_sidecars": setting})
    assert with_native_sidecars(cfg, major, minor).native_sidecars == want


def _receiver_settings(pod: Any) -> ReceiverConfig:
    return ReceiverConfig.model_validate_json(
        _expand_env(_sidecar(pod), FIELDS)["KUBEREFIT_CONFIG"]
    )


def _lws_pod(worker: int, *, size: str = "2", subdomain: str | None = "big") -> Any:
    """A pod of LeaderWorkerSet `big`, group 3, as its controller creates it."""
    labels = {
        "leaderworkerset.sigs.k8s.io/name": "big",
        "leaderworkerset.sigs.k8s.io/group-index": "3",
        "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
    }
    pod = _pod("rollout", labels=labels, annotations={"leaderworkerset.sigs.k8s.io/size": size})
    if subdomain:
        pod["spec"]["subdomain"] = subdomain
    return pod


def test_a_leader_worker_set_group_is_one_server() -> None:
    """Worker index 0 is the leader (it applies through every rank); the others stage for their
    own ranks and ask the leader's receiver, at LeaderWorkerSet's DNS name for it, how far it
    got (docs/multi-host.md). A group of one pod is an ordinary server."""
    leader = _receiver_settings(_applied(_lws_pod(0)))
    assert (leader.server, leader.applier.kind) == ("big-3", "vllm")
    assert leader.applier.vllm_url == "http://127.0.0.1:8123"
    worker = _applied(_lws_pod(1))
    assert worker["metadata"]["labels"]["kuberefit.io/server"] == "big-3"  # counted once
    settings = _receiver_settings(worker)
    assert (settings.server, settings.applier.kind) == ("big-3", "vllm_host")
    assert settings.applier.leader_url == "http://big-3.big:8470"
    assert str(settings.applier.shm_dir) == CFG.shm_dir  # the same path in every pod
    assert worker["spec"]["containers"][0]["args"][-2] == (
        f"--worker-extension-cls={VLLM_WORKER_EXTENSION}"  # its ranks run the refit methods
    )
    single = _receiver_settings(_applied(_lws_pod(0, size="1")))
    assert (single.server, single.applier.kind) == (None, "vllm")


def test_other_launchers_name_the_server_and_roles_by_annotation() -> None:
    def annotated(**annotations: str) -> Any:
        keys = {"server": "kuberefit.io/server", "role": "kuberefit.io/server-role"}
        keys["leader"] = "kuberefit.io/server-leader"
        return _pod("rollout", annotations={keys[k]: v for k, v in annotations.items()})

    leader = _receiver_settings(_applied(annotated(server="ray-big", role="leader")))
    assert (leader.server, leader.applier.kind) == ("ray-big", "vllm")
    worker = _receiver_settings(
        _applied(annotated(server="ray-big", role="worker", leader="10.0.0.7"))
    )
    assert (worker.applier.kind, worker.applier.leader_url) == ("vllm_host", "http://10.0.0.7:8470")
    refusals = {
        "needs kuberefit.io/server-leader": annotated(server="ray-big", role="worker"),
        "must be leader or worker, not 'head'": annotated(server="ray-big", role="head"),
        "set kuberefit.io/server too": annotated(role="leader"),
        "has no spec.subdomain": _lws_pod(1, subdomain=None),
    }
    for says, pod in refusals.items():
        denied = inject(pod, CFG, POLICY).denied
        assert denied is not None, says
        assert says in denied, denied


def _s3_policy(**s3: Any) -> PolicyFacts:
    spec = parse_spec(
        {
            "tokenSecret": {"name": "alpha-token"},
            "transport": "s3",
            "s3": {"bucket": "payloads", "endpointUrl": "https://store:8333", **s3},
        }
    )
    return PolicyFacts(
        exists=True, token_secret=TokenSecretRef(name="alpha-token"), s3=spec.s3_settings()
    )


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_an_s3_policy_gives_both_sidecars_the_store_credentials_and_ca(role: str) -> None:
    policy = _s3_policy(credentialsSecret="s3-keys", caBundle={"configMap": "store-ca"})
    container = {"name": "main", "image": "i", "args": ["--port", "8123"]}
    pod = _applied(_pod(role, [container]), policy)
    sidecar = _sidecar(pod)
    env = _expand_env(sidecar, FIELDS)
    if role == "trainer":
        config = ProducerProcessConfig.model_validate_json(env["KUBEREFIT_CONFIG"])
        assert isinstance(config.transport, S3TransportConfig)
        store = config.transport.s3
    else:
        receiver = ReceiverConfig.model_validate_json(env["KUBEREFIT_CONFIG"])
        assert receiver.relay is not None  # still bound: the policy may go back to zmq
        store = receiver.s3
    assert store is not None
    assert (store.bucket, store.endpoint_url) == ("payloads", "https://store:8333")
    assert str(store.ca_bundle) == "/etc/kuberefit/s3-ca/ca.crt"
    assert store.access_key_id is None  # no secret in the config: boto3 reads the env
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in sidecar["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {
        "AWS_ACCESS_KEY_ID": {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY"},
    }
    assert "AWS_ACCESS_KEY_ID" not in json.dumps(pod["spec"]["containers"][0])  # sidecar only
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kuberefit-s3-ca"]["configMap"]["name"] == "store-ca"
    assert {"name": "kuberefit-s3-ca", "mountPath": "/etc/kuberefit/s3-ca", "readOnly": True} in (
        sidecar["volumeMounts"]
    )
    annotations = pod["metadata"]["annotations"]
    assert annotations["kuberefit.io/transport"] == "s3"
    assert annotations["kuberefit.io/s3-settings"] == policy.s3.digest()  # type: ignore[union-attr]
    assert restricted_violations(pod) == []


def test_without_a_credentials_secret_the_pods_cloud_identity_reaches_the_sidecar() -> None:
    token = "/var/run/secrets/eks.amazonaws.com/serviceaccount/token"
    trainer = {
        "name": "train",
        "image": "t",
        "env": [
            {"name": "AWS_ROLE_ARN", "value": "arn:aws:iam::1:role/refit"},
            {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": token},
            {"name": "HOME", "value": "/home/t"},
            {"name": "AWS_PROFILE", "value": "dev"},  # names a file the sidecar lacks
            {"name": "AWS_ENDPOINT_URL", "value": "https://elsewhere"},  # another store
        ],
        "volumeMounts": [
            {
                "name": "aws-iam-token",
                "mountPath": "/var/run/secrets/eks.amazonaws.com/serviceaccount",
            }
        ],
    }
    pod = _applied(_pod("trainer", [trainer]), _s3_policy())
    sidecar = _sidecar(pod)
    env = _expand_env(sidecar, FIELDS)
    assert env["AWS_ROLE_ARN"] == "arn:aws:iam::1:role/refit"
    assert env["AWS_WEB_IDENTITY_TOKEN_FILE"] == token
    assert set(env) & {"HOME", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID"} == set()
    assert {
        "name": "aws-iam-token",
        "mountPath": "/var/run/secrets/eks.amazonaws.com/serviceaccount",
        "readOnly": True,
    } in sidecar["volumeMounts"]
    # A token mounted where the sidecar keeps its own files is refused, naming the path.
    clash = copy.deepcopy(trainer)
    clash["env"][1]["value"] = "/tmp/token"
    clash["volumeMounts"] = [{"name": "aws-iam-token", "mountPath": "/tmp"}]
    refused = inject(_pod("trainer", [clash]), CFG, _s3_policy())
    assert refused.denied is not None
    assert "would mount both kuberefit-tmp and aws-iam-token at /tmp" in refused.denied
    # A token file the sidecar could not read is refused, with the fix.
    del trainer["volumeMounts"]
    result = inject(_pod("trainer", [trainer]), CFG, _s3_policy())
    assert result.denied is not None
    assert "under none of its volume mounts" in result.denied
    assert "spec.s3.credentialsSecret" in result.denied
