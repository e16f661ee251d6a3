"""The exact law of target-only sampling on the tiny models, and the goodness-of-fit test every
speculative path is held to: lossless speculation means its samples follow that law."""
from __future__ import annotations

import collections
from typing import Callable

import torch
from scipy import stats as sstats

from splitspec.engine.penalties import process_logits
from splitspec.engine.sample import SamplingParams, probs_from_logits
from target_service.engine import forward_sequences

SAMPLED = SamplingParams(temperature=1.0, top_k=3)     # what service_helpers.sampled_runs asks for


def walk_joint(n: int, probs_after: Callable[[list[int]], torch.Tensor]) -> dict[tuple[int, ...], float]:
    """Probability of every n-token continuation with non-zero probability, from
    `probs_after(prefix)`: the next token's distribution after the generated `prefix`."""
    out = {}
    with torch.no_grad():
        def walk(prefix, p):
            if len(prefix) == n:
                out[tuple(prefix)] = p
                return
            probs = probs_after(prefix)
            for t in torch.nonzero(probs).flatten().tolist():
                walk(prefix + [t], p * float(probs[t]))
        walk([], 1.0)
    return out


def exact_joint(model, prompt: list[int], params, n: int) -> dict[tuple[int, ...], float]:
    """Target-only probability of every n-token continuation of `prompt`, with the processors
    (penalties, bias) applied to each prefix's own generated tokens."""
    def probs_after(prefix):
        logits = forward_sequences(model, torch.tensor([prompt + prefix])).logits[0, -1:]
        return probs_from_logits(process_logits(logits, params, prompt, prefix)[0], params)
    return walk_joint(n, probs_after)


def chi_square_pvalue(counts, probs, total):
    """Pool cells with expected count < 5 into one, then a chi-square goodness of fit."""
    obs, exp, rest_o, rest_e = [], [], 0.0, 0.0
    for key, p in probs.items():
        e = p * total
        if e < 5:
            rest_o += counts.get(key, 0)
            rest_e += e
        else:
            obs.append(counts.get(key, 0))
            exp.append(e)
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)
    return sstats.chisquare(obs, [e * scale for e in exp]).pvalue


def assert_follows(answers, joint, samples: int) -> collections.Counter:
    """The sampled `answers` (token-id tuples) follow `joint`: none outside its support, and the
    chi-square does not reject it at 1e-3. Returns their counts."""
    counts = collections.Counter(answers)
    assert set(counts) <= set(joint)
    assert chi_square_pvalue(counts, joint, samples) > 1e-3
    return counts


def dflash_law(stub, model, samples: int, *, prompt=(7, 8, 9, 7, 8), n: int = 3, **run) -> list:
    """`samples` seeded answers of n tokens drafted by DFlash through a gateway `stub`
    (service_helpers.sampled_runs; `run`: its draft_sampling, workers and speculative fields),
    none fallen back to target-only, following the target's exact law. Returns their stats for
    the caller's checks of what was drafted."""
    from service_helpers import sampled_runs
    joint = exact_joint(model, list(prompt), SAMPLED, n)
    results = sampled_runs(stub, list(prompt), n, samples, method="dflash", **run)
    # A request that fell back to target-only steps follows the target's law whatever the
    # draft does: it would test nothing.
    assert all(st.draft_fallbacks == 0 for _, st in results)
    assert_follows([ids for ids, _ in results], joint, samples)
    return [st for _, st in results]


def g_test_pvalue(counts, probs, total) -> float:
    """The G-test (log-likelihood ratio) of observed `counts` against exact `probs` (dicts keyed
    alike), cells with expected count < 5 pooled into one; 0.0 if anything landed outside the
    support."""
    if any(key not in probs and c for key, c in counts.items()):
        return 0.0
    obs, exp, rest_o, rest_e = [], [], 0.0, 0.0
    for key, p in probs.items():
        e = p * total
        if e < 5:
            rest_o += counts.get(key, 0)
            rest_e += e
        else:
            obs.append(counts.get(key, 0))
            exp.append(e)
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    if len(obs) < 2:
        return 1.0
    scale = sum(obs) / sum(exp)
    return float(sstats.power_divergence(obs, [e * scale for e in exp], lambda_="log-likelihood").pvalue)
