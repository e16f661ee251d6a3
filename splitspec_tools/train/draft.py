"""Train a DFlash or DFlash2 block-diffusion draft online against a frozen target (TorchSpec-style).

    python -m splitspec_tools.train.draft --target-model-path models/splitspec-code-target \\
        --out models/splitspec-code-draft --run-dir runs/draft

A *producer* (a separate process by default, or a thread) holds the frozen target. It regenerates
training data — the target's own continuations of training-corpus prompts, a mix of temperature 0
and temperature 1 rows, many rows per forward with a batched KV cache — and streams every sequence
with the hidden states of `target_layer_ids` through a bounded queue to the *trainer*, which
optimises the DFlash objective (`draft_objective.py`). The token ids are cached under
`<run-dir>/data/`; features are never written to disk. Once the requested number of sequences
exists, the producer replays the cached token ids in a seeded order, recomputing their features
with one target forward per batch. Producer and consumer rates are reported so that the
bottleneck is visible.

The run is resumable (`<run-dir>/ckpt.pt`; re-run the same command), evaluates the accept length τ
on held-out prompts with the real verification code during training, exports the draft in the
z-lab format (`save_draft`) every few minutes and at the end, and writes a model card.

`--arch dflash2` trains the DFlash2 draft (dynamic convs + candidate selector; its extra loss term is
`dflash2_objective.py`); `--init-from` warm-starts from a trained draft. This module holds the flags,
the draft's construction and the training loop; the data producer is `draft_data.py`, the
objectives `draft_objective.py` / `dflash2_objective.py`, evaluation `draft_eval.py`, and
checkpoints, export and the card `draft_export.py`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from draft_service.dflash import DFlashDraft, default_target_layer_ids, new_draft
from draft_service.dflash2 import DFlash2Draft, new_dflash2
from splitspec_tools.defaults import DEFAULT_TARGET
from splitspec.models.config import ModelConfig

from .checkpoint import add_run_flags
from .draft_data import (Producer, ProducerHandle, ProducerSpec, chunk_path, corpus_streams,  # noqa: F401
                         eos_ids_of, features_of, load_target, regenerate, target_tokenizer, windows)
from .draft_eval import eval_set, full_eval, tau_eval
from .draft_export import export, load_ckpt, machine, save_ckpt, taps_reason, write_card
from .draft_objective import Anchors, Teacher, objective, sample_anchors
from .optim import add_optimizer_flags, make_optimizer

DEFAULT_OUT = "models/splitspec-code-draft"
DEFAULT_RUN_DIR = "runs/draft"
MASK_TOKEN = "<|mask|>"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitspec train-draft", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--target-model-path", default=DEFAULT_TARGET, help="frozen target (HF folder the engine loads)")
    add_run_flags(a, DEFAULT_OUT, DEFAULT_RUN_DIR, "draft (z-lab DFlash format + README.md)")
    # draft model
    a("--arch", choices=("dflash", "dflash2"), default="dflash",
      help="dflash: the DFlash block drafter; dflash2: DFlash plus the dynamic convs and the candidate selector")
    a("--init-from", default=None, metavar="DRAFT",
      help="warm start from a trained draft folder (DFlash or DFlash2); its layers, block size, taps and mask "
           "id are used and --layers/--block-size/--target-layer-ids/--init are ignored. A DFlash draft "
           "warm-starts a DFlash2 one: its backbone is copied, the convs start as the identity and the "
           "selector at zero, so training starts from exactly the DFlash draft's proposals")
    a("--conv-group-size", type=int, default=16, help="dflash2: channels sharing one dynamic conv coefficient")
    a("--conv-kernel-size", type=int, default=2, help="dflash2: causal taps of each conv")
    a("--selector-rank", type=int, default=64, help="dflash2: width of the selector's codebooks")
    a("--selector-top-k", type=int, default=16, help="dflash2: unary candidates kept per position")
    a("--selector-alpha", type=float, default=1.0, help="dflash2: weight of the selector's K-way cross-entropy")
    a("--output-multiplier", type=float, default=1.0, help="dflash2: scale of the unary logits")
    a("--final-logit-softcapping", type=float, default=None, help="dflash2: tanh cap of the unary logits")
    a("--layers", type=int, default=2, help="draft decoder layers")
    a("--block-size", type=int, default=8, help="verify width B: last token + B-1 drafted tokens")
    a("--sliding-window", type=int, default=None, metavar="W",
      help="every draft layer attends only to keys fewer than W positions away (bidirectional in the "
           "block; `layer_types` sliding_attention, `is_causal` false in the config). Applies to a "
           "--init-from draft too. A Propose then reads the last W - 1 context positions whatever the "
           "prompt's length, and the draft sees at inference exactly the relative positions it was "
           "trained on")
    a("--target-layer-ids", default=None,
      help="comma-separated target layers to tap (default: default_target_layer_ids(L, --num-taps))")
    a("--num-taps", type=int, default=None, help="number of target layers to tap (default: --layers)")
    a("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    a("--mask-token-id", type=int, default=None, help=f"default: the tokenizer's {MASK_TOKEN}")
    a("--draft-vocab", default=None, metavar="FILE",
      help="a reduced vocabulary made by `splitspec draft-vocab`: the draft's head scores only its kept tokens "
           "(d2t, saved with the draft); proposals and q stay in the target's vocabulary")
    a("--draft-vocab-coverage", type=float, default=None, metavar="P",
      help="choose the reduced vocabulary in this run, before training: the smallest set of the target's most "
           "frequent greedy tokens holding P of them (e.g. 0.99) over --draft-vocab-seqs continuations of "
           "training prompts; kept in <run-dir>/draft_vocab.safetensors, which a resumed run reuses")
    a("--draft-vocab-max", type=int, default=None, metavar="K", help="cap on the chosen set's size")
    a("--draft-vocab-min", type=int, default=0, metavar="K",
      help="floor on the chosen set's size (the next most counted tokens, then the lowest ids): a small "
           "sample's smallest set fits that sample")
    a("--draft-vocab-seqs", type=int, default=64, help="training prompts the target continues to choose it")
    a("--init", choices=("random", "target", "target-last"), default="random",
      help="draft layers from N(0, 0.02); copied from the target's first layers (which, like the "
           "draft's, read token embeddings); or copied from its last layers, with fc and hidden_norm set "
           "so that the first draft layer's context K/V are exactly the target's there (needs the layer "
           "below them among the taps)")
    # data
    a("--prompt-len", type=int, default=128, help="tokens of training-corpus prompt per sequence")
    a("--seq-len", type=int, default=512, help="prompt + target continuation, tokens per sequence")
    a("--num-seqs", type=int, default=4096,
      help="sequences to regenerate; after that the cached token ids are replayed")
    a("--greedy-frac", type=float, default=0.5, help="share of rows regenerated at temperature 0")
    a("--regen-temperature", type=float, default=1.0, help="temperature of the sampled rows")
    a("--regen-top-p", type=float, default=1.0, help="top-p of the sampled rows")
    a("--raw-frac", type=float, default=0.0, help="share of rows that are raw corpus text (no regeneration)")
    a("--gen-batch", type=int, default=32, help="rows regenerated per batched forward (a data chunk)")
    a("--replay-batch", type=int, default=16, help="rows per feature forward when replaying")
    a("--replay-kinds", choices=("all", "greedy", "sampled"), default="all",
      help="which cached rows replaying uses (rows generated by this run are used once as they come): all, "
           "only the temperature-0 rows, or only the sampled ones (raw corpus rows count as sampled)")
    a("--max-files", type=int, default=None, help="use a small corpus subset (tests, smoke runs)")
    a("--queue-size", type=int, default=128, help="sequences the producer may run ahead")
    a("--max-reuse", type=int, default=3,
      help="when the producer is behind, the trainer reuses a recent sequence (new anchors) up to this "
           "many uses in all instead of waiting (1: always wait for fresh data)")
    a("--reuse-buffer", type=int, default=64, help="recent sequences kept for --max-reuse")
    a("--producer", choices=("process", "thread"), default="process")
    a("--producer-threads", type=int, default=1, help="torch threads of the producer")
    a("--producer-tensor-parallel-size", "--producer-tp-size", type=int, default=1, metavar="N",
      help="run the producer's copy of the target on N tensor-parallel ranks (the service's sharding; "
           "rank 0 in the producer, the others spawned beside it) for a target too big for one device")
    a("--producer-bf16", action=argparse.BooleanOptionalAction, default=True,
      help="the producer's copy of the target in bfloat16 (regeneration and features; ~1.3-2x faster on CPU)")
    # training
    a("--steps", type=int, default=3000)
    a("--log-every", type=int, default=200, help="steps between loss/accuracy records (metrics history, log line)")
    a("--batch-seqs", type=int, default=2, help="sequences per optimizer step")
    a("--anchors", type=int, default=64, help="anchored blocks per sequence (fixed; masked when unused)")
    a("--min-anchor", type=int, default=8, help="smallest anchor position (context length)")
    a("--gamma", type=float, default=None, help="loss decay exp(-(k-1)/gamma); default 4 for B<=8, else 7")
    a("--distill", type=float, default=0.0,
      help="weight of the soft label (the target's next-token distribution, from its last layer) against "
           "the data token (1: soft only, 0: data tokens only, as the plain DFlash objective)")
    a("--attention", choices=("factored", "dense"), default="factored")
    add_optimizer_flags(p, lr=1e-3, weight_decay=0.01)
    a("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 autocast in training")
    a("--threads", type=int, default=None, help="torch threads of the trainer (default: cores - producer)")
    a("--device", default="cpu",
      help="where the target, the producer and the draft run: cpu, cuda or cuda:N (on a GPU the producer "
           "shares the card with the trainer; --threads and --producer-threads then only size CPU work)")
    a("--max-minutes", type=float, default=None,
      help="training time budget: the LR schedule follows max(step/steps, time/budget) and stops at it")
    a("--ckpt-every", type=int, default=100)
    a("--stop-at-step", type=int, default=None, metavar="N",
      help="checkpoint and exit after step N without the final evaluation, as if the run were stopped "
           "there (the LR schedule still follows --steps): re-run without it to go on, e.g. in the next "
           "session")
    # evaluation and export
    a("--eval-every", type=int, default=500, help="steps between in-process tau evaluations (0: never)")
    a("--eval-prompts", type=int, default=6, help="held-out prompts in the periodic evaluation")
    a("--final-eval-prompts", type=int, default=24, help="held-out prompts in the final evaluation")
    a("--eval-prompt-len", type=int, default=128)
    a("--data", default="code", choices=["code", "chat"],
      help="code: windows of the stdlib's source as prompts; chat: chat-templated instructions built from "
           "the stdlib's documented functions (splitspec_tools/train/chat_data.py), for instruct targets")
    a("--eval-new-tokens", type=int, default=128)
    a("--eval-top-p", type=float, default=0.95)
    a("--export-every-minutes", type=float, default=10.0, help="provisional export to --out (0: never)")
    a("--eval-only", action="store_true",
      help="evaluate the draft already in --out (e.g. a provisional export) and rewrite its card")
    a("--calibrate", type=int, default=0, metavar="N",
      help="time data regeneration, feature replay and N training steps, print rates, and exit")
    args = p.parse_args(argv)
    if args.gamma is None:
        args.gamma = 4.0 if args.block_size <= 8 else 7.0
    if not 0 < args.prompt_len < args.seq_len:
        p.error("--prompt-len must be positive and below --seq-len")
    if args.draft_vocab and args.draft_vocab_coverage is not None:
        p.error("--draft-vocab and --draft-vocab-coverage both choose the vocabulary; pass one")
    if args.draft_vocab_coverage is not None and not 0 < args.draft_vocab_coverage <= 1:
        p.error("--draft-vocab-coverage must be in (0, 1]")
    return args



# ---------------------------------------------------------------- the draft

def resolve_layer_ids(args, target_cfg: ModelConfig) -> tuple[int, ...]:
    if args.target_layer_ids:
        ids = tuple(int(x) for x in args.target_layer_ids.split(","))
    else:
        ids = tuple(default_target_layer_ids(target_cfg.num_hidden_layers, args.num_taps or args.layers))
    for i in ids:
        if not 0 <= i < target_cfg.num_hidden_layers:
            raise SystemExit(f"--target-layer-ids: {i} is outside 0..{target_cfg.num_hidden_layers - 1}")
    return ids


def produced_layers(layer_ids, num_layers: int, distill: float) -> tuple[int, ...]:
    """The layers the producer sends: the taps, plus the target's last layer when soft labels need
    it and it is not already tapped."""
    ids = tuple(layer_ids)
    return ids + (num_layers - 1,) if distill > 0 and num_layers - 1 not in ids else ids


def split_features(feats: torch.Tensor, layer_ids, produced, hidden: int, distill: float):
    """(draft features [.., len(layer_ids) * H], last-layer hidden [.., H] or None) of producer
    features laid out as `produced`."""
    ctx = feats[..., :len(layer_ids) * hidden]
    if distill <= 0:
        return ctx, None
    j = list(produced).index(max(produced))      # the last layer (produced_layers added it)
    return ctx, feats[..., j * hidden:(j + 1) * hidden]


def resolve_mask_id(args, target_path) -> int:
    if args.mask_token_id is not None:
        return args.mask_token_id
    tok_file = Path(target_path) / "tokenizer.json"
    if tok_file.is_file():
        idx = target_tokenizer(target_path).token_to_id(MASK_TOKEN)
        if idx is not None:
            return idx
    raise SystemExit(f"the target's tokenizer has no {MASK_TOKEN}; pass --mask-token-id")


def build_draft(args, target, layer_ids, mask_id, kept: torch.Tensor | None = None) -> DFlashDraft:
    """kept: the reduced vocabulary's target ids (ascending), or None for the whole vocabulary."""
    if args.init_from:
        from draft_service.architectures import load_draft
        draft = load_draft(args.init_from, args.target_model_path, device=args.device).requires_grad_(True)
        own = draft.head_ids()
        if kept is not None and own is not None and not torch.equal(own.cpu(), kept):
            raise SystemExit(f"--init-from {args.init_from} has its own reduced vocabulary ({len(own):,} tokens), "
                             f"not the one asked for ({len(kept):,}); drop the --draft-vocab flags to keep its own")
        if kept is not None and own is None:
            draft.set_vocab(kept)
    else:
        draft = new_backbone(args, target, layer_ids, mask_id, kept)
    if args.arch == "dflash2" and not isinstance(draft, DFlash2Draft):
        draft = new_dflash2(draft, conv_group_size=args.conv_group_size, conv_kernel_size=args.conv_kernel_size,
                            selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                            output_multiplier=args.output_multiplier,
                            final_logit_softcapping=args.final_logit_softcapping, seed=args.seed)
    elif args.arch == "dflash" and isinstance(draft, DFlash2Draft):
        raise SystemExit(f"--init-from {args.init_from} is a DFlash2 draft; pass --arch dflash2")
    if args.sliding_window:
        draft = with_window(draft, args.sliding_window)
    if hasattr(draft.cfg, "check"):
        draft.cfg.check()
    check_trainable(draft.cfg)
    return draft.to(target.lm_head.weight.device).train()


