"""Checkpoints (resumable runs), the export of a draft folder in the public layout, and its model card."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from draft_service.dflash import default_target_layer_ids, save_draft

from . import checkpoint

# ---------------------------------------------------------------- checkpoints, export, card

RESUME_KEYS = ("arch", "init_from", "layers", "block_size", "target_layer_ids", "num_taps", "intermediate_size", "init",
               "prompt_len", "seq_len", "num_seqs", "greedy_frac", "regen_temperature", "regen_top_p",
               "raw_frac", "gen_batch", "replay_batch", "max_files", "batch_seqs", "seed", "distill",
               "replay_kinds", "sliding_window", "draft_vocab", "draft_vocab_coverage", "draft_vocab_max")


def save_ckpt(path: Path, draft, opt, state: dict, args) -> None:
    checkpoint.save(path, draft, opt, args, state=state)


def load_ckpt(path: Path, draft, opt, args) -> dict:
    return checkpoint.load(path, draft, opt, args, RESUME_KEYS)["state"]


def export(draft, out: Path, card: str | None, metrics: dict | None = None) -> None:
    """save_draft into a sibling temp folder, then move the files in (a kill never leaves a
    half-written model.safetensors in --out)."""
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tmp)
    if card is not None:
        (tmp / "README.md").write_text(card)
    if metrics is not None:
        (tmp / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)          # safetensors writes 0600
        os.replace(f, out / f.name)
    tmp.rmdir()


def machine() -> str:
    from .evaluate import machine as m
    return m()


def _fmt_acc(acc) -> str:
    return " | ".join(f"{a:.3f}" for a in acc)


def write_card(m: dict, args, final: bool) -> str:
    cfg = m["draft_config"]
    B = cfg.get("block_size") or cfg["dflash_config"]["block_size"]     # DFlash2 keeps it in dflash_config
    ev = m.get("eval") or {}
    status = ("" if final else
              f"\n> **Provisional export** at step {m['step']:,} ({m['train_seconds'] / 60:.1f} min of "
              f"training); the run was still going when this was written. The final card replaces this.\n")
    if m.get("note"):
        status += f"\n> {m['note']}\n"
    rows = []
    names = {"T0": "temperature 0 (greedy verification)",
             "T1_greedy_draft": f"T=1.0, top_p={args.eval_top_p}: greedy draft + target-only verification",
             "T1_sampled_draft": f"T=1.0, top_p={args.eval_top_p}: sampled drafts + min(1, p/q)"}
    for key, label in names.items():
        r = ev.get(key)
        if r:
            rates = " / ".join(f"{x:.2f}" for x in r["accept_rate_per_position"])
            rows.append(f"| {label} | **{r['tau']:.2f}** | {r['tau_pooled']:.2f} | {r['verify_steps']} | {rates} |")
    tau_table = ("| setting | τ (mean per request) | τ (pooled) | verify steps | P(slot k accepted), k = 1..%d |\n"
                 "|---|---|---|---|---|\n" % (B - 1) + "\n".join(rows)) if rows else "(no evaluation yet)"
    head = " | ".join(f"k={k}" for k in range(1, B))
    acc_rows = []
    if m.get("train_acc"):
        acc_rows.append(f"| training (last {m['acc_window']} steps) | {_fmt_acc(m['train_acc'])} |")
    if ev.get("tf_acc"):
        acc_rows.append(f"| held-out, target greedy continuations | {_fmt_acc(ev['tf_acc'])} |")
    acc_table = f"| data | {head} |\n|---|{'---|' * (B - 1)}\n" + "\n".join(acc_rows)
    ids = cfg["dflash_config"]["target_layer_ids"]
    data = m["data"]
    rates = m.get("rates", {})
    dflash2 = cfg["architectures"] == ["DFlash2DraftModel"]
    kind = ("**DFlash2 block-diffusion draft** (DFlash + dynamic grouped convs + a low-rank candidate selector)"
            if dflash2 else "**DFlash block-diffusion draft**")
    init = f"warm start from `{args.init_from}`" if args.init_from else args.init
    t = m.get("target") or {"name": Path(str(args.target_model_path)).name, "architecture": "?", "family": "?",
                            "layers": cfg["num_target_layers"]}
    return f"""# {Path(args.out).name}

A {kind} for [`{t['name']}`](../{t['name']}/) ({t['architecture']}, {t['family']}, {t['layers']} layers):
one forward drafts a block of {B - 1} tokens (verify width / block size {B}), conditioned on the
target's hidden states of layers {ids} (KV injection). Trained online against the frozen target
with `splitspec train-draft`; its features come from the target's serving runner, so the draft
reads at inference exactly what it was trained on. It serves this target only.
{status}
## Model

