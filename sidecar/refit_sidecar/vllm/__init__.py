"""vLLM integration (❻ inside vLLM): the worker extension, the metadata form of its RPC
arguments, vLLM's runtime quirks (`quirks/`) (vllm itself is imported lazily)."""
