"""The gateway's configuration, built from its flags (SGLang's names where they exist)."""
from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("dflash", "ngram", "none")
ALGORITHMS = {"DFLASH": "dflash", "NGRAM": "ngram", "NONE": "none"}
DRAFT_SAMPLING = ("greedy", "sample")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"            # default for requests that do not choose
    num_steps: int = 7              # draft depth per branch
    eagle_topk: int = 1             # branching factor; 1 = chain
    num_draft_tokens: int = 8       # verify width: root + drafted nodes
    draft_sampling: str = "greedy"  # "greedy": target-only verification; "sample": min(1, p/q)


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
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
