"""The speculative loop in one process, with no gRPC: the reference the gateway's
distributed loop must equal, and configuration (c) of the benchmark."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from splitspec.acceptance import count_accepted
from target_service.engine import TargetSequence


@dataclass
class SpecStats:
    verify_steps: int = 0
    committed: int = 0                  # tokens committed by verify steps (b0 not counted)
    draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0

    def record(self, drafted: int, accepted: int, committed: int, depth: int | None = None) -> None:
        """depth: a tree's (its positions are its levels); None: a chain of `drafted`."""
        self.verify_steps += 1
        self.draft_tokens += drafted
        self.committed += committed
        count_accepted(self.accepted_per_position, drafted if depth is None else depth, accepted)

    @property
    def accept_length(self) -> float:
        """Mean tau: committed tokens per verify step (accepted drafts + bonus)."""
        return self.committed / self.verify_steps if self.verify_steps else 0.0


def finish(tokens: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """Cut at the first eos (kept) and at max_new_tokens."""
    eos = set(eos_ids)
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[:i + 1]
    return tokens[:max_new_tokens]


def speculative_generate(target: TargetSequence, proposer, max_new_tokens: int,
                         eos_ids=()) -> tuple[list[int], SpecStats]:
    stats = SpecStats()
    first = target.prefill()
    out = list(first.committed)
    proposer.open(list(target.prompt), first.hidden)
    new_ids, new_hidden = list(first.committed), None
    eos = set(eos_ids)
    while len(out) < max_new_tokens and not eos.intersection(out):
        prop = proposer.propose(target.length, new_ids, new_hidden)
        t0 = time.perf_counter()
        step = target.verify(prop.tree, prop.draft_probs)
        stats.verify_ms += (time.perf_counter() - t0) * 1e3
        stats.draft_ms += prop.draft_ms
        stats.record(len(prop.tree), step.result.num_accepted, len(step.committed),
                     max(prop.tree.depths(), default=0))
        new_ids, new_hidden = step.committed, step.hidden
        out.extend(step.committed)
    return finish(out, max_new_tokens, eos), stats
