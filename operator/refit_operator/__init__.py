"""KubeRefit control plane: coordinator, commit stores, kopf handlers and the CLI.

Nothing in this package may import torch, vllm or zmq: the operator image does not ship them.
"""

__version__ = "0.1.0"
