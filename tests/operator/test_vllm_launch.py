"""Each way people start vLLM, through the whole injection (`inject`, patches applied as the API
server applies them): the vLLM container's command line, env and port after injection, or the
refusal and the fix it names. The Helm journey runs the shell and KServe styles end to end."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest

from refit_operator.injection import InjectionConfig, PolicyFacts, inject
from refit_operator.injection.config import TokenSecretRef
from refit_protocol.pod_contract import (
    VLLM_COMPOSED_EXTENSION,
    VLLM_MIDDLEWARE,
    VLLM_WORKER_EXTENSION,
)
from refit_sidecar.receiver.config import ReceiverConfig

CFG = InjectionConfig()
POLICY = PolicyFacts(exists=True, token_secret=TokenSecretRef(name="t"))
OURS = [f"--worker-extension-cls={VLLM_WORKER_EXTENSION}", f"--middleware={VLLM_MIDDLEWARE}"]
COMPOSED = [f"--worker-extension-cls={VLLM_COMPOSED_EXTENSION}", f"--middleware={VLLM_MIDDLEWARE}"]


def _inject(container: dict[str, Any], **annotations: str) -> tuple[dict[str, Any], int]:
    """The vLLM container after injection and the port its receiver calls vLLM on."""
    pod = {
        "metadata": {
            "name": "r",
            "annotations": {
                "kuberefit.io/inject": "rollout",
                "kuberefit.io/policy": "a",
                **annotations,
            },
        },
        "spec": {"containers": [{"image": "img", **container}]},
    }
    result = inject(pod, CFG, POLICY)
    assert result.denied is None, result.denied
    out = jsonpatch.apply_patch(pod, result.patch)
    sidecar = out["spec"]["containers"][-1]
    config = next(e["value"] for e in sidecar["env"] if e["name"] == "KUBEREFIT_CONFIG")
    port = int(str(ReceiverConfig.model_validate_json(config).applier.vllm_url).rsplit(":", 1)[1])
    return out["spec"]["containers"][0], port


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


@pytest.mark.parametrize(
    ("container", "args", "port"),
    [
        # vllm serve, with its port
        (
            {"name": "vllm", "command": ["vllm", "serve", "/m", "--port", "9000"]},
            OURS,
            9000,
        ),
        # python -m the OpenAI server, port by default
        (
            {"name": "vllm", "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"]},
            OURS,
            8000,
        ),
        # args only: the image's entrypoint (vllm/vllm-openai: vllm serve) takes them
        ({"name": "vllm", "args": ["/m", "--port=8123"]}, ["/m", "--port=8123", *OURS], 8123),
        # KServe's vLLM runtime: kserve-container on 8080
        (
            {
                "name": "kserve-container",
                "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
                "args": ["--model=/mnt/models", "--served-model-name=m"],
            },
            ["--model=/mnt/models", "--served-model-name=m", *OURS],
            8080,
        ),
    ],
)
def test_flags_are_appended_where_vllm_parses_them(
    container: dict[str, Any], args: list[str], port: int
) -> None:
    out, got_port = _inject(container)
    assert out.get("args", [])[-2:] == OURS
    if "args" in container:
        assert out["args"] == args
    assert out.get("command") == container.get("command")
    assert got_port == port
    assert "KUBEREFIT_VLLM_ARGS" not in _env(out)


@pytest.mark.parametrize("ref", ["$KUBEREFIT_VLLM_ARGS", "${KUBEREFIT_VLLM_ARGS}"])
def test_a_shell_script_gets_the_flags_in_its_variable(ref: str) -> None:
    script = f"cd /srv && exec python -m vllm.entrypoints.openai.api_server --port 8301 {ref}"
    container = {"name": "vllm", "command": ["/bin/bash", "-c"], "args": [script]}
    out, port = _inject(container)
    assert out["command"] == ["/bin/bash", "-c"]
    assert out["args"] == [script]  # the script is never rewritten
    assert _env(out)["KUBEREFIT_VLLM_ARGS"] == " ".join(OURS)
    assert port == 8301


def test_a_user_worker_extension_is_composed_with_ours() -> None:
    container = {
        "name": "vllm",
        "command": ["vllm", "serve", "/m", "--worker-extension-cls", "verl.Ext"],
        "args": ["--worker-extension-cls=openrlhf.Ext"],
    }
    pod = {
        "metadata": {"annotations": {"kuberefit.io/inject": "rollout", "kuberefit.io/policy": "a"}},
        "spec": {"containers": [{"image": "i", **container}]},
    }
    refused = inject(pod, CFG, POLICY).denied
    assert refused is not None
    assert "vLLM takes one" in refused
    container["args"] = ["--port", "8001"]
    out, _ = _inject(container)
    assert out["command"] == [
        *("vllm", "serve", "/m", "--worker-extension-cls", VLLM_COMPOSED_EXTENSION)
    ]
    assert out["args"] == ["--port", "8001", f"--middleware={VLLM_MIDDLEWARE}"]
    assert _env(out)["KUBEREFIT_USER_WORKER_EXTENSION"] == "verl.Ext"
    # named by annotation instead (e.g. for a shell script, which is never rewritten)
    script = "vllm serve /m $(KUBEREFIT_VLLM_ARGS)"
    out, _ = _inject(
        {"name": "vllm", "command": ["sh", "-c", script]},
        **{"kuberefit.io/worker-extension": "verl.Ext"},
    )
    assert _env(out)["KUBEREFIT_VLLM_ARGS"] == " ".join(COMPOSED)
    assert _env(out)["KUBEREFIT_USER_WORKER_EXTENSION"] == "verl.Ext"
    script = "vllm serve /m --worker-extension-cls verl.Ext $KUBEREFIT_VLLM_ARGS"
    pod["spec"]["containers"] = [{"name": "vllm", "image": "i", "command": ["sh", "-c", script]}]
    refused = inject(pod, CFG, POLICY).denied
    assert refused is not None
    assert "kuberefit.io/worker-extension" in refused


def test_annotations_override_port_resources_and_shm() -> None:
    pod = {
        "metadata": {
            "annotations": {
                "kuberefit.io/inject": "rollout",
                "kuberefit.io/policy": "a",
                "kuberefit.io/vllm-port": "9100",
                "kuberefit.io/sidecar-cpu": "500m",
                "kuberefit.io/sidecar-memory": "1Gi",
                "kuberefit.io/sidecar-memory-limit": "3Gi",
                "kuberefit.io/shm-size-limit": "16Gi",
            }
        },
        "spec": {"containers": [{"name": "v", "image": "i", "args": ["--port", "8000"]}]},
    }
    out = jsonpatch.apply_patch(pod, inject(pod, CFG, POLICY).patch)
    sidecar = out["spec"]["containers"][-1]
    assert sidecar["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"memory": "3Gi"},
    }
    volumes = {v["name"]: v for v in out["spec"]["volumes"]}
    assert volumes["kuberefit-shm"]["emptyDir"]["sizeLimit"] == "16Gi"
    config = next(e["value"] for e in sidecar["env"] if e["name"] == "KUBEREFIT_CONFIG")
    assert ReceiverConfig.model_validate_json(config).applier.vllm_url.endswith(":9100")


def test_a_guaranteed_pod_stays_guaranteed_and_a_root_pod_gets_a_sidecar_that_starts() -> None:
    exact = {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"}
    pod = {
        "metadata": {"annotations": {"kuberefit.io/inject": "rollout", "kuberefit.io/policy": "a"}},
        "spec": {
            "securityContext": {"runAsUser": 0},
            "containers": [
                {"name": "v", "image": "i", "args": ["/m"], "resources": {"limits": exact}}
            ],
        },
    }
    out = jsonpatch.apply_patch(pod, inject(pod, CFG, POLICY).patch)
    for c in [out["spec"]["containers"][-1], *out["spec"]["initContainers"]]:
        res = c["resources"]
        assert res["limits"] == res["requests"], c["name"]  # QoS Guaranteed is kept
        assert {"cpu", "memory"} <= set(res["limits"])
        ctx = c["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert ctx["runAsUser"] == 65532  # not the pod's root, which runAsNonRoot would refuse
    # a Burstable pod keeps the chart's requests-only sidecar
    pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "8"}}
    out = jsonpatch.apply_patch(pod, inject(pod, CFG, POLICY).patch)
    assert "limits" not in out["spec"]["containers"][-1]["resources"]
