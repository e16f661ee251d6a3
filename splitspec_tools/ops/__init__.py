"""Operator tools: what runs *around* the services, never inside one.

`launch` (start local service processes and wait for grpc.health.v1), `up_ops` (the operations
flags of `splitspec up`), `certs` (development CA and service certificates), `scaleout` (the
compose topology in a network namespace), `loadtest` (concurrent streams against a gateway) and
`ops_overhead` (what metrics + TLS cost). A service imports none of them; what every service
imports (flags, logs, metrics, security, wire, serving) stays at the top of `splitspec/`."""
