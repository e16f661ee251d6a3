"""The accept-length ceiling of a target (splitspec_tools.bench.ceiling) on tiny random targets, against
cases whose answer is known in closed form."""
from __future__ import annotations

import json

import pytest
import torch

from splitspec_tools.bench.ceiling import ceiling, context_ceiling, main
from splitspec.models.loader import load_model
from splitspec.engine.sample import SamplingParams, probs_from_logits
from tiny_models import save_tiny_model
from target_service.engine import forward_sequences

B = 8
T1 = SamplingParams(temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("ceiling-target"), vocab_size=64, num_layers=2, seed=3)


@pytest.fixture
def target(target_dir):
    return load_model(target_dir)


def context_free(model):
    """Make the target ignore its input: one embedding for every token and layers that add nothing,
    so every position has the same next-token distribution."""
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb[:1].expand_as(emb))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def test_context_free_target_has_closed_form_ceilings(target):
    """With p the same at every slot, the exact marginals are p itself (every sampled draft is
    accepted: tau = B), and the argmax chain is accepted through slot k with probability pmax^k."""
    model = context_free(target)
    g = torch.Generator().manual_seed(0)
    r = context_ceiling(model, [5, 9, 2], block_size=B, params=T1, num_paths=16, generator=g)
    p = probs_from_logits(forward_sequences(model, torch.tensor([[5]])).logits[0, -1], T1)
    pmax = float(p.max())
    assert pmax < 0.9                                    # not trivially deterministic
    assert r.sampled_tau == pytest.approx(B, abs=1e-4)
    assert r.greedy_tau == pytest.approx(1 + sum(pmax ** k for k in range(1, B)), rel=1e-5)


def test_greedy_temperature_makes_the_target_fully_predictable(target):
    res = ceiling(target, [[3, 4, 5], [7, 1]], block_size=B, params=SamplingParams(temperature=0.0),
                  num_paths=4, offsets=(0, 5))
    assert res["contexts"] == 4
    assert res["greedy_tau"] == pytest.approx(B) and res["sampled_tau"] == pytest.approx(B)
    assert res["entropy_nats"] == pytest.approx(0.0, abs=1e-6)


def test_greedy_chain_matches_a_full_forward(target):
    """The argmax chain run through the forked cache gives the same per-slot probabilities as
    running the whole sequence through the model at once."""
    ctx = [11, 3, 40, 7]
    r = context_ceiling(target, ctx, block_size=B, params=T1, num_paths=4, generator=torch.Generator().manual_seed(1))
    seq = list(ctx)
    expected = []
    for _ in range(B - 1):
        p = probs_from_logits(forward_sequences(target, torch.tensor([seq])).logits[0, -1], T1)
        expected.append(float(p.max()))
        seq.append(int(p.argmax()))
    assert r.greedy_accept.tolist() == pytest.approx(expected, rel=1e-4)


def test_random_target_ceiling_is_a_valid_accept_length(target):
    res = ceiling(target, [[1, 2, 3, 4]], block_size=B, params=T1, num_paths=32, offsets=(0, 3))
    for key in ("greedy_tau", "sampled_tau"):
        assert 1.0 <= res[key] <= B
    for key in ("greedy_reach_per_position", "sampled_reach_per_position"):
        reach = res[key]
        assert len(reach) == B - 1 and all(a >= b for a, b in zip(reach, reach[1:]))
    # a sampled draft's first slot is drawn from q_1 = p_1 itself and always accepted
    assert res["sampled_reach_per_position"][0] == pytest.approx(1.0)


def test_cli_writes_json(target_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [1, 2, 3]}\n{"token_ids": [4, 5]}\n')
    out = tmp_path / "c.json"
    assert main(["--target-model-path", str(target_dir), "--prompts", str(prompts), "--num-paths", "4",
                 "--offsets", "0,2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["contexts"] == 4 and "greedy drafts" in capsys.readouterr().out


def test_splitspec_ceiling_subcommand(capsys):
    from splitspec_tools.cli import main as cli_main
    with pytest.raises(SystemExit) as e:
        cli_main(["ceiling", "--help"])
    assert e.value.code == 0 and "--num-paths" in capsys.readouterr().out
