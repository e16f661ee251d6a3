"""Structured output in the target: per-node grammar masks against a brute-force walk of the
grammar, the tree rewrite (pruning, forced tokens), greedy speculation equal to target-only
under the same grammar, the T=1 distribution with a grammar and trees in each draft mode,
independent grammars in one batch, and refusals of specs that do not compile."""
from __future__ import annotations

import asyncio
import collections
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from scheduler_helpers import run_scheduler
from service_helpers import tiny_target_dir
from splitspec.engine.sample import SamplingParams, probs_from_logits
from splitspec.engine.tree import Tree
from splitspec.v1 import common_pb2
from target_service.engine import forward_sequences
from splitspec.grammar import GrammarError, Grammars, Guide, choice_grammar, rewrite_tree
from splitspec.models.loader import load_model, load_tokenizer
from target_service.pools import make_pool
from sampling_law import chi_square_pvalue, walk_joint

REGEX = "[ab]{1,3}c[ab]*"     # several tokens fit at most positions, one (c) at some


@pytest.fixture(scope="module")
def target_dir():
    return tiny_target_dir()


@pytest.fixture(scope="module")
def model(target_dir):
    return load_model(target_dir)


@pytest.fixture(scope="module")
def grammars(target_dir, model):
    return Grammars(target_dir, model.cfg.vocab_size, model.cfg.eos_token_ids)


@pytest.fixture(scope="module")
def tok(target_dir):
    return load_tokenizer(target_dir)


def regex_guide(grammars, model, regex=REGEX):
    return Guide(grammars.compile(common_pb2.Constraint(regex=regex)), model.cfg.vocab_size)


def brute_rows(grammars, model, tree: Tree, regex=REGEX) -> list[torch.Tensor | None]:
    """Each row's allowed tokens by walking a fresh matcher down the node's path (None: the
    path leaves the grammar)."""
    rows = []
    for i in range(len(tree) + 1):
        path, n = [], i - 1
        while n >= 0:
            path.append(tree.token_ids[n])
            n = tree.parents[n]
        g = regex_guide(grammars, model, regex)
        ok = all(g.matcher.accept_token(t) for t in reversed(path))
        rows.append(g.allowed() if ok and not g.done else None)
    return rows


def alphabet(tok, model):
    """Token ids made only of a / b / c, and a few others the grammar forbids."""
    ab = [i for i in range(model.cfg.vocab_size) if (s := tok.decode([i])) and set(s) <= set("abc")]
    return ab + [tok.encode("x").ids[0], tok.encode("(").ids[0]]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_tree_masks_equal_a_brute_force_walk(grammars, model, tok, data):
    vocab = alphabet(tok, model)
    n = data.draw(st.integers(1, 9))
    parents = [-1] + [data.draw(st.integers(-1, i - 1)) for i in range(1, n)]
    tokens = [data.draw(st.sampled_from(vocab)) for _ in range(n)]
    tree = Tree(tuple(tokens), tuple(parents))
    guide = regex_guide(grammars, model)
    prefix = data.draw(st.sampled_from(["", "a", "ab", "abc", "bbc"]))
    guide.advance(tok.encode(prefix).ids if prefix else [])
    got = guide.tree_allowed(tree)
    valid = guide.valid_nodes(tree)
    want_prefix = tok.encode(prefix).ids if prefix else []
    for i, want in enumerate(brute_rows(grammars, model, Tree(tuple(want_prefix) + tree.token_ids,
                                                               tuple(range(-1, len(want_prefix) - 1)) + tuple(
                                                                   p + len(want_prefix) if p >= 0 else len(want_prefix) - 1
                                                                   for p in tree.parents)))[len(want_prefix):]):
        if want is None:
            assert not (i and valid[i - 1])
        else:
            assert torch.equal(got[i], want), i
            assert i == 0 or valid[i - 1]


def test_rewrite_prunes_deterministic_nodes_keeps_sampled_ones_and_adds_forced_tokens(grammars, model, tok):
    a, b, c, x = (tok.encode(s).ids[0] for s in "abcx")
    guide = regex_guide(grammars, model, "abc(d|e)")
    guide.advance([a])
    # x is forbidden: pruned with its subtree when deterministic, kept when sampled.
    tree = Tree((x, b, a), (-1, 0, -1))
    pruned, _, added = rewrite_tree(guide, tree, None, 16)
    # Nothing valid is left, and "b" then "c" are forced: they are the new branch.
    assert pruned.token_ids == (b, c) and pruned.parents == (-1, 0) and added == 2
    q = torch.zeros(3, model.cfg.vocab_size)
    q[0, x] = 1.0
    kept, probs, added = rewrite_tree(guide, tree, q, 16)
    assert kept.token_ids[0] == x and probs.shape[0] == len(kept) and torch.equal(probs[0], q[0])
    assert kept.token_ids[-2:] == (b, c) and not probs[-1].any()
    # A drafted branch that agrees with the forced tokens is reused, not doubled.
    merged, _, added = rewrite_tree(guide, Tree((b, c), (-1, 0)), None, 16)
    assert merged.token_ids == (b, c) and added == 0


