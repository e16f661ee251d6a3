"""Reliability through the real services (issue 9): a draft killed mid-generation, a target
replica killed mid-generation, cancelled and timed-out clients, and a short load run.

One set of services per module: two target replicas (A, B), one DFlash draft, one gateway
pinned to both targets. The tests that kill processes come last and restart what they kill."""
from __future__ import annotations

import contextlib
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from service_helpers import (STARTUP_TIMEOUT_S, collect, gateway_stub, running, running_gateway, target_info)
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import start_service
from splitspec_tools.ops.loadtest import open_sessions, run_load
from target_service.engine import generate

MAX_CONTEXT = TARGET_CONTEXT = 1024
N_LONG = 240            # long enough to kill a service while the request is still running


class Cluster:
    """Services that tests may kill and restart (same port)."""

    def __init__(self, target_dir, draft_dir, log_dir, stack: contextlib.ExitStack):
        self.target_dir, self.draft_dir, self.log_dir, self.stack = target_dir, draft_dir, log_dir, stack
        self.targets = [self._start("target", self._target_args()) for _ in range(2)]
        self.draft = self._start("draft", self._draft_args())
        self.gateway = stack.enter_context(running_gateway(
            ",".join(t.address for t in self.targets), log_dir, "--draft", self.draft.address,
            "--speculative-algorithm", "DFLASH", "--reconnect-max-s", "0.5", "--draft-timeout-ms", "20000"))

    def _target_args(self):
        return ["--model-path", str(self.target_dir), "--idle-timeout-s", "30"]

    def _draft_args(self):
        return ["--method", "dflash", "--model-path", str(self.draft_dir), "--target-model-path",
                str(self.target_dir), "--idle-timeout-s", "30"]

    def _start(self, name, args, port=None):
        return self.stack.enter_context(running(name, args, self.log_dir, port=port))

    def restart_draft(self):
        self.draft = self._start("draft", self._draft_args(), port=self.draft.port)

    def restart_target(self, i):
        self.targets[i] = self._start("target", self._target_args(), port=self.targets[i].port)

    def open_sessions(self):
        return [open_sessions("target", t.address) for t in self.targets] + [open_sessions("draft", self.draft.address)]

    def wait_no_sessions(self, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while (counts := self.open_sessions()) != [0, 0, 0] and time.monotonic() < deadline:
            time.sleep(0.05)
        return counts


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
    rng = random.Random(100 + i)
    base = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 10))]
    return base * 2


def long_request(prompt, method="dflash", n=N_LONG):
    return build_request(prompt, max_new_tokens=n, ignore_eos=True, method=method)


def test_cancelled_and_timed_out_requests_leave_no_sessions(cluster, stub):
    """200 requests cancelled after their first chunk (8 at a time), then clients whose deadline
    passes mid-generation: zero sessions stay open on both targets and on the draft."""
    def cancel_one(i):
        call = stub.Generate(long_request(prompt_for(i), method=("dflash", "none")[i % 2]), timeout=120)
        next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        return err.value.code()
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(cancel_one, range(200)))
    assert codes == [grpc.StatusCode.CANCELLED] * 200
    assert cluster.wait_no_sessions() == [0, 0, 0]

    def time_out(i):
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(long_request(prompt_for(i), n=1000), timeout=0.4))
        return err.value.code()
    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(time_out, range(8))) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert cluster.wait_no_sessions() == [0, 0, 0]


def test_short_load_run(cluster):
    """16 streams with random sampling, lengths and cancels: no failure, no session left open,
    resident memory reported for every service."""
    services = {"target0": ("target", cluster.targets[0].address), "target1": ("target", cluster.targets[1].address),
                "draft": ("draft", cluster.draft.address)}
    report = run_load(cluster.gateway.address, streams=16, duration_s=20, max_new_tokens=48, cancel_prob=0.2,
                      methods=("dflash", "ngram", "none"), seed=1, services=services)
    print(report.summary())
    assert report.failed == 0, report.failures
    assert report.completed > 16 and report.cancelled > 0
    assert report.open_sessions_after == {"target0": 0, "target1": 0, "draft": 0}
    assert all(m["start"] and m["end"] for m in report.memory_mb.values()), report.memory_mb


def test_draft_timeout_falls_back_without_losing_tokens(cluster, model):
    """A gateway whose per-step draft deadline is far too short: every step times out, the
    request goes on target-only on the same target session, identical to target-only."""
    prompt = prompt_for(1)
    ref = generate(model, prompt, 40)
    with running_gateway(cluster.targets[0], cluster.log_dir, "--draft", cluster.draft.address,
                         "--speculative-algorithm", "DFLASH", "--draft-timeout-ms", "0.001") as gw:
        ch, stub = gateway_stub(gw.address)
        with ch:
            ids, _, complete = collect(stub.Generate(long_request(prompt, n=40), timeout=120))
    assert ids == ref
    assert complete.stats.draft_fallbacks >= 1
    assert "draft_fallback" in gw.log_path.read_text()


