"""The target in process: the one small API that tools (`splitspec_tools/train`, `splitspec_tools/bench`),
tests and the one-process speculative loop use, all through the runner and pools the service
batches with, so each model family has exactly one forward path.

- `load_model`: a checkpoint folder as the service loads it (any family, optionally tensor-parallel);
  `load_tokenizer` and `tokenizer_hash` for its tokenizer.
- `TargetSequence`: one sequence: prefill, target-only decode, tree verification.
- `SequenceBatch`: many sequences in lockstep (the draft trainer's producer, `splitspec ceiling`).
- `forward_sequences`: logits and tap features of whole sequences in one forward.
- `generate`: target-only decoding, the reference every speculative path must equal."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.engine.attention import Row, plan_attention
from splitspec.engine.kv_pool import BlockTable, KVPool
from splitspec.engine.sample import SamplingParams, make_generator
from splitspec.engine.tree import Tree

from splitspec.models.loader import load_model as _load_model
from splitspec.models.loader import load_tokenizer, parse_dtype, resolve_device, tokenizer_hash  # noqa: F401 - the API's
from splitspec.models.dense import CausalLM, PagedBatch
from target_service.pools import make_pool
from target_service.runner import Decode, Prefill, Sequence, StepOutput, Verify, check_hidden_stream, run_batch
from splitspec.engine.state_pool import StatePlan, StateRow
from target_service.torch_verifier import TorchVerifier
from target_service.verify import check_draft_probs

DEFAULT_PREFILL_CHUNK = 512


def load_model(path, *, dtype="float32", device="cpu", tensor_parallel_size: int = 1, timeout_s: float = 600.0,
               gguf_weights: str = "packed", gguf_head: str = "int8"):
    """A target folder as the service loads it. tensor_parallel_size > 1 spawns the other ranks
    on this host (`tp_worker.start`) and returns rank 0's driver, which every function here
    drives like a plain model; `close_model` stops the ranks. A GGUF file keeps its weights
    packed on CPU unless `gguf_weights="dequantized"` (loader.load_model)."""
    if tensor_parallel_size <= 1:
        return _load_model(path, dtype=dtype, device=device, gguf_weights=gguf_weights, gguf_head=gguf_head)
    from target_service import tp_worker
    return tp_worker.start(str(path), tensor_parallel_size, dtype=parse_dtype(dtype),
                           device=resolve_device(str(device)), timeout_s=timeout_s)


def close_model(model) -> None:
    """Stop a tensor-parallel model's ranks (nothing for a model in this process)."""
    if hasattr(model, "close"):
        model.close()


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None       # [B, T, V]; None when not asked for
    hidden: torch.Tensor | None       # [B, T, len(layers) * H]: the taps (`model.tap`), concatenated


def check_layers(model, hidden_layers) -> None:
    n = model.cfg.num_hidden_layers
    for layer in hidden_layers:
        if not 0 <= layer < n:
            raise ValueError(f"hidden layer id {layer} is outside 0..{n - 1}")


