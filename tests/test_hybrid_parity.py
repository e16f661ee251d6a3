"""KimiLinear and DeepSeek-V3 targets against transformers on tiny random models (fp32): logits
of a prefill, of decode steps and of a multi-token verify forward within 1e-4, greedy
generation token for token."""
from __future__ import annotations

import pytest
import torch

import target_service.runner as runner
from hybrid_models import save_tiny_deepseek, save_tiny_kimi
from splitspec.engine.tree import Tree
from target_service.engine import TargetSequence, forward_sequences, generate
from target_service.torch_verifier import TorchVerifier
from splitspec.models.loader import load_model

TOL = 1e-4
FAMILIES = {
    "kimi": lambda p: save_tiny_kimi(p),
    "kimi_mla_first": lambda p: save_tiny_kimi(p, kda=(2, 3), mla=(1, 4)),
    # tie_word_embeddings set, yet the reference never ties a Kimi head: the stored lm_head is used
    "kimi_tie_flag": lambda p: save_tiny_kimi(p, tie_word_embeddings=True),
    "deepseek": lambda p: save_tiny_deepseek(p),
    "deepseek_yarn": lambda p: save_tiny_deepseek(p, yarn=True),
}


pytestmark = pytest.mark.usefixtures("torch_one_thread")     # hundreds of tiny forwards


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path), ref


class Recording(TorchVerifier):
    def __init__(self):
        super().__init__()
        self.logits = []

    def verify(self, logits, *args, **kw):
        self.logits.append(logits.clone())
        return super().verify(logits, *args, **kw)


@pytest.fixture
def sampled(monkeypatch):
    seen = []

    def recording(logits, *args, **kw):
        seen.append(logits.clone())
        return real(logits, *args, **kw)
    real = runner.sample
    monkeypatch.setattr(runner, "sample", recording)
    return seen


def test_prefill_decode_and_verify_logits_match_transformers(pair, sampled):
    mine, ref = pair
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 128, (11,), generator=gen).tolist()
    drafts = torch.randint(3, 128, (5,), generator=gen).tolist()
    verifier = Recording()
    seq = TargetSequence(mine, prompt, verifier=verifier, max_len=64)
    seq.prefill()
    b0 = seq.tokens[-1]
    seq.decode()
    b1 = seq.tokens[-1]
    seq.verify(Tree.chain(drafts))
    with torch.no_grad():
        out = ref(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        assert (sampled[0] - out.logits[0, -1]).abs().max() < TOL            # prefill (last row)
        step = ref(torch.tensor([[b0]]), cache=cache, use_cache=True)
        assert (sampled[1] - step.logits[0, -1]).abs().max() < TOL           # decode
        assert step.logits[0, -1].argmax().item() == b1
        many = ref(torch.tensor([[b1, *drafts]]), cache=step.past_key_values, use_cache=True)
        assert (verifier.logits[0] - many.logits[0]).abs().max() < TOL       # 6-token verify forward


def test_whole_sequence_forward_matches_transformers(pair):
    mine, ref = pair
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (forward_sequences(mine, ids).logits - ref(ids).logits).abs().max() < TOL


def test_greedy_generation_equals_transformers(pair):
    mine, ref = pair
    prompt = torch.randint(3, 128, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                            pad_token_id=1)[0, len(prompt):].tolist()
    assert generate(mine, prompt, 20) == want
