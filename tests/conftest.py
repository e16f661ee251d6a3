"""Shared fixtures: tiny random HF checkpoints (saved once per session) and model loading.

The checkpoint factory itself is the plain function `tests.tiny_models.save_tiny_model`,
so test files outside this suite (services, draft) can reuse it; `tiny_model_factory`
here only caches its results per session."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import save_tiny_model  # noqa: E402

# `--dtype auto` serves bfloat16 on CPUs with native bf16 (this CI machine has it). The service
# tests compare with float32 references computed in the test process, so the services they start
# run float32 unless a test asks otherwise; the bf16 path has its own tests (test_gguf_model.py).
os.environ.setdefault("SPLITSPEC_DTYPE", "float32")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skips without one, fails with SPLITSPEC_REQUIRE_GPU=1")
    config.addinivalue_line("markers", "flashinfer: needs CUDA and FlashInfer; skips without them, fails with "
                                       "SPLITSPEC_REQUIRE_GPU=1")


def pytest_runtest_setup(item):
    import gpu_checks
    gpu_checks.check(item)

# The target variants every parity test runs on. Between them they cover: a sharded save
# with an index, GQA, llama3 rope scaling, tied embeddings, q/k/v bias (Qwen2), q/k norm
# with an explicit head_dim != hidden / heads (Qwen3).
TARGET_VARIANTS = {
    "llama-sharded": dict(arch="llama", max_shard_size="20KB", seed=11),
    "llama3-tied": dict(arch="llama3", tie_word_embeddings=True, seed=12),
    "qwen2-bias": dict(arch="qwen2", seed=13),
    "qwen3-qknorm": dict(arch="qwen3", head_dim=32, seed=14),
}


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`make(arch="qwen3", **save_tiny_model_kwargs) -> Path`, cached per session.
    Treat the returned folder as read-only; copy it (`shutil.copytree`) to modify it."""
    made: dict[str, Path] = {}

    def make(arch: str = "qwen3", **kwargs) -> Path:
        key = json.dumps({"arch": arch, **kwargs}, sort_keys=True, default=str)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = save_tiny_model(path, arch, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session", params=list(TARGET_VARIANTS), ids=list(TARGET_VARIANTS))
def target_variant(request, tiny_model_factory):
    """(variant name, checkpoint path) for each entry of TARGET_VARIANTS."""
    kw = dict(TARGET_VARIANTS[request.param])
    return request.param, tiny_model_factory(kw.pop("arch"), **kw)


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory) -> Path:
    """A default tiny Qwen3 checkpoint (vocab 128, 2 layers, hidden 64, head_dim 32)."""
    return tiny_model_factory("qwen3", seed=21)


@pytest.fixture(scope="session")
def tiny_qwen3_model(tiny_qwen3):
    from splitspec.models.loader import load_model
    return load_model(tiny_qwen3)


# ---------------------------------------------------------------------------------------
# Independent references for the statistical tests (numpy, float64): they do not call
# splitspec.engine.sample, so a mistake there cannot cancel out.

def reference_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Exact distribution of temperature -> top-k -> top-p sampling (renormalised after
    each filter; top-p keeps the shortest highest-probability prefix whose mass reaches
    top_p). temperature 0 is a one-hot of the argmax."""
    import numpy as np

    z = np.asarray(logits, dtype=np.float64)
    V = z.shape[-1]
    if temperature == 0:
        out = np.zeros(V)
        out[int(np.argmax(z))] = 1.0
        return out
    z = z / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_k and top_k < V:
        keep = np.argsort(-p, kind="stable")[:top_k]
        mask = np.zeros(V, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        csum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(csum, top_p - 1e-12)) + 1   # first prefix reaching top_p
        mask = np.zeros(V, dtype=bool)
        mask[order[:n_keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of observed `counts` to exact `probs` (same shape).
    Cells with expected count < min_expected are pooled into one bin. Any observation in
    a zero-probability cell returns 0.0 (impossible outcome)."""
    import numpy as np
    from scipy import stats

    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape
    assert abs(probs.sum() - 1.0) < 1e-9, probs.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = n * probs
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    rest_e = expected[~big].sum()
    if rest_e > 0:
        obs.append(counts[~big].sum())
        exp.append(rest_e)
    if len(obs) < 2:
        return 1.0
    stat = float(sum((o - e) ** 2 / e for o, e in zip(obs, exp)))
    return float(stats.chi2.sf(stat, len(obs) - 1))


@pytest.fixture(scope="session")
def stat_ref():
    """`stat_ref.probs(logits, T, top_k, top_p)` and `stat_ref.chi2(counts, probs)`."""
    from types import SimpleNamespace
    return SimpleNamespace(probs=reference_probs, chi2=chi2_pvalue)


def _one_torch_thread():
    """One torch thread for many tiny forwards (thread start-up costs more than it saves); the
    previous count is restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


torch_one_thread = pytest.fixture(scope="module", name="torch_one_thread")(_one_torch_thread)   # for a module
one_thread = pytest.fixture(name="one_thread")(_one_torch_thread)                               # for one test


@pytest.fixture(scope="module")
def target_dir(request):
    """The tiny byte-level Qwen3 a service test module runs (its context: the module's
    TARGET_CONTEXT, 512 when unset); a module with another target defines its own."""
    from service_helpers import tiny_target_dir
    return tiny_target_dir(getattr(request.module, "TARGET_CONTEXT", 512))


@pytest.fixture(scope="module")
def model(target_dir):
    """`target_dir` loaded in process: the reference the services must equal."""
    from splitspec.models.loader import load_model
    return load_model(target_dir)


@pytest.fixture(scope="module")
def draft_dir(model, tmp_path_factory):
    """A tiny random DFlash draft of `model` (one layer, block 8), saved for a draft service to
    load; a module that needs another draft defines its own."""
    from draft_service.dflash import new_draft, save_draft
    path = tmp_path_factory.mktemp("draft") / "tiny-dflash"
    save_draft(new_draft(model.cfg, num_layers=1, block_size=8, mask_token_id=2, seed=3), path)
    return path


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> bytes:
    """The tiny byte-level tokenizer's tokenizer.json, for fake targets to describe themselves with."""
    from service_helpers import VOCAB
    from tiny_models import save_tiny_tokenizer
    path = save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)
    path = path / "tokenizer.json" if path.is_dir() else path
    return path.read_bytes()


@pytest.fixture(scope="module")
def stub(services):
    """A Generation stub on the gateway of the module's `services` (the gateway comes last)."""
    from service_helpers import gateway_stub
    ch, stub = gateway_stub(services[-1].address)
    yield stub
    ch.close()
