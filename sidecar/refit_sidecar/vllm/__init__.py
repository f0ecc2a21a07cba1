"""vLLM integration: the worker extension and engine helpers (import vllm lazily)."""