def constrained_greedy(model, guide, prompt, n):
    """Target-only greedy decoding under the grammar: the reference."""
    out = []
    for _ in range(n):
        logits = forward_sequences(model, torch.tensor([prompt + out])).logits[0, -1]
        logits = logits.masked_fill(~guide.allowed(), float("-inf"))
        t = int(logits.argmax())
        out.append(t)
        guide.advance([t])
        if t in model.cfg.eos_token_ids:
            break
    return out


def run(model, body):
    return run_scheduler(model, body, pool=make_pool(model, num_blocks=128, block_size=4, max_sessions=4),
                         max_queued=64, max_batched_tokens=128, chunked_prefill_size=64)


PROMPT = [5, 9, 14, 3]


def test_greedy_speculation_under_a_grammar_equals_target_only(grammars, model, tok):
    ref = constrained_greedy(model, regex_guide(grammars, model), PROMPT, 12)
    assert ref[-1] in model.cfg.eos_token_ids           # the grammar ended the answer
    text = tok.decode(ref[:-1])
    import re
    assert re.fullmatch(REGEX, text), text
    vocab = alphabet(tok, model)

    async def body(sched):
        s, step = await sched.open("g", PROMPT, SamplingParams(), max_new_tokens=40,
                                   guide=regex_guide(grammars, model))
        out = list(step.out.committed)
        g = torch.Generator().manual_seed(0)
        while not set(out) & set(model.cfg.eos_token_ids):
            # Random trees over a / b / c / x: many nodes forbidden, some right.
            k = int(torch.randint(1, 6, (), generator=g))
            toks = [vocab[int(i)] for i in torch.randint(len(vocab), (k,), generator=g)]
            parents = [-1] + [int(torch.randint(-1, i, (), generator=g)) for i in range(1, k)]
            v = await sched.verify(s, s.length, Tree(tuple(toks), tuple(parents)), None)
            out += v.out.committed
        sched.close(s)
        return out
    out = run(model, body)
    cut = next(i for i, t in enumerate(out) if t in model.cfg.eos_token_ids)
    assert out[:cut + 1] == ref


def masked_joint(model, grammars, prompt, params, n, regex):
    """Target-only probability of every n-token continuation, masked by the grammar at each prefix."""
    def probs_after(prefix):
        g = regex_guide(grammars, model, regex)
        g.advance(prefix)
        logits = forward_sequences(model, torch.tensor([prompt + prefix])).logits[0, -1]
        return probs_from_logits(logits.masked_fill(~g.allowed(), float("-inf")), params)
    return walk_joint(n, probs_after)


@pytest.mark.parametrize("mode", ["deterministic", "sampled"])
def test_sampling_under_a_grammar_with_trees_follows_the_masked_target(grammars, model, tok, mode):
    """T=1 / top-k 3, 3 tokens: the prefill's, then a verify of a 4-node tree whose nodes are
    partly forbidden (deterministic drafts as greedy / n-gram drafters send them; or sampled
    from a q that puts mass on forbidden tokens too), then a decode if needed. The joint of the
    3 tokens must be the grammar-masked target's."""
    regex = "[ab]{2,4}c"
    params = SamplingParams(temperature=1.0, top_k=3)
    joint = masked_joint(model, grammars, PROMPT, params, 3, regex)
    vocab = alphabet(tok, model)
    a, b = tok.encode("a").ids[0], tok.encode("b").ids[0]
    samples = 400

    async def one(sched, seed):
        p = SamplingParams(temperature=1.0, top_k=3, seed=seed)
        s, step = await sched.open(str(seed), PROMPT, p, max_new_tokens=12, guide=regex_guide(grammars, model, regex))
        out = list(step.out.committed)
        g = torch.Generator().manual_seed(10_000 + seed)
        if mode == "deterministic":
            tree, q = Tree((a, b, vocab[-1], b), (-1, 0, -1, 2)), None
        else:
            q = torch.zeros(4, model.cfg.vocab_size)
            support = torch.tensor([a, b, vocab[-1], vocab[-2]])
            q[:, support] = torch.rand(4, 4, generator=g) + 0.1
            q /= q.sum(-1, keepdim=True)
            toks = torch.multinomial(q, 1, generator=g).flatten().tolist()
            if toks[0] == toks[1]:          # siblings hold distinct tokens
                q, toks = q[[0, 2, 3]], [toks[0], toks[2], toks[3]]
                tree = Tree(tuple(toks), (-1, 0, 1))
            else:
                tree = Tree(tuple(toks), (-1, -1, 0, 1))
        v = await sched.verify(s, s.length, tree, q)
        out += v.out.committed
        if len(out) < 3:
            async for t in sched.decode(s, 1):
                out += t.out.committed
        sched.close(s)
        return tuple(out[:3])

    async def body(sched):
        res = []
        for start in range(0, samples, 4):
            res += await asyncio.gather(*(one(sched, s) for s in range(start, start + 4)))
        return res
    counts = collections.Counter(run(model, body))
    assert set(counts) <= set(joint)
    assert chi_square_pvalue(counts, joint, samples) > 1e-3