@torch.no_grad()     # not inference_mode: trainers and tests use the features in autograd graphs
def forward_sequences(model, input_ids: torch.Tensor, *, hidden_layers=(), logits: bool = True,
                      block_size: int = 16) -> ForwardOutput:
    """Whole sequences input_ids [B, T] (or [T]) from position 0, in one batched forward over a
    pool of their own: the same `forward_batch`, attention plan and KDA state chaining that
    serve them, for every family. For features of many training sequences at once."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    B, T = input_ids.shape
    vocab = model.cfg.vocab_size
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        bad = int(input_ids[(input_ids < 0) | (input_ids >= vocab)][0])
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    check_layers(model, hidden_layers)
    dev = next(model.parameters()).device
    pool = make_pool(model, num_blocks=B * -(-T // block_size) + 1, block_size=block_size, max_sessions=B)
    tables = []
    for _ in range(B):
        table = BlockTable(pool)
        table.ensure(T)
        tables.append(table)
    states = None if pool.states is None else \
        StatePlan(pool.states, [StateRow(t.state, b * T, T) for b, t in enumerate(tables)], pool.states.rollback)
    batch = PagedBatch(pool, plan_attention([Row(t, T) for t in tables], dev), states)
    layers = list(hidden_layers)
    index = None if logits else torch.zeros(0, dtype=torch.long, device=dev)
    out, hidden = model.forward_batch(input_ids.reshape(-1).to(dev), torch.arange(T, device=dev).repeat(B), batch,
                                      hidden_layers=layers, logits_index=index, max_position=T - 1)
    for t in tables:
        t.free()
    return ForwardOutput(logits=out.view(B, T, -1) if logits and out is not None else None,
                         hidden=torch.cat([hidden[i].view(B, T, -1) for i in layers], -1) if layers else None)


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
        check_layers(model, hidden_layers)
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
        if draft_probs is not None:
            draft_probs = check_draft_probs(draft_probs, tree, "draft_probs")
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


class SequenceBatch:
    """Many sequences run in lockstep through the same runner the service batches with, on a pool
    of their own: the draft trainer's producer, its evaluation and `splitspec ceiling`, so each
    model family (dense or hybrid KDA / MLA) has one forward path. Every row holds blocks for its
    whole `max_len` from the start, so its blocks are consecutive and a step never allocates.

    `rows` sizes the pool: the prompts plus room for `fork`ed branches."""

    def __init__(self, model: CausalLM, prompts: list[list[int]], params: list[SamplingParams], *,
                 max_len: int, generators: list[torch.Generator] | None = None, hidden_layers: tuple[int, ...] = (),
                 keep_logits: bool = False, rows: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 block_size: int = 16):
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        for prompt in prompts:
            if not prompt:
                raise ValueError("a prompt is empty: at least one token id is needed")
            if len(prompt) >= max_len:
                raise ValueError(f"a prompt has {len(prompt)} tokens; max_len is {max_len}")
        check_layers(model, hidden_layers)
        rows = rows or len(prompts)
        self.model, self.max_len, self.prefill_chunk = model, max_len, prefill_chunk
        self.keep_logits, self.hidden_layers = keep_logits, tuple(hidden_layers)
        self.pool = make_pool(model, num_blocks=rows * -(-max_len // block_size) + 1, block_size=block_size,
                              max_sessions=rows)
        self.verifier = TorchVerifier()
        device = next(model.parameters()).device
        if generators is None:
            generators = [make_generator(p.seed, device) for p in params]
        self.seqs = [self._sequence(list(pr), p, gen) for pr, p, gen in zip(prompts, params, generators)]

    def _sequence(self, prompt, params, generator) -> Sequence:
        seq = Sequence(prompt, params, generator, BlockTable(self.pool), self.max_len, self.hidden_layers,
                       keep_logits=self.keep_logits)
        seq.table.ensure(self.max_len)
        return seq

    def _run(self, steps) -> list[StepOutput]:
        outs = run_batch(self.model, self.pool, self.verifier, steps)
        for out in outs:
            if isinstance(out, Exception):
                raise out
        return outs

    def prefill(self) -> list[StepOutput]:
        """Every row's prompt, `prefill_chunk` tokens per row per forward; each row's output has its
        first sampled token, the features of every prompt token and (keep_logits) what it was drawn from."""
        hidden: list[list[torch.Tensor]] = [[] for _ in self.seqs]
        last: list[StepOutput | None] = [None] * len(self.seqs)
        while True:
            todo = [i for i, s in enumerate(self.seqs) if last[i] is None]
            if not todo:
                break
            steps = [Prefill(self.seqs[i], min(self.seqs[i].prefilled + self.prefill_chunk, len(self.seqs[i].prompt)))
                     for i in todo]
            for i, out in zip(todo, self._run(steps)):
                if out.hidden is not None:
                    hidden[i].append(out.hidden)
                if out.committed:
                    last[i] = out
        return [StepOutput(o.committed, torch.cat(h) if h else None, logits=o.logits) for o, h in zip(last, hidden)]

    def decode(self, rows: list[int] | None = None, feed: list[int] | None = None) -> list[StepOutput]:
        """One target step for each of `rows` (default: all): feeds its last token, or `feed[i]` in its
        place (the caller chose the token, e.g. a path of its own), and samples the next."""
        rows = list(range(len(self.seqs))) if rows is None else rows
        if feed is not None:
            for i, t in zip(rows, feed, strict=True):
                self.seqs[i].tokens[-1] = int(t)
        for i in rows:
            if self.seqs[i].length >= self.max_len:
                raise ValueError(f"row {i} would pass max_len {self.max_len}")
        return self._run([Decode(self.seqs[i]) for i in rows])

    def fork(self, row: int, n: int, params: SamplingParams | None = None) -> list[int]:
        """n new rows continuing from row `row` (same tokens, K/V and recurrent state); their indices."""
        src = self.seqs[row]
        new = []
        for _ in range(n):
            p = params or src.params
            seq = Sequence(list(src.prompt), p, make_generator(p.seed, src.generator.device), src.table.fork(),
                           self.max_len, self.hidden_layers, tokens=list(src.tokens), prefilled=src.prefilled,
                           keep_logits=self.keep_logits)
            new.append(len(self.seqs))
            self.seqs.append(seq)
        return new

    def release(self, rows: list[int]) -> None:
        """Hand the blocks of `rows` back (they must not step again); indices of the others stay."""
        for i in rows:
            self.seqs[i].table.free()
