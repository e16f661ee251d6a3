"""The target training recipe (splitspec_tools.train): corpus selection and split, tokenizer,
schedule, evaluation helpers, and a tiny end-to-end run that writes a folder our loader loads
and generates from; re-running the command resumes from the checkpoint instead of retraining."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitspec_tools.train import corpus, evaluate
from splitspec_tools.train import target as trainer
from splitspec_tools.train.tokenizer import EOS, MASK, save_tokenizer, train_tokenizer
from target_service.generate import generate
from splitspec.models.loader import load_model, load_tokenizer

TINY = ["--max-files", "8", "--vocab-size", "300", "--hidden-size", "32", "--layers", "2",
        "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--intermediate-size", "64",
        "--seq-len", "64", "--batch-size", "4", "--steps", "6", "--warmup", "2",
        "--eval-every", "3", "--ckpt-every", "3", "--eval-functions", "3", "--eval-max-new", "8",
        "--samples", "1", "--threads", "1"]


# ---------------------------------------------------------------- corpus

def test_corpus_excludes_tests_and_site_packages():
    rels = corpus.list_sources()
    assert len(rels) > 300
    for rel in rels:
        parts = rel.split("/")[:-1]
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), rel
    assert "os.py" in rels and "json/decoder.py" in rels
    assert "idlelib/idle_test/test_config.py" not in rels


def test_split_is_deterministic_and_small():
    rels = corpus.list_sources()
    held = [r for r in rels if corpus.is_heldout(r)]
    assert held == [r for r in rels if corpus.is_heldout(r)]
    assert 0 < len(held) < 0.06 * len(rels)


def test_tiny_corpus_subset_has_both_sides():
    train, heldout = corpus.load_corpus(max_files=5)
    assert 0 < len(train) <= 5 and len(heldout) >= 1
    assert not {d.path for d in train} & {d.path for d in heldout}


# ---------------------------------------------------------------- tokenizer

@pytest.fixture(scope="module")
def tiny_tokenizer():
    train, _ = corpus.load_corpus(max_files=6)
    return train_tokenizer((d.text for d in train), 400)


def _roundtrip(tok, text: str) -> str:
    return tok.decode(tok.encode(text).ids, skip_special_tokens=False)


def test_tokenizer_special_ids_and_roundtrip_of_source(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(MASK) == 1
    for rel in ("os.py", "textwrap.py", "json/decoder.py"):
        src = (corpus.stdlib_root() / rel).read_text(encoding="utf-8")
        assert _roundtrip(tok, src) == src, rel
    tricky = "\tif x:\r\n  \u00a0 y = 'é😀'  \n\n\n   # trailing   \n  "
    assert _roundtrip(tok, tricky) == tricky


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_tokenizer_roundtrips_any_text(tiny_tokenizer, text):
    assert _roundtrip(tiny_tokenizer, text) == text


def test_tokenizer_files_load_in_transformers(tiny_tokenizer, tmp_path):
    from transformers import PreTrainedTokenizerFast
    save_tokenizer(tiny_tokenizer, tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert hf.eos_token == EOS and hf.eos_token_id == 0
    src = "def f(a, b):\n    return a  +  b\n"
    assert hf(src)["input_ids"] == tiny_tokenizer.encode(src).ids
    assert hf.decode(hf(src)["input_ids"]) == src


# ---------------------------------------------------------------- schedule and helpers

def test_wsd_schedule():
    args = trainer.parse_args(["--steps", "100", "--warmup", "10", "--lr", "1e-3",
                               "--decay", "0.2", "--min-lr-ratio", "0.1"])
    assert trainer.lr_at(0, args, 100) == pytest.approx(1e-4)
    assert trainer.lr_at(50, args, 100) == pytest.approx(1e-3)
    assert trainer.lr_at(80, args, 100) == pytest.approx(1e-3)
    assert trainer.lr_at(90, args, 100) == pytest.approx(0.55e-3)
    assert trainer.lr_at(100, args, 100) == pytest.approx(1e-4)
    assert trainer.lr_at(50, args, None) == pytest.approx(1e-3)  # total not fixed yet: stable


def test_time_budget_fixes_total_when_decay_starts():
    args = trainer.parse_args(["--steps", "1000", "--minutes", "10", "--decay", "0.2"])
    assert trainer.fix_total(300, 7 * 60, args) is None
    total = trainer.fix_total(400, 8 * 60, args)
    assert total == 500 and trainer.lr_at(400, args, total) == pytest.approx(args.lr)
    assert trainer.fix_total(900, 8 * 60, args) == 1000  # --steps caps it


def test_batches_are_a_function_of_the_step():
    args = trainer.parse_args(["--seq-len", "16", "--batch-size", "3"])
    stream = torch.arange(1000, dtype=torch.int32)
    x1, y1 = trainer.batch_at(stream, 7, args)
    x2, y2 = trainer.batch_at(stream, 7, args)
    assert torch.equal(x1, x2) and torch.equal(y1[:, :-1], x1[:, 1:])
    assert not torch.equal(x1, trainer.batch_at(stream, 8, args)[0])


def test_thread_tuner_moves_to_the_faster_setting():
    tuner = trainer.ThreadTuner(2, every=10)
    speeds = {1: 3.0, 2: 9.0}   # contended: one thread is faster
    for step in range(30):
        n = tuner.threads_for(step)
        tuner.record(step, n, speeds[n])
    assert tuner.current == 1
    speeds = {1: 3.0, 2: 2.0}   # the other job ended
    for step in range(30, 60):
        n = tuner.threads_for(step)
        tuner.record(step, n, speeds[n])
    assert tuner.current == 2


def test_function_cases_and_stop_rule():
    src = ('class A:\n    def m(self, x):\n        """Doc\n        more."""\n        y = x + 1\n'
           '        return y\n\n    def n(self):\n        pass\n\n\ndef g():\n    return 1\n')
    cases = evaluate.function_cases([corpus.Doc("a.py", src)], 10)
    by_name = {c.name: c for c in cases}
    m = by_name["m"]
    assert m.prefix.endswith('more."""') and m.head.startswith("    def m(") and m.indent == 4
    assert by_name["g"].prefix.endswith("def g():")
    body = "\n        y = x + 1\n        return y\n\n    def n(self):"
    assert body[:evaluate.stop_index(body, 4)] == "\n        y = x + 1\n        return y\n"
    assert evaluate.stop_index("\n        y = 1\n  ", 4) is None  # indentation not decided yet
    assert evaluate.parses(m.head + "\n        return x\n")
    assert not evaluate.parses(m.head)                        # docstring only: not a completion
    assert not evaluate.parses(m.head + "\n        return (x\n")


