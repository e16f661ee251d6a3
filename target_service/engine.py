"""Target-side sequence operations on one sequence: prefill, target-only decode and tree
verification, each a one-row batch through the same runner the service batches with. Tests,
the in-process speculative loop and the benchmark's reference call these directly."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.engine.kv_pool import BlockTable, KVPool
from splitspec.engine.sample import SamplingParams, make_generator
from splitspec.engine.tree import Tree

from .torch_verifier import TorchVerifier
from .model import CausalLM
from .pools import make_pool
from .runner import Decode, Prefill, Sequence, StepOutput, Verify, check_hidden_stream, run_batch

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class CacheView:
    """A sequence's K/V gathered out of the pool, [layers, 1, kv_heads, length, head_dim]."""
    length: int
    k: torch.Tensor
    v: torch.Tensor


class TargetSequence:
    """One sequence run alone through the batched runner, on a pool of its own (or a shared
    one): the in-process reference and what tests and the one-process loop call directly."""

    def __init__(self, model: CausalLM, prompt: list[int], params: SamplingParams | None = None, *,
                 max_len: int | None = None, hidden_layers: tuple[int, ...] = (), verifier=None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, pool: KVPool | None = None, block_size: int = 16,
                 attention: str = "torch", hidden_stream: str = ""):
        cfg = model.cfg
        params = params or SamplingParams()
        if not prompt:
            raise ValueError("prompt is empty: at least one token id is needed")
        for i, t in enumerate(prompt):
            if not 0 <= t < cfg.vocab_size:
                raise ValueError(f"prompt token_ids[{i}] = {t} is outside the vocabulary [0, {cfg.vocab_size})")
        params.validate()
        for layer in hidden_layers:
            if not 0 <= layer < cfg.num_hidden_layers:
                raise ValueError(f"hidden layer id {layer} is outside 0..{cfg.num_hidden_layers - 1}")
        check_hidden_stream(model, hidden_stream)
        self.max_len = max_len or cfg.max_position_embeddings
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the max context is {self.max_len}")
        self.model, self.prompt, self.params = model, list(prompt), params
        self.verifier = verifier or TorchVerifier()
        self.prefill_chunk = prefill_chunk
        self.attention = attention
        p = next(model.parameters())
        self.device = p.device
        if pool is None:
            pool = make_pool(model, num_blocks=-(-self.max_len // block_size) + 1, block_size=block_size)
        self.pool = pool
        self.seq = Sequence(self.prompt, params, make_generator(params.seed, self.device), BlockTable(pool),
                            self.max_len, tuple(hidden_layers), hidden_stream=hidden_stream)

    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens

    @property
    def length(self) -> int:
        return self.seq.length

    @property
    def generator(self) -> torch.Generator:
        return self.seq.generator

    @property
    def cache(self) -> CacheView:
        k, v = self.seq.table.dense()
        return CacheView(self.seq.table.length, k, v)

    def _run(self, step) -> StepOutput:
        out = run_batch(self.model, self.pool, self.verifier, [step], self.attention)[0]
        if isinstance(out, Exception):
            raise out
        return out

    def prefill(self) -> StepOutput:
        """Run the prompt (in chunks, so memory stays linear in its length) and sample b0."""
        if self.seq.prefilled:
            raise RuntimeError("prefill called twice on one sequence")
        hidden = []
        while True:
            out = self._run(Prefill(self.seq, min(self.seq.prefilled + self.prefill_chunk, len(self.prompt))))
            if out.hidden is not None:
                hidden.append(out.hidden)
            if out.committed:
                return StepOutput(out.committed, torch.cat(hidden) if hidden else None)

    def decode(self) -> StepOutput:
        """One target-only step: feed the last committed token, sample the next."""
        self._check_room(1)
        return self._run(Decode(self.seq))

    def verify(self, tree: Tree, draft_probs: torch.Tensor | None = None) -> StepOutput:
        """Verify `tree` (drafted after the last committed token) in one forward pass."""
        tree.validate(self.model.cfg.vocab_size)
        vocab = self.model.cfg.vocab_size
        if draft_probs is not None and tuple(draft_probs.shape) != (len(tree), vocab):
            raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
                             f"({len(tree)}, {vocab}): one row per tree node over the vocabulary")
        self._check_room(len(tree) + 1)
        return self._run(Verify(self.seq, tree, draft_probs))

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
