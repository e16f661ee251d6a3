"""Exact rollback on hybrid targets: after a verify that accepts k of w drafts (every k from 0 to
w), the next step's logits equal those of a fresh run over the accepted sequence, for KDA-only,
MLA-only and mixed stacks, with either rollback strategy; a tree verify that accepts a side
branch; a failed row leaves its state untouched; state slots come and go with the session."""
from __future__ import annotations

import pytest
import torch

import target_service.runner as runner
from hybrid_models import save_tiny_deepseek, save_tiny_kimi
from splitspec.engine.kv_pool import BlockTable
from splitspec.engine.tree import Tree
from target_service.engine import TargetSequence, forward_sequences, generate
from splitspec.models.loader import load_model
from target_service.pools import make_pool
from splitspec.engine.state_pool import ROLLBACKS

W = 6
STACKS = {
    "mixed": dict(kda=(1, 2, 3), mla=(4,)),
    "kda_only": dict(kda=(1, 2, 3), mla=()),
    "mla_only": dict(kda=(), mla=(1, 2)),
}


# Stacks with recurrent (KDA) state, where the rollback strategy matters. MLA-only and DeepSeek
# stacks have none: a strategy there does nothing, so they run once, with None.
STATEFUL = {"mixed": True, "kda_only": True, "mla_only": False, "deepseek": False}


def rollback_cases(stacks):
    return ([(s, rb) for s in stacks if STATEFUL[s] for rb in ROLLBACKS]
            + [(s, None) for s in stacks if not STATEFUL[s]])


# Many tiny forwards: thread start-up costs more than it saves.
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {name: load_model(save_tiny_kimi(tmp_path_factory.mktemp(name), **kw)) for name, kw in STACKS.items()}
    out["deepseek"] = load_model(save_tiny_deepseek(tmp_path_factory.mktemp("ds")))
    return out


def fresh_next_logits(model, tokens):
    with torch.no_grad():
        return forward_sequences(model, torch.tensor([tokens])).logits[0, -1]


def start(model, prompt, rollback):
    seq = TargetSequence(model, prompt, max_len=64)
    assert (seq.pool.states is None) == (rollback is None)
    if rollback is not None:
        seq.pool.states.rollback = rollback
    seq.prefill()
    return seq