def with_window(draft, window: int):
    """The same draft with every layer sliding over `window` positions, bidirectional in the block."""
    import dataclasses
    n = draft.cfg.num_hidden_layers
    draft.cfg = dataclasses.replace(draft.cfg, layer_types=("sliding_attention",) * n, sliding_window=window,
                                    is_causal=False)
    return draft


def check_trainable(cfg) -> None:
    """The training layouts build bidirectional blocks (with each layer's window); refuse a draft
    whose attention they would not reproduce."""
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_causal(i):
            raise SystemExit(f"draft layer {i} is causal within the block; the trainer builds only "
                             f"bidirectional blocks (is_causal: false)")
        window = cfg.layer_window(i)
        if window and window < cfg.block_size:
            raise SystemExit(f"draft layer {i} has sliding_window {window} < block size {cfg.block_size}; "
                             f"the block's own tokens would not all see each other")


def new_backbone(args, target, layer_ids, mask_id, kept: torch.Tensor | None = None) -> DFlashDraft:
    tcfg = target.cfg
    draft = new_draft(tcfg, num_layers=args.layers, block_size=args.block_size, mask_token_id=mask_id,
                      target_layer_ids=layer_ids, intermediate_size=args.intermediate_size, seed=args.seed,
                      draft_vocab=kept)
    if args.init in ("target", "target-last"):
        if getattr(tcfg, "hybrid", None) is not None:
            raise SystemExit(f"--init {args.init} copies the target's dense attention layers; {tcfg.architecture} "
                             f"has KDA / MLA layers: use --init random (or --init-from a trained draft)")
        if draft.cfg.intermediate_size != tcfg.intermediate_size:
            raise SystemExit(f"--init {args.init} needs the target's intermediate size")
        L = tcfg.num_hidden_layers
        src = target.model.layers[:args.layers] if args.init == "target" else target.model.layers[L - args.layers:]
        with torch.no_grad():
            for dst, s in zip(draft.layers, src):
                dst.load_state_dict(s.state_dict(), strict=True)
            if args.init == "target-last":
                # The first copied layer reads the output of layer `below`; when that layer is tapped,
                # fc picks its slice and hidden_norm takes that layer's input norm, so
                # k_proj(hidden_norm(fc(features))) is the target's own context K there.
                below = L - args.layers - 1
                if below not in layer_ids:
                    raise SystemExit(f"--init target-last needs target layer {below} among --target-layer-ids")
                H, j = tcfg.hidden_size, list(layer_ids).index(below)
                draft.fc.weight.zero_()
                draft.fc.weight[:, j * H:(j + 1) * H] = torch.eye(H)
                draft.hidden_norm.weight.copy_(src[0].input_layernorm.weight)
                draft.norm.weight.copy_(target.model.norm.weight)
    draft = draft.to(target.lm_head.weight.device)
    draft.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
    return draft


