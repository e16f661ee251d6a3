"""Penalties, logit_bias and min_tokens in the target's sampler and verifier, and the target's
log-probs (issue 28). Every row of a verified tree is checked against a direct computation: a
full forward over that node's own context (prompt + generated + the node's path), then the
processors written out by hand from vLLM's definitions, so a wrong count at one node shows."""
from __future__ import annotations

import collections

import pytest
import torch

from splitspec.engine.penalties import path_tokens, process_logits, token_logprobs
from splitspec.engine.sample import SamplingParams
from splitspec.engine.tree import Tree
from splitspec.wire import WireError, sampling_from_pb
from splitspec.v1 import common_pb2
from target_service.engine import TargetSequence, forward_sequences
from target_service.torch_verifier import TorchVerifier

PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3,
                 logit_bias=((5, 3.0), (9, -2.0)), min_tokens=12, stop_token_ids=(7,))


def by_hand(raw: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """vLLM's processors for one position, written out token by token."""
    out = raw.double().clone()
    for t, b in params.logit_bias:
        out[t] += b
    if len(generated) < params.min_tokens:
        for t in params.stop_token_ids:
            out[t] = float("-inf")
    counts = collections.Counter(generated)
    for t in set(prompt) | set(generated):
        out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    for t, c in counts.items():
        out[t] -= params.frequency_penalty * c + params.presence_penalty
    return out


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return forward_sequences(model, torch.tensor([ids])).logits[0, -1].float()


class Spy(TorchVerifier):
    """Records the logits the verifier was given."""
    seen: list[torch.Tensor] = []

    def verify(self, logits, tree, params, generator, draft_probs, position=None):
        self.seen.append(logits.clone())
        return super().verify(logits, tree, params, generator, draft_probs, position)


def test_path_tokens_follow_each_nodes_own_branch():
    assert path_tokens([4, 5, 6, 7], [-1, 0, -1, 2]) == [[], [4], [4, 5], [6], [6, 7]]


def test_verify_uses_each_nodes_own_counts(tiny_qwen3_model, torch_one_thread):
    model = tiny_qwen3_model
    params = SamplingParams(**PENALTIES)
    prompt = [3, 4, 5, 6, 3]
    seq = TargetSequence(model, prompt, params, verifier=Spy())
    seq.prefill()
    for _ in range(3):
        seq.decode()
    generated = seq.tokens[len(prompt):]
    g0, g1 = generated[0], generated[1]
    # Branch A repeats generated tokens and then itself; branch B is new tokens only.
    tree = Tree((g0, g0, g1, 40, 41, 40), (-1, 0, 1, -1, 3, 4))
    Spy.seen.clear()
    seq.verify(tree)
    scored = Spy.seen[0]
    paths = path_tokens(tree.token_ids, tree.parents)
    context = list(seq.tokens[:len(prompt) + len(generated)])
    for row, path in enumerate(paths):
        raw = full_logits(model, context + path)
        want = by_hand(raw, params, prompt, generated + path)
        got = scored[row].double()
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), row
        torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4, msg=f"row {row} {path}")


def test_greedy_speculation_with_penalties_equals_target_only(tiny_qwen3_model, torch_one_thread):
    model = tiny_qwen3_model
    params = SamplingParams(**PENALTIES, logprobs=3)
    prompt = [3, 4, 5, 6, 3]
    ref = TargetSequence(model, prompt, params)
    ref_lps = [ref.prefill()]
    for _ in range(10):
        ref_lps.append(ref.decode())
    want = ref.tokens[len(prompt):]
    # The true continuation as one chain, with a wrong sibling at the root: all accepted.
    seq = TargetSequence(model, prompt, params)
    seq.prefill()
    first = want[1:7]
    tree = Tree(tuple(first) + ((first[0] + 1) % 100,), tuple(range(-1, len(first) - 1)) + (-1,))
    out = seq.verify(tree)
    assert out.committed == want[1:8]
    # The verify's log-probs equal target-only decoding's, token by token (raw distribution).
    for lp, ref_out in zip(out.logprobs, ref_lps[1:8]):
        r = ref_out.logprobs[0]
        assert lp.token_id == r.token_id and lp.rank == r.rank
        assert abs(lp.logprob - r.logprob) < 1e-4
        assert [t for t, _ in lp.top] == [t for t, _ in r.top]


def test_logprobs_are_the_raw_model_distribution(tiny_qwen3_model, torch_one_thread):
    model = tiny_qwen3_model
    prompt = [3, 4, 5, 6]
    seq = TargetSequence(model, prompt, SamplingParams(logprobs=5, presence_penalty=2.0, logit_bias=((1, 50.0),)))
    seq.prefill()
    out = seq.decode()
    assert out.committed == [1]              # the bias wins the sampling...
    raw = torch.log_softmax(full_logits(model, seq.tokens[:-1]), -1)
    lp = out.logprobs[0]
    assert abs(lp.logprob - float(raw[1])) < 1e-4       # ...but the reported log-prob is the model's
    assert lp.rank == int((raw > raw[1]).sum()) + 1
    assert [t for t, _ in lp.top] == raw.topk(5).indices.tolist()


def test_prompt_logprobs_cover_every_prompt_token_after_the_first(tiny_qwen3_model, torch_one_thread):
    model = tiny_qwen3_model
    prompt = [3, 4, 5, 6, 9, 11, 2]
    seq = TargetSequence(model, prompt, SamplingParams(prompt_logprobs=2), prefill_chunk=3)
    seq.prefill()
    with torch.no_grad():
        lp = torch.log_softmax(forward_sequences(model, torch.tensor([prompt])).logits[0].float(), -1)
    got = seq.seq.prompt_logprobs
    assert [g.token_id for g in got] == prompt[1:]
    for i, g in enumerate(got):
        assert abs(g.logprob - float(lp[i, prompt[i + 1]])) < 1e-4
        assert len(g.top) == 2


def test_min_tokens_holds_back_stop_tokens():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 10.0
    params = SamplingParams(min_tokens=2, stop_token_ids=(7,))
    out = process_logits(logits, params, [1], [], [[], [4], [4, 5]], eos_token_ids=(8,))
    assert out[0, 7] == out[1, 7] == float("-inf") and out[0, 8] == float("-inf")
    assert out[2, 7] == 10.0 and out[2, 8] == 0.0
    ignore = SamplingParams(min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    assert process_logits(logits, ignore, [1], [], None, eos_token_ids=(8,))[0, 8] == 0.0


def test_token_logprobs_rank_and_top():
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0]])
    (lp,) = token_logprobs(logits, [2], 2)
    assert lp.rank == 3 and [t for t, _ in lp.top] == [3, 1]


@pytest.mark.parametrize("field, value, words", [
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("min_tokens", -1, "min_tokens must be >= 0"),
    ("logprobs", 21, "logprobs must be in [0, 20]"),
    ("prompt_logprobs", -1, "prompt_logprobs must be in [0, 20]"),
])
def test_bad_values_are_refused_on_the_wire(field, value, words):
    msg = common_pb2.SamplingParams()
    setattr(msg, field, value)
    with pytest.raises(WireError, match=words.replace("[", r"\[").replace("]", r"\]")):
        sampling_from_pb(msg)
    msg = common_pb2.SamplingParams()
    msg.logit_bias[3] = 101.0
    with pytest.raises(WireError, match="logit_bias"):
        sampling_from_pb(msg)
