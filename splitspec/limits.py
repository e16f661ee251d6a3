"""Limits on what a request may carry, shared by the side that checks it first (the gateway)
and the side that owns the work (the target). One definition here, so the two can never refuse
at different sizes. Torch-free: the gateway imports it."""
from __future__ import annotations

from splitspec.v1 import common_pb2

MAX_SPEC_BYTES = 64 * 1024      # a schema, regex, grammar or choice list, serialized
MAX_LOGPROBS = 20               # top alternatives per position, vLLM's default --max-logprobs
MAX_CACHE_SALT = 256            # characters of a cache salt: a tenant or user id, or a hash of one

# The kinds of sampling.constraint, in the proto's order: the proto owns them.
CONSTRAINT_KINDS = tuple(f.name for f in common_pb2.Constraint.DESCRIPTOR.oneofs_by_name["kind"].fields)
