"""Coupled sampling (issue 64): the noise source, the law of a coupled draw, and the identity
it buys: with one seed, target-only decoding and speculative decoding with any drafter, chain or
tree, emit the same tokens (in process here; through the services in
test_same_seed_services.py)."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from sampling_law import g_test_pvalue, walk_joint

from splitspec.engine.sample import (SamplingParams, coupled_sample, gumbel, make_generator, noise_key,
                                     noise_uniform, probs_from_logits, sample)
from splitspec.engine.tree import Tree
from target_service.verify import verify_tree

pytestmark = pytest.mark.usefixtures("torch_one_thread")     # thousands of draws over a few tokens
ROOT = Path(__file__).resolve().parents[1]
P_MIN = 1e-4          # seeds are fixed, so p-values are deterministic; a biased draw gives p ~ 0
SETTINGS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7-p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T1.3-k4": SamplingParams(temperature=1.3, top_k=4),
    "T1-k5-p0.8": SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
}


# ------------------------------------------------------------------ the noise source

# (seed, position, token ids) -> the 52-bit integers m of u = (m + 0.5) / 2^52, and g.
KNOWN = [
    (0, 0, [0, 1, 2, 3], [3727738460360535, 4438733770154512, 1244359251589652, 3656337334891958],
     [1.665610166841241, 4.233065718082044, -0.2517358704509495, 1.5682236299366363]),
    (2 ** 64 - 1, 123456, [0, 8191, 49151, 151935],
     [1774386164408890, 2886130630634994, 2328937755825336, 3959839717391365],
     [0.0710423409749947, 0.8097702787365402, 0.4163267891196372, 2.050477516940036]),
    (42, 7, [5], [4444195206638153], [4.321631873993298]),
]


@pytest.mark.parametrize("seed, position, ids, m, g", KNOWN)
def test_noise_known_values(seed, position, ids, m, g):
    """Pinned: a torch or platform change that moved the noise would change every seeded answer."""
    u = noise_uniform(seed, position, torch.tensor(ids))
    assert u.dtype == torch.float64
    assert ((u * 2.0 ** 52) - 0.5).long().tolist() == m        # exact: u is a dyadic rational
    assert gumbel(seed, position, torch.tensor(ids)).tolist() == pytest.approx(g, rel=1e-13, abs=1e-13)
    assert noise_key(0, 0) == 0xA706DD2F4D197E6F


@pytest.mark.cuda
def test_noise_on_cuda_equals_cpu():
    ids = torch.arange(151936)
    for seed, position in ((0, 0), (2 ** 64 - 1, 10 ** 6), (12345, 77)):
        assert torch.equal(noise_uniform(seed, position, ids.cuda()).cpu(), noise_uniform(seed, position, ids))


def test_noise_is_uniform_and_distinct():
    ids = torch.arange(1 << 17)
    u = noise_uniform(3, 11, ids)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert u.unique().numel() == ids.numel()          # a bijection of the token id within a position
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    # Neighbouring keys are unrelated: another position, another seed.
    for other in (noise_uniform(3, 12, ids), noise_uniform(4, 11, ids)):
        assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.02


@pytest.mark.parametrize("seed, position, ids, field", [
    (-1, 0, [0], "seed"), (2 ** 64, 0, [0], "seed"), (0, -1, [0], "position"), (0, 0, [-3], "token ids")])
def test_noise_refuses_keys_outside_its_domain(seed, position, ids, field):
    with pytest.raises(ValueError, match=field):
        noise_uniform(seed, position, torch.tensor(ids))


def test_sampling_params_refuse_a_seed_outside_uint64():
    for seed in (-1, 2 ** 64):
        with pytest.raises(ValueError, match="seed must be in"):
            SamplingParams(temperature=1.0, seed=seed).validate()


# ------------------------------------------------------------------ the law of a coupled draw

def _law_pvalue(logits: torch.Tensor, params: SamplingParams, draws: int, seed: int, draw=coupled_sample) -> float:
    probs = probs_from_logits(logits, params)
    counts = collections.Counter(draw(logits, params, seed, pos) for pos in range(draws))
    exact = {i: float(p) for i, p in enumerate(probs.tolist()) if p > 0}
    return g_test_pvalue(counts, exact, draws)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_coupled_draw_follows_the_processed_distribution(setting):
    """Over positions (each a fresh key), argmax(logits / T + g) over the kept set is a draw from
    temperature / top-k / top-p's distribution; nothing outside the kept set is ever drawn."""
    logits = torch.randn(12, generator=torch.Generator().manual_seed(5)) * 1.5
    p = _law_pvalue(logits, SETTINGS[setting], 3000, seed=list(SETTINGS).index(setting))
    print(f"coupled draw {setting}: p={p:.3g}")
    assert p > P_MIN


