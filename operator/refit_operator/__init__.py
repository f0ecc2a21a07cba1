"""KubeRefit control plane (docs/architecture.md): coordinator (❼), commit stores, the HTTP
clients of both sidecars, membership, and its commands.

It imports the shared protocol (`refit_protocol`), never the data plane (`refit_sidecar`), and
nothing here may import torch, vllm or zmq: the operator image ships none of them
(tests/test_layers.py, tests/test_operator_image.py).
"""

__version__ = "0.1.0"
