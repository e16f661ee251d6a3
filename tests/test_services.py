"""The real target service and gateway as subprocesses on loopback ports: streamed generations
equal the in-process target-only reference, text streams decode cleanly, stops work across
chunks, and a cancelled client stream frees the target session."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from tokenizers import Tokenizer

from service_helpers import collect, running_gateway, running_target, target_info, tiny_target_dir
from splitspec_tools.client import build_request
from splitspec.v1 import gateway_pb2
from target_service.engine import generate
from splitspec.models.loader import load_model
from splitspec.engine.sample import SamplingParams

PROMPT = [5, 17, 42, 99, 300, 7, 8]
MAX_CONTEXT = 2048


@pytest.fixture(scope="module")
def model_dir():
    return tiny_target_dir(MAX_CONTEXT)


@pytest.fixture(scope="module")
def services(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with running_target(model_dir, logs) as target, running_gateway(target, logs) as gateway:
        yield target, gateway


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def run(stub, prompt, **kw):
    return collect(stub.Generate(build_request(prompt, **kw), timeout=120))


def test_greedy_by_token_ids_equals_in_process(stub, model):
    ids, _, complete = run(stub, PROMPT, max_new_tokens=40, ignore_eos=True)
    assert ids == generate(model, PROMPT, 40)
    assert complete.finish_reason == "length"
    assert complete.usage.prompt_tokens == len(PROMPT)
    assert complete.usage.completion_tokens == 40
    assert complete.stats.method == "none"
    assert complete.stats.verify_steps == 39        # Decode steps after the prefill token


def test_greedy_stops_at_eos_like_in_process(stub, model):
    ref = generate(model, PROMPT, 60, eos_ids=model.cfg.eos_token_ids)
    ids, _, complete = run(stub, PROMPT, max_new_tokens=60)
    assert ids == ref
    assert complete.finish_reason == ("eos" if ref[-1] in model.cfg.eos_token_ids else "length")


def test_seeded_sampling_equals_in_process_and_repeats(stub, model):
    kw = dict(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    first, _, _ = run(stub, PROMPT, max_new_tokens=40, ignore_eos=True, **kw)
    second, _, _ = run(stub, PROMPT, max_new_tokens=40, ignore_eos=True, **kw)
    ref = generate(model, PROMPT, 40, params=SamplingParams(**kw))
    assert first == second == ref
    other, _, _ = run(stub, PROMPT, max_new_tokens=40, ignore_eos=True, **{**kw, "seed": 99})
    assert other != first


def test_concurrent_streams_each_equal_their_reference(stub, model):
    seeds = [1, 2, 3]
    results = {}

    def worker(seed):
        results[seed] = run(stub, PROMPT, max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=seed)[0]
    threads = [threading.Thread(target=worker, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for s in seeds:
        assert results[s] == generate(model, PROMPT, 30, params=SamplingParams(temperature=1.0, seed=s))


@pytest.mark.parametrize("prompt", ["naïve café: 日本語 🙂 €", "def fibonacci(n):\n    a, b = 0, 1\n"])
def test_text_deltas_equal_decoding_the_whole_sequence(stub, tokenizer, prompt):
    # Sampling at T=1 from a random model emits odd byte tokens, the hard case for UTF-8.
    ids, texts, complete = run(stub, prompt, max_new_tokens=120, temperature=1.0, seed=7, ignore_eos=True)
    assert complete.usage.prompt_tokens == len(tokenizer.encode(prompt).ids)
    assert "".join(texts) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_straddling_chunks(stub, tokenizer):
    ids, texts, _ = run(stub, PROMPT, max_new_tokens=60, ignore_eos=True, temperature=1.0, seed=5)
    full = "".join(texts)
    # A stop string made of the end of one chunk and the start of the next.
    j = next(j for j in range(10, len(texts) - 1) if texts[j] and texts[j + 1] and "\ufffd" not in texts[j] + texts[j + 1])
    stop = texts[j][-2:] + texts[j + 1][:2]
    cut = full.find(stop)
    stopped_ids, stopped_texts, complete = run(stub, PROMPT, max_new_tokens=60, ignore_eos=True,
                                               temperature=1.0, seed=5, stop=[stop, "never-produced-xyz"])
    assert "".join(stopped_texts) == full[:cut]
    assert complete.finish_reason == "stop"
    assert stopped_ids == ids[:len(stopped_ids)] and len(stopped_ids) < len(ids)


def test_stop_token_id(stub):
    ids, _, _ = run(stub, PROMPT, max_new_tokens=40, ignore_eos=True)
    stop = ids[5]
    out, _, complete = run(stub, PROMPT, max_new_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    assert out == ids[:ids.index(stop) + 1]       # the stop token is emitted, like eos
    assert complete.finish_reason == "stop"


def test_model_info(stub):
    info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.model_id, info.vocab_size, info.max_context) == ("tiny-qwen3", 512, MAX_CONTEXT)
    assert list(info.eos_token_ids) == [0]
    assert info.speculative_method == "none" and info.max_new_tokens_cap == 2048


def test_cancel_closes_target_session_within_a_second(services, stub):
    target, gateway = services
    stream = stub.Generate(build_request(PROMPT, max_new_tokens=2000, ignore_eos=True), timeout=120)
    for _ in range(3):
        next(stream)
    assert target_info(target.address).active_sessions >= 1
    stream.cancel()
    deadline = time.monotonic() + 1.0
    while (active := target_info(target.address).active_sessions) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert active == 0
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    ids, _, _ = run(stub, PROMPT, max_new_tokens=5)   # still serving
    assert len(ids) >= 1
