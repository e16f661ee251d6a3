"""Measures for the trained target and the model card that reports them.

* held-out loss (nats/token) and perplexity over the packed held-out files, against a unigram
  baseline (train-set token frequencies, add-one smoothed): beating it shows the model uses context;
* completion: held-out functions cut after their signature and docstring, completed greedily to
  the end of the function, and the share whose source then parses with `ast.parse`.
"""
from __future__ import annotations

import ast
import hashlib
import math
import os
import platform
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from splitspec_tools.bench.prompts import completable_functions
from target_service.engine import load_model


# ---------------------------------------------------------------- losses

@torch.no_grad()
def stream_loss(model, stream: torch.Tensor, seq_len: int, batch: int, *,
                max_windows: int | None = None, bf16: bool = False) -> float:
    """Mean next-token loss over non-overlapping windows of a packed stream (spread evenly
    over the stream when max_windows cuts it short)."""
    was_training = model.training
    model.eval()
    n = (len(stream) - 1) // seq_len
    starts = [i * seq_len for i in range(n)]
    if max_windows is not None and n > max_windows:
        starts = [starts[i * n // max_windows] for i in range(max_windows)]
    total, count = 0.0, 0
    for i in range(0, len(starts), batch):
        rows = torch.stack([stream[s:s + seq_len + 1] for s in starts[i:i + batch]]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(rows[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    model.train(was_training)
    return total / max(count, 1)


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of held-out tokens under train-set unigram frequencies (add-one)."""
    counts = torch.bincount(train.long(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return -logp[heldout[1:].long()].mean().item()


# ---------------------------------------------------------------- function completion

@dataclass
class FunctionCase:
    path: str
    name: str
    prefix: str      # file text up to the end of the signature/docstring (no trailing newline)
    head: str        # the function's own lines from `def` to the cut
    indent: int      # column of `def`


def function_cases(docs, n: int) -> list[FunctionCase]:
    """Up to n held-out functions that have a body after their signature and docstring,
    picked by a hash of (path, line) so they spread over files rather than filling up
    from the first one."""
    cases = []
    for doc in docs:
        lines = doc.text.splitlines(keepends=True)
        for node, cut in completable_functions(doc.text):
            prefix = "".join(lines[:cut]).rstrip("\n")
            head = "".join(lines[node.lineno - 1:cut]).rstrip("\n")
            cases.append(FunctionCase(doc.path, node.name, prefix, head, node.col_offset))
    cases.sort(key=lambda c: hashlib.sha256(f"{c.path}:{c.name}:{len(c.prefix)}".encode()).hexdigest())
    return cases[:n]


def stop_index(completion: str, indent: int) -> int | None:
    """Where the function ends in `completion`: the start of the first line (after the one the
    completion continues) with code at the `def`'s column or left of it."""
    pos = completion.find("\n")
    while pos != -1:
        nxt = completion.find("\n", pos + 1)
        line = completion[pos + 1: nxt if nxt != -1 else len(completion)]
        stripped = line.lstrip()
        if stripped and len(line) - len(stripped) <= indent:
            return pos
        pos = nxt
    return None


@torch.no_grad()
def greedy_until(model, prompt_ids: list[int], max_new: int, decode, indent: int, eos_ids) -> tuple[str, bool]:
    """Greedy decoding through the service's runner, stopping at the end of the function.
    Returns (completion text, stopped before the token cap)."""
    from target_service.engine import TargetSequence
    seq = TargetSequence(model, list(prompt_ids), max_len=len(prompt_ids) + max_new + 1)
    nxt = seq.prefill().committed[0]
    new: list[int] = []
    for _ in range(max_new):
        if nxt in eos_ids:
            return decode(new), True
        new.append(nxt)
        text = decode(new)
        cut = stop_index(text, indent)
        if cut is not None:
            return text[:cut], True
        if len(new) == max_new:
            break
        nxt = seq.decode().committed[0]
    return decode(new), False


def parses(source: str) -> bool:
    """The completed function parses and has a body beyond its docstring (an empty
    completion after a docstring would otherwise parse and count as a success)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError):
        return False
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = fn.body
    has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
               and isinstance(body[0].value.value, str))
    return len(body) > int(has_doc)


def completion_eval(model, tok, docs, *, n: int, max_new: int, context: int, eos_id: int) -> dict:
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    cases = function_cases(docs, n)
    results = []
    for case in cases:
        ids = [eos_id] + tok.encode(case.prefix).ids
        completion, stopped = greedy_until(model, ids[-context:], max_new, decode, case.indent, {eos_id})
        results.append({"path": case.path, "name": case.name, "head": case.head,
                        "completion": completion, "stopped": stopped,
                        "parses": parses(case.head + completion)})
    k = len(results)
    return {"functions": k,
            "parse_rate": sum(r["parses"] for r in results) / max(k, 1),
            "stopped_rate": sum(r["stopped"] for r in results) / max(k, 1),
            # A capped completion can still parse when its cut falls at a statement's end;
            # this stricter count excludes those.
            "stopped_parse_rate": sum(r["stopped"] and r["parses"] for r in results) / max(k, 1),
            "results": results}


# ---------------------------------------------------------------- the whole evaluation + card

def evaluate_folder(out: Path, data, args, run: dict) -> dict:
    model = load_model(out)  # measure what was shipped, through our own loader
    vocab = model.cfg.vocab_size
    n_held = (len(data.heldout) - 1) // args.seq_len
    m = dict(run)
    m["heldout_loss"] = stream_loss(model, data.heldout, args.seq_len, args.batch_size)
    m["train_loss"] = stream_loss(model, data.train, args.seq_len, args.batch_size,
                                  max_windows=max(n_held, 16))
    m["unigram_loss"] = unigram_loss(data.train, data.heldout, vocab)
    m["heldout_tokens"] = n_held * args.seq_len
    m["train_corpus_tokens"] = len(data.train)
    m["train_files"], m["heldout_files"] = len(data.train_docs), len(data.heldout_docs)
    comp = completion_eval(model, data.tok, data.heldout_docs, n=args.eval_functions,
                           max_new=args.eval_max_new, context=args.seq_len - args.eval_max_new,
                           eos_id=data.eos_id)
    m.update({k: comp[k] for k in ("functions", "parse_rate", "stopped_rate", "stopped_parse_rate")})
    m["samples"] = comp["results"][:args.samples]
    m["model_bytes"] = (out / "model.safetensors").stat().st_size
    write_card(out, m, args)
    return m


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({cpu}), torch {torch.__version__}, {torch.get_num_threads()} threads"


def write_card(out: Path, m: dict, args) -> None:
    ppl = math.exp(m["heldout_loss"])
    if m.get("minutes"):
        early = (f" (the step count set by the {m['minutes']:g}-minute time budget; "
                 f"`--steps {m['steps']}` without `--minutes` reproduces the same schedule)")
    else:
        early = ("" if m["steps"] == m["planned_steps"]
                 else f" (stopped early by --max-minutes; {m['planned_steps']} were planned)")
    samples = "\n".join(
        f"**{s['path']}: `{s['name']}`** (parses: {'yes' if s['parses'] else 'no'}; "
        f"{'ended' if s['stopped'] else 'hit the token cap'}; the first "
        f"{s['head'].count(chr(10)) + 1} line(s) are the prompt, the rest is the model's)\n\n"
        f"```python\n{s['head']}{s['completion']}\n```\n"
        for s in m["samples"])
    card = f"""# splitspec-code-target

The default **target** model of splitspec: a {m['params'] / 1e6:.1f}M-parameter decoder in the
Qwen3 architecture (`Qwen3ForCausalLM`), trained from scratch on this machine on the Python standard
library's own source. It exists so that the project has a real target to speculate against with no
download; it is a small code model, not a useful assistant.

## Model

| | |
|---|---|
| parameters | {m['params']:,} (tied input/output embeddings) |
| layers / hidden / intermediate | {args.layers} / {args.hidden_size} / {args.intermediate_size} |
| attention heads / KV heads / head dim | {args.heads} / {args.kv_heads} / {args.head_dim} (q/k RMSNorm, RoPE theta 10000) |
| vocabulary | {m.get('vocab_size', args.vocab_size):,} byte-level BPE tokens, `<\\|endoftext\\|>` (eos, id 0) and reserved `<\\|mask\\|>` (id 1) |
| context | trained on {args.seq_len}-token windows; `max_position_embeddings` {args.max_position_embeddings} |
| weights | `model.safetensors`, float32, {m['model_bytes'] / 1e6:.1f} MB |

## Data

The `.py` files of the interpreter's standard library (`sysconfig.get_paths()["stdlib"]`), without
`site-packages`, every test folder (`test`, `tests`, `idle_test`, ...), `pydoc_data/topics.py` and the
generated codec tables. Files are split by a SHA-256 of their relative path: {m['train_files']} train
files ({m['train_corpus_tokens']:,} tokens), {m['heldout_files']} held-out files. Documents are packed
into one stream, each preceded by `<|endoftext|>`.

## Training

{m['steps']:,} steps{early} of {args.batch_size} x {args.seq_len} tokens: **{m['tokens_seen']:,} tokens
seen** ({m['tokens_seen'] / m['train_corpus_tokens']:.1f} passes over the train set). AdamW (betas 0.9/0.95,
weight decay {args.weight_decay} on matrices), peak LR {args.lr}, {args.warmup} linear warm-up steps, constant, then linear
decay to {args.min_lr_ratio} x peak over the last {args.decay:.0%} of the steps (WSD), gradient clipping at {args.clip}, bfloat16 autocast
{'on' if args.bf16 else 'off'} with float32 master weights, seed {args.seed}.
Wall time {m['train_seconds'] / 60:.1f} min of training, {m['tokens_seen'] / m['train_seconds']:.0f} tokens/s on
average ({m['total_seconds'] / 60:.1f} min with tokenizer, data preparation and export; evaluation not
included) on a {machine()}.

## Results

| measure | value |
|---|---|
| held-out loss | **{m['heldout_loss']:.3f} nats/token** over {m['heldout_tokens']:,} tokens |
| held-out perplexity | **{ppl:.2f}** |
| unigram baseline (train frequencies, add-one) | {m['unigram_loss']:.3f} nats/token (perplexity {math.exp(m['unigram_loss']):.0f}) |
| train loss (same measure, sampled train windows) | {m['train_loss']:.3f} nats/token |
| function completions that parse (`ast.parse`) | **{m['parse_rate']:.0%}** of {m['functions']} held-out functions |
| completions that ended by themselves | {m['stopped_rate']:.0%} (the rest hit the {args.eval_max_new}-token cap) |
| completions that ended by themselves and parse | {m['stopped_parse_rate']:.0%} |

Completion measure: each held-out function is cut after its signature and docstring; the model
gets up to {args.seq_len - args.eval_max_new} tokens of the file before the cut and completes greedily
until a line at the `def`'s indentation or less appears (or `<|endoftext|>`, or {args.eval_max_new}
tokens); the function's source up to there is dedented and counts if `ast.parse` accepts it and
the function has at least one statement besides its docstring.

## Sample completions of held-out code (greedy)

{samples}
## Reproduce

```
{m['command']}
```

Same interpreter version (the corpus is its standard library), same seed; results match up to
floating-point differences between machines. Re-running the command resumes from `{args.run_dir}/ckpt.pt`.
"""
    (out / "README.md").write_text(card)
