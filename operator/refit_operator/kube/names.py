"""Names shared by the operator, the webhook and the pods it discovers (one home each)."""

from __future__ import annotations

GROUP, VERSION = "refit.kuberefit.io", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
POLICIES, TRANSITIONS, POLICY_VERSIONS = "refitpolicies", "refittransitions", "policyversions"

#: Pod opt-in: `kuberefit.io/inject: trainer|rollout` and `kuberefit.io/policy: <RefitPolicy>`.
INJECT, POLICY = "kuberefit.io/inject", "kuberefit.io/policy"
#: Optional pod annotations: which container KubeRefit pairs with (default: the first), this
#: trainer pod's producer index (default: its StatefulSet ordinal, else 0), and the checkpoint
#: the rollout engines started from (the trainer sidecar checks the first export against it).
CONTAINER, PRODUCER_INDEX = "kuberefit.io/container", "kuberefit.io/producer-index"
REFERENCE_CHECKPOINT = "kuberefit.io/reference-checkpoint"
#: Optional rollout pod annotations: the port vLLM serves on (default: its --port) and the
#: user's own vLLM worker extension, composed with KubeRefit's (injection.vllm_launch).
VLLM_PORT, USER_WORKER_EXTENSION = "kuberefit.io/vllm-port", "kuberefit.io/worker-extension"
#: A vLLM server spanning several pods, for launchers other than LeaderWorkerSet (whose labels
#: are recognised, `injection.server`): the server's name in every pod, each pod's role
#: (leader|worker), and on workers the leader pod's address (docs/multi-host.md).
SERVER, SERVER_ROLE = "kuberefit.io/server", "kuberefit.io/server-role"
SERVER_LEADER = "kuberefit.io/server-leader"
#: Written by injection on every pod of such a server (LeaderWorkerSet's included): its name,
#: so the operator counts servers (the ROLLOUTS column).
SERVER_LABEL = "kuberefit.io/server"
#: Optional per-pod overrides of the chart's sidecar settings (as Istio's
#: sidecar.istio.io/proxyCPU...): the sidecar's CPU and memory requests and limits, and the
#: sizeLimit of the shared-memory volume.
SIDECAR_CPU, SIDECAR_MEMORY = "kuberefit.io/sidecar-cpu", "kuberefit.io/sidecar-memory"
SIDECAR_CPU_LIMIT = "kuberefit.io/sidecar-cpu-limit"
SIDECAR_MEMORY_LIMIT = "kuberefit.io/sidecar-memory-limit"
SHM_SIZE_LIMIT = "kuberefit.io/shm-size-limit"
#: Written by injection: the marker annotation (its value is the role injected) and the labels
#: NetworkPolicies select on (annotations cannot be selected).
INJECTED = "kuberefit.io/injected"
#: Written by injection: the transport the pod's sidecar was configured for, and for s3 a
#: digest of the store settings (both fixed for the pod's life; a policy change is reported).
TRANSPORT = "kuberefit.io/transport"
S3_SETTINGS = "kuberefit.io/s3-settings"
ROLE_LABEL, POLICY_LABEL = "kuberefit.io/role", "kuberefit.io/policy"
#: On the operator's own pods; the webhook configuration never selects them.
COMPONENT_LABEL = "kuberefit.io/component"
#: The label that marks a Secret as a KubeRefit token (the operator reads no other Secret).
TOKEN_LABEL = "kuberefit.io/token"  # noqa: S105 - a label key, not a secret
#: RefitPolicy annotation that clears an abort (any value); the operator removes it after.
CLEAR_ABORT = "kuberefit.io/clear-abort"
#: RefitPolicy annotation that asks for an audit of the committed version now (any value); the
#: operator removes it after (`kuberefit verify` for every ready rollout node).
VERIFY_NOW = "kuberefit.io/verify-now"
#: kopf's own bookkeeping, kept under our prefix so it does not change with kopf's version.
KOPF_PREFIX, FINALIZER = "kuberefit.io", "kuberefit.io/finalizer"

#: The sidecar container and its named ports (what injection adds to a pod).
SIDECAR_CONTAINER = "kuberefit-sidecar"
CONTROL_PORT, RELAY_PORT = "refit-control", "refit-relay"
#: The relay's second port, for MAC-only links from the other relays of the cluster.
RELAY_MAC_PORT = "refit-relay-mac"
DEFAULT_PORTS = {"trainer": 8471, "rollout": 8470}

#: Who writes Events and RefitTransitions (shown by kubectl as the event source).
COMPONENT = "kuberefit-operator"
#: The injected volume holding the policy's token Secret (discovery reads which Secret a pod got).
TOKEN_VOLUME = "kuberefit-token"  # noqa: S105 - a volume name, not a secret
