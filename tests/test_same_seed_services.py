"""The same seed, the same text, through the real services (issue 64): seeded sampled requests
emit exactly target-only coupled sampling's tokens with every method (none, ngram, dflash with
sampled drafts, auto, dflash trees), one at a time and concurrently, and when the replica serving
one is killed mid-answer; an unseeded request reports the seed it drew, and replays with it.

One set of services: two target replicas, a DFlash draft, a gateway over both (with its HTTP
front). The failover test comes last: it kills a replica."""
from __future__ import annotations

import contextlib
import json
import random
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from service_helpers import collect, gateway_stub, running, running_gateway, target_info

from splitspec.engine.sample import SamplingParams
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import free_port
from target_service.engine import generate

TARGET_CONTEXT = 512
SETTINGS = {"T1-p0.95": dict(temperature=1.0, top_p=0.95), "T0.7-k40": dict(temperature=0.7, top_k=40)}
# method -> SpeculativeParams fields
METHODS = {
    "none": dict(method="none"),
    "ngram": dict(method="ngram"),
    "dflash": dict(method="dflash", draft_sampling="sample"),
    "dflash-greedy-drafts": dict(method="dflash", draft_sampling="greedy"),
    "auto": dict(method="auto"),
    "dflash-tree": dict(method="dflash", draft_sampling="sample", topk=2, num_draft_tokens=8, num_steps=4),
}
N_NEW = 24


class Cluster:
    def __init__(self, target_dir, draft_dir, log_dir, stack: contextlib.ExitStack):
        self.target_dir, self.log_dir, self.stack = target_dir, log_dir, stack
        self.targets = [self._target() for _ in range(2)]
        self.draft = stack.enter_context(running("draft", [
            "--method", "dflash", "--model-path", str(draft_dir), "--target-model-path", str(target_dir)], log_dir))
        self.http_port = free_port()
        self.gateway = stack.enter_context(running_gateway(
            ",".join(t.address for t in self.targets), log_dir, "--draft", self.draft.address,
            "--speculative-algorithm", "DFLASH", "--reconnect-max-s", "0.5", "--http-port", str(self.http_port)))

    def _target(self):
        return self.stack.enter_context(running("target", ["--model-path", str(self.target_dir)], self.log_dir))


@pytest.fixture(scope="module")
def cluster(target_dir, draft_dir, tmp_path_factory):
    with contextlib.ExitStack() as stack:
        yield Cluster(target_dir, draft_dir, tmp_path_factory.mktemp("logs"), stack)


@pytest.fixture(scope="module")
def stub(cluster):
    ch, stub = gateway_stub(cluster.gateway.address)
    yield stub
    ch.close()


def prompt_for(i: int) -> list[int]:
    rng = random.Random(300 + i)
    base = [rng.randrange(3, 200) for _ in range(rng.randrange(4, 9))]
    return base * 3        # repeats, so n-gram lookup finds matches


def request(prompt, seed, setting, method, n=N_NEW):
    req = build_request(prompt, max_new_tokens=n, ignore_eos=True, seed=seed, **SETTINGS[setting])
    for name, value in METHODS[method].items():
        setattr(req.speculative, name, value)
    return req


def reference(model, prompt, seed, setting, n=N_NEW):
    return generate(model, prompt, n, params=SamplingParams(seed=seed, **SETTINGS[setting]))


def run(stub, req):
    ids, _, complete = collect(stub.Generate(req, timeout=300))
    return ids, complete


def check_identity(stub, model, cases, workers: int):
    """cases: (prompt index, seed, setting); every method, `workers` streams at a time."""
    want = {c: reference(model, prompt_for(c[0]), c[1], c[2]) for c in cases}
    jobs = [(c, m) for c in cases for m in METHODS]
    with ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(lambda j: run(stub, request(prompt_for(j[0][0]), j[0][1], j[0][2], j[1])), jobs))
    drafted = 0
    for (case, method), (ids, complete) in zip(jobs, outs):
        assert ids == want[case], (case, method, complete.stats.method)
        assert complete.seed == case[1]
        drafted += complete.stats.draft_tokens
    assert drafted > 0          # speculation really ran


def test_same_text_with_every_method_one_stream(cluster, stub, model):
    check_identity(stub, model, [(0, 11, "T1-p0.95"), (1, 2 ** 64 - 1, "T0.7-k40")], workers=1)


def test_same_text_with_every_method_concurrent_streams(cluster, stub, model):
    check_identity(stub, model, [(2, 5, "T1-p0.95"), (3, 6, "T1-p0.95"), (2, 7, "T0.7-k40"), (4, 8, "T0.7-k40")],
                   workers=8)


@pytest.mark.slow
def test_same_text_20_prompts_3_seeds(cluster, stub, model):
    cases = [(p, s, setting) for p in range(20) for s in (1, 2, 3) for setting in SETTINGS]
    check_identity(stub, model, cases, workers=8)


def test_an_unseeded_request_reports_its_seed_and_replays(cluster, stub):
    prompt = prompt_for(5)
    unseeded = build_request(prompt, max_new_tokens=N_NEW, ignore_eos=True, temperature=1.0, method="dflash")
    ids, complete = run(stub, unseeded)
    assert complete.HasField("seed")
    again, replay = run(stub, build_request(prompt, max_new_tokens=N_NEW, ignore_eos=True, temperature=1.0,
                                            seed=complete.seed, method="none"))
    assert again == ids and replay.seed == complete.seed
    # Two unseeded requests draw two seeds.
    assert run(stub, unseeded)[1].seed != complete.seed


def _post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_http_answers_report_the_seed(cluster):
    body = {"prompt": prompt_for(6), "max_tokens": 12, "temperature": 1.0, "n": 2}
    first = _post(cluster.http_port, "/v1/completions", body)
    assert isinstance(first["seed"], int) and 0 <= first["seed"] < 2 ** 64
    replay = _post(cluster.http_port, "/v1/completions", body | {"seed": first["seed"]})
    assert replay["seed"] == first["seed"]
    assert [c["text"] for c in replay["choices"]] == [c["text"] for c in first["choices"]]


def test_a_seed_outside_uint64_is_refused_naming_it(cluster):
    import urllib.error
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(cluster.http_port, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "seed": 2 ** 64})
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["param"] == "seed"


def test_an_unknown_sampler_is_refused_naming_it(stub):
    import grpc
    req = request(prompt_for(0), 1, "T1-p0.95", "none")
    req.sampling.sampler = 7
    with pytest.raises(grpc.RpcError) as err:
        run(stub, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.sampler" in err.value.details()


def test_same_text_when_the_serving_replica_is_killed(cluster, stub, model):
    """SIGKILL the replica serving a seeded sampled request mid-answer: it resumes on the other
    replica (a re-prefill of everything so far) with the same noise, so the text is unchanged."""
    prompt, seed, n = prompt_for(9), 4242, 120
    want = reference(model, prompt, seed, "T1-p0.95", n)
    call = stub.Generate(request(prompt, seed, "T1-p0.95", "dflash", n), timeout=300)
    first = list(next(call).chunk.token_ids)
    serving = [target_info(t.address).active_sessions for t in cluster.targets]
    assert sorted(serving) == [0, 1], serving
    victim = serving.index(1)
    cluster.targets[victim].proc.send_signal(signal.SIGKILL)
    cluster.targets[victim].proc.wait()
    ids, _, complete = collect(call)
    assert first + ids == want
    assert complete.stats.target_failovers == 1
