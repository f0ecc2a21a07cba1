"""The kit every KubeRefit process runs with: the `kuberefit` command (`cli`), settings files
(`config_files`), tokens and their rotation (`tokens`, `auth`), logging (`logs`, `loggers`,
`http_log`), Prometheus conventions (`metrics`) and the HTTP skeleton (`service_http`).

The wire models of `refit_protocol` never import it (`tests/test_layers.py`); it imports them.
Nothing is imported here, so that code running inside vLLM loads only the module it needs.
"""
