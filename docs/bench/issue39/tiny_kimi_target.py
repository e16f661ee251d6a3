"""A tiny KimiLinear target (3 KDA layers + 1 MLA layer, MoE) that has learnt something: made
with transformers' own `KimiLinearForCausalLM` and trained briefly on the draft corpus (the
Python standard library, `splitspec_tools.train.corpus`) with the default target's tokenizer, so a
drafter has structure to learn. A random-weight tiny model continues prompts with tokens no
drafter can predict (τ ≈ 1.0 after 400 steps, measured), which says nothing about the trainer.

    python docs/bench/issue39/tiny_kimi_target.py --out runs/tiny-kimi --steps 300
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER_FROM = ROOT / "models" / "splitspec-code-target"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from splitspec_tools.train.draft_data import corpus_streams
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FROM / f, out / f)
    vocab = json.loads((TOKENIZER_FROM / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    cfg = KimiLinearConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                           kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                           num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           linear_attn_config={"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4,
                                               "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
                           pad_token_id=0, bos_token_id=0, eos_token_id=0, max_position_embeddings=2048,
                           tie_word_embeddings=False)
    model = KimiLinearForCausalLM(cfg)
    # The tokenizer's files name this folder's config; corpus_streams caches under a run folder.
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))
    (out / "corpus-cache").mkdir(exist_ok=True)
    stream = corpus_streams(out, out / "corpus-cache", max_files=None)["train"]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    for step in range(1, a.steps + 1):
        lr = a.lr * min(1.0, step / 20) * (0.1 + 0.9 * (1 - step / a.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - a.seq_len - 1, (a.batch,), generator=g).tolist()
        x = torch.stack([stream[s:s + a.seq_len + 1] for s in starts]).long()
        logits = model(x[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval().save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "do_sample": False}) + "\n")
    shutil.rmtree(out / "corpus-cache", ignore_errors=True)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()):,} parameters, {a.steps} steps, "
          f"{time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
