"""One target forward over the steps of many sessions (the model runner).

A step is a prefill chunk, a decode step (one query token) or a verify step (the last
committed token plus a draft tree, with the tree's ancestor mask). `run_batch` lays every
step's tokens out in one flat ragged batch, runs the model once over the paged KV pool, then
finishes each step on its own: samples with the session's own parameters and generator (so
a seeded request draws the same tokens whatever else shares the batch), verifies trees, and
rolls back rejected nodes by shortening the session's block table. A step that fails is
rolled back and reported alone; the other rows of the batch are not affected."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitspec.engine.attention import Row, plan_attention
from splitspec.engine.kv_pool import BlockTable, KVPool
from splitspec.engine.penalties import TokenLogprob, path_tokens, process_logits, token_logprobs
from splitspec.engine.sample import SamplingParams, sample
from splitspec.engine.tree import Tree

from splitspec.grammar import mask_rows
from splitspec.models.dense import CausalLM, PagedBatch
from splitspec.models.gguf_packed import rows_invariant
from target_service.parallel import TensorParallelError
from splitspec.engine.state_pool import StatePlan, StateRow
from target_service.verify import VerifyResult


@dataclass
class Sequence:
    """One session on the target. Invariant once prefilled: `tokens` holds every committed
    token and the pool holds K/V for all but the last, which is fed at the next step."""
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    table: BlockTable
    max_len: int
    hidden_layers: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    hidden_stream: str = ""             # Attention-Residuals targets: "prefix" / "attn_res"; "": the model's default
    prefilled: int = 0                  # prompt tokens whose K/V are in the pool
    # Where the request's own output starts in `tokens`: a resumed request's prompt ends with
    # tokens it generated before, which penalties and min_tokens count as generated. None: len(prompt).
    output_start: int | None = None
    eos_token_ids: tuple[int, ...] = ()   # what min_tokens holds back (unless params.ignore_eos)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # with params.prompt_logprobs
    # Return the logits each sampled token was drawn from (StepOutput.logits): the ceiling's and
    # the draft trainer's distributions, which the service never ships.
    keep_logits: bool = False
    guide: object | None = None         # structured output: a grammar.Guide, advanced by committed tokens

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)
        if self.output_start is None:
            self.output_start = len(self.prompt)

    def processed(self, logits: torch.Tensor, paths: list[list[int]] | None = None, tree: Tree | None = None) -> torch.Tensor:
        """The logits the sampler and verifier use: `logits` through this request's processors
        (penalties, logit_bias, min_tokens) with each row's own context, then its grammar's mask
        with each row's own state (a tree's nodes: the state after their path); as is when it
        has neither."""
        scored = logits
        if self.params.processes:
            scored = process_logits(logits, self.params, self.tokens[:self.output_start],
                                    self.tokens[self.output_start:], paths, self.eos_token_ids)
        if self.guide is not None and not self.guide.done:
            allowed = self.guide.allowed()[None] if tree is None else self.guide.tree_allowed(tree)
            scored = mask_rows(scored, logits, allowed)
        return scored

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if self.guide is not None:
            self.guide.advance(tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Prefill:
    seq: Sequence
    end: int                            # run prompt[seq.prefilled:end]

    @property
    def last(self) -> bool:
        return self.end == len(self.seq.prompt)


@dataclass
class Decode:
    seq: Sequence


@dataclass
class Verify:
    seq: Sequence
    tree: Tree
    draft_probs: torch.Tensor | None = None


@dataclass
class StepOutput:
    committed: list[int]                 # tokens committed by this step (none for a middle prefill chunk)
    hidden: torch.Tensor | None          # [n, len(layers) * H] features of the tokens just run (kept ones)
    result: VerifyResult | None = None   # verification details (Verify only)
    logprobs: list[TokenLogprob] | None = None   # one per committed token, with params.logprobs
    logits: torch.Tensor | None = None   # [1, V] what a prefill's or decode's token was sampled from (seq.keep_logits)


def _layout(step) -> tuple[list[int], list[int], torch.Tensor | None, bool]:
    """(token ids, positions, mask among them, logits for every row?) of one step."""
    seq = step.seq
    if isinstance(step, Prefill):
        # Prompt log-probs need every row's logits, not just the last one's.
        return (seq.prompt[seq.prefilled:step.end], list(range(seq.prefilled, step.end)), None,
                seq.params.prompt_logprobs is not None)
    base = seq.length - 1
    if isinstance(step, Decode):
        return [seq.tokens[-1]], [base], None, True
    depths = [0] + step.tree.depths()
    return [seq.tokens[-1], *step.tree.token_ids], [base + d for d in depths], step.tree.ancestor_mask(), True


def run_batch(model: CausalLM, pool: KVPool, verifier, steps: list,
              attention: str = "torch") -> list[StepOutput | Exception]:
    """Run `steps` (at most one per sequence) as one forward; one output or exception per step.
    attention: "torch" (SDPA over gathered blocks, any device), "torch-exact" (the same, with
    decode and verify tokens attended batch-invariantly: `attention.exact_queries`) or
    "flashinfer" (CUDA)."""
    device = pool.k.device
    vocab = model.cfg.vocab_size
    outputs: list[StepOutput | Exception | None] = [None] * len(steps)
    rows, ids, positions, logit_rows, live = [], [], [], [], []
    n = 0
    for i, step in enumerate(steps):
        tok, pos, mask, all_logits = _layout(step)
        table = step.seq.table
        try:
            bad = next((t for t in tok if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
            table.ensure(table.length + len(tok))
        except Exception as exc:  # noqa: BLE001 - this step fails alone
            outputs[i] = exc
            continue
        rows.append(Row(table, len(tok), mask))
        ids += tok
        positions += pos
        if all_logits:
            logit_rows.append(list(range(n, n + len(tok))))
        elif isinstance(step, Prefill) and step.last:
            logit_rows.append([n + len(tok) - 1])
        else:
            logit_rows.append([])
        live.append((i, n, len(tok)))
        n += len(tok)
    if not rows:
        return outputs
    layers = list(dict.fromkeys(_tap_key(steps[i].seq, layer)
                                for i, *_ in live for layer in steps[i].seq.hidden_layers))
    index = torch.tensor([r for rs in logit_rows for r in rs], dtype=torch.long, device=device)
    plan = plan_attention(rows, device, groups=attention in ("torch", "torch-exact"), exact=attention == "torch-exact")
    # A model whose every matmul is a packed kernel (gguf_packed.rows_invariant) computes a lone
    # row as it computes it among others, and exact attention attends each decode and verify token
    # alone anyway: it needs neither second copy below.
    copies = attention == "torch-exact" and not rows_invariant(model)
    if copies and n == 1:
        # A one-token forward (one session decoding alone) runs as two copies of that token: the
        # BLAS takes another kernel for a single row (for SmolLM2's down projection its rows
        # differ in the last bit from the same rows among 2..24), and a decode must compute what
        # that token's row of a verify computes. Both copies write the same K/V to one slot.
        ids, positions = ids * 2, positions * 2
        plan.repeat_first_token()
    if copies and len(index) == 1:
        # lm_head's GEMM takes the one-row kernel too (at hidden 1,536 its last bits differ from the
        # same row among 2+), so a lone logits row (a decode, a prompt's last chunk) is computed
        # twice, as a verify's rows are computed among others; the second copy is never read.
        index = index.repeat(2)
    states = None
    if pool.states is not None:
        states = StatePlan(pool.states, [_state_row(steps[i], start, q) for i, start, q in live], pool.states.rollback)
    if attention == "flashinfer":
        if getattr(model.cfg, "hybrid", None) is not None:
            raise ValueError("--attention-backend flashinfer does not run MLA / KDA layers; use torch")
        from splitspec.engine.flashinfer_attention import FlashInferPlan
        cfg = model.cfg
        plan.flashinfer = FlashInferPlan(rows, num_qo_heads=cfg.num_attention_heads,
                                         num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                         block_size=pool.block_size, dtype=pool.k.dtype, device=device)
    try:
        with torch.inference_mode():
            logits, hidden = model.forward_batch(
                torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(positions, device=device),
                PagedBatch(pool, plan, states), hidden_layers=layers, logits_index=index,
                max_position=max(positions))
    except TensorParallelError as exc:
        # The forward itself failed (a tensor-parallel rank is gone): every row fails with it and
        # no table moved, so each session is as it was before this step.
        for i, *_ in live:
            outputs[i] = exc
        return outputs
    at = 0
    for row, ((i, start, q), lr) in enumerate(zip(live, logit_rows)):
        step, seq = steps[i], steps[i].seq
        step_logits = logits[at:at + len(lr)]
        at += len(lr)
        feats = None
        if seq.hidden_layers:
            feats = torch.cat([hidden[_tap_key(seq, layer)][start:start + q] for layer in seq.hidden_layers], dim=-1)
        base = seq.table.length
        try:
            out = _finish(step, step_logits, feats, verifier)
            if states is not None:
                # The recurrent state follows the tokens that stay: all of a prefill chunk or a
                # decode step, the accepted path of a verify (root first).
                path = list(range(q)) if out.result is None else [0] + [n + 1 for n in out.result.accepted]
                with torch.inference_mode():
                    states.commit(row, path)
            outputs[i] = out
        except Exception as exc:  # noqa: BLE001 - roll this step back; the others stand
            seq.table.truncate(base)
            outputs[i] = exc
    return outputs


def check_hidden_stream(model, stream: str, name: str = "hidden_stream") -> None:
    """A draft may declare which stream its taps read; only Attention-Residuals targets have two."""
    if not stream:
        return
    h = getattr(model.cfg, "hybrid", None)
    if h is None or not h.attn_res_block_size:
        raise ValueError(f"{name} = {stream!r}: this target has no Attention Residuals, so its taps have "
                         f"one stream; leave {name} unset")
    if stream not in ("prefix", "attn_res"):
        raise ValueError(f"{name} = {stream!r}: expected prefix or attn_res")


def _tap_key(seq: Sequence, layer: int):
    """What forward_batch is asked for: a layer id, or (layer, stream) when the session's draft
    declared a stream of an Attention-Residuals target."""
    return (layer, seq.hidden_stream) if seq.hidden_stream else layer


def _state_row(step, start: int, q: int) -> StateRow:
    """How a step's tokens chain for the KDA layers: a tree's nodes start from their parent's state."""
    parents = None
    if isinstance(step, Verify):
        tp = list(step.tree.parents)
        if tp != list(range(-1, len(tp) - 1)):
            parents = [-1] + [p + 1 for p in tp]
    return StateRow(step.seq.table.state, start, q, parents, verify=isinstance(step, Verify))


