"""The gateway's configuration, built from its flags (SGLang's names where they exist)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .routing import BALANCE_ABS, LOAD_FACTOR

METHODS = ("auto", "dflash", "ngram", "none")
ALGORITHMS = {"AUTO": "auto", "DFLASH": "dflash", "NGRAM": "ngram", "NONE": "none"}
DRAFT_SAMPLING = ("greedy", "sample")
ROUTING_POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"            # default for requests that do not choose ("auto" when a draft is configured)
    num_steps: int = 7              # draft depth per branch
    eagle_topk: int = 1             # branching factor; 1 = chain
    num_draft_tokens: int = 8       # verify width: root + drafted nodes
    draft_sampling: str = "greedy"  # "greedy": target-only verification; "sample": min(1, p/q)
    target_lookahead: bool = True   # auto: n-gram chains drafted inside the target's Decode runs where it can


@dataclass(frozen=True)
class GatewayConfig:
    targets: tuple[str, ...]
    draft: str | None = None
    tokenizer_path: str | None = None
    max_new_tokens_cap: int = 2048
    default_max_new_tokens: int = 256
    max_sessions: int = 256
    max_message_mb: int = 64
    target_wait_s: float = 600.0
    draft_wait_s: float = 30.0         # then serve target-only and keep probing the draft
    max_prompt_tokens: int = 0              # 0: up to the model's context
    draft_timeout_ms: float = 2000.0        # per draft step (Propose); Open gets 4x
    reconnect_max_s: float = 5.0      # backoff cap of the health probes of a failed backend
    target_failover_attempts: int = 3       # replica switches one request may make
    routing_policy: str = "prefix"          # over several --target replicas; see gateway/routing.py
    routing_load_factor: float = LOAD_FACTOR    # prefix routing: most a replica holds, in mean in-flight loads
    routing_balance_abs: int = BALANCE_ABS      # ... applied once it holds this many more than the least loaded
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