def progress(step: int, train_s: float, args) -> float:
    frac = step / max(args.steps, 1)
    if args.max_minutes:
        frac = max(frac, train_s / (args.max_minutes * 60))
    return min(frac, 1.0)


def lr_at(step: int, train_s: float, args) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio x lr at the end of the run (steps or time)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = progress(step, train_s, args)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


VOCAB_FILE = "draft_vocab.safetensors"


def draft_vocabulary(args, target, run_dir: Path, streams: dict) -> tuple[torch.Tensor | None, dict | None]:
    """(kept target ids, what the card says of them) from --draft-vocab, or chosen here for
    --draft-vocab-coverage (once: a resumed run reads the map its first run saved), or (None, None)."""
    from draft_service import vocab
    V = target.cfg.vocab_size
    if args.draft_vocab:
        ids, counts = vocab.load_vocab(args.draft_vocab, V)
        return ids, vocab_card(ids, counts, V, f"`{args.draft_vocab}` (`splitspec draft-vocab`)")
    if args.draft_vocab_coverage is None:
        return None, None
    path = run_dir / VOCAB_FILE
    if not path.is_file():
        from .draft_vocab import choose
        print(f"choosing the draft vocabulary: the target's greedy continuations of {args.draft_vocab_seqs} "
              f"training prompts", flush=True)
        got = choose(args.target_model_path, target, streams, num_seqs=args.draft_vocab_seqs,
                     prompt_len=args.prompt_len, new_tokens=args.seq_len - args.prompt_len, batch=args.gen_batch,
                     coverage=args.draft_vocab_coverage, max_size=args.draft_vocab_max,
                     min_size=args.draft_vocab_min, seed=args.seed)
        vocab.save_vocab(path, got["target_ids"], got["counts"], {"coverage": got["report"]["coverage"]})
    ids, counts = vocab.load_vocab(path, V)
    return ids, vocab_card(ids, counts, V, f"chosen by this run (`--draft-vocab-coverage "
                                          f"{args.draft_vocab_coverage:g}`, {args.draft_vocab_seqs} prompts)")


