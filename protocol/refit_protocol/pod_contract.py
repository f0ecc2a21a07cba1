"""What an injected pod's containers agree on: the environment the admission webhook writes
(`refit_operator.injection`) and the sidecars and vLLM extensions read (`refit_sidecar`).

One home for these names, so the control plane never imports the data plane to name it.
"""

from __future__ import annotations

#: The sidecar's whole settings as JSON (a ReceiverConfig or ProducerProcessConfig), used by
#: `kuberefit receiver serve` / `kuberefit producer serve` when no `--config` file is given.
CONFIG_ENV = "KUBEREFIT_CONFIG"
#: The mounted token file (the policy's Secret); every KubeRefit process reads it.
TOKEN_FILE_ENV = "KUBEREFIT_TOKEN_FILE"  # noqa: S105 - the name of a variable, not a secret
#: The downward API: this pod's name and IP (the sidecars bind the pod IP).
POD_NAME_ENV, POD_IP_ENV = "KUBEREFIT_POD_NAME", "KUBEREFIT_POD_IP"
#: For the trainer container: its sidecar's producer URL and the shared-memory inbox.
PRODUCER_URL_ENV, INBOX_ENV = "KUBEREFIT_PRODUCER_URL", "KUBEREFIT_INBOX"
#: json | console (default: json inside a pod or when stderr is not a terminal).
LOG_FORMAT_ENV = "KUBEREFIT_LOG_FORMAT"
#: debug, info, warning or error (default: info).
LOG_LEVEL_ENV = "KUBEREFIT_LOG_LEVEL"

#: vLLM options that load the worker extension and the guarded refit control path.
VLLM_WORKER_EXTENSION = "refit_sidecar.vllm.worker_extension.RefitWorkerExtension"
VLLM_MIDDLEWARE = "refit_sidecar.vllm.control_path.RefitControlMiddleware"
#: The worker extension injection names when vLLM already has one (verl, OpenRLHF): a class
#: composed at import from the user's (named in `USER_WORKER_EXTENSION_ENV`) and ours.
VLLM_COMPOSED_EXTENSION = "refit_sidecar.vllm.composed.ComposedWorkerExtension"
USER_WORKER_EXTENSION_ENV = "KUBEREFIT_USER_WORKER_EXTENSION"
#: For vLLM started by a shell script: the flags injection would append, for the script to
#: put on vLLM's command line (`vllm serve ... $KUBEREFIT_VLLM_ARGS`).
VLLM_ARGS_ENV = "KUBEREFIT_VLLM_ARGS"
#: In the trainer's inbox: the trainer process holds a shared `flock` on TRAINER_ALIVE_FILE while
#: it runs (its publisher takes it; the kernel releases it however the process ends) and writes
#: TRAINER_DONE_FILE when it closes its publisher. A trainer sidecar in a pod that ends (a Job's)
#: watches them to exit after its trainer (`refit_sidecar.producer.trainer_exit`).
TRAINER_ALIVE_FILE, TRAINER_DONE_FILE = "trainer.alive", "trainer.done"