def test_the_law_test_rejects_a_wrong_temperature():
    """Negative control: the same harness flags a draw that forgets the temperature."""
    logits = torch.randn(12, generator=torch.Generator().manual_seed(5)) * 1.5
    params = SamplingParams(temperature=0.5)

    def wrong(lg, prm, seed, pos):
        return coupled_sample(lg, SamplingParams(temperature=1.0), seed, pos)
    assert _law_pvalue(logits, params, 3000, seed=0, draw=wrong) < 1e-6


def test_sample_dispatches_on_the_mode():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    coupled = SamplingParams(temperature=1.0)
    gen = make_generator(99)
    assert sample(logits, coupled, gen, 17) == coupled_sample(logits, coupled, 99, 17)
    with pytest.raises(ValueError, match="position"):
        sample(logits, coupled, gen)
    # A coupled draw depends on the key only: it does not consume the generator.
    before = gen.get_state()
    sample(logits, coupled, gen, 3)
    assert torch.equal(gen.get_state(), before)


# ------------------------------------------------------------------ verification: chains and trees

V = 8
SHAPES = {"chain": (-1, 0, 1, 2), "tree": (-1, -1, 0, 0, 1, 3)}


class Markov:
    """Target logits TL[a, b] after (..., a, b) and a draft distribution Q near it."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.TL = torch.randn(V, V, V, generator=g) * 1.6
        self.DL = 0.8 * self.TL + 0.9 * torch.randn(V, V, V, generator=g)

    def target_only(self, hist: list[int], params, seed: int, n: int) -> list[int]:
        hist = list(hist)
        for _ in range(n):
            hist.append(coupled_sample(self.TL[hist[-2], hist[-1]], params, seed, len(hist)))
        return hist[-n:]

    def draft(self, hist, parents, params, seed: int, shared_noise: bool) -> list[int]:
        """Each node: the draft's own coupled draw from its q (with the target's noise, or with
        another seed's), then its later siblings are the draft's next best tokens."""
        toks: list[int] = []
        for i, p in enumerate(parents):
            ctx = (hist[-2], hist[-1]) if p < 0 else ((hist[-1] if parents[p] < 0 else toks[parents[p]]), toks[p])
            depth, node = 0, i
            while parents[node] >= 0:
                node, depth = parents[node], depth + 1
            siblings = [toks[j] for j in range(i) if parents[j] == p]
            row = self.DL[ctx].clone()
            row[siblings] = float("-inf")
            s = seed if shared_noise else seed + 1
            toks.append(coupled_sample(row, params, s, len(hist) + depth) if not siblings else int(row.argmax()))
        return toks

    def logits(self, hist, parents, toks) -> torch.Tensor:
        rows = [self.TL[hist[-2], hist[-1]]]
        for i, p in enumerate(parents):
            prev = hist[-1] if p < 0 else toks[p]
            rows.append(self.TL[prev, toks[i]])
        return torch.stack(rows)

    def speculative(self, hist, parents, params, seed: int, n: int, shared_noise: bool = True) -> tuple[list[int], int]:
        hist, steps = list(hist), 0
        start = len(hist)
        gen = make_generator(seed)
        while len(hist) - start < n:
            toks = self.draft(hist, parents, params, seed, shared_noise)
            tree = Tree(tuple(toks), tuple(parents))
            hist += verify_tree(self.logits(hist, parents, toks), tree, params, gen, position=len(hist)).committed(tree)
            steps += 1
        return hist[start:start + n], steps


@pytest.mark.parametrize("shape, setting", [("chain", "T1"), ("tree", "T1-k5-p0.8")])
def test_coupled_verification_is_target_only_sampling(shape, setting):
    """For every seed the committed tokens ARE target-only coupled sampling's (so their law is
    the target's: the G-test checks it), with the draft sharing the noise or not."""
    world = Markov(seed=11 + len(setting))
    params, parents = SETTINGS[setting], SHAPES[shape]
    trials, n = 600, 3
    answers, steps_taken = [], 0
    for seed in range(trials):
        want = world.target_only([1, 2], params, seed, n)
        got, steps = world.speculative([1, 2], parents, params, seed, n, shared_noise=seed % 3 != 0)
        assert got == want, seed
        answers.append(tuple(got))
        steps_taken += steps

    def probs_after(prefix):
        hist = [1, 2] + prefix
        return probs_from_logits(world.TL[hist[-2], hist[-1]], params)
    joint = walk_joint(n, probs_after)
    p = g_test_pvalue(collections.Counter(answers), joint, trials)
    print(f"coupled {shape} {setting}: p={p:.3g}, {steps_taken} verify steps for {trials * n} tokens")
    assert p > P_MIN
    assert steps_taken < trials * n          # drafts were accepted: the identity was not target-only by default


