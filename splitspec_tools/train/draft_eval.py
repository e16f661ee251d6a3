"""Evaluation of a draft during and after training: teacher-forced per-slot accuracy (and, for DFlash2,
the selector's top-K recall and accuracy) on the target's greedy continuations of held-out prompts, and
the accept length τ with the real verification loop."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draft_service.dflash2 import DFlash2Draft
from splitspec.engine.sample import SamplingParams

from .draft_data import features_of, regenerate, windows
from .draft_objective import Anchors, objective

# ---------------------------------------------------------------- evaluation

@dataclass
class EvalSet:
    prompts: list[list[int]]                 # held-out prompts (never trained on)
    tf_tokens: torch.Tensor                  # [n, P + new] target greedy continuations
    tf_prompt_len: int


def eval_set(target, streams, args, n: int, seed_offset: int = 0) -> EvalSet:
    g = torch.Generator().manual_seed(args.seed * 31 + 17 + seed_offset)
    prompts = windows(streams["heldout"], n, args.eval_prompt_len, g).to(target.lm_head.weight.device)
    g2 = torch.Generator().manual_seed(0)
    tf, _ = regenerate(target, prompts, args.eval_prompt_len + args.eval_new_tokens,
                       torch.zeros(n), 1.0, g2, (0,))
    return EvalSet([p.tolist() for p in prompts], tf, args.eval_prompt_len)


@torch.inference_mode()
def teacher_forced(draft, target, es: EvalSet, args) -> dict:
    """Per-slot accuracy and accept-length estimate on the target's greedy continuations of held-out
    prompts, with an anchor at every position of the continuation."""
    tokens = es.tf_tokens
    feats = features_of(target, tokens, draft.cfg.target_layer_ids)
    S = tokens.shape[1]
    pos = torch.arange(es.tf_prompt_len, S - 1)   # b0 … : the roots inference drafts from
    correct = count = unary = recall = 0
    accept, full = 0.0, 0
    for i in range(len(tokens)):
        an = Anchors(pos[None].to(tokens.device), torch.ones(1, len(pos), dtype=torch.bool, device=tokens.device))
        out = objective(draft, feats[i:i + 1], tokens[i:i + 1], an, gamma=args.gamma, attention=args.attention)
        correct = correct + out.correct
        count = count + out.count
        unary = unary + out.unary_correct
        if out.selector is not None:
            recall = recall + out.selector.recall
        accept += out.accept_sum
        full += out.anchors
    n = count.clamp(min=1)
    res = {"tf_acc": (correct / n).tolist(), "tf_tau": 1 + accept / max(full, 1)}
    if isinstance(draft, DFlash2Draft):
        # the selector's pick, the unary argmax alone, and how often gold is among the K candidates
        res.update(tf_selector_acc=res["tf_acc"], tf_unary_acc=(unary / n).tolist(),
                   tf_topk_recall=(recall / n).tolist())
    return res


@torch.inference_mode()
def tau_eval(draft, target, prompts: list[list[int]], args, *, temperature: float, top_p: float = 1.0,
             sampled_draft: bool = False, eos_ids=()) -> dict:
    """Accept length with the real loop: TargetSequence + DFlashProposer + speculative_generate."""
    from draft_service.proposer import DFlashProposer
    from splitspec_tools.speculate import speculative_generate
    from target_service.engine import TargetSequence
    taus, steps, committed, new_tokens = [], 0, 0, 0
    per_pos = [0] * (draft.cfg.block_size - 1)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=args.seed + 1000 + i)
        max_len = len(prompt) + args.eval_new_tokens + draft.cfg.block_size + 2
        seq = TargetSequence(target, list(prompt), params, max_len=max_len,
                             hidden_layers=tuple(draft.cfg.target_layer_ids))
        draft_params = (SamplingParams(temperature=temperature, top_p=top_p, seed=args.seed + 5000 + i)
                        if sampled_draft and temperature > 0 else None)
        prop = DFlashProposer(draft, max_len=max_len, sampling=draft_params)
        out, stats = speculative_generate(seq, prop, args.eval_new_tokens, eos_ids)
        if stats.verify_steps:
            taus.append(stats.accept_length)
        steps += stats.verify_steps
        committed += stats.committed
        new_tokens += len(out)
        for k, c in enumerate(stats.accepted_per_position[:len(per_pos)]):
            per_pos[k] += c
    return {"tau": sum(taus) / max(len(taus), 1), "tau_pooled": committed / max(steps, 1),
            "verify_steps": steps, "new_tokens": new_tokens, "prompts": len(prompts),
            "accept_rate_per_position": [c / max(steps, 1) for c in per_pos],
            "seconds": time.perf_counter() - t0}


def full_eval(draft, target, es: EvalSet, args, eos_ids) -> dict:
    res = {"T0": tau_eval(draft, target, es.prompts, args, temperature=0.0, eos_ids=eos_ids),
           "T1_greedy_draft": tau_eval(draft, target, es.prompts, args, temperature=1.0,
                                       top_p=args.eval_top_p, eos_ids=eos_ids),
           "T1_sampled_draft": tau_eval(draft, target, es.prompts, args, temperature=1.0,
                                        top_p=args.eval_top_p, sampled_draft=True, eos_ids=eos_ids)}
    res.update(teacher_forced(draft, target, es, args))
    return res
