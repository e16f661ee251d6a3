"""The benches (docs/benchmarks.md): one harness (stack.py starts the services, client.py speaks to
them, harness.py holds the statistics, metadata and report writers) and a workload per bench on it:
run.py (`splitspec bench`), auto.py, prefix.py, structured.py, drafts.py, trees.py, ceiling.py."""
