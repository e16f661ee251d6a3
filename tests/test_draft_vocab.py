"""A reduced draft vocabulary (issue 62; `draft_service/vocab.py`): the d2t map and its checks,
the kept set chosen from counts, a head that scores only the kept rows while proposals and q stay
in the target's vocabulary, lossless speculation with such a draft (greedy equality and the T>0
distribution), the checkpoint (saved, loaded, bad maps and truncated files refused naming the file
and the field, also by the draft service at start-up), and training over the kept set (the
target's distribution restricted and renormalised; `draft-vocab`; resume keeps the map)."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draft_service import vocab
from draft_service.architectures import load_draft
from draft_service.dflash import new_draft, save_draft
from draft_service.dflash2 import new_dflash2
from draft_service.proposer import DFlashProposer
from sampling_law import chi_square_pvalue
from splitspec.engine.sample import SamplingParams
from splitspec.models.config import ConfigError
from splitspec.models.loader import CheckpointError, load_model
from splitspec_tools.speculate import speculative_generate
from splitspec_tools.train import draft as trainer
from splitspec_tools.train.draft_objective import (Teacher, draft_hidden, objective, position_weights,
                                                   sample_anchors)
from target_service.engine import TargetSequence, forward_sequences, generate
from test_dflash import exact_joint
from tiny_models import rough_draft, save_tiny_model


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return load_model(tiny_model_factory("qwen3", vocab_size=64, seed=31))


def kept_half(V: int, seed: int = 0) -> torch.Tensor:
    return torch.tensor(sorted(random.Random(seed).sample(range(V), V // 2)))


def make(target, arch: str, kept: torch.Tensor | None, block_size: int = 6, seed: int = 0):
    """A draft with every weight away from its init; `kept` set after, so that the same seed gives
    the same weights with and without a reduced vocabulary."""
    d = new_draft(target.cfg, num_layers=2, block_size=block_size, mask_token_id=target.cfg.vocab_size - 1,
                  seed=seed, target_layer_ids=[0, target.cfg.num_hidden_layers - 1])
    d = rough_draft(d, target, seed=seed + 7, std=0.2)
    if arch == "dflash2":
        d = new_dflash2(d, conv_group_size=16, selector_rank=8, selector_top_k=5, seed=seed)
        g = torch.Generator().manual_seed(seed + 11)
        with torch.no_grad():
            for name, p in d.named_parameters():
                if name.startswith("candidate_selector") or "conv" in name:
                    p.normal_(0, 0.2, generator=g)
    if kept is not None:
        d.set_vocab(kept)
    return d.eval()


# ---------------------------------------------------------------- the map


def test_d2t_is_eagle3s_offset_map():
    ids = torch.tensor([2, 3, 7, 20])
    d2t = vocab.d2t_of(ids)
    assert d2t.tolist() == [2, 2, 5, 17]                   # target id = draft id + d2t[draft id]
    assert torch.equal(vocab.target_ids_of(d2t), ids)
    assert torch.equal(vocab.check_d2t(d2t, 21, 4, "m"), ids)
    assert vocab.t2d_mask(ids, 21).nonzero().flatten().tolist() == [2, 3, 7, 20]
    index = vocab.t2d_index(ids, 21)
    assert index[ids].tolist() == [0, 1, 2, 3] and int((index >= 0).sum()) == 4


@pytest.mark.parametrize("ids, vocab_size, head, match", [
    ([2, 3, 30], 21, None, "draft id 2 to target id 30, outside the target's vocabulary 0..20"),
    ([-1, 3], 21, None, "draft id 0 to target id -1"),
    ([2, 5, 5, 9], 21, None, "two draft ids to target id 5"),
    ([2, 9, 5], 21, None, "must increase with the draft id"),
    ([2, 5, 9], 21, 4, "has 3 entries but config.json's draft_vocab_size is 4"),
])
def test_bad_maps_are_refused_naming_the_field(ids, vocab_size, head, match):
    with pytest.raises(ConfigError, match="m.safetensors: tensor 'd2t'") as err:
        vocab.check_d2t(vocab.d2t_of(torch.tensor(ids)), vocab_size, head, "m.safetensors")
    assert match in str(err.value)
    with pytest.raises(ConfigError, match="1-D integer"):
        vocab.check_d2t(torch.tensor([0.0, 1.0]), vocab_size, None, "m.safetensors")


def test_kept_set_is_the_smallest_holding_the_coverage():
    counts = torch.tensor([0, 50, 30, 15, 4, 1, 0])
    assert vocab.kept_by_coverage(counts, 0.95).tolist() == [1, 2, 3]          # 95 of 100
    assert vocab.kept_by_coverage(counts, 0.96).tolist() == [1, 2, 3, 4]
    assert vocab.kept_by_coverage(counts, 1.0).tolist() == [1, 2, 3, 4, 5]     # never a token never counted
    assert vocab.kept_by_coverage(counts, 0.95, always=(6,)).tolist() == [1, 2, 3, 6]
    assert vocab.kept_by_coverage(counts, 0.95, max_size=2).tolist() == [1, 2]
    assert vocab.kept_by_coverage(counts, 0.95, max_size=2, always=(6,)).tolist() == [1, 6]
    # a floor fills with the next most counted, then the lowest never-counted ids
    assert vocab.kept_by_coverage(counts, 0.95, min_size=6).tolist() == [0, 1, 2, 3, 4, 5]
    assert vocab.coverage_of(counts, torch.tensor([1, 2, 3])) == pytest.approx(0.95)
    assert vocab.top_k_coverage(counts, [1, 2]) == {1: pytest.approx(0.5), 2: pytest.approx(0.8)}


# ---------------------------------------------------------------- the head and the proposals


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_reduced_head_scores_only_the_kept_rows(target, arch):
    V = target.cfg.vocab_size
    kept = kept_half(V)
    full, small = make(target, arch, None), make(target, arch, kept)
    assert tuple(small._target["head"].shape) == (len(kept), target.cfg.hidden_size)
    h = torch.randn(3, 5, target.cfg.hidden_size)
    with torch.no_grad():
        z_full, z_small = full.logits(h), small.logits(h)
        assert small.draft_logits(h).shape == (3, 5, len(kept))
    torch.testing.assert_close(z_small[..., kept], z_full[..., kept])
    out = torch.ones(V, dtype=torch.bool)
    out[kept] = False
    assert bool(torch.isneginf(z_small[..., out]).all())


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("topk", [1, 3])
def test_proposals_are_kept_target_ids_and_q_is_a_distribution_over_the_target_vocabulary(target, arch, topk):
    V = target.cfg.vocab_size
    kept = kept_half(V, seed=1)
    d = make(target, arch, kept)
    allowed = set(kept.tolist())
    rng = random.Random(3)
    for i in range(4):
        prompt = [rng.randrange(V - 1) for _ in range(rng.randrange(2, 10))]
        seq = TargetSequence(target, prompt, SamplingParams(1.0, seed=i), max_len=64,
                             hidden_layers=d.cfg.target_layer_ids)
        first = seq.prefill()
        prop = DFlashProposer(d, max_len=64, num_draft_tokens=6 if topk == 1 else 9, topk=topk,
                              sampling=SamplingParams(1.0, seed=100 + i))
        prop.open(list(seq.prompt), first.hidden)
        proposal = prop.propose(seq.length, first.committed, None)
        assert set(proposal.tree.token_ids) <= allowed
        q = proposal.draft_probs
        assert q is not None and q.shape[-1] == V
        spine = q.sum(-1) > 0                     # tree nodes off the sampled spine carry a zero row
        assert bool(spine[0])
        torch.testing.assert_close(q[spine].sum(-1), torch.ones(int(spine.sum())))
        outside = torch.ones(V, dtype=torch.bool)
        outside[kept] = False
        assert float(q[:, outside].abs().sum()) == 0.0
        for j in spine.nonzero().flatten().tolist():      # each sampled token had mass under its row
            assert float(q[j, proposal.tree.token_ids[j]]) > 0


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_a_propose_scores_only_the_slots_its_tree_can_reach(target, arch):
    d = make(target, arch, kept_half(target.cfg.vocab_size))          # block 6: 5 mask slots
    seen = []
    head = d.draft_logits
    d.draft_logits = lambda h: (seen.append(tuple(h.shape)), head(h))[1]
    seq = TargetSequence(target, [3, 4, 5], max_len=64, hidden_layers=d.cfg.target_layer_ids)
    first = seq.prefill()
    prop = DFlashProposer(d, max_len=64, num_draft_tokens=3)            # a chain of 2 drafted tokens
    prop.open(list(seq.prompt), first.hidden)
    assert len(prop.propose(seq.length, first.committed, None).tree) == 2
    assert seen == [(1, 2, target.cfg.hidden_size)]


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("width", [2, 6])
def test_greedy_speculation_with_a_reduced_draft_equals_target_only(target, arch, width):
    V = target.cfg.vocab_size
    # The target's own greedy tokens kept (and half the rest): a draft that could never propose
    # them would test only the bonus path.
    rng = random.Random(width)
    prompts = [[rng.randrange(V - 1) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    refs = [generate(target, p, 30) for p in prompts]
    kept = torch.tensor(sorted(set(kept_half(V, seed=2).tolist()) | {t for r in refs for t in r[:10]}))
    d = make(target, arch, kept, seed=4)
    assert len(kept) < V
    for prompt, ref in zip(prompts, refs):
        seq = TargetSequence(target, prompt, max_len=128, hidden_layers=d.cfg.target_layer_ids)
        out, st = speculative_generate(seq, DFlashProposer(d, num_draft_tokens=width, max_len=128), 30)
        assert out == ref
        assert 1.0 <= st.accept_length <= width


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_sampled_drafts_from_a_reduced_vocabulary_keep_the_targets_distribution(tiny_model_factory, one_thread,
                                                                                  arch):
    """q is zero outside the kept set; min(1, p/q) with the residual max(p - q, 0) must still give
    exactly the target's law, including the tokens the draft can never propose."""
    target = load_model(tiny_model_factory("qwen3", vocab_size=24, seed=41))
    d = make(target, arch, kept_half(24, seed=5), block_size=4, seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    prompt = [3, 8, 1]
    exact = exact_joint(target, prompt, params)
    n, counts = 2000, {}
    for seed in range(n):
        seq = TargetSequence(target, prompt, SamplingParams(1.0, 0.9, seed=seed), max_len=32,
                             hidden_layers=d.cfg.target_layer_ids)
        prop = DFlashProposer(d, max_len=32, sampling=SamplingParams(1.0, 0.9, seed=10_000 + seed))
        out, _ = speculative_generate(seq, prop, 2)
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    assert chi_square_pvalue(counts, exact, n) > 1e-3


# ---------------------------------------------------------------- the checkpoint


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("t"), "qwen3", vocab_size=128, seed=21, tokenizer=True)