def vocab_card(ids: torch.Tensor, counts: torch.Tensor | None, V: int, source: str) -> dict:
    from draft_service import vocab
    return {"kept": int(ids.shape[0]), "target_vocab": V, "source": source,
            "counted_tokens": None if counts is None else int(counts.sum()),
            "coverage": None if counts is None else vocab.coverage_of(counts, ids)}


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    command = "python -m splitspec_tools.train.draft " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    run_dir, out = Path(args.run_dir), Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "ckpt.pt"
    if args.fresh:
        ckpt_path.unlink(missing_ok=True)
        shutil.rmtree(run_dir / "data", ignore_errors=True)
        (run_dir / "corpus.pt").unlink(missing_ok=True)
    cores = os.cpu_count() or 1
    # One OpenMP thread per process on a small shared machine: with more threads than free cores,
    # spinning barriers make each matmul 10-40x slower.
    threads = args.threads or (1 if cores <= 2 else cores - args.producer_threads)
    torch.set_num_threads(threads)

    target = load_target(args.target_model_path, device=args.device)
    tcfg = target.cfg
    tok = target_tokenizer(args.target_model_path) if (Path(args.target_model_path) / "tokenizer.json").is_file() else None
    eos_ids = eos_ids_of(tcfg, tok)
    layer_ids = resolve_layer_ids(args, tcfg)
    mask_id = resolve_mask_id(args, args.target_model_path)
    streams = corpus_streams(args.target_model_path, run_dir, args.max_files, args.data,
                             max(args.prompt_len, args.eval_prompt_len))
    kept, vocab_info = draft_vocabulary(args, target, run_dir, streams)
    draft = build_draft(args, target, layer_ids, mask_id, kept)
    if args.init_from:        # the warm start's own geometry wins over the flags
        layer_ids, mask_id = tuple(draft.cfg.target_layer_ids), draft.cfg.mask_token_id
        args.layers, args.block_size = draft.cfg.num_hidden_layers, draft.cfg.block_size
        if vocab_info is None and draft.head_ids() is not None:
            vocab_info = vocab_card(draft.head_ids().cpu(), None, tcfg.vocab_size, f"kept from `{args.init_from}`")
    opt = make_optimizer(draft, args)
    print(f"target: {args.target_model_path} ({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, "
          f"vocab {tcfg.vocab_size}); draft: {param_count(draft):,} params, {args.layers} layers, head "
          f"{draft.cfg.head_size:,} tokens, block "
          f"{args.block_size}, taps {list(layer_ids)}, mask id {mask_id}; corpus {len(streams['train']):,} train "
          f"/ {len(streams['heldout']):,} held-out tokens; trainer threads {threads}", flush=True)

    if args.calibrate:
        return calibrate(args, target, draft, opt, streams, layer_ids)
    if args.eval_only:
        return eval_only(args, target, streams, eos_ids)

    state = {"step": 0, "train_seconds": 0.0, "consumed": 0, "history": [], "last_eval": None}
    if ckpt_path.is_file():
        chosen = draft.head_ids()
        state = load_ckpt(ckpt_path, draft, opt, args)
        if chosen is not None and not torch.equal(draft.head_ids(), chosen):
            raise SystemExit(f"{ckpt_path}: the checkpoint's draft vocabulary differs from the one this run "
                             f"chose; use the same map or --fresh")
        print(f"resumed from {ckpt_path} at step {state['step']}", flush=True)
    state["draft_vocab"] = vocab_info

    num_chunks = max(1, math.ceil(args.num_seqs / args.gen_batch))
    produced = produced_layers(layer_ids, tcfg.num_hidden_layers, args.distill)
    spec = ProducerSpec(target_path=str(args.target_model_path), run_dir=str(run_dir), layer_ids=produced,
                        prompt_len=args.prompt_len, seq_len=args.seq_len, num_chunks=num_chunks,
                        gen_batch=args.gen_batch, replay_batch=args.replay_batch, greedy_frac=args.greedy_frac,
                        raw_frac=args.raw_frac, temperature=args.regen_temperature, top_p=args.regen_top_p,
                        seed=args.seed, threads=args.producer_threads, bf16=args.producer_bf16,
                        start_item=state["consumed"], max_files=args.max_files, device=args.device, data=args.data,
                        pool_width=max(args.prompt_len, args.eval_prompt_len),
                        replay_kinds=args.replay_kinds, tp_size=args.producer_tensor_parallel_size)
    producer = ProducerHandle(spec, args.producer, args.queue_size)
    periodic = eval_set(target, streams, args, args.eval_prompts) if args.eval_every else None
    try:
        info = train_loop(args, draft, opt, producer, state, ckpt_path, target, periodic, eos_ids,
                          started, command, layer_ids, out, produced)
    finally:
        producer.close()
    save_ckpt(ckpt_path, draft, opt, state, args)
    if args.stop_at_step is not None and state["step"] < args.steps:
        print(f"stopped at step {state['step']} (--stop-at-step); re-run without it to resume", flush=True)
        return 0

    # final evaluation: the producer is gone
    torch.set_num_threads(args.threads or (1 if cores <= 2 else cores))
    print("training done; final evaluation", flush=True)
    draft.eval()
    es = eval_set(target, streams, args, args.final_eval_prompts, seed_offset=1)
    ev = full_eval(draft, target, es, args, eos_ids)
    m = metrics(args, draft, state, info, ev, started, command, layer_ids, tcfg)
    export(draft, out, write_card(m, args, final=True), m)
    (run_dir / "metrics.json").write_text(json.dumps(m, indent=2) + "\n")
    print(json.dumps({k: ev[k] for k in ev}, indent=2), flush=True)
    print(f"wrote {out} in {(time.time() - started) / 60:.1f} min", flush=True)
    return 0


