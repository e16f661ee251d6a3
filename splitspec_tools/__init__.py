"""The tools that drive the services from above: the `splitspec` command (cli.py), the benches,
the trainers, operations (scale-out, certificates, load tests). Nothing below imports this package
(docs/architecture.md, "Layers")."""
