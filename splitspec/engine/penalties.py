"""Logit processors and log-probs of the target (issue 28), with vLLM's meanings:

* `logit_bias`: added to the token's logit;
* `min_tokens`: eos (unless ignore_eos) and `stop_token_ids` get -inf while fewer tokens than
  that have been generated;
* `repetition_penalty` r: a token seen in the prompt OR the generated tokens has a positive
  logit divided by r, a non-positive one multiplied by r;
* `frequency_penalty` f and `presence_penalty` p: minus f * count and minus p * [count > 0],
  counting the generated tokens only.

Applied in that order, before temperature / top-k / top-p. Every row of a step gets its own
context: a decode row counts the tokens generated so far; inside a verified chain or tree, the
row of node i also counts the drafted tokens on i's own path (root to i, i included), because
that row's distribution is the one the target would sample from had that path been generated.
This is what keeps speculation lossless with penalties: each position is verified against the
distribution a target-only run would have used there.

Log-probs are reported from the RAW logits (log_softmax in fp32 before any processor, penalty
or temperature), like vLLM's default logprobs_mode "raw_logprobs"."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sample import SamplingParams


def path_tokens(token_ids, parents) -> list[list[int]]:
    """For a verify step's rows (root, then node i): the drafted tokens generated before the
    position that row predicts — empty at the root, the path root..i (i included) at node i."""
    paths: list[list[int]] = [[]]
    for i, parent in enumerate(parents):
        paths.append(paths[parent + 1] + [token_ids[i]])
    return paths


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int],
                   paths: list[list[int]] | None = None, eos_token_ids=()) -> torch.Tensor:
    """logits [R, V] -> processed fp32 logits. `prompt`: the request's prompt; `generated`: its
    tokens generated before row 0's position; `paths[r]`: the further tokens before row r's
    (None: every row has the same context, `generated`)."""
    out = logits.float().clone()
    rows, vocab = out.shape
    device = out.device
    paths = paths if paths is not None else [[] for _ in range(rows)]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        out[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=device)
    if params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        short = [r for r in range(rows) if len(generated) + len(paths[r]) < params.min_tokens]
        if stops and short:
            stop = torch.tensor(sorted(stops), dtype=torch.long, device=device)
            out[torch.tensor(short, device=device)[:, None], stop[None, :]] = float("-inf")
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        counts = torch.zeros(vocab, dtype=out.dtype, device=device)
        if generated:
            counts += torch.bincount(torch.tensor(generated, device=device), minlength=vocab).to(out.dtype)
        counts = counts.expand(rows, vocab).clone()
        extra = [(r, t) for r, path in enumerate(paths) for t in path]
        if extra:
            r_idx = torch.tensor([r for r, _ in extra], device=device)
            t_idx = torch.tensor([t for _, t in extra], device=device)
            counts.index_put_((r_idx, t_idx), torch.ones(len(extra), dtype=out.dtype, device=device), accumulate=True)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            if prompt:
                seen[:, torch.tensor(sorted(set(prompt)), device=device)] = True
            r = params.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        if params.frequency_penalty:
            out -= params.frequency_penalty * counts
        if params.presence_penalty:
            out -= params.presence_penalty * (counts > 0).to(out.dtype)
    return out


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int                          # 1 = the most likely
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """The raw log-prob of tokens[r] under row r of `logits` [R, V], with its rank and the
    row's top_n alternatives."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    idx = torch.tensor(tokens, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    top_v, top_i = (lp.topk(top_n, dim=-1) if top_n else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(t, c, r, tuple(zip(ti, tv))) for t, c, r, ti, tv in zip(tokens, chosen, ranks, top_i, top_v)]