def metrics(args, draft, state, info, ev, started, command, layer_ids, tcfg) -> dict:
    return {"command": command, "params": param_count(draft), "draft_config": draft.cfg.to_dict(),
            "step": state["step"], "train_seconds": state["train_seconds"],
            "total_seconds": time.time() - started, "machine": machine(),
            "data": {"generated_seqs": info.get("generated", 0), "consumed_seqs": state["consumed"],
                     "reused_seqs": state.get("reused", 0)},
            "rates": info.get("rates", {}), "train_acc": info.get("train_acc"),
            "acc_window": info.get("acc_window", 0), "eval": ev,
            "taps_reason": taps_reason(layer_ids, args, tcfg), "history": state["history"],
            "draft_vocab": state.get("draft_vocab"),
            "target": target_card(args.target_model_path, tcfg), "args": vars(args)}


def target_card(path, tcfg) -> dict:
    """Which target the draft was trained against: the card names its family, since a draft only
    serves the target (and the tap convention) it was trained on."""
    h = getattr(tcfg, "hybrid", None)
    if h is None:
        family = "dense attention (Llama / Qwen)"
    else:
        kinds = [k for k, n in (("KDA", h.kda_layers), ("MLA", h.mla_layers)) if n]
        family = "Kimi hybrid: " + " + ".join(kinds) + (", MoE" if h.num_experts else "") + \
            (", Attention Residuals" if h.attn_res_block_size else "")
    return {"path": str(path), "name": Path(str(path)).name, "architecture": tcfg.architecture, "family": family,
            "layers": tcfg.num_hidden_layers, "hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size}


def eval_only(args, target, streams, eos_ids) -> int:
    """Final evaluation of the draft in --out, e.g. when a run was stopped before its own."""
    from draft_service.architectures import load_draft
    out = Path(args.out)
    m = json.loads((out / "training_metrics.json").read_text())
    draft = load_draft(out, args.target_model_path)
    train_args = argparse.Namespace(**{**vars(args), **m.get("args", {}),
                                       "final_eval_prompts": args.final_eval_prompts,
                                       "eval_new_tokens": args.eval_new_tokens, "eval_top_p": args.eval_top_p,
                                       "eval_prompt_len": args.eval_prompt_len, "attention": args.attention})
    torch.set_num_threads(args.threads or 1)
    es = eval_set(target, streams, train_args, train_args.final_eval_prompts, seed_offset=1)
    m["eval"] = full_eval(draft, target, es, train_args, eos_ids)
    m["note"] = (f"Evaluated by `--eval-only` on the export of step {m['step']:,}; training ran "
                 f"{m['train_seconds'] / 60:.1f} min.")
    export(draft, out, write_card(m, train_args, final=True), m)
    print(json.dumps(m["eval"], indent=2), flush=True)
    return 0


def train_loop(args, draft, opt, producer, state, ckpt_path, target, periodic, eos_ids, started, command,
               layer_ids, out, produced) -> dict:
    from tqdm import tqdm
    B = args.block_size
    H = target.cfg.hidden_size
    teacher = Teacher.of(target) if args.distill > 0 else None
    draft.train()
    bar = tqdm(total=args.steps, initial=state["step"], unit="step", mininterval=10, ncols=150,
               file=sys.stderr, dynamic_ncols=False)
    seg_start = time.time()
    base_train_s = state["train_seconds"]
    busy = 0.0
    consumed_seg = blocktok_seg = 0
    window = 50
    hist_correct, hist_count, hist_loss, hist_tau = [], [], [], []
    last_export = time.time()
    last_meta: dict = {}
    info: dict = {}
    reuse: list = []          # recent fresh items [item, uses], for --max-reuse

    def rates() -> dict:
        el = time.time() - seg_start
        pb = last_meta.get("producer_busy_s", 0.0) or 1e-9
        return {"producer_seq_s": last_meta.get("producer_seqs", 0) / pb,
                "producer_tok_s": last_meta.get("producer_tokens", 0) / pb,
                "consumer_seq_s": consumed_seg / max(busy, 1e-9),
                "consumer_blocktok_s": blocktok_seg / max(busy, 1e-9),
                "consumer_wait_frac": producer.wait_s / max(el - (producer.first_s or 0.0), 1e-9),
                "producer_startup_s": producer.first_s or 0.0}

    def snapshot(final=False) -> dict:
        k = min(window, len(hist_count))
        acc = None
        if k:
            c = torch.stack(hist_correct[-k:]).sum(0)
            n = torch.stack(hist_count[-k:]).sum(0).clamp(min=1)
            acc = (c / n).tolist()
        info.update({"rates": rates(), "train_acc": acc, "acc_window": k,
                     "generated": last_meta.get("generated", 0)})
        return info

    while True:
        train_s = base_train_s + time.time() - seg_start
        if state["step"] >= args.steps or (args.max_minutes and train_s >= args.max_minutes * 60):
            break
        if args.stop_at_step is not None and state["step"] >= args.stop_at_step:
            break
        step = state["step"]
        items, fresh = [], []
        for _ in range(args.batch_seqs):
            it = producer.poll() if reuse else None
            if it is None and reuse:
                # Starved: rather than idle, reuse a recent sequence with new random anchors.
                usable = [e for e in reuse if e[1] < args.max_reuse]
                if usable:
                    e = usable[int(torch.randint(len(usable), (1,)))]
                    e[1] += 1
                    items.append(e[0])
                    continue
            if it is None:
                it = producer.get()
            fresh.append(it)
            items.append(it)
            if args.max_reuse > 1:
                reuse.append([it, 1])
                del reuse[:-args.reuse_buffer]
        t0 = time.perf_counter()
        if fresh:
            last_meta = fresh[-1][2]
        dev = target.lm_head.weight.device
        tokens = torch.stack([it[0] for it in items]).to(dev)
        feats, final = split_features(torch.stack([it[1] for it in items]).to(dev), layer_ids, produced, H,
                                      args.distill)
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        an = sample_anchors(len(items), tokens.shape[1], args.anchors, g, min_anchor=args.min_anchor)
        anchors = Anchors(an.pos.to(dev), an.valid.to(dev))
        lr = lr_at(step, train_s, args)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
            res = objective(draft, feats, tokens, anchors, gamma=args.gamma, attention=args.attention,
                            teacher=teacher, final_hidden=final, distill=args.distill,
                            selector_alpha=args.selector_alpha)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(draft.parameters(), args.clip))
        opt.step()
        busy += time.perf_counter() - t0
        consumed_seg += len(items)
        blocktok_seg += len(items) * args.anchors * B
        state["step"] = step + 1
        state["consumed"] += len(fresh)
        state["reused"] = state.get("reused", 0) + len(items) - len(fresh)
        state["train_seconds"] = base_train_s + time.time() - seg_start
        hist_correct.append(res.correct)
        hist_count.append(res.count)
        hist_loss.append(res.loss.item())
        hist_tau.append(1 + res.accept_sum / max(res.anchors, 1))
        del hist_correct[:-window], hist_count[:-window], hist_loss[:-window], hist_tau[:-window]
        k = len(hist_count)
        acc = (torch.stack(hist_correct).sum(0) / torch.stack(hist_count).sum(0).clamp(min=1)).tolist()
        r = rates()
        bar.set_postfix_str(
            f"loss {sum(hist_loss) / k:.3f} acc {'/'.join(f'{a * 100:.0f}' for a in acc)} "
            f"tauTF {sum(hist_tau) / k:.2f} lr {lr:.1e} blk_tok/s {r['consumer_blocktok_s']:.0f} "
            f"prod {r['producer_seq_s']:.2f}seq/s cons {r['consumer_seq_s']:.2f}seq/s "
            f"wait {r['consumer_wait_frac']:.0%} reused {state.get('reused', 0)}"
            + (f" budget left {(args.max_minutes * 60 - state['train_seconds']) / 60:.0f}m" if args.max_minutes else ""),
            refresh=False)
        bar.update(1)
        if state["step"] % args.log_every == 0:
            state["history"].append({"step": state["step"], "train_s": round(state["train_seconds"], 1),
                                     "loss": sum(hist_loss) / k, "acc": acc, "tau_tf": sum(hist_tau) / k,
                                     "gnorm": gnorm, **{kk: round(v, 3) for kk, v in r.items()}})
            bar.write(f"step {state['step']}: loss {sum(hist_loss) / k:.3f} acc "
                      f"{' '.join(f'{a:.2f}' for a in acc)} tau_tf {sum(hist_tau) / k:.2f} | producer "
                      f"{r['producer_seq_s']:.2f} seq/s {r['producer_tok_s']:.0f} tok/s (busy), generated "
                      f"{last_meta.get('generated', 0)} | trainer {r['consumer_seq_s']:.2f} seq/s "
                      f"{r['consumer_blocktok_s']:.0f} block tok/s (busy), waits {r['consumer_wait_frac']:.0%}, "
                      f"fresh {state['consumed']} reused {state.get('reused', 0)}")
        if periodic is not None and args.eval_every and state["step"] % args.eval_every == 0:
            draft.eval()
            ev = tau_eval(draft, target, periodic.prompts, args, temperature=0.0, eos_ids=eos_ids)
            draft.train()
            state["last_eval"] = {"step": state["step"], "T0": ev}
            state["history"].append({"step": state["step"], "eval_tau_T0": ev["tau"]})
            bar.write(f"step {state['step']}: held-out tau at T=0 {ev['tau']:.2f} over {ev['prompts']} "
                      f"prompts ({ev['seconds']:.0f}s); per-position accept "
                      f"{' '.join(f'{a:.2f}' for a in ev['accept_rate_per_position'])}")
        if state["step"] % args.ckpt_every == 0:
            save_ckpt(ckpt_path, draft, opt, state, args)
        if args.export_every_minutes and time.time() - last_export >= args.export_every_minutes * 60:
            last_export = time.time()
            ev = {"T0": state["last_eval"]["T0"]} if state.get("last_eval") else {}
            m = metrics(args, draft, state, snapshot(), ev, started, command, layer_ids, target.cfg)
            export(draft, out, write_card(m, args, final=False), m)
            save_ckpt(ckpt_path, draft, opt, state, args)
            bar.write(f"step {state['step']}: provisional export to {out}")
    bar.close()
    return snapshot(final=True)


