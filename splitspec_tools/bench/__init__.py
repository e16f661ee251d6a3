"""Benchmark harness (`splitspec bench`, `python -m splitspec_tools.bench`): target-only, DFlash and
n-gram speculation through the gRPC services, the same loop in one process, and transformers,
on the same held-out prompts. See docs/benchmarks.md."""
