"""Local mode: the same coordinator, sidecar services and vLLM worker extension as in a cluster,
run as processes on one machine with the SQLite commit store (`kuberefit demo`)."""