def verify(seq, tree, rollback, monkeypatch):
    """seq.verify(tree), checking that the verify forward kept what `rollback` keeps in every
    KDA layer (per-token states for snapshot, per-token inputs for replay): a strategy that
    was set but never reached would otherwise pass as that strategy."""
    plans = []
    real = runner.StatePlan
    monkeypatch.setattr(runner, "StatePlan", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    out = seq.verify(tree)
    monkeypatch.setattr(runner, "StatePlan", real)
    if rollback is not None:
        (plan,) = [p for p in plans if any(r.verify for r in p.rows)]
        assert plan.rollback == rollback and plan.pending
        for record in plan.pending.values():
            assert (record.hist is not None) == (rollback == "snapshot")
            assert bool(record.inputs) == (rollback == "replay")
    return out


def next_logits(seq, monkeypatch):
    seen = []
    real = runner.sample
    monkeypatch.setattr(runner, "sample", lambda logits, *a, **k: seen.append(logits.clone()) or real(logits, *a, **k))
    seq.decode()
    monkeypatch.setattr(runner, "sample", real)
    return seen[0]


@pytest.mark.parametrize("stack, rollback", rollback_cases(["mixed", "kda_only", "mla_only", "deepseek"]))
def test_verify_accepting_k_of_w_leaves_the_state_of_the_accepted_sequence(models, stack, rollback, monkeypatch):
    model = models[stack]
    prompt = [5, 17, 9, 33, 2, 71, 8]
    greedy = generate(model, prompt, W + 2)
    for k in range(W + 1):
        drafts = greedy[1:1 + W]
        drafts[k:] = [(t + 1 + k) % 128 for t in drafts[k:]]     # wrong from draft k on
        if k < W:
            assert drafts[k] != greedy[k + 1]
        seq = start(model, prompt, rollback)
        out = verify(seq, Tree.chain(drafts), rollback, monkeypatch)
        assert len(out.result.accepted) == k
        assert seq.tokens == prompt + greedy[:k + 2]
        got = next_logits(seq, monkeypatch)
        want = fresh_next_logits(model, seq.tokens[:-1])
        assert (got - want).abs().max() < 1e-4, f"k={k}"


@pytest.mark.parametrize("stack, rollback", rollback_cases(["mixed", "deepseek"]))
def test_tree_verify_keeps_the_state_of_the_accepted_branch(models, stack, rollback, monkeypatch):
    model = models[stack]
    prompt = [5, 17, 9, 33, 2]
    g = generate(model, prompt, 5)
    bad = [(t + 7) % 128 for t in g]
    # root -> [bad1 -> bad2] and root -> [g1 -> g2 -> bad3]: the second branch is accepted, 2 deep.
    tree = Tree(token_ids=(bad[1], bad[2], g[1], g[2], bad[3]), parents=(-1, 0, -1, 2, 3))
    seq = start(model, prompt, rollback)
    out = verify(seq, tree, rollback, monkeypatch)
    assert out.result.accepted == [2, 3]
    assert seq.tokens == prompt + g[:4]
    got = next_logits(seq, monkeypatch)
    assert (got - fresh_next_logits(model, seq.tokens[:-1])).abs().max() < 1e-4


def test_a_row_that_fails_after_the_forward_leaves_its_state(models, monkeypatch):
    model = models["mixed"]
    prompt = [5, 17, 9, 33]
    seq = TargetSequence(model, prompt, max_len=64)
    seq.prefill()
    conv = seq.pool.states.conv.clone()
    rec = seq.pool.states.rec.clone()

    def broken(*a, **k):
        raise RuntimeError("sampling failed")
    monkeypatch.setattr(runner, "sample", broken)
    with pytest.raises(RuntimeError):
        seq.decode()
    monkeypatch.undo()
    assert torch.equal(seq.pool.states.conv, conv) and torch.equal(seq.pool.states.rec, rec)
    assert seq.seq.table.length == len(prompt)
    got = next_logits(seq, monkeypatch)
    assert (got - fresh_next_logits(model, seq.tokens[:-1])).abs().max() < 1e-4


def test_state_slots_are_taken_per_session_and_given_back(models):
    model = models["mixed"]
    pool = make_pool(model, num_blocks=16, max_sessions=2)
    a, b = BlockTable(pool), BlockTable(pool)
    a.ensure(4)
    b.ensure(4)
    assert {a.state, b.state} == {0, 1} and pool.states.free_slots == 0
    c = BlockTable(pool)
    with pytest.raises(Exception, match="recurrent-state slots"):
        c.ensure(4)
    assert c.blocks == []
    a.free()
    c.ensure(4)
    assert pool.states.free_slots == 0 and c.state is not None


def test_rows_of_every_kind_batched_together_equal_each_run_alone(models):
    """Prefill chunks, decode rows, a chain verify and a tree verify in one forward: the KDA rows
    run in lock step and must not leak into each other."""
    from splitspec.engine.sample import SamplingParams, make_generator
    from target_service.torch_verifier import TorchVerifier
    from target_service.runner import Decode, Prefill, Sequence, Verify, run_batch
    model = models["mixed"]
    prompts = [[5, 17, 9, 33, 2, 71, 8], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [99, 3]]
    greedy = [generate(model, p, 5) for p in prompts]

    def sequences(pool):
        return [Sequence(p, SamplingParams(), make_generator(0), BlockTable(pool), 64, (1, 3)) for p in prompts]

    def schedule(seqs):
        g = greedy
        chain = Tree.chain([g[1][1], g[1][2], 5])
        tree = Tree(token_ids=(9, g[2][1], g[2][2]), parents=(-1, -1, 1))
        return [[Prefill(seqs[0], 4), Prefill(seqs[1], 3), Prefill(seqs[2], 11), Prefill(seqs[3], 2)],
                [Prefill(seqs[0], 7), Verify(seqs[1], chain), Verify(seqs[2], tree), Decode(seqs[3])],
                [Decode(s) for s in seqs]]

    verifier = TorchVerifier()
    pool = make_pool(model, num_blocks=64, max_sessions=4)
    together = sequences(pool)
    feats_together = [run_batch(model, pool, verifier, steps) for steps in schedule(together)]
    alone_pool = make_pool(model, num_blocks=64, max_sessions=4)
    alone = sequences(alone_pool)
    feats_alone = [[run_batch(model, alone_pool, verifier, [s])[0] for s in steps] for steps in schedule(alone)]
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens
    for batch_out, solo_out in zip(feats_together, feats_alone):
        for x, y in zip(batch_out, solo_out):
            assert not isinstance(x, Exception) and x.committed == y.committed
            assert (x.hidden - y.hidden).abs().max() < 1e-4
    for seq, g, n in zip(together, greedy, (2, 5, 5, 3)):     # the chain and the tree branch were accepted
        assert seq.tokens == seq.prompt + g[:n]


@pytest.mark.parametrize("stack", ["mixed", "deepseek"])
def test_a_prompt_in_chunks_leaves_the_state_of_the_whole_prompt(models, stack, monkeypatch):
    model = models[stack]
    prompt = [5, 17, 9, 33, 2, 71, 8, 40, 41, 42, 43]
    seq = TargetSequence(model, prompt, max_len=64, prefill_chunk=3)
    seq.prefill()
    got = next_logits(seq, monkeypatch)
    assert (got - fresh_next_logits(model, seq.tokens[:-1])).abs().max() < 1e-4
    assert seq.tokens[len(prompt):] == generate(model, prompt, 2)
