"""`kuberefit plan`: projected refit latency from a model calibrated on this repository's bench
results (`calibration`: fit and file; `model`: the formula; `projection`: deployments and bench
runs through it; `sizing`: H from an index or a config; `report`: table, JSON, SVG; `command`:
the click command)."""