def _finish(step, logits: torch.Tensor, feats: torch.Tensor | None, verifier) -> StepOutput:
    seq = step.seq
    table = seq.table
    want = seq.params.logprobs
    if isinstance(step, Prefill):
        start = seq.prefilled
        if seq.params.prompt_logprobs is not None:
            # Row j predicts prompt[start + j + 1]; the last prompt row predicts b0 instead.
            targets = seq.prompt[start + 1:step.end + 1]
            seq.prompt_logprobs += token_logprobs(logits, targets, seq.params.prompt_logprobs)
        table.length = step.end
        seq.prefilled = step.end
        if not step.last:
            return StepOutput([], feats)
        scored = seq.processed(logits[-1:])
        first = sample(scored[0], seq.params, seq.generator, seq.length)
        seq.commit([first])
        return StepOutput([first], feats, logprobs=None if want is None else token_logprobs(logits[-1:], [first], want),
                          logits=scored if seq.keep_logits else None)
    if isinstance(step, Decode):
        scored = seq.processed(logits[:1])
        tok = sample(scored[0], seq.params, seq.generator, seq.length)
        table.length += 1
        seq.commit([tok])
        return StepOutput([tok], feats, logprobs=None if want is None else token_logprobs(logits[:1], [tok], want),
                          logits=scored if seq.keep_logits else None)
    base = table.length
    probs = None if step.draft_probs is None else step.draft_probs.to(logits.device)
    scored = seq.processed(logits, path_tokens(step.tree.token_ids, step.tree.parents), step.tree)
    result = verifier.verify(scored, step.tree, seq.params, seq.generator, probs, position=seq.length)
    keep = [0] + [node + 1 for node in result.accepted]
    if keep != list(range(len(keep))):         # a tree branch: compact the path in place
        table.move([base + r for r in keep], base)
    table.length = base + len(keep)
    table.truncate(base + len(keep))
    committed = result.committed(step.tree)
    seq.commit(committed)
    # Each committed token is scored at the row that predicted it: its parent's (root first).
    lps = None if want is None else token_logprobs(logits[keep], committed, want)
    return StepOutput(committed, None if feats is None else feats[keep], result, lps)
