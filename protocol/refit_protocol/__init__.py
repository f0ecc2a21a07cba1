"""KubeRefit's shared protocol layer: what the control plane and the data plane say to each other.

Both `refit_operator` (control plane) and `refit_sidecar` (data plane) import this package; it
imports neither (tests/test_layers.py enforces it). At its top, the wire models both sides must
agree on: the control-plane messages (`receiver_api`, `producer_api`), the commit record
(`commit`), canonical tensor identities (`tensors`, `limits`), sizes (`sizes`), derived keys
(`keys`), endpoint errors (`errors`) and the pod contract (`pod_contract`). In `kit/`, what
runs a process: the `kuberefit` command, settings files, tokens, logs, metrics and the HTTP
skeleton; the kit imports the models, never the reverse. No torch, vllm or zmq here: the
operator image installs it.
"""

__version__ = "0.1.0"
