"""The strongest CPU engine beside ours: llama.cpp on the same weights (issue 25, part 5).

Optional, for the bench only: `pip install -e '.[llamacpp]'` builds llama-cpp-python (a few
minutes on 2 cores) and the `gguf` writer. Nothing else imports this module.

* `to_gguf` writes a dense Llama / Qwen2 / Qwen3 checkpoint folder as a GGUF file (f32 or f16
  matrices, f32 norms), with its byte-level BPE vocabulary, so llama.cpp loads exactly the
  weights our target serves. Llama's q/k rows are reordered for llama.cpp's interleaved rope;
  Qwen models use the rotate-half rope both engines share.
* `LlamaCppRunner` is the bench's `llamacpp` configuration: the prompt's ids evaluated, then
  one token per step (greedy, or our sampler over its logits), timed like the others.
* `python -m splitspec_tools.bench.llamacpp` times one decode step and one 8-token evaluation (the
  cost of an 8-wide verify) in llama.cpp (f32 and f16) and in our runner, in turns, and prints
  the table with the command and machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def available() -> str | None:
    """None when llama.cpp and the GGUF writer import; otherwise what to install."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama.cpp is not installed (pip install -e '.[llamacpp]')"
    return None


def _permute_rope_rows(w, heads: int):
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs, per head: row (h, half, i)
    moves to (h, i, half)."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, out // heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def to_gguf(model_dir: str | Path, out: str | Path, dtype: str = "f32") -> Path:
    """Write `model_dir` (a dense Llama / Qwen2 / Qwen3 folder) as GGUF at `out`; returns out."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS.get((cfg.get("architectures") or [""])[0])
    if arch is None:
        raise ValueError(f"{model_dir}: llama.cpp conversion covers {sorted(ARCHS)}, not {cfg.get('architectures')}")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"{model_dir}: rope scaling {rope.get('rope_type')!r} is not converted")
    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype {dtype!r}: f32 or f16")
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or H // heads
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    _add_vocab(w, model_dir, cfg)

    def put(name: str, t, matrix: bool) -> None:
        t = np.ascontiguousarray(t.astype(np.float16 if matrix and dtype == "f16" else np.float32))
        w.add_tensor(name, t)

    put("token_embd.weight", tensors["model.embed_tokens.weight"], True)
    put("output_norm.weight", tensors["model.norm.weight"], False)
    if not cfg.get("tie_word_embeddings", False):
        put("output.weight", tensors["lm_head.weight"], True)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for i in range(L):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                t = tensors.get(f"model.layers.{i}.{src}.{kind}")
                if t is None:
                    continue
                if arch == "llama" and src in ("self_attn.q_proj", "self_attn.k_proj"):
                    t = _permute_rope_rows(t, heads if src.endswith("q_proj") else kv_heads)
                put(f"blk.{i}.{dst}.{kind}", t, kind == "weight" and t.ndim == 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_vocab(w, model_dir: Path, cfg: dict) -> None:
    """The folder's byte-level BPE tokenizer as llama.cpp's `gpt2` vocabulary (ids and merges
    as they are; the bench feeds ids, so only loading has to succeed)."""
    import gguf
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{model_dir}: tokenizer type {model.get('type')!r}; the conversion writes byte-level BPE")
    vocab = dict(model["vocab"])
    special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    for t in tok.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    n = cfg["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for text, i in vocab.items():
        if i < n:
            tokens[i] = text
            types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    gen = model_dir / "generation_config.json"
    gen = json.loads(gen.read_text()) if gen.is_file() else {}
    for key, add in (("eos_token_id", w.add_eos_token_id), ("bos_token_id", w.add_bos_token_id)):
        tid = cfg.get(key, gen.get(key))
        tid = tid[0] if isinstance(tid, list) and tid else tid
        if isinstance(tid, int):
            add(tid)


def load(path: str | Path, threads: int, n_ctx: int, logits_all: bool = False):
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                 n_batch=512, logits_all=logits_all, verbose=False)


class LlamaCppRunner:
    """The bench's `llamacpp` configuration: llama.cpp on the same weights, one token per step."""

    def __init__(self, gguf_path: str | Path, threads: int, n_ctx: int):
        self.llm = load(gguf_path, threads, n_ctx)

    def run(self, prompt_ids, max_new: int, params):
        import numpy as np
        import torch
        from splitspec_tools.bench.configs import Sample, positions_from_steps
        from splitspec.engine.sample import make_generator, sample

        llm, gen = self.llm, make_generator(params.seed)
        llm.reset()
        t0 = time.perf_counter()
        times, tokens = [], []
        llm.eval(list(prompt_ids))
        for _ in range(max_new):
            # The last evaluated token's logits (llama-cpp-python keeps `scores` only with logits_all).
            logits = torch.from_numpy(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).copy())
            tok = sample(logits, params, gen)
            tokens.append(tok)
            times.append(time.perf_counter() - t0)
            if len(tokens) < max_new:
                llm.eval([tok])
        steps = [1] * (len(tokens) - 1)
        return Sample(tokens=tokens, wall_s=times[-1], ttft_s=times[0], step_sizes=steps, step_times=times,
                      accepted_per_position=positions_from_steps(steps), verify_steps=len(steps),
                      committed=len(steps), method_ran="none")