def saved(target_dir, path, kept, arch="dflash"):
    d = make(load_model(target_dir), arch, kept)
    save_draft(d, path)
    return d


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_the_map_is_saved_with_the_draft_and_loaded_at_start_up(target_dir, tmp_path, arch):
    kept = kept_half(128)
    d = saved(target_dir, tmp_path / "d", kept, arch)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["vocab_size"] == 128
    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert stored["d2t"].dtype == torch.int64 and torch.equal(vocab.target_ids_of(stored["d2t"]), kept)
    back = load_draft(tmp_path / "d", target_dir)
    assert torch.equal(back.head_ids(), kept)
    h = torch.randn(4, back.cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(back.logits(h), d.logits(h))
    # a draft without a map keeps the whole vocabulary, as before
    saved(target_dir, tmp_path / "full", None, arch)
    assert "draft_vocab_size" not in json.loads((tmp_path / "full" / "config.json").read_text())
    assert "d2t" not in load_file(str(tmp_path / "full" / "model.safetensors"))
    full = load_draft(tmp_path / "full", target_dir)
    assert full.head_ids() is None and full._target["head"].shape[0] == 128


def rewrite(path, *, d2t=None, drop=False, **config):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    if drop:
        del tensors["d2t"]
    elif d2t is not None:
        tensors["d2t"] = d2t
    save_file(tensors, str(file))
    raw = json.loads((path / "config.json").read_text())
    for k, v in config.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("case, edit, match", [
    ("id past the vocabulary", dict(d2t=vocab.d2t_of(torch.arange(64) * 2 + 10)), "outside the target's vocabulary"),
    ("duplicate ids", dict(d2t=vocab.d2t_of(torch.tensor([1, 1] + list(range(3, 65))))), "two draft ids"),
    ("not increasing", dict(d2t=vocab.d2t_of(torch.tensor([5, 1] + list(range(6, 68))))), "must increase"),
    ("size disagreeing with the head", dict(draft_vocab_size=60), "config.json's draft_vocab_size is 60"),
    ("map missing", dict(drop=True), "no weights file holds the tensor 'd2t'"),
    ("map without its size", dict(draft_vocab_size=None), "has no draft_vocab_size"),
])
def test_a_bad_map_is_refused_naming_the_file_and_the_field(target_dir, tmp_path, case, edit, match):
    saved(target_dir, tmp_path / "d", kept_half(128))
    rewrite(tmp_path / "d", **edit)
    with pytest.raises(ConfigError, match=match) as err:
        load_draft(tmp_path / "d", target_dir)
    assert "d2t" in str(err.value) or "draft_vocab_size" in str(err.value)
    assert str(tmp_path / "d") in str(err.value)


def truncate(path):
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])


