"""Online DFlash draft training (splitspec_tools.train.draft, splitspec_tools.train.draft_objective).

* the training forward (all anchored blocks of a sequence in one query set, dense block mask or
  factored attention) equals, position by position, the cached inference forward
  (`DraftCache` + `draft_block`) in float32;
* the producer runs the target through the serving runner: batched regeneration equals
  target-only decoding row by row, and its features equal the serving path's position by
  position, for dense and hybrid (KDA / MLA / MoE) targets;
* the trainer runs end to end on a tiny random target and writes a draft that `load_draft` loads
  and `DFlashProposer` proposes with; re-running resumes from the checkpoint.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from draft_service.architectures import load_draft
from draft_service.dflash import DraftCache, draft_block, new_draft, save_draft
from draft_service.proposer import DFlashProposer
from splitspec_tools.train import draft as trainer
from splitspec_tools.train.draft_objective import (Anchors, Teacher, block_mask, draft_hidden, objective,
                                             position_weights, sample_anchors, soft_labels)
from target_service.engine import TargetSequence, forward_sequences, generate
from splitspec.models.loader import load_model
from splitspec.engine.sample import SamplingParams
from tiny_models import rough_draft, save_tiny_model

BLOCK = 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-target")
    return save_tiny_model(path, "qwen3", vocab_size=384, head_dim=32, num_layers=3, seed=5,
                           max_position_embeddings=1024, tokenizer=True)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


def make_draft(target, num_layers=2, seed=0):
    d = new_draft(target.cfg, num_layers=num_layers, block_size=BLOCK, mask_token_id=1, seed=seed,
                  target_layer_ids=[0, 1, 2])
    return rough_draft(d, target, seed=seed + 3, std=0.1)


def sequence(target, n_seqs, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.cfg.vocab_size, (n_seqs, S), generator=g)
    return tokens, forward_sequences(target, tokens, hidden_layers=(0, 1, 2)).hidden


def inference_logits(d, feats_row, tokens_row, anchor):
    cache = DraftCache(d, max(256, anchor + BLOCK))
    cache.append(d, feats_row[:anchor])
    with torch.no_grad():
        return draft_block(d, cache, int(tokens_row[anchor]), anchor)


@pytest.mark.parametrize("attention", ["dense", "factored"])
def test_training_forward_equals_inference_one_anchor(target, attention):
    d = make_draft(target)
    tokens, feats = sequence(target, 1, 48)
    for a in (1, 17, 40):
        an = Anchors(torch.tensor([[a]]), torch.tensor([[True]]))
        with torch.no_grad():
            h, labels, valid = draft_hidden(d, feats, tokens, an, attention=attention)
            train_logits = d.logits(h[0, 0, 1:])
        ref = inference_logits(d, feats[0], tokens[0], a)
        torch.testing.assert_close(train_logits, ref, atol=1e-5, rtol=1e-5)
        assert labels[0, 0].tolist() == tokens[0, a + 1:a + BLOCK].tolist()
        assert valid.all()


@pytest.mark.parametrize("attention", ["dense", "factored"])
def test_training_forward_equals_inference_many_anchors(target, attention):
    """Several anchors in each of two sequences, neighbouring and overlapping blocks, one padding
    anchor, an anchor whose block runs past the end, and features that stop before the last token."""
    d = make_draft(target, seed=1)
    S = 40
    tokens, feats = sequence(target, 2, S, seed=1)
    feats = feats[:, :S - 1]
    pos = torch.tensor([[1, 5, 6, 9, 20, 33, 38, 38], [2, 3, 4, 12, 13, 25, 30, 39]])
    valid = torch.ones_like(pos, dtype=torch.bool)
    valid[0, -1] = False
    an = Anchors(pos, valid)
    with torch.no_grad():
        h, labels, lvalid = draft_hidden(d, feats, tokens, an, attention=attention)
        train_logits = d.logits(h[:, :, 1:])
    for i in range(2):
        for j in range(pos.shape[1]):
            a = int(pos[i, j])
            ref = inference_logits(d, feats[i], tokens[i], a)
            torch.testing.assert_close(train_logits[i, j], ref, atol=1e-5, rtol=1e-5)
            expect = [p < S and bool(valid[i, j]) for p in range(a + 1, a + BLOCK)]
            assert lvalid[i, j].tolist() == expect


def windowed(d, window, layers=None):
    """d with a sliding window on `layers` (default: all), bidirectional in the block."""
    n = d.cfg.num_hidden_layers
    types = tuple("sliding_attention" if layers is None or i in layers else "full_attention" for i in range(n))
    d.cfg = dataclasses.replace(d.cfg, layer_types=types, sliding_window=window, is_causal=False)
    return d


@pytest.mark.parametrize("attention", ["dense", "factored"])
@pytest.mark.parametrize("layers", [None, (0,)], ids=["all-sliding", "mixed"])
def test_windowed_training_equals_inference_on_a_long_window(target, attention, layers):
    """A sliding-window draft on a 700-token sequence: anchors near the start (fewer than W keys
    before them), in the middle and near the end, in one batch; the training layouts (dense mask,
    and the per-anchor band of `_banded_attention` when every layer slides) equal the cached
    inference forward position by position, and the context each block sees is the window."""
    d = windowed(make_draft(target, seed=4), 24, layers)
    S = 700
    tokens, feats = sequence(target, 2, S, seed=4)
    feats = feats[:, :S - 1]
    pos = torch.tensor([[1, 10, 23, 24, 25, 300, 301, 690], [2, 5, 30, 160, 161, 400, 600, 697]])
    an = Anchors(pos, torch.ones_like(pos, dtype=torch.bool))
    with torch.no_grad():
        h, _, _ = draft_hidden(d, feats, tokens, an, attention=attention)
        train_logits = d.logits(h[:, :, 1:])
    for i in range(2):
        for j in range(pos.shape[1]):
            ref = inference_logits(d, feats[i], tokens[i], int(pos[i, j]))
            torch.testing.assert_close(train_logits[i, j], ref, atol=1e-5, rtol=1e-5)
    # the window matters: without it the far anchors' blocks see other keys and differ
    full = make_draft(target, seed=4)
    with torch.no_grad():
        h_full, _, _ = draft_hidden(full, feats, tokens, an, attention=attention)
    assert not torch.allclose(full.logits(h_full[0, -1, 1:]), train_logits[0, -1], atol=1e-3)


def test_windowed_block_mask_structure():
    an = Anchors(torch.tensor([[3, 9]]), torch.tensor([[True, True]]))
    m = block_mask(an, 12, 4, window=5)[0, 0]
    for qi in range(8):
        a, k = [3, 9][qi // 4], qi % 4
        assert m[qi, :12].tolist() == [j < a and a + k - j < 5 for j in range(12)], qi
        assert m[qi, 12:].tolist() == [j // 4 == qi // 4 for j in range(8)]


def test_block_mask_structure():
    an = Anchors(torch.tensor([[3, 6]]), torch.tensor([[True, True]]))
    m = block_mask(an, 10, 4)[0, 0]
    assert m.shape == (8, 10 + 8)
    for q in range(8):
        blk, a = q // 4, [3, 6][q // 4]
        assert m[q, :10].tolist() == [j < a for j in range(10)]          # context strictly before
        assert m[q, 10:].tolist() == [j // 4 == blk for j in range(8)]   # own block, both ways


def test_dense_and_factored_gradients_agree(target):
    d = make_draft(target, seed=2)
    tokens, feats = sequence(target, 2, 64, seed=2)
    an = sample_anchors(2, 64, 6, torch.Generator().manual_seed(0))
    grads = {}
    for mode in ("dense", "factored"):
        d.zero_grad()
        out = objective(d, feats, tokens, an, attention=mode)
        out.loss.backward()
        grads[mode] = [p.grad.clone() for p in d.parameters()]
    for a, b in zip(grads["dense"], grads["factored"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_anchor_sampling_and_weights():
    g = torch.Generator().manual_seed(0)
    an = sample_anchors(3, 20, 30, g, min_anchor=4)
    assert an.pos.shape == (3, 30)
    assert int(an.valid.sum(1)[0]) == 15          # candidates 4..18
    assert (an.pos[an.valid] >= 4).all() and (an.pos[an.valid] <= 18).all()
    for row, v in zip(an.pos, an.valid):
        assert len(set(row[v].tolist())) == int(v.sum())
    w = position_weights(8, 4.0)
    assert w[0] == 1 and torch.allclose(w[3], torch.exp(torch.tensor(-0.75)))


def test_batched_regeneration_equals_target_only_decoding(target):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.cfg.vocab_size, (4, 12), generator=g)
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0])
    tokens, feats = trainer.regenerate(target, prompts, 30, temps, 1.0, torch.Generator().manual_seed(1),
                                       (0, 2))
    assert tokens.shape == (4, 30) and feats.shape == (4, 29, 2 * target.cfg.hidden_size)
    for r in (0, 2):    # greedy rows equal the engine's target-only greedy decoding
        ref = generate(target, prompts[r].tolist(), 18)
        assert tokens[r, 12:].tolist() == ref
    torch.testing.assert_close(feats, trainer.features_of(target, tokens, (0, 2)), atol=1e-4, rtol=1e-4)


def test_soft_labels_are_the_targets_next_token_distribution(target):
    tokens, _ = sequence(target, 2, 40, seed=3)
    out = forward_sequences(target, tokens, hidden_layers=(2,))
    teacher = Teacher(target.lm_head.weight)
    an = Anchors(torch.tensor([[4, 17, 30], [9, 10, 31]]), torch.ones(2, 3, dtype=torch.bool))
    p = soft_labels(teacher, out.hidden, an, BLOCK)
    assert p.shape == (2, 3, BLOCK - 1, target.cfg.vocab_size)
    ref = torch.softmax(out.logits.float(), -1)
    for i in range(2):
        for j in range(3):
            for k in range(1, BLOCK):   # slot k predicts x_{a+k}: the target's row a+k-1
                torch.testing.assert_close(p[i, j, k - 1], ref[i, int(an.pos[i, j]) + k - 1],
                                           atol=1e-5, rtol=1e-4)


def test_distill_weight_mixes_soft_and_hard_cross_entropy(target):
    tokens, feats = sequence(target, 2, 48, seed=4)
    d = make_draft(target)
    an = sample_anchors(2, 48, 6, torch.Generator().manual_seed(2), min_anchor=4)
    teacher = Teacher(target.lm_head.weight)
    final = feats[..., -target.cfg.hidden_size:]          # taps (0, 1, 2): the last is the last layer
    hard = objective(d, feats, tokens, an).loss
    soft = objective(d, feats, tokens, an, teacher=teacher, final_hidden=final, distill=1.0).loss
    half = objective(d, feats, tokens, an, teacher=teacher, final_hidden=final, distill=0.5).loss
    none = objective(d, feats, tokens, an, teacher=teacher, final_hidden=final, distill=0.0).loss
    torch.testing.assert_close(none, hard)
    torch.testing.assert_close(half, 0.5 * soft + 0.5 * hard)
    assert abs(soft.item() - hard.item()) > 1e-3
    # soft cross-entropy >= the teacher's entropy (Gibbs), with the weights of the hard loss
    h, _, valid = draft_hidden(d, feats, tokens, an)
    p = soft_labels(teacher, final, an, BLOCK)
    ent = -(p * p.clamp(min=1e-30).log()).sum(-1)
    w = position_weights(BLOCK, 4.0) * valid.float()
    assert soft.item() >= float((ent * w).sum() / w.sum()) - 1e-4


def test_producer_adds_the_last_layer_for_soft_labels():
    H = 4
    assert trainer.produced_layers((0, 1), 3, 1.0) == (0, 1, 2)
    assert trainer.produced_layers((0, 2), 3, 1.0) == (0, 2)
    assert trainer.produced_layers((0, 1), 3, 0.0) == (0, 1)
    feats = torch.arange(3 * H, dtype=torch.float32).expand(5, -1)     # layer i's slice = i*H …
    ctx, final = trainer.split_features(feats, (0, 1), (0, 1, 2), H, 1.0)
    assert ctx.shape == (5, 2 * H) and final[0].tolist() == list(range(2 * H, 3 * H))
    ctx, final = trainer.split_features(feats[:, :2 * H], (0, 2), (0, 2), H, 1.0)
    assert ctx.shape == (5, 2 * H) and final[0].tolist() == list(range(H, 2 * H))
    assert trainer.split_features(feats[:, :2 * H], (0, 1), (0, 1), H, 0.0)[1] is None


def test_init_target_last_reproduces_the_targets_context_kv(target):
    """--init target-last: the first draft layer is the target's layer L-n, and its injected
    context K/V are exactly what that target layer computes at those positions."""
    from argparse import Namespace
    from splitspec.models.dense import apply_rope, rope_cos_sin
    args = Namespace(layers=1, block_size=BLOCK, intermediate_size=None, seed=0, init="target-last")
    d = trainer.new_backbone(args, target, (0, 1), 1)
    tokens, _ = sequence(target, 1, 20, seed=6)
    feats = forward_sequences(target, tokens, hidden_layers=(0, 1)).hidden
    with torch.no_grad():
        (k, v), = d.context_kv(d.fuse(feats), torch.arange(20))
        at = target.model.layers[2].self_attn
        h = target.model.layers[2].input_layernorm(feats[..., target.cfg.hidden_size:])
        ref_k = at.k_norm(at.k_proj(h).view(1, 20, at.n_kv, at.head_dim)).transpose(1, 2)
        cos, sin = rope_cos_sin(target.inv_freq(ref_k.device), torch.arange(20), ref_k.dtype)
        ref_v = at.v_proj(h).view(1, 20, at.n_kv, at.head_dim).transpose(1, 2)
    torch.testing.assert_close(k, apply_rope(ref_k, cos, sin), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(d.layers[0].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    with pytest.raises(SystemExit, match="layer 1"):
        trainer.new_backbone(args, target, (0, 2), 1)


def run_args(target_dir, tmp_path, steps, producer="process"):
    return ["--target-model-path", str(target_dir), "--out", str(tmp_path / "draft"),
            "--run-dir", str(tmp_path / "run"), "--mask-token-id", "1", "--max-files", "3",
            "--layers", "1", "--num-taps", "2", "--steps", str(steps), "--num-seqs", "16",
            "--gen-batch", "8", "--replay-batch", "8", "--seq-len", "64", "--prompt-len", "16",
            "--anchors", "8", "--batch-seqs", "2", "--warmup", "2", "--ckpt-every", "5",
            "--eval-every", "6", "--eval-prompts", "2", "--final-eval-prompts", "2",
            "--eval-prompt-len", "16", "--eval-new-tokens", "12", "--producer", producer]


def test_trainer_end_to_end(target_dir, target, tmp_path):
    assert trainer.main(run_args(target_dir, tmp_path, 12)) == 0
    out = tmp_path / "draft"
    for f in ("config.json", "model.safetensors", "README.md", "training_metrics.json"):
        assert (out / f).is_file(), f
    assert (tmp_path / "run" / "ckpt.pt").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "data").iterdir()) == ["chunk_00000.pt", "chunk_00001.pt"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"]["mask_token_id"] == 1
    m = json.loads((out / "training_metrics.json").read_text())
    assert m["step"] == 12
    assert m["data"]["consumed_seqs"] + m["data"]["reused_seqs"] == 24
    consumed = m["data"]["consumed_seqs"]
    for key in ("T0", "T1_greedy_draft", "T1_sampled_draft"):
        assert 1.0 <= m["eval"][key]["tau"] <= 8.0
    assert m["rates"]["producer_seq_s"] > 0 and m["rates"]["consumer_seq_s"] > 0
    assert "τ" in (out / "README.md").read_text()

    d = load_draft(out, target_dir)
    ids = tuple(d.cfg.target_layer_ids)
    seq = TargetSequence(target, [5, 6, 7, 8, 9], SamplingParams(), max_len=64, hidden_layers=ids)
    first = seq.prefill()
    prop = DFlashProposer(d, max_len=64)
    prop.open(list(seq.prompt), first.hidden)
    proposal = prop.propose(seq.length, first.committed, None)
    assert len(proposal.tree) == 7

    # Re-running with more steps resumes from the checkpoint (thread producer this time, always
    # waiting for fresh data).
    assert trainer.main(run_args(target_dir, tmp_path, 16, producer="thread") + ["--max-reuse", "1"]) == 0
    m = json.loads((out / "training_metrics.json").read_text())
    assert m["step"] == 16 and m["data"]["consumed_seqs"] == consumed + 8


def test_trainer_resumes_to_the_same_state_as_an_uninterrupted_run(target_dir, tmp_path):
    """Stopped at step 4 (`--stop-at-step`, as a run cut by a session's end) and re-run, the
    windowed trainer ends with the same weights as a run that never stopped (same seed)."""
    from safetensors.torch import load_file

    def args(sub, *extra):
        return run_args(target_dir, tmp_path / sub, 8) + [
            "--raw-frac", "1", "--max-reuse", "1", "--eval-every", "0", "--export-every-minutes", "0",
            "--sliding-window", "16", *extra]
    assert trainer.main(args("whole")) == 0
    assert trainer.main(args("cut", "--stop-at-step", "4")) == 0
    assert not (tmp_path / "cut" / "draft").exists()          # no final export when stopped
    assert torch.load(tmp_path / "cut" / "run" / "ckpt.pt", weights_only=False)["state"]["step"] == 4
    assert trainer.main(args("cut")) == 0
    whole = load_file(str(tmp_path / "whole" / "draft" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "draft" / "model.safetensors"))
    assert whole.keys() == cut.keys()
    for k in whole:
        assert torch.equal(whole[k], cut[k]), k
    cfg = json.loads((tmp_path / "cut" / "draft" / "config.json").read_text())
    assert cfg["sliding_window"] == 16 and cfg["is_causal"] is False
    assert cfg["layer_types"] == ["sliding_attention"]
    m = json.loads((tmp_path / "cut" / "draft" / "training_metrics.json").read_text())
    assert m["step"] == 8 and m["data"]["consumed_seqs"] == 16


@pytest.mark.cuda
def test_trainer_end_to_end_on_cuda(target_dir, tmp_path):
    """--device cuda: producer and trainer on the card; the export loads and drafts on the CPU."""
    torch.cuda.reset_peak_memory_stats()
    assert trainer.main(run_args(target_dir, tmp_path, 8) + ["--device", "cuda"]) == 0
    m = json.loads((tmp_path / "draft" / "training_metrics.json").read_text())
    assert m["step"] == 8 and 1.0 <= m["eval"]["T0"]["tau"] <= 8.0
    d = load_draft(tmp_path / "draft", target_dir)
    assert next(d.parameters()).device.type == "cpu"
    # A run that quietly stayed on the CPU would pass everything above: the trainer (this
    # process) must have held at least the draft's weights on the card.
    weight_bytes = sum(p.numel() * p.element_size() for p in d.parameters())
    assert torch.cuda.max_memory_allocated() >= weight_bytes > 0


@pytest.mark.parametrize("kinds, expected", [("all", 8), ("greedy", 3), ("sampled", 5)])
def test_replay_kinds_pick_rows_by_their_recorded_temperature(tmp_path, kinds, expected):
    temps = [torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, -1.0, 0.0, 1.0])]
    for k, t in enumerate(temps):
        trainer.chunk_path(tmp_path, k).parent.mkdir(exist_ok=True)
        torch.save({"tokens": torch.zeros(4, 8, dtype=torch.int32), "temperature": t}, trainer.chunk_path(tmp_path, k))
    spec = trainer.ProducerSpec(target_path="", run_dir=str(tmp_path), layer_ids=(0,), prompt_len=4, seq_len=8,
                                num_chunks=2, gen_batch=4, replay_batch=4, greedy_frac=0.5, raw_frac=0.0,
                                temperature=1.0, top_p=1.0, seed=0, threads=1, bf16=False, replay_kinds=kinds)
    rows = trainer.Producer(spec, None, None)._replay_rows()
    assert len(rows) == expected
    if kinds == "greedy":
        assert rows == [(0, 0), (0, 3), (1, 2)]


def test_dflash2_trainer_warm_starts_from_dflash(target_dir, tmp_path):
    """--arch dflash2 --init-from a DFlash draft: the export is a DFlash2 checkpoint in the public
    layout that the draft service loads, and the card reports the selector's numbers."""
    from draft_service.dflash2 import DFlash2Draft
    base = tmp_path / "base"
    save_draft(new_draft(load_model(target_dir).cfg, num_layers=1, block_size=6, mask_token_id=1,
                         target_layer_ids=[0, 1], seed=3), base)
    args = run_args(target_dir, tmp_path, 6) + ["--arch", "dflash2", "--init-from", str(base),
                                                "--selector-rank", "8", "--selector-top-k", "4"]
    assert trainer.main(args) == 0
    out = tmp_path / "draft"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["block_size"] == 6
    assert cfg["dflash_config"]["selector_top_k"] == 4 and cfg["dflash_config"]["target_layer_ids"] == [0, 1]
    d = load_draft(out, target_dir)
    assert isinstance(d, DFlash2Draft)
    m = json.loads((out / "training_metrics.json").read_text())
    assert 0.0 <= m["eval"]["tf_topk_recall"][0] <= 1.0 and len(m["eval"]["tf_selector_acc"]) == 5
    card = (out / "README.md").read_text()
    assert "top-4 recall" in card and "warm start" in card


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_prompts_are_templated_instructions_that_end_where_the_answer_starts(tmp_path):
    """--data chat: every pool row ends with the assistant's header (the template's generation
    prompt), prompts come from the stdlib's training split only, and windows() draws rows cut
    to the asked length from the end."""
    from splitspec_tools.train import corpus
    from splitspec_tools.train.chat_data import conversations, prompt_pool
    from splitspec_tools.train.draft_data import windows
    from tokenizers import AddedToken, Tokenizer
    folder = save_tiny_model(tmp_path / "chat-target", "qwen3", vocab_size=384, tokenizer=True)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    train, held = corpus.load_corpus(max_files=20)
    convs = conversations(train, seed=0)
    assert convs and all(m[-1]["role"] == "user" for m in convs)
    assert any(len(m) == 3 for m in conversations(train * 3, seed=1))      # multi-turn ones too
    pool = prompt_pool(folder, 24, max_files=20)
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    assert pool["train"].shape[1] == 24 and len(pool["train"]) > 10
    assert all(row[-len(header):].tolist() == header for row in pool["train"])
    rows = windows(pool["train"], 5, 16, torch.Generator().manual_seed(0))
    assert rows.shape == (5, 16) and all(r[-len(header):].tolist() == header for r in rows)
    with pytest.raises(ValueError, match="pool"):
        windows(pool["train"], 1, 25, torch.Generator())