def step_ms(llm, prompt: list[int], width: int, reps: int) -> tuple[float, float]:
    """(one decode step, one `width`-token evaluation with logits for every row) in ms, medians,
    each at the prompt's length (the evaluated tokens are dropped again)."""
    llm.reset()
    llm.eval(prompt)
    base = llm.n_tokens
    dec, wide = [], []
    for i in range(reps):
        llm.n_tokens = base
        t = time.perf_counter()
        llm.eval([prompt[i % len(prompt)]])
        dec.append((time.perf_counter() - t) * 1e3)
        llm.n_tokens = base
        t = time.perf_counter()
        llm.eval(prompt[:width])
        wide.append((time.perf_counter() - t) * 1e3)
    llm.n_tokens = base
    return statistics.median(dec[2:]), statistics.median(wide[2:])


def ours_ms(model_dir: Path, prompt: list[int], width: int, reps: int) -> tuple[float, float]:
    """The same two steps through our runner (decode; an 8-wide chain verify)."""
    from splitspec.engine.tree import Tree
    from target_service.engine import TargetSequence
    from target_service.engine import load_model
    model = load_model(model_dir)
    seq = TargetSequence(model, prompt, max_len=len(prompt) + 2 * width + 8)
    seq.prefill()
    dec, wide = [], []
    chain = Tree.chain(prompt[:width - 1])
    table, tokens = seq.seq.table, seq.seq.tokens
    for _ in range(reps):
        n = len(tokens)
        t = time.perf_counter()
        seq.decode()
        dec.append((time.perf_counter() - t) * 1e3)
        del tokens[n:]
        table.truncate(n - 1)
        t = time.perf_counter()
        seq.verify(chain)
        wide.append((time.perf_counter() - t) * 1e3)
        del tokens[n:]
        table.truncate(n - 1)
    return statistics.median(dec[2:]), statistics.median(wide[2:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="llama.cpp beside our runner: one decode step and one 8-token evaluation")
    ap.add_argument("--target-model-path", default=str(Path(__file__).resolve().parents[2] / "models" / "splitspec-code-target"))
    ap.add_argument("--out", default="runs/llamacpp", help="where the GGUF files are written (reused when present)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    missing = available()
    if missing:
        raise SystemExit(missing)
    import torch
    torch.set_num_threads(a.threads)
    model_dir = Path(a.target_model_path)
    files = {}
    for dt in ("f32", "f16"):
        path = Path(a.out) / f"{model_dir.name}-{dt}.gguf"
        if not path.is_file():
            to_gguf(model_dir, path, dt)
        files[dt] = path
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(2, vocab, (a.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"$ python -m splitspec_tools.bench.llamacpp {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, llama-cpp-python {__import__('llama_cpp').__version__}")
    engines = {f"llama.cpp {dt}": load(p, a.threads, a.prompt_tokens + 64, logits_all=True) for dt, p in files.items()}
    rows: dict[str, list[tuple[float, float]]] = {"splitspec": [], **{k: [] for k in engines}}
    for _ in range(a.rounds):
        rows["splitspec"].append(ours_ms(model_dir, prompt, a.width, a.reps))
        for name, llm in engines.items():
            rows[name].append(step_ms(llm, prompt, a.width, a.reps))
    print(f"\n{a.prompt_tokens}-token context, {a.threads} thread(s), medians of {a.rounds} rounds "
          f"(each the median of {a.reps} steps)\n")
    print(f"| engine | decode ms | decode tok/s | {a.width}-token eval ms | eval ÷ decode |")
    print("|---|---|---|---|---|")
    for name, vals in rows.items():
        d = statistics.median(v[0] for v in vals)
        e = statistics.median(v[1] for v in vals)
        print(f"| {name} | {d:.2f} | {1e3 / d:.0f} | {e:.2f} | {e / d:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