def calibrate(args, target, draft, opt, streams, layer_ids) -> int:
    """Rates of the three stages, each on this process's threads. Reports wall time and process CPU
    time (with one thread the CPU time is the rate an uncontended core would give)."""
    g = torch.Generator().manual_seed(0)
    b = args.gen_batch
    saved = torch.get_num_threads()
    torch.set_num_threads(args.producer_threads)

    dev = target.lm_head.weight.device

    def timed(fn):
        w, c = time.perf_counter(), time.process_time()
        r = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return r, time.perf_counter() - w, time.process_time() - c

    prompts = windows(streams["train"], b, args.prompt_len, g).to(dev)
    temps = torch.tensor([0.0 if i % 2 == 0 else args.regen_temperature for i in range(b)], device=dev)
    ptarget = load_target(args.target_model_path, dtype="bfloat16" if args.producer_bf16 else "float32",
                          device=args.device)
    produced = produced_layers(layer_ids, target.cfg.num_hidden_layers, args.distill)
    (toks, feats), w, c = timed(lambda: regenerate(ptarget, prompts, args.seq_len, temps, args.regen_top_p, g,
                                                   produced))
    gen_tok = b * (args.seq_len - args.prompt_len)
    print(f"regeneration ({args.producer_threads} threads, bf16={args.producer_bf16}): {b} rows x "
          f"{args.seq_len} tokens: wall {w:.1f}s ({b / w:.2f} seq/s, {gen_tok / w:.0f} generated tok/s); "
          f"cpu {c:.1f}s ({b / c:.2f} seq/s, {gen_tok / c:.0f} tok/s)", flush=True)
    rb = toks[:args.replay_batch]
    _, w, c = timed(lambda: features_of(ptarget, rb, produced))
    print(f"feature replay: {len(rb)} rows: wall {w:.2f}s ({len(rb) / w:.2f} seq/s); cpu {c:.2f}s "
          f"({len(rb) / c:.2f} seq/s, {rb.numel() / c:.0f} tok/s)", flush=True)
    torch.set_num_threads(saved)
    feats, final = split_features(feats, layer_ids, produced, target.cfg.hidden_size, args.distill)
    teacher = Teacher.of(target) if args.distill > 0 else None
    draft.train()
    walls, cpus = [], []
    for step in range(args.calibrate + 1):
        idx = torch.randint(0, b, (args.batch_seqs,), generator=g)
        an = sample_anchors(args.batch_seqs, args.seq_len, args.anchors, g, min_anchor=args.min_anchor)
        anchors = Anchors(an.pos.to(dev), an.valid.to(dev))
        idx = idx.to(dev)

        def one():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
                res = objective(draft, feats[idx], toks[idx], anchors, gamma=args.gamma, attention=args.attention,
                                teacher=teacher, final_hidden=None if final is None else final[idx],
                                distill=args.distill)
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            opt.step()
            return res
        res, w, c = timed(one)
        if step:
            walls.append(w)
            cpus.append(c)
    w, c = sum(walls) / max(len(walls), 1), sum(cpus) / max(len(cpus), 1)
    blk = args.batch_seqs * args.anchors * args.block_size
    print(f"training ({saved} threads, {args.attention}, bf16={args.bf16}, {args.batch_seqs} seqs x "
          f"{args.anchors} anchors): wall {w:.3f} s/step ({args.batch_seqs / w:.2f} seq/s, {blk / w:.0f} block "
          f"tok/s); cpu {c:.3f} s/step ({args.batch_seqs / c:.2f} seq/s, {blk / c:.0f} block tok/s); "
          f"loss {res.loss.item():.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
