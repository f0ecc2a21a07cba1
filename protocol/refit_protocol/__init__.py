"""KubeRefit's shared protocol layer: what the control plane and the data plane say to each other.

Both `refit_operator` (control plane) and `refit_sidecar` (data plane) import this package; it
imports neither (tests/test_layers.py enforces it). It holds only what both sides must agree on:
the control-plane messages (`receiver_api`, `producer_api`), the commit record (`commit`),
canonical tensor identities (`tensors`), endpoint errors, token resolution (`auth`), logging
set-up (`logs`) and the `kuberefit` command line that joins each package's commands (`cli`).
No torch, vllm or zmq here: the operator image installs it.
"""

__version__ = "0.1.0"