def test_unigram_loss_is_entropy_of_uniform_stream():
    stream = torch.arange(8).repeat(100)
    assert evaluate.unigram_loss(stream, stream, 8) == pytest.approx(torch.log(torch.tensor(8.0)).item(), rel=1e-3)


# ---------------------------------------------------------------- end to end

def test_tiny_recipe_end_to_end_and_resume(tmp_path, capsys):
    out, run = tmp_path / "model", tmp_path / "run"
    argv = TINY + ["--out", str(out), "--run-dir", str(run)]
    assert trainer.main(argv) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["eos_token_id"] == 0 and cfg["tie_word_embeddings"] is True
    card = (out / "README.md").read_text()
    assert "held-out loss" in card and "unigram baseline" in card and "ast.parse" in card
    assert "python -m splitspec_tools.train.target" in card

    model = load_model(out)
    tok = load_tokenizer(out)
    prompt = tok.encode("def add(a, b):\n").ids
    new = generate(model, prompt, 8, eos_ids=model.cfg.eos_token_ids)
    assert 1 <= len(new) <= 8 and all(0 <= t < model.cfg.vocab_size for t in new)
    # Our early-stopping greedy loop in the evaluation agrees with generate().
    text, _ = evaluate.greedy_until(model, prompt, 8, lambda ids: tok.decode(ids, skip_special_tokens=False),
                                    indent=10**6, eos_ids=set())
    assert text == tok.decode([t for t in new if t != 0], skip_special_tokens=False)[:len(text)]

    weights = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert trainer.main(argv) == 0   # same command again: resumes at the last step, no training
    assert "resumed from" in capsys.readouterr().out
    assert (out / "model.safetensors").read_bytes() == weights
