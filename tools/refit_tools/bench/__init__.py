"""Benchmarks behind `kuberefit bench ...` (results and method in docs/performance.md)."""
