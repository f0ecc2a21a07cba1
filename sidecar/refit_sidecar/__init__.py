"""KubeRefit data plane: codec, baseline, producer pipeline, transports, receiver and apply.

Importing this package is cheap; modules that need torch, zmq or vllm import them themselves.
"""
