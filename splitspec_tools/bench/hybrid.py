"""What verification costs on a hybrid (KDA + MLA + MoE) target, and what its caches weigh.

* Per-token MLA cache (latent + rope key slice) against the expanded per-head K/V the same layers
  would cache, for the tiny test configs and Kimi-K3's published shape (computed from configs).
* KDA state per session, and what a verify of width w holds until commit under each rollback
  strategy (snapshot: the state after every position; replay: each position's k, v, g, β).
* On a small KimiLinear config (random weights, built here, no download): one decode step,
  8 single decode steps, and a width-8 verify with rollback (accepting k = 0, 4, 8 drafts) under
  both strategies, median of `--repeats`, with the commit (rollback) timed on its own.

    python -m splitspec_tools.bench.hybrid [--threads 1] [--repeats 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import splitspec.engine.state_pool as state_pool
from splitspec.engine.tree import Tree
from splitspec.models.config import ModelConfig
from target_service.engine import TargetSequence
from splitspec.models.hybrid import HybridLM

# Kimi-K3's text config, as published (see docs/hybrid-targets.md for the source).
K3 = {"architectures": ["KimiLinearForCausalLM"], "vocab_size": 163840, "hidden_size": 7168,
      "intermediate_size": 33792, "moe_intermediate_size": 3072, "num_hidden_layers": 93,
      "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": 896,
      "num_experts_per_token": 16, "num_shared_experts": 2, "first_k_dense_replace": 1,
      "linear_attn_config": {"head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4,
                             "full_attn_layers": list(range(4, 93, 4)) + [93],
                             "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93]},
      "hidden_act": "silu", "max_position_embeddings": 1048576}

# A small KimiLinear: 6 KDA + 2 MLA layers, MoE after the first layer.
SMALL = {"architectures": ["KimiLinearForCausalLM"], "vocab_size": 4096, "hidden_size": 512,
         "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": None, "kv_lora_rank": 128,
         "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "num_experts": 16,
         "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
         "linear_attn_config": {"head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 4,
                                "full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7]},
         "max_position_embeddings": 4096}

TINY_TEST = {**SMALL, "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
             "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
             "v_head_dim": 16, "linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                                      "full_attn_layers": [4], "kda_layers": [1, 2, 3]}}


def cache_sizes() -> dict:
    out = {}
    for name, raw, elem in (("tiny test (fp32)", TINY_TEST, 4), ("small bench (fp32)", SMALL, 4),
                            ("Kimi-K3 (bf16)", K3, 2)):
        h = ModelConfig.from_dict(raw).hybrid
        out[name] = {"mla_layers": len(h.mla_layers), "kda_layers": len(h.kda_layers),
                     "latent_bytes_per_token": h.latent_bytes_per_token(elem),
                     "expanded_kv_bytes_per_token": h.expanded_kv_bytes_per_token(elem),
                     "kda_state_bytes_per_session": h.state_bytes_per_session()}
    return out


def small_model(seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    model = HybridLM(ModelConfig.from_dict(SMALL))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape) * 2)
            elif p.dim() > 1:
                p.normal_(0, 0.05)
    return model.eval().requires_grad_(False)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def timings(model: HybridLM, repeats: int, context: int = 256, width: int = 8) -> dict:
    prompt = [(i * 7919) % 4000 + 3 for i in range(context)]
    seq = TargetSequence(model, prompt, max_len=context + 4 * width + 64)
    seq.prefill()
    slot, base = seq.seq.table.state, list(seq.tokens)
    saved = (seq.pool.states.conv[:, slot].clone(), seq.pool.states.rec[:, slot].clone())

    def rewind(rollback: str = "snapshot"):
        """Back to right after the prefill: tokens, KV length and KDA state."""
        seq.seq.tokens[:] = base
        seq.seq.table.truncate(len(base) - 1)
        seq.pool.states.conv[:, slot], seq.pool.states.rec[:, slot] = saved
        seq.pool.states.rollback = rollback

    out = {"context": context, "width": width}
    seq.decode()                                        # warm-up
    rewind()
    out["decode_1_ms"] = _median_ms(lambda: (seq.decode(), rewind()), repeats)
    greedy = [seq.decode().committed[0] for _ in range(width)]
    rewind()

    def singles():
        for _ in range(width):
            seq.decode()
        rewind()
    out[f"decode_{width}_ms"] = _median_ms(singles, max(3, repeats // 3))

    commit_ms = []
    real_commit = state_pool.StatePlan.commit

    def timed_commit(self, row, path):
        t = time.perf_counter()
        real_commit(self, row, path)
        commit_ms.append((time.perf_counter() - t) * 1e3)
    state_pool.StatePlan.commit = timed_commit
    try:
        for rollback in ("snapshot", "replay"):
            for k in (0, width // 2, width):
                # the target's own greedy continuation, wrong from draft k on: exactly k accepted
                drafts = greedy[:k] + [(t + 1) % SMALL["vocab_size"] for t in greedy[k:]]
                times, commits = [], []
                for _ in range(repeats):
                    rewind(rollback)
                    commit_ms.clear()
                    t = time.perf_counter()
                    res = seq.verify(Tree.chain(drafts))
                    times.append((time.perf_counter() - t) * 1e3)
                    assert len(res.result.accepted) == k, (k, res.result.accepted)
                    commits.append(sum(commit_ms))
                rewind()
                out[f"verify{width}_{rollback}_accept{k}_ms"] = statistics.median(times)
                out[f"verify{width}_{rollback}_accept{k}_commit_ms"] = statistics.median(commits)
    finally:
        state_pool.StatePlan.commit = real_commit
    return out


def pending_memory(model: HybridLM, widths=(1, 2, 4, 8, 16)) -> dict:
    """Bytes a verify of width w holds until commit, per session, under each strategy."""
    out = {}
    seen = {}
    real = state_pool.StatePlan.commit

    def spy(self, row, path):
        seen.setdefault("bytes", self.pending_bytes())
        real(self, row, path)
    state_pool.StatePlan.commit = spy
    try:
        for rollback in ("snapshot", "replay"):
            for w in widths:
                seq = TargetSequence(model, [5, 6, 7, 8], max_len=64)
                seq.pool.states.rollback = rollback
                seq.prefill()
                seen.clear()
                seq.verify(Tree.chain([9] * w))
                out[f"{rollback}_w{w}"] = seen["bytes"]
    finally:
        state_pool.StatePlan.commit = real
    out["state_slot_bytes"] = TargetSequence(model, [5], max_len=8).pool.states.bytes_per_slot
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = small_model()
    with torch.inference_mode():
        res = {"threads": a.threads, "torch": torch.__version__, "cache": cache_sizes(),
               "pending": pending_memory(model), "time": timings(model, a.repeats, a.context)}
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