| | |
|---|---|
| parameters | {m['params']:,} (draft layers + `fc` + norms; embedding and lm_head are the target's, frozen) |
| draft layers / hidden / intermediate | {cfg['num_hidden_layers']} / {cfg['hidden_size']} / {cfg['intermediate_size']} |
| heads / KV heads / head dim | {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / {cfg['head_dim']} |
| block size | {B} (`block_size` stored as the verify width: the last committed token + {B - 1} masks) |
| mask token id | {cfg['dflash_config']['mask_token_id']} (`<\\|mask\\|>`) |
| target layers tapped | {ids} of {cfg['num_target_layers']} (`fc`: {len(ids)} x {cfg['hidden_size']} -> {cfg['hidden_size']}) |
| initialisation | {init} |
| head | {_head_row(m, cfg)} |
{_dflash2_rows(cfg) if dflash2 else ''}
Target layer taps: {m['taps_reason']}

## Data

The target's own continuations of {_prompt_source(args)}: {args.prompt_len}-token prompt windows
continued by the target to {args.seq_len} tokens, {args.gen_batch} rows per batched forward,
{args.greedy_frac:.0%} of the rows at temperature 0 and {1 - args.greedy_frac - args.raw_frac:.0%} at
temperature {args.regen_temperature} (top_p {args.regen_top_p}){f', {args.raw_frac:.0%} raw corpus windows' if args.raw_frac else ''}.
Regenerated by this run: {data['generated_seqs']:,} sequences ({data['generated_seqs'] * args.seq_len:,} tokens, cached as token ids){_cached_note(data, args)};
sequences consumed by training: {data['consumed_seqs']:,} fresh ({data['consumed_seqs'] / max(data['generated_seqs'], args.num_seqs, 1):.2f} passes over {max(data['generated_seqs'], args.num_seqs):,})
plus {data.get('reused_seqs', 0):,} reuses of a recent sequence with new anchors while the producer was behind
(at most {args.max_reuse} uses per sequence).{_replay_note(args)}
Features are computed online by the producer (target forward), never stored.

## Training

{m['step']:,} steps of {args.batch_seqs} sequences x {args.anchors} random anchors x {B} block tokens
(weighted cross-entropy through the target's lm_head against {_labels(args)}, weight exp(-(k-1)/{args.gamma:g}) for slot k),
AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak LR {args.lr}, {args.warmup} warm-up steps,
cosine decay to {args.min_lr_ratio} x peak{f' over a {args.max_minutes:g}-minute budget' if args.max_minutes else ''},
gradient clipping {args.clip}, bfloat16 autocast {'on' if args.bf16 else 'off'}, seed {args.seed}.
Wall time: {m['train_seconds'] / 60:.1f} min training, {m['total_seconds'] / 60:.1f} min end to end, on a {m['machine']}.
{_budget(m, args)}
Producer: {rates.get('producer_seq_s', 0):.2f} seq/s ({rates.get('producer_tok_s', 0):.0f} tokens/s) while busy;
trainer: {rates.get('consumer_seq_s', 0):.2f} seq/s ({rates.get('consumer_blocktok_s', 0):.0f} block tokens/s) while busy,
waiting on the producer {rates.get('consumer_wait_frac', 0):.0%} of the time.

## Per-position accuracy (draft argmax = label at slot k)

{acc_table}

Teacher-forced accept length estimate on the held-out continuations: {ev.get('tf_tau', float('nan')):.2f}.
{_selector_table(cfg, ev) if dflash2 else ''}
## Accept length τ on held-out prompts

{ev.get('T0', {}).get('prompts', 0)} held-out prompts ({args.eval_prompt_len}-token windows of the held-out stdlib files),
{args.eval_new_tokens} new tokens each, measured with the real verification code
(`splitspec_tools.speculate.speculative_generate`, `TargetSequence`, `DFlashProposer`), float32, {B - 1} drafted tokens
per step (τ ceiling {B}). τ = committed tokens / verify steps, averaged per request.

{tau_table}

## Reproduce

```
{m['command']}
```

Resumable: re-running the command continues from `{args.run_dir}/ckpt.pt` and the cached token ids
under `{args.run_dir}/data/`. Same interpreter (the corpus is its standard library) and seed;
the producer runs asynchronously, so results match up to floating-point differences.
"""


def _budget(m: dict, args) -> str:
    """The run's budget in the units drafts are compared by: steps, tokens, sequence length and
    CPU-hours (wall time x the cores its trainer and producer threads occupy)."""
    data = m["data"]
    seqs = data["consumed_seqs"] + data.get("reused_seqs", 0)
    cores = (args.threads or 1) + args.producer_threads
    window = getattr(args, "sliding_window", None)
    return (f"**Budget of this run:** {m['step']:,} steps; {seqs:,} sequences of {args.seq_len:,} tokens "
            f"({seqs * args.seq_len:,} context tokens, {m['step'] * args.batch_seqs * args.anchors * args.block_size:,} "
            f"block tokens); {m['train_seconds'] / 3600 * cores:.2f} CPU-hours ({cores} threads x "
            f"{m['train_seconds'] / 3600:.2f} h)" + (f"; every draft layer slides over {window} positions"
                                                   if window else "") + ".")


def _head_row(m: dict, cfg: dict) -> str:
    v = m.get("draft_vocab")
    if not v:
        return f"the target's lm_head, all {cfg['vocab_size']:,} tokens"
    held = (f", holding {v['coverage']:.2%} of the {v['counted_tokens']:,} greedy tokens of the target they were "
            f"chosen from" if v.get("coverage") is not None else "")
    return (f"the target's lm_head rows of {v['kept']:,} kept tokens of {v['target_vocab']:,} "
            f"({v['kept'] / v['target_vocab']:.1%}: `draft_vocab_size`, map `d2t`), {v['source']}{held}")


def _dflash2_rows(cfg: dict) -> str:
    d = cfg["dflash_config"]
    return (f"| dynamic convs | kernel {d['conv_kernel_size']}, group size {d['conv_group_size']}, around every "
            f"attention and MLP sublayer |\n"
            f"| candidate selector | top-{d['selector_top_k']} unary candidates, rank {d['selector_rank']} codebooks |\n"
            f"| unary logits | x {d['output_multiplier']:g}, soft cap {d['final_logit_softcapping'] or 'none'} |\n")


def _selector_table(cfg: dict, ev: dict) -> str:
    if not ev.get("tf_topk_recall"):
        return ""
    K, B = cfg["dflash_config"]["selector_top_k"], cfg["dflash_config"]["block_size"]
    head = " | ".join(f"k={k}" for k in range(1, B))
    return f"""
Candidate selector on the same held-out continuations (teacher-forced predecessor):

| | {head} |
|---|{'---|' * (B - 1)}
| top-{K} recall (gold among the unary candidates) | {_fmt_acc(ev['tf_topk_recall'])} |
| selector accuracy (its pick = gold) | {_fmt_acc(ev['tf_selector_acc'])} |
| unary argmax accuracy (what DFlash would draft) | {_fmt_acc(ev['tf_unary_acc'])} |
"""


def _prompt_source(args) -> str:
    if getattr(args, "data", "code") == "chat":
        return ("chat prompts (`--data chat`, `splitspec_tools/train/chat_data.py`: instructions, code completions, "
                "explanations and multi-turn exchanges built from the documented functions of the Python standard "
                "library's train split, rendered with the target's chat template; the held-out files are never "
                "used), each the last tokens of a rendered prompt, ending at the assistant's header")
    return ("training-corpus prompts (Python standard library, train split of `splitspec_tools.train.corpus`; the "
            "held-out files are never used)")


def _cached_note(data, args) -> str:
    cached = args.num_seqs - data["generated_seqs"]
    if cached <= 0:
        return ""
    return (f"; the other {cached:,} of the {args.num_seqs:,} were already cached in `{args.run_dir}/data/` "
            f"(regenerated earlier with the settings above) and only replayed")


def _replay_note(args) -> str:
    kinds = getattr(args, "replay_kinds", "all")
    return "" if kinds == "all" else (f" Replaying used only the cached "
                                      f"{'temperature-0' if kinds == 'greedy' else 'sampled'} rows.")


def _labels(args) -> str:
    d = getattr(args, "distill", 0.0) or 0.0
    if d <= 0:
        return "the data tokens"
    if d >= 1:
        return "the target's next-token distribution (soft labels)"
    return f"{d:g} x the target's next-token distribution + {1 - d:g} x the data tokens"


def taps_reason(ids, args, target_cfg) -> str:
    L, n = target_cfg.num_hidden_layers, len(ids)
    default = default_target_layer_ids(L, n)
    if list(ids) == list(default):
        return f"default_target_layer_ids({L}, {n}) (z-lab's even spread round(1 + i(L-4)/(n-1)))."
    return (f"{list(ids)}, chosen for a {L}-layer target instead of the default spread {default} "
            f"(round(1 + i(L-4)/(n-1)), built for deep targets, which for L = {L} "
            f"{'repeats layers and ' if len(set(default)) < n else ''}stops at layer {max(default)}): evenly spaced "
            f"from an early layer (token identity and local syntax, which the draft cannot otherwise see for "
            f"context tokens) to the last layer (the target's own next-token plan, EAGLE's single feature).")