def test_sessions_in_one_batch_keep_their_own_grammars(grammars, model, tok):
    async def body(sched):
        async def one(sid, regex):
            s, step = await sched.open(sid, PROMPT, SamplingParams(), max_new_tokens=20,
                                       guide=regex_guide(grammars, model, regex))
            out = list(step.out.committed)
            while not set(out) & set(model.cfg.eos_token_ids):
                async for t in sched.decode(s, 1):
                    out += t.out.committed
            sched.close(s)
            return tok.decode(out[:-1])
        return await asyncio.gather(one("1", "a+b"), one("2", "(xy){2}"), one("3", "[0-9]{3}"))
    import re
    for text, regex in zip(run(model, body), ["a+b", "(xy){2}", "[0-9]{3}"]):
        assert re.fullmatch(regex, text), (regex, text)


@pytest.mark.parametrize("constraint, field", [
    (common_pb2.Constraint(json_schema="{not json"), "json_schema"),
    (common_pb2.Constraint(json_schema='{"type": "objectx"}'), "json_schema"),
    (common_pb2.Constraint(json_schema="[1, 2]"), "json_schema"),
    (common_pb2.Constraint(regex="(unclosed"), "regex"),
    (common_pb2.Constraint(grammar='root ::= foo'), "grammar"),
    (common_pb2.Constraint(choice=common_pb2.ChoiceList()), "choice"),
    (common_pb2.Constraint(json_object=False), "json_object"),
    (common_pb2.Constraint(regex="a" * (65 * 1024)), "regex"),
    (common_pb2.Constraint(), "constraint"),
])
def test_specs_that_do_not_compile_are_refused_naming_the_field(grammars, constraint, field):
    with pytest.raises(GrammarError, match=f"sampling.constraint(.{field})?"):
        grammars.compile(constraint)


def test_compiled_grammars_are_cached_and_choice_is_exact(grammars, model, tok):
    c = common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=['yes "sir"', "no\\pe"]))
    assert grammars.compile(c) is grammars.compile(c)
    assert choice_grammar(['a"b']) == 'root ::= "a\\"b"'
    g = Guide(grammars.compile(c), model.cfg.vocab_size)
    g.advance(tok.encode('yes "sir"').ids)
    assert g.matcher.is_completed()
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    strict = grammars.compile(common_pb2.Constraint(json_schema=schema, strict=True))
    assert strict is not grammars.compile(common_pb2.Constraint(json_schema=schema, strict=False))


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_dflash_chain_drafts_inside_the_grammar(grammars, model, tok, sampled, arch):
    """The draft side's chain: each position picks among the tokens the grammar allows after
    the chain so far; sampled rows of q are those masked distributions (zero on forbidden
    tokens, summing to one), which the verifier tests the tokens against."""
    from draft_service.dflash import new_draft
    from draft_service.proposer import DFlashProposer
    from target_service.engine import TargetSequence
    d = new_draft(model.cfg, num_layers=1, block_size=8, mask_token_id=2, seed=1)
    d.attach_target(model.model.embed_tokens.weight, model.lm_head.weight)
    if arch == "dflash2":       # its selector walks the block's top-K candidates: masked by the grammar
        from draft_service.dflash2 import new_dflash2
        d = new_dflash2(d, selector_rank=8, selector_top_k=64, seed=2)
    params = SamplingParams(temperature=1.0, seed=4)
    seq = TargetSequence(model, PROMPT, params, max_len=64, hidden_layers=d.cfg.target_layer_ids)
    prop = DFlashProposer(d, max_len=64, sampling=params if sampled else None)
    prop.guide = regex_guide(grammars, model, "[ab]{3,9}c")
    first = seq.prefill()
    prop.open(PROMPT, first.hidden)
    out = prop.propose(seq.length, first.committed, None)
    assert len(out.tree) >= 1
    check = regex_guide(grammars, model, "[ab]{3,9}c")
    assert all(check.matcher.accept_token(t) for t in out.tree.token_ids)
    # The guide is back where the committed tokens left it: nothing drafted was consumed.
    assert prop.guide.matcher.accept_token(out.tree.token_ids[0])
    if sampled:
        assert out.draft_probs.shape[0] == len(out.tree)
        torch.testing.assert_close(out.draft_probs.sum(-1), torch.ones(len(out.tree)))
        walk = regex_guide(grammars, model, "[ab]{3,9}c")
        for row, t in zip(out.draft_probs, out.tree.token_ids):
            assert not bool(row[~walk.allowed()].any())
            walk.advance([t])
    else:
        assert out.draft_probs is None
