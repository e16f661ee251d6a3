"""Issue 39: the draft trainer's producer, its evaluation and `splitspec ceiling` run the target
through the serving runner, so every family (dense, KimiLinear's KDA + MLA, DeepseekV3's MLA +
MoE, the K3 text model's Attention Residuals) has one forward path.

* the producer's tokens, tap features and logits equal the serving path's position by position
  on long sequences (many blocks, several prefill chunks, the KDA recurrence over ~200 tokens);
* forked rows (`SequenceBatch.fork`, the ceiling's branches) carry the K/V and the KDA state;
* a short `train-draft` run against each family writes a draft that the draft service's loader
  loads, and greedy speculation with it equals target-only decoding; for KimiLinear also
  through the real services."""
from __future__ import annotations

import json

import pytest
import torch

from draft_service.architectures import load_draft
from draft_service.proposer import DFlashProposer
from hybrid_models import save_tiny_deepseek, save_tiny_k3, save_tiny_kimi
from splitspec.engine.sample import SamplingParams
from splitspec_tools.speculate import speculative_generate
from splitspec_tools.train import draft as trainer
from target_service.engine import SequenceBatch, TargetSequence, forward_sequences, generate, load_model
from tiny_models import save_tiny_model, save_tiny_tokenizer

VOCAB = 384          # a byte-level BPE: the stdlib corpus tokenizes without unknowns
TOL = dict(atol=5e-4, rtol=1e-3)     # batch of 3 vs 1: float32 summation order only


FAMILIES = {
    "qwen3": lambda p: save_tiny_model(p, "qwen3", vocab_size=VOCAB, head_dim=32, num_layers=3, seed=5,
                                       max_position_embeddings=1024, tokenizer=True),
    "kimi-linear": lambda p: save_tiny_kimi(p, vocab_size=VOCAB, tokenizer=True),
    "deepseek-v3": lambda p: (save_tiny_deepseek(p, vocab_size=VOCAB), save_tiny_tokenizer(p, VOCAB))[0],
    "k3": lambda p: save_tiny_k3(p, vocab_size=VOCAB, tokenizer=True),
}


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def family(request, tmp_path_factory):
    path = FAMILIES[request.param](tmp_path_factory.mktemp(request.param) / "target")
    return request.param, path, load_model(path)


def _taps(model) -> tuple[int, ...]:
    """A first-layer tap and the last layer's (normed) one: both conventions a draft reads."""
    return (0, model.cfg.num_hidden_layers - 1)


def _serve_greedy(model, prompt: list[int], n: int, layers) -> tuple[list[int], torch.Tensor]:
    """What a target-only session computes: prefill, then one decode per token; the tokens and
    the features of every position it ran."""
    seq = TargetSequence(model, prompt, max_len=len(prompt) + n + 1, hidden_layers=layers, prefill_chunk=64)
    out = seq.prefill()
    toks, feats = list(out.committed), [out.hidden]
    while len(toks) < n:
        out = seq.decode()
        toks += out.committed
        feats.append(out.hidden)
    return toks, torch.cat(feats)


def test_producer_tokens_and_features_equal_the_serving_runner(family):
    name, _, model = family
    P, S = 40, 200
    layers = _taps(model)
    prompts = torch.randint(3, model.cfg.vocab_size, (3, P), generator=torch.Generator().manual_seed(1))
    temps = torch.tensor([0.0, 1.0, 0.0])
    tokens, feats = trainer.regenerate(model, prompts, S, temps, 1.0, torch.Generator().manual_seed(2), layers)
    assert tokens.shape == (3, S) and feats.shape == (3, S - 1, 2 * model.cfg.hidden_size)
    assert torch.equal(tokens[:, :P], prompts)
    for r in (0, 2):            # greedy rows: the session's tokens and, position by position, its features
        toks, served = _serve_greedy(model, prompts[r].tolist(), S - P, layers)
        assert tokens[r, P:].tolist() == toks, name
        torch.testing.assert_close(feats[r], served, **TOL)
    # every row, the sampled one too: a serving prefill (64-token chunks) of the same tokens
    for r in range(3):
        seq = TargetSequence(model, tokens[r, :-1].tolist(), max_len=S + 1, hidden_layers=layers, prefill_chunk=64)
        torch.testing.assert_close(feats[r], seq.prefill().hidden, **TOL)
    # the replay pass (one batched forward of whole sequences) gives the same features
    torch.testing.assert_close(trainer.features_of(model, tokens, layers), feats, **TOL)
    assert len(set(tokens[0, P:].tolist())) > 1          # a constant continuation would make this weak


def test_stepwise_logits_equal_one_forward_position_by_position(family):
    """The logits a lockstep batch keeps (the ceiling's distributions) at each decode step equal
    the whole sequence's in one forward, at every position."""
    _, _, model = family
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, model.cfg.vocab_size, (2, 24), generator=g)
    feed = torch.randint(3, model.cfg.vocab_size, (2, 120), generator=g)
    batch = SequenceBatch(model, prompts.tolist(), [SamplingParams()] * 2, max_len=24 + 121, keep_logits=True)
    steps = [torch.cat([o.logits for o in batch.prefill()])]
    for k in range(feed.shape[1]):
        steps.append(torch.cat([o.logits for o in batch.decode(feed=feed[:, k].tolist())]))
    whole = forward_sequences(model, torch.cat([prompts, feed], 1)).logits
    torch.testing.assert_close(torch.stack(steps, 1), whole[:, 23:], **TOL)


