"""The prefix cache through the real services: requests that share a prompt prefix take it from
the target's cache (Usage.cached_tokens, the Prometheus counters) and still equal target-only
greedy decoding, with DFlash, n-gram and none, on a dense and on a KDA target; sampled DFlash on
a cached prefix follows the target's distribution; --disable-radix-cache turns it off."""
from __future__ import annotations

import collections
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from draft_service.dflash import new_draft, save_draft
from hybrid_models import save_tiny_kimi
import contextlib

from service_helpers import VOCAB, collect, gateway_stub, running_draft, running_gateway, running_target, target_stub
from splitspec_tools.client import build_request
from splitspec.engine.sample import SamplingParams
from splitspec.serving import free_port
from splitspec.v1 import common_pb2, target_pb2
from target_service.engine import generate
from splitspec.models.loader import load_model
from sampling_law import chi_square_pvalue, exact_joint

N_NEW = 16
PREFIX = [(11 * i) % 90 + 5 for i in range(40)]       # 2 full blocks of 16 and a partial one
QUESTIONS = [[60 + i, 61 + i, 7] for i in range(3)]

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@contextlib.contextmanager
def stack(target_dir, model, tmp_path_factory, *target_args):
    draft_dir = tmp_path_factory.mktemp("draft") / "tiny-dflash"
    save_draft(new_draft(model.cfg, num_layers=1, block_size=4, mask_token_id=2,
                         target_layer_ids=(0, model.cfg.num_hidden_layers - 1), seed=5), draft_dir)
    logs = tmp_path_factory.mktemp("logs")
    with running_target(target_dir, logs, "--torch-threads", "1", *target_args) as target, \
            running_draft(target_dir, logs, "--torch-threads", "1", draft_dir=draft_dir) as draft, \
            running_gateway(target, logs, "--draft", draft.address, "--speculative-algorithm", "DFLASH",
                            "--draft-timeout-ms", "60000") as gw:
        yield target, draft, gw


@pytest.fixture(scope="module")
def dense(target_dir, model, tmp_path_factory):
    port = free_port()
    with stack(target_dir, model, tmp_path_factory, "--metrics-port", str(port)) as services:
        ch, stub = gateway_stub(services[-1].address)
        yield stub, model, port
        ch.close()


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    target_dir = save_tiny_kimi(tmp_path_factory.mktemp("kimi") / "tiny-kimi", vocab_size=VOCAB, tokenizer=True)
    model = load_model(target_dir)
    with stack(target_dir, model, tmp_path_factory) as services:
        ch, stub = gateway_stub(services[-1].address)
        yield stub, model, None
        ch.close()


def greedy(stub, prompt, method, salt):
    req = build_request(prompt, max_new_tokens=N_NEW, ignore_eos=True, method=method)
    req.speculative.num_draft_tokens = 3
    req.cache_salt = salt
    ids, _, complete = collect(stub.Generate(req, timeout=300))
    return ids, complete


@pytest.mark.parametrize("family", ["dense", "kimi"])
@pytest.mark.parametrize("method", ["none", "ngram", "dflash"])
def test_greedy_on_a_cached_prefix_equals_target_only(request, family, method):
    stub, model, _ = request.getfixturevalue(family)
    salt = f"{family}-{method}"             # each case starts from a cold namespace
    cached = []
    for q in QUESTIONS:
        ids, complete = greedy(stub, PREFIX + q, method, salt)
        assert ids == generate(model, PREFIX + q, N_NEW)
        assert complete.stats.draft_fallbacks == 0
        cached.append(complete.usage.cached_tokens)
    # The first request computes the prefix; the next ones take its two full blocks (and, on a
    # KDA target, the state checkpointed after them: 43 tokens end their last full block at 32).
    assert cached == [0, 32, 32]


def test_sampled_dflash_on_a_cached_prefix_follows_the_target_distribution(dense):
    stub, model, _ = dense
    prompt = PREFIX[:30] + [7, 8, 9, 7]
    n, samples = 3, 300
    joint = exact_joint(model, prompt, SamplingParams(temperature=1.0, top_k=3), n)

    def run(seed):
        req = build_request(prompt, max_new_tokens=n, ignore_eos=True, temperature=1.0, top_k=3, seed=seed,
                            method="dflash")
        req.speculative.num_draft_tokens = 3
        req.speculative.draft_sampling = "sample"
        req.cache_salt = "sampled"
        ids, _, complete = collect(stub.Generate(req, timeout=120))
        return tuple(ids), complete
    run(10_000)                             # the prefix is cached before the samples start
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, range(samples)))
    assert all(c.usage.cached_tokens == 32 for _, c in results)
    assert all(c.stats.draft_fallbacks == 0 and any(s.k for s in c.stats.steps) for _, c in results)
    counts = collections.Counter(ids for ids, _ in results)
    assert set(counts) <= set(joint)
    assert chi_square_pvalue(counts, joint, samples) > 1e-3


def test_the_target_counts_queries_and_hits(dense):
    stub, _, port = dense
    before = scrape(port)
    for q in QUESTIONS[:2]:
        greedy(stub, PREFIX + q, "none", "counted")
    after = scrape(port)
    assert after["splitspec:prefix_cache_queries_total"] - before["splitspec:prefix_cache_queries_total"] == 86
    assert after["splitspec:prefix_cache_hits_total"] - before["splitspec:prefix_cache_hits_total"] == 32


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln.startswith("splitspec:prefix_cache")}


def test_disable_radix_cache_computes_every_prompt(target_dir, tmp_path):
    with running_target(target_dir, tmp_path, "--disable-radix-cache", "--torch-threads", "1") as target:
        ch, stub = target_stub(target.address)
        cached = []
        for _ in range(2):
            def reqs():
                yield target_pb2.TargetRequest(open=target_pb2.TargetOpen(
                    prompt_token_ids=PREFIX, sampling=common_pb2.SamplingParams(), max_new_tokens=4))
            for resp in stub.Session(reqs(), timeout=60):
                cached.append(resp.opened.cached_tokens)
                break
        ch.close()
    assert cached == [0, 0]
