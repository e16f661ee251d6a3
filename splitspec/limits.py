"""Limits on what a request may carry, shared by the side that checks it first (the gateway)
and the side that owns the work (the target). One definition here, so the two can never refuse
at different sizes. Torch-free: the gateway imports it."""
from __future__ import annotations

from splitspec.v1 import common_pb2

MAX_SPEC_BYTES = 64 * 1024      # a schema, regex, grammar or choice list, serialized
MAX_LOGPROBS = 20               # top alternatives per position, vLLM's default --max-logprobs
MAX_CACHE_SALT = 256            # characters of a cache salt: a tenant or user id, or a hash of one
# Lists whose every entry costs work on every generated token (the stop matcher scans each stop
# string on each chunk of each choice; the target applies each bias and holds back each stop
# token at each step): counted before any entry is looked at.
MAX_STOP_STRINGS = 4            # OpenAI's limit ("up to 4 sequences"), TGI's default too
MAX_STOP_CHARS = 256            # one stop string: a tail this long is held back and matched per chunk
MAX_STOP_TOKEN_IDS = 1024       # room for every special token of a large vocabulary
MAX_LOGIT_BIAS = 300            # entries of logit_bias: a word list to ban, not a vocabulary
MAX_JSON_DEPTH = 64             # a JSON text inside a string (a schema, a structural tag), as the HTTP body's

# The kinds of sampling.constraint, in the proto's order: the proto owns them.
CONSTRAINT_KINDS = tuple(f.name for f in common_pb2.Constraint.DESCRIPTOR.oneofs_by_name["kind"].fields)