def test_forked_rows_carry_the_cache_and_the_recurrent_state(family):
    _, _, model = family
    prompt = torch.randint(3, model.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    batch = SequenceBatch(model, [prompt], [SamplingParams()], max_len=48, keep_logits=True, rows=3)
    first = batch.prefill()[0].committed[0]
    rows = batch.fork(0, 2)
    a, b = (o.logits[0] for o in batch.decode(rows, feed=[7, 11]))
    src = batch.decode([0])[0].logits[0]             # the source row is untouched by its forks' steps
    whole = forward_sequences(model, torch.tensor([prompt + [7], prompt + [11], prompt + [first]])).logits[:, -1]
    torch.testing.assert_close(torch.stack([a, b, src]), whole, **TOL)
    batch.release(rows)
    with pytest.raises(ValueError, match="max_len"):
        SequenceBatch(model, [prompt], [SamplingParams()], max_len=len(prompt))


def _train_args(target_dir, out, steps: int):
    return ["--target-model-path", str(target_dir), "--out", str(out / "draft"), "--run-dir", str(out / "run"),
            "--mask-token-id", "1", "--max-files", "3", "--layers", "1", "--num-taps", "2", "--steps", str(steps),
            "--num-seqs", "8", "--gen-batch", "8", "--replay-batch", "8", "--seq-len", "64", "--prompt-len", "16",
            "--anchors", "8", "--batch-seqs", "2", "--warmup", "2", "--eval-every", "100", "--eval-prompts", "2",
            "--final-eval-prompts", "2", "--eval-prompt-len", "16", "--eval-new-tokens", "12", "--producer", "thread",
            "--block-size", "4"]


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_train_draft_against_each_family_serves_losslessly(family, arch, tmp_path):
    name, target_dir, model = family
    if arch == "dflash2" and name not in ("kimi-linear", "qwen3"):
        pytest.skip("DFlash2 is trained against one dense and one hybrid family; DFlash covers the rest")
    assert trainer.main(_train_args(target_dir, tmp_path, 6) + ["--arch", arch]) == 0
    out = tmp_path / "draft"
    card = (out / "README.md").read_text()
    assert model.cfg.architecture in card
    m = json.loads((out / "training_metrics.json").read_text())
    assert m["step"] == 6 and m["target"]["architecture"] == model.cfg.architecture
    d = load_draft(out, target_dir)                   # the draft service's loader
    layers = tuple(d.cfg.target_layer_ids)
    for seed in range(2):
        prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        seq = TargetSequence(model, prompt, max_len=64, hidden_layers=layers)
        prop = DFlashProposer(d, max_len=64)
        got, stats = speculative_generate(seq, prop, 30)
        prop.close()
        assert got[:30] == generate(model, prompt, 30), (name, arch)
        assert stats.verify_steps > 0


def test_a_draft_trained_against_kimi_linear_serves_losslessly_through_the_services(tmp_path):
    """train-draft against a KimiLinear target, then the real target, draft and gateway services:
    greedy DFlash output equals target-only, and the draft service drafts every step."""
    from service_helpers import collect, gateway_stub, running_stack
    from splitspec_tools.client import build_request
    target_dir = save_tiny_kimi(tmp_path / "kimi", vocab_size=VOCAB, tokenizer=True)
    assert trainer.main(_train_args(target_dir, tmp_path, 8)) == 0
    model = load_model(target_dir)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 17)]
    with running_stack(target_dir, tmp_path, tmp_path / "draft", "--speculative-algorithm", "DFLASH",
                       "--draft-timeout-ms", "60000", service_args=("--torch-threads", "1")) as (_, _, gw):
        ch, stub = gateway_stub(gw.address)
        try:
            for p in prompts:
                ids, _, complete = collect(stub.Generate(build_request(p, max_new_tokens=24, ignore_eos=True,
                                                                        method="dflash"), timeout=300))
                assert ids == generate(model, p, 24)
                assert complete.stats.draft_fallbacks == 0 and all(s.k > 0 for s in complete.stats.steps[:-1])
        finally:
            ch.close()


def test_the_producer_runs_a_target_on_two_tensor_parallel_ranks(tmp_path):
    """A target too big for one device: the producer's copy runs sharded as the service runs it,
    and gives the tokens and features of the unsharded target; train-draft drives it from its
    producer process (`--producer-tp-size 2`)."""
    from target_service.engine import close_model
    path = save_tiny_kimi(tmp_path / "kimi", vocab_size=VOCAB, tokenizer=True)
    one, two = load_model(path), load_model(path, tensor_parallel_size=2)
    try:
        assert two.world == 2
        prompts = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
        temps = torch.zeros(2)
        t1, f1 = trainer.regenerate(one, prompts, 60, temps, 1.0, torch.Generator().manual_seed(0), (0, 3))
        t2, f2 = trainer.regenerate(two, prompts, 60, temps, 1.0, torch.Generator().manual_seed(0), (0, 3))
        assert torch.equal(t1, t2)
        torch.testing.assert_close(f2, f1, **TOL)
        torch.testing.assert_close(trainer.features_of(two, t1, (0, 3)), f1, **TOL)
    finally:
        close_model(two)
    assert trainer.main(_train_args(path, tmp_path, 4) + ["--producer", "process", "--producer-tp-size", "2"]) == 0
    assert json.loads((tmp_path / "draft" / "training_metrics.json").read_text())["step"] == 4
