"""KubeRefit data plane (docs/architecture.md): baseline and compare (❶), trainer sources (❷),
codec (❸), transports (❹), receiver (❺), apply and the vLLM worker extension (❻), producer.

It imports the shared protocol (`refit_protocol`), never the control plane (`refit_operator`).
Importing this package is cheap; modules that need torch, zmq or vllm import them themselves.
"""
