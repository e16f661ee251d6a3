"""Target-side sequence operations: prefill, target-only decode and tree verification on one
sequence with its own KV cache. Plain Python over the model; the gRPC service drives these
from its engine loop, and tests and the in-process speculative loop call them directly."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .flashinfer_backend import TorchVerifier
from .kv_cache import KVCache
from .model import CausalLM
from .sample import SamplingParams, make_generator, sample
from .tree import Tree
from .verify import VerifyResult

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class StepOutput:
    committed: list[int]                 # tokens committed by this call
    hidden: torch.Tensor | None          # [n, len(layers) * H] features of the tokens just run
    result: VerifyResult | None = None   # verification details (Verify only)


@dataclass
class TargetSequence:
    """One sequence on the target. Invariant after `prefill`: `tokens` holds every committed
    token and the KV cache holds all but the last one, which is fed at the next step."""
    model: CausalLM
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_len: int | None = None
    hidden_layers: tuple[int, ...] = ()
    verifier: object = field(default_factory=TorchVerifier)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    def __post_init__(self):
        cfg = self.model.cfg
        if not self.prompt:
            raise ValueError("prompt is empty: at least one token id is needed")
        for i, t in enumerate(self.prompt):
            if not 0 <= t < cfg.vocab_size:
                raise ValueError(f"prompt token_ids[{i}] = {t} is outside the vocabulary [0, {cfg.vocab_size})")
        self.params.validate()
        self.max_len = self.max_len or cfg.max_position_embeddings
        if len(self.prompt) >= self.max_len:
            raise ValueError(f"prompt has {len(self.prompt)} tokens; the max context is {self.max_len}")
        p = next(self.model.parameters())
        self.device = p.device
        self.cache = KVCache(cfg, self.max_len, dtype=p.dtype, device=p.device)
        self.generator = make_generator(self.params.seed, self.device)
        self.tokens: list[int] = list(self.prompt)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def _run(self, ids: list[int], positions: torch.Tensor, mask=None, logits_rows=None):
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            return self.model(x, positions.to(self.device), cache=self.cache, mask=mask,
                              hidden_layers=self.hidden_layers, logits_rows=logits_rows)

    def prefill(self) -> StepOutput:
        """Run the prompt (in chunks, so memory stays linear in its length) and sample b0."""
        if self.cache.length:
            raise RuntimeError("prefill called twice on one sequence")
        hidden, n = [], len(self.prompt)
        for start in range(0, n, self.prefill_chunk):
            chunk = self.prompt[start:start + self.prefill_chunk]
            last = start + len(chunk) == n
            out = self._run(chunk, torch.arange(start, start + len(chunk)),
                            logits_rows=slice(-1, None) if last else slice(0, 0))
            if out.hidden is not None:
                hidden.append(out.hidden[0])
        first = sample(out.logits[0, -1], self.params, self.generator)
        self.tokens.append(first)
        return StepOutput([first], torch.cat(hidden) if hidden else None)

    def decode(self) -> StepOutput:
        """One target-only step: feed the last committed token, sample the next."""
        self._check_room(1)
        pos = self.length - 1
        out = self._run([self.tokens[-1]], torch.tensor([pos]))
        tok = sample(out.logits[0, -1], self.params, self.generator)
        self.tokens.append(tok)
        return StepOutput([tok], None if out.hidden is None else out.hidden[0])

    def verify(self, tree: Tree, draft_probs: torch.Tensor | None = None) -> StepOutput:
        """Verify `tree` (drafted after the last committed token) in one forward pass."""
        tree.validate(self.model.cfg.vocab_size)
        vocab = self.model.cfg.vocab_size
        if draft_probs is not None and tuple(draft_probs.shape) != (len(tree), vocab):
            raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
                             f"({len(tree)}, {vocab}): one row per tree node over the vocabulary")
        self._check_room(len(tree) + 1)
        base = self.length - 1                       # cached tokens; the root goes here
        depths = torch.tensor([0] + tree.depths())
        mask = torch.cat([torch.ones(len(tree) + 1, base, dtype=torch.bool), tree.ancestor_mask()], dim=1)
        out = self._run([self.tokens[-1], *tree.token_ids], base + depths, mask=mask.to(self.device))
        try:
            result = self.verifier.verify(out.logits[0], tree, self.params, self.generator,
                                          None if draft_probs is None else draft_probs.to(self.device))
        except Exception:
            self.cache.truncate(base)   # drop the root + nodes the forward appended
            raise
        rows = [0] + [i + 1 for i in result.accepted]
        self.cache.keep(base, rows)
        committed = result.committed(tree)
        self.tokens.extend(committed)
        hidden = None if out.hidden is None else out.hidden[0, rows]
        return StepOutput(committed, hidden, result)

    def _check_room(self, n: int) -> None:
        if self.length - 1 + n > self.max_len:
            raise ValueError(f"sequence would reach {self.length - 1 + n} tokens; the max context is {self.max_len}")


def generate(model: CausalLM, prompt_ids: list[int], max_new_tokens: int, *,
             params: SamplingParams | None = None, eos_ids=(), max_len: int | None = None,
             temperature: float | None = None) -> list[int]:
    """Target-only decoding in process: the reference every speculative path must equal.
    Returns the new tokens, including a final eos if one was produced."""
    if params is None:
        params = SamplingParams(temperature=temperature or 0.0)
    if max_len is None:
        max_len = min(model.cfg.max_position_embeddings, len(prompt_ids) + max_new_tokens + 1)
    seq = TargetSequence(model, list(prompt_ids), params, max_len=max_len)
    out = [seq.prefill().committed[0]]
    eos = set(eos_ids)
    while len(out) < max_new_tokens and out[-1] not in eos:
        out.append(seq.decode().committed[0])
    return out