def test_coupled_verify_needs_the_position():
    logits = torch.randn(3, V)
    with pytest.raises(ValueError, match="position"):
        verify_tree(logits, Tree.chain([1, 2]), SamplingParams(temperature=1.0), make_generator(0))


def test_greedy_verification_ignores_the_mode():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    tree = Tree.chain(logits[:3].argmax(-1).tolist())
    for coupled in (True, False):
        r = verify_tree(logits, tree, SamplingParams(temperature=0.0, coupled=coupled), make_generator(0), position=9)
        assert r.accepted == [0, 1, 2] and r.bonus == int(logits[3].argmax())


# ------------------------------------------------------------------ in process, the bundled code pair

CODE_PROMPTS = ["def fibonacci(n):\n    ", "import os\n\n\ndef list_files(path):\n    "]
# setting -> (sampling, prompt index, seed): one prompt and seed each in the default run.
CODE_SETTINGS = {"T1-p0.95": (dict(temperature=1.0, top_p=0.95), 0, 7),
                 "T0.7-k40": (dict(temperature=0.7, top_k=40), 1, 2 ** 64 - 5)}


@pytest.fixture(scope="module")
def code_pair():
    from tokenizers import Tokenizer

    from draft_service.architectures import load_draft
    from target_service.engine import load_model
    target = ROOT / "models" / "splitspec-code-target"
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    return (load_model(target), load_draft(ROOT / "models" / "splitspec-code-draft", target),
            load_draft(ROOT / "models" / "splitspec-code-draft-dflash", target),
            [tok.encode(p).ids for p in CODE_PROMPTS])


def _speculate(model, make_proposer, prompt, params, n):
    from splitspec_tools.speculate import speculative_generate
    from target_service.engine import TargetSequence
    proposer = make_proposer()
    layers = tuple(proposer.model.cfg.target_layer_ids) if hasattr(proposer, "model") else ()
    seq = TargetSequence(model, prompt, params, hidden_layers=layers, max_len=len(prompt) + n + 80)
    return speculative_generate(seq, proposer, n)


@pytest.mark.parametrize("setting", list(CODE_SETTINGS))
def test_same_seed_same_text_with_every_drafter(code_pair, setting):
    """Target-only coupled decoding against DFlash2 chains and trees (sampled drafts sharing the
    noise, greedy drafts), the DFlash twin, n-gram trees, and a draft told another seed: for each
    prompt and seed, the same tokens."""
    from draft_service.proposer import DFlashProposer, NgramProposer
    from target_service.engine import generate
    model, dflash2, dflash, prompts = code_pair
    n = 24
    kw, which, seed = CODE_SETTINGS[setting]
    prompt = prompts[which]
    params = SamplingParams(seed=seed, **kw)
    other = SamplingParams(seed=seed ^ 1, **kw)
    want = generate(model, prompt, n, params=params)
    drafters = {
        "dflash2 chain": lambda: DFlashProposer(dflash2, sampling=params, max_len=400),
        "dflash2 tree": lambda: DFlashProposer(dflash2, sampling=params, max_len=400, num_draft_tokens=12, topk=3),
        "dflash2 greedy drafts": lambda: DFlashProposer(dflash2, max_len=400),
        "dflash chain": lambda: DFlashProposer(dflash, sampling=params, max_len=400),
        "ngram tree": lambda: NgramProposer(num_draft_tokens=8, topk=2),
        "draft with another seed": lambda: DFlashProposer(dflash2, sampling=other, max_len=400),
    }
    for name, make in drafters.items():
        got, stats = _speculate(model, make, prompt, params, n)
        assert got == want, name
        assert stats.verify_steps <= n


def test_sampled_drafts_share_the_noise(code_pair):
    """A DFlash2 draft with the target's seed proposes the target's own coupled tokens where q is
    near p: its drafts are accepted more often than those of a draft with another seed."""
    from draft_service.proposer import DFlashProposer
    model, dflash2, _, prompts = code_pair
    params = SamplingParams(seed=3, temperature=1.0)
    other = SamplingParams(seed=4, temperature=1.0)
    steps = {}
    for name, sampling in (("shared", params), ("other", other)):
        steps[name] = sum(_speculate(model, lambda: DFlashProposer(dflash2, sampling=sampling, max_len=400),
                                     p, params, 32)[1].verify_steps for p in prompts)
    assert steps["shared"] < steps["other"], steps


def test_a_stream_mode_draft_does_not_read_the_targets_coins(code_pair):
    from draft_service.proposer import DFlashProposer
    _, dflash2, _, _ = code_pair
    stream = DFlashProposer(dflash2, sampling=SamplingParams(temperature=1.0, seed=5, coupled=False), max_len=64)
    coupled = DFlashProposer(dflash2, sampling=SamplingParams(temperature=1.0, seed=5), max_len=64)
    assert stream.generator.initial_seed() != 5 and coupled.generator.initial_seed() == 5