def test_gateway_starts_without_its_draft_and_speculates_once_it_comes(cluster, model, draft_dir):
    """The draft is down when the gateway starts: after --draft-wait-s the gateway serves
    target-only (same tokens), and once a draft answers on that address requests speculate."""
    from splitspec_tools.ops.launch import free_port
    port = free_port()
    prompt = prompt_for(2)
    ref = generate(model, prompt, 30)
    with running_gateway(cluster.targets[0], cluster.log_dir, "--draft", f"127.0.0.1:{port}",
                         "--speculative-algorithm", "DFLASH", "--draft-wait-s", "0.5",
                         "--reconnect-max-s", "0.5") as gw:
        ch, stub = gateway_stub(gw.address)
        with ch:
            ids, _, complete = collect(stub.Generate(long_request(prompt, n=30), timeout=120))
            assert ids == ref and complete.stats.method == "none"
            assert "draft_unavailable_at_start" in gw.log_path.read_text()
            with running("draft", cluster._draft_args(), cluster.log_dir, port=port):
                deadline = time.monotonic() + 30
                while True:
                    ids, _, complete = collect(stub.Generate(long_request(prompt, n=30), timeout=120))
                    assert ids == ref
                    if complete.stats.method == "dflash":
                        break
                    assert time.monotonic() < deadline, "speculation did not start after the draft came up"
                    time.sleep(0.2)
            assert complete.stats.draft_tokens > 0


def test_draft_killed_mid_generation(cluster, stub, model):
    """SIGKILL the draft while 4 requests are streaming: all complete, identical to target-only
    greedy; new requests succeed target-only; a restarted draft brings speculation back."""
    prompts = [prompt_for(i) for i in range(4)]
    refs = [generate(model, p, N_LONG) for p in prompts]
    calls = [stub.Generate(long_request(p), timeout=300) for p in prompts]
    firsts = [next(c) for c in calls]                  # every request is running
    cluster.draft.proc.send_signal(signal.SIGKILL)
    cluster.draft.proc.wait()
    results = []
    for first, call in zip(firsts, calls):
        ids, _, complete = collect(call)
        results.append((list(first.chunk.token_ids) + ids, complete))
    for (ids, complete), ref in zip(results, refs):
        assert ids == ref
        assert complete.finish_reason == "length" and complete.usage.completion_tokens == N_LONG
    assert sum(c.stats.draft_fallbacks for _, c in results) >= 1
    assert any(c.stats.method == "dflash" and c.stats.draft_fallbacks for _, c in results)

    ids, _, complete = collect(stub.Generate(long_request(prompts[0], n=30), timeout=120))
    assert ids == refs[0][:30]
    assert complete.stats.method == "none" and complete.stats.draft_fallbacks == 1

    cluster.restart_draft()
    deadline = time.monotonic() + 30
    while True:
        ids, _, complete = collect(stub.Generate(long_request(prompts[0], n=30), timeout=120))
        assert ids == refs[0][:30]
        if complete.stats.method == "dflash" and not complete.stats.draft_fallbacks:
            break
        assert time.monotonic() < deadline, "speculation did not come back after the draft restarted"
        time.sleep(0.2)
    assert complete.stats.draft_tokens > 0             # drafts were verified: speculation really ran
    assert "backend_healthy" in cluster.gateway.log_path.read_text()


def test_target_replica_killed_mid_generation(cluster, stub, model):
    """SIGKILL the replica serving a request: it completes on the other replica, identical to
    an uninterrupted greedy run; with no replica left the stream ends UNAVAILABLE after the
    tokens already streamed."""
    prompt = prompt_for(7)
    ref = generate(model, prompt, N_LONG)
    call = stub.Generate(long_request(prompt), timeout=300)
    first = next(call)
    serving = [target_info(t.address).active_sessions for t in cluster.targets]
    assert sorted(serving) == [0, 1], serving
    victim = serving.index(1)
    cluster.targets[victim].proc.send_signal(signal.SIGKILL)
    cluster.targets[victim].proc.wait()
    ids, _, complete = collect(call)
    assert list(first.chunk.token_ids) + ids == ref
    assert complete.stats.target_failovers == 1
    assert complete.stats.method == "dflash"
    assert "target_failover" in cluster.gateway.log_path.read_text()

    # New requests go to the survivor.
    for _ in range(2):
        ids, _, complete = collect(stub.Generate(long_request(prompt, n=20), timeout=120))
        assert ids == ref[:20] and complete.stats.target_failovers == 0

    # Kill the survivor mid-request too: nothing can serve, UNAVAILABLE with a clear message.
    survivor = cluster.targets[1 - victim]
    call = stub.Generate(long_request(prompt), timeout=300)
    got = list(next(call).chunk.token_ids)
    survivor.proc.send_signal(signal.SIGKILL)
    survivor.proc.wait()
    with pytest.raises(grpc.RpcError) as err:
        for resp in call:
            got.extend(resp.chunk.token_ids)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no target replica could continue" in err.value.details()
    assert got == ref[:len(got)] and got                 # what was streamed stays valid

    # A restarted replica serves again.
    cluster.restart_target(victim)
    deadline = time.monotonic() + 30
    while True:
        try:
            ids, _, _ = collect(stub.Generate(long_request(prompt, n=20), timeout=120))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
            time.sleep(0.5)
    assert ids == ref[:20]