def test_a_truncated_checkpoint_is_refused_naming_the_file(target_dir, tmp_path):
    saved(target_dir, tmp_path / "d", kept_half(128))
    truncate(tmp_path / "d")
    with pytest.raises(CheckpointError, match="truncated") as err:
        load_draft(tmp_path / "d", target_dir)
    assert str(tmp_path / "d" / "model.safetensors") in str(err.value)


@pytest.mark.parametrize("case", ["map for a larger vocabulary", "truncated"])
def test_the_draft_service_exits_at_start_up_naming_the_file(target_dir, tmp_path, case):
    saved(target_dir, tmp_path / "d", kept_half(128))
    if case == "truncated":
        truncate(tmp_path / "d")
    else:
        rewrite(tmp_path / "d", d2t=vocab.d2t_of(torch.arange(64) * 3))       # ids up to 189
    out = subprocess.run([sys.executable, "-m", "draft_service.server", "--method", "dflash", "--model-path",
                          str(tmp_path / "d"), "--target-model-path", str(target_dir), "--port", "0"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode != 0
    assert str(tmp_path / "d" / "model.safetensors") in out.stderr, out.stderr[-2000:]
    assert ("'d2t'" if case != "truncated" else "truncated") in out.stderr, out.stderr[-2000:]


# ---------------------------------------------------------------- training over the kept set


@pytest.fixture(scope="module")
def train_target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tt"), "qwen3", vocab_size=384, head_dim=32, num_layers=3,
                           seed=5, max_position_embeddings=1024, tokenizer=True)


def test_loss_uses_the_targets_distribution_restricted_to_the_kept_set_and_renormalised(train_target_dir):
    target = load_model(train_target_dir)
    V, B = target.cfg.vocab_size, 6
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (2, 48), generator=g)
    out = forward_sequences(target, tokens, hidden_layers=(0, 1, 2))
    feats, final = out.hidden, out.hidden[..., -target.cfg.hidden_size:]
    # the kept set: half the vocabulary, but every argmax of the first sequence, so that both
    # kinds of position (argmax kept or not) occur
    kept = torch.tensor(sorted(set(kept_half(V, seed=6).tolist()) | set(out.logits[0].argmax(-1).tolist())))
    d = new_draft(target.cfg, num_layers=1, block_size=B, mask_token_id=1, target_layer_ids=[0, 1, 2], seed=1,
                  draft_vocab=kept)
    d = rough_draft(d, target, seed=2, std=0.1)
    an = sample_anchors(2, 48, 6, torch.Generator().manual_seed(2), min_anchor=4)
    teacher = Teacher(target.lm_head.weight)
    soft = objective(d, feats, tokens, an, gamma=4.0, teacher=teacher, final_hidden=final, distill=1.0).loss
    hard = objective(d, feats, tokens, an, gamma=4.0).loss

    h, labels, valid = draft_hidden(d, feats, tokens, an)
    logp = torch.log_softmax(h[:, :, 1:] @ target.lm_head.weight[kept].T, -1).detach()    # over the kept set
    z = out.logits.float()
    pos = (an.pos[:, :, None] + torch.arange(B - 1)).clamp(max=47)     # slot k reads row a+k-1 (past the end: invalid)
    zs = torch.stack([z[i, pos[i]] for i in range(2)])                                   # [N, nA, B-1, V]
    w = position_weights(B, 4.0) * valid.float()
    in_kept = torch.zeros(V, dtype=torch.bool)
    in_kept[kept] = True

    def weighted(ce, ok):
        ww = w * ok.float()
        return (ce * ww).sum() / ww.sum()
    p = torch.softmax(zs[..., kept], -1)
    ok = in_kept[zs.argmax(-1)]
    assert 0 < int((ok & valid).sum()) < int(valid.sum())
    torch.testing.assert_close(soft, weighted(-(p * logp).sum(-1), ok), atol=1e-5, rtol=1e-4)
    # not renormalised (the full softmax's mass on the kept set) would differ
    p_raw = torch.softmax(zs, -1)[..., kept]
    assert abs(float(weighted(-(p_raw * logp).sum(-1), ok)) - soft.item()) > 1e-3
    # hard labels: a data token outside the kept set adds no loss
    index = vocab.t2d_index(kept, V)[labels]
    ce = -logp.gather(-1, index.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(hard, weighted(ce, index >= 0), atol=1e-5, rtol=1e-4)
    # and counts as a miss in the accuracy
    res = objective(d, feats, tokens, an, gamma=4.0)
    assert torch.equal(res.count, valid.sum((0, 1)).float())
    assert bool((res.correct <= ((index >= 0) & valid).sum((0, 1)).float()).all())


def test_draft_vocab_counts_the_targets_greedy_tokens(train_target_dir, tmp_path):
    from splitspec_tools.train import draft_vocab
    out = tmp_path / "v.safetensors"
    assert draft_vocab.main(["--target-model-path", str(train_target_dir), "--out", str(out), "--run-dir",
                             str(tmp_path / "run"), "--max-files", "3", "--num-seqs", "6", "--prompt-len", "16",
                             "--new-tokens", "24", "--batch", "6", "--coverage", "0.9", "--report-sizes", "8,64"]) == 0
    target = load_model(train_target_dir)
    ids, counts = vocab.load_vocab(out, target.cfg.vocab_size)
    # the counts are the target's greedy continuations of the same prompts
    streams = torch.load(tmp_path / "run" / "corpus.pt")
    prompts = draft_vocab.training_prompts(streams, "train", 6, 16, 0)
    ref = torch.zeros(target.cfg.vocab_size, dtype=torch.long)
    for p in prompts.tolist():                 # each continuation up to and including its first eos
        gen = generate(target, p, 24, eos_ids=target.cfg.eos_token_ids)
        ref += torch.bincount(torch.tensor(gen), minlength=target.cfg.vocab_size)
    assert torch.equal(counts, ref)
    assert set(target.cfg.eos_token_ids) <= set(ids.tolist())     # the end of an answer is always kept
    assert vocab.coverage_of(counts, ids) >= 0.9
    smaller = vocab.kept_by_coverage(counts, 0.9)[:-1]
    assert vocab.coverage_of(counts, counts.sort(descending=True, stable=True).indices[:len(smaller)]) < 0.9


def run_args(target_dir, tmp_path, steps, *extra):
    return ["--target-model-path", str(target_dir), "--out", str(tmp_path / "draft"),
            "--run-dir", str(tmp_path / "run"), "--mask-token-id", "1", "--max-files", "3",
            "--layers", "1", "--num-taps", "2", "--steps", str(steps), "--num-seqs", "16",
            "--gen-batch", "8", "--replay-batch", "8", "--seq-len", "64", "--prompt-len", "16",
            "--anchors", "8", "--batch-seqs", "2", "--warmup", "2", "--ckpt-every", "5",
            "--raw-frac", "1", "--max-reuse", "1", "--eval-every", "0", "--export-every-minutes", "0",
            "--final-eval-prompts", "2", "--eval-prompt-len", "16", "--eval-new-tokens", "12",
            "--arch", "dflash2", "--selector-rank", "8", "--selector-top-k", "4",
            "--draft-vocab-coverage", "0.8", "--draft-vocab-seqs", "8", *extra]


def test_a_reduced_vocabulary_draft_trains_and_resumes_to_the_same_result(train_target_dir, tmp_path):
    """train-draft chooses the kept set, trains a DFlash2 draft over it, and a run stopped at step 4
    and re-run ends with the same map and weights as one that never stopped."""
    assert trainer.main(run_args(train_target_dir, tmp_path / "whole", 8)) == 0
    assert trainer.main(run_args(train_target_dir, tmp_path / "cut", 8, "--stop-at-step", "4")) == 0
    assert trainer.main(run_args(train_target_dir, tmp_path / "cut", 8)) == 0
    whole = load_file(str(tmp_path / "whole" / "draft" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "draft" / "model.safetensors"))
    assert whole.keys() == cut.keys() and "d2t" in whole
    for k in whole:
        assert torch.equal(whole[k], cut[k]), k
    cfg = json.loads((tmp_path / "cut" / "draft" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(whole["d2t"]) < 384
    m = json.loads((tmp_path / "cut" / "draft" / "training_metrics.json").read_text())
    assert m["draft_vocab"]["kept"] == cfg["draft_vocab_size"] and m["draft_vocab"]["coverage"] >= 0.8
    assert "kept tokens of 384" in (tmp_path / "cut" / "draft" / "README.md").read_text()
    d = load_draft(tmp_path / "cut" / "draft", train_target_dir)
    assert d.cfg.draft_vocab_size == cfg["draft_vocab_size"]
    for key in ("T0", "T1_sampled_draft"):
        assert 1.0 <= m["eval"][key]["tau"] <= 8.0
