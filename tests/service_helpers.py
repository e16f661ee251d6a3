"""Run the real services as subprocesses on free loopback ports for integration tests.

    with running_target(model_dir, tmp_path) as target, running_gateway(target, tmp_path) as gw:
        ...

Each context manager waits for grpc.health.v1 SERVING, and on exit stops the process with
SIGTERM (it drains) and shows its log tail if it failed. `tiny_target_dir()` writes one tiny
random Qwen3 checkpoint with a byte-level tokenizer per test process."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import queue
import tempfile
from pathlib import Path

import grpc

from splitspec_tools.ops.launch import ServiceProcess, start_service
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 180.0
VOCAB = 512     # >= 320: the tiny tokenizer is byte-level BPE, so any text round-trips


@functools.lru_cache(maxsize=None)
def tiny_target_dir(max_position_embeddings: int = 256) -> Path:
    from tiny_models import save_tiny_model
    path = Path(tempfile.mkdtemp(prefix="splitspec-tiny-")) / "tiny-qwen3"
    return save_tiny_model(path, "qwen3", vocab_size=VOCAB, tokenizer=True,
                           max_position_embeddings=max_position_embeddings)


def repeating_prompts(n: int, seed: int, lengths: tuple[int, int], repeat: int) -> list[list[int]]:
    """n random prompts; every other one is a short run repeated `repeat` times, so that prompt
    lookup (n-gram) has something to find."""
    import random
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, 500) for _ in range(rng.randrange(*lengths))]
        out.append(base * repeat if i % 2 else base)
    return out


@contextlib.contextmanager
def running(name: str, args: list[str], log_dir: Path, **kw):
    svc = start_service(name, args, log_dir=Path(log_dir), **kw)
    try:
        svc.wait_healthy(STARTUP_TIMEOUT_S)
        yield svc
    finally:
        code = svc.stop()
        if code not in (0, -15):
            print(f"--- {name} exited with {code}; log tail:\n{svc.log_tail(60)}")


def running_target(model_dir: Path, log_dir: Path, *extra: str):
    return running("target", ["--model-path", str(model_dir), *extra], log_dir)


def running_draft(target_dir: Path, log_dir: Path, *extra: str, draft_dir: Path | None = None):
    """A draft service: DFlash with `draft_dir`, else model-free ngram."""
    if draft_dir is None:
        args = ["--method", "ngram", "--target-model-path", str(target_dir)]
    else:
        args = ["--method", "dflash", "--model-path", str(draft_dir), "--target-model-path", str(target_dir)]
    return running("draft", [*args, *extra], log_dir)


def running_gateway(target: ServiceProcess | str, log_dir: Path, *extra: str):
    address = target if isinstance(target, str) else target.address
    return running("gateway", ["--target", address, *extra], log_dir)


@contextlib.contextmanager
def running_stack(target_dir: Path, log_dir: Path, draft_dir: Path | None, *gateway_args: str,
                  service_args: tuple[str, ...] = ()):
    """Target + draft + a gateway wired to both: yields (target, draft, gateway).
    service_args go to the target and the draft alike (e.g. --torch-threads 1)."""
    with running_target(target_dir, log_dir, *service_args) as target, \
            running_draft(target_dir, log_dir, *service_args, draft_dir=draft_dir) as draft, \
            running_gateway(target, log_dir, "--draft", draft.address, *gateway_args) as gw:
        yield target, draft, gw


def bench_smoke(main, out: Path, command: str) -> tuple[dict, str]:
    """Run a bench's `main` with --smoke into `out` and return its results.json and results.md,
    checked for what every bench report records: the command line (in the Markdown too), the
    machine's cores and the smoke flag."""
    assert main(["--smoke", "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert r["meta"]["command"].startswith(f"{command} --smoke") and r["meta"]["command"] in md
    assert r["meta"]["machine"]["cores"] and r["run"]["smoke"]
    return r, md


def gateway_stub(address: str) -> tuple[grpc.Channel, gateway_pb2_grpc.GenerationStub]:
    ch = grpc.insecure_channel(address)
    return ch, gateway_pb2_grpc.GenerationStub(ch)


def target_stub(address: str) -> tuple[grpc.Channel, target_pb2_grpc.TargetStub]:
    ch = grpc.insecure_channel(address)
    return ch, target_pb2_grpc.TargetStub(ch)


class SessionStream:
    """A Session stream (the target's or the draft's) driven one message at a time: `send(**kind)`
    puts one `request` message, `recv()` takes the next answer."""

    def __init__(self, address: str, stub, request):
        self.ch = grpc.insecure_channel(address)
        self.request = request
        self.q: queue.Queue = queue.Queue()
        self.responses = stub(self.ch).Session(iter(self.q.get, None), timeout=60)

    def send(self, **kind):
        self.q.put(self.request(**kind))
        return self

    def recv(self):
        return next(self.responses)

    def refused(self, messages: list[dict]) -> grpc.RpcError:
        """Send `messages` (each the kind=message of one request), then read until the server
        ends the stream: its error (a stream that ends without one fails the test)."""
        for m in messages:
            self.send(**m)
        try:
            while True:
                self.recv()
        except grpc.RpcError as exc:
            return exc

    def close(self):
        self.q.put(None)
        self.responses.cancel()
        self.ch.close()


def finish_with_one_failover(calls, firsts, want) -> None:
    """Two streams started before a replica was broken: both finish with the reference tokens,
    and exactly one of them failed over to the other replica to do so."""
    failovers = 0
    for call, first in zip(calls, firsts):
        ids, _, complete = collect(call)
        assert first + ids == want
        failovers += complete.stats.target_failovers
    assert failovers == 1


def wait_not_serving(address: str, timeout_s: float = 30) -> None:
    """Health turns NOT_SERVING (2) within timeout_s."""
    import time

    from splitspec_tools.ops.launch import health_status
    deadline = time.monotonic() + timeout_s
    while health_status(address) != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert health_status(address) == 2


def target_info(address: str):
    with grpc.insecure_channel(address) as ch:
        return target_pb2_grpc.TargetStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)


def collect(responses) -> tuple[list[int], list[str], gateway_pb2.Complete]:
    """Token ids, text deltas (one per chunk) and the Complete of a Generate stream."""
    ids, texts, complete = [], [], None
    for r in responses:
        if r.HasField("chunk"):
            ids.extend(r.chunk.token_ids)
            texts.append(r.chunk.text)
        else:
            assert complete is None, "more than one Complete"
            complete = r.complete
    assert complete is not None, "stream ended without Complete"
    return ids, texts, complete


def sampled_runs(stub, prompt: list[int], n: int, samples: int, *, method: str, draft_sampling: str = "greedy",
                 workers: int = 8, **speculative) -> list[tuple[tuple[int, ...], object]]:
    """(token ids, stats) of `samples` seeded requests (seeds 0..samples-1) at T=1 / top-k 3
    for the distribution tests; `speculative` sets further SpeculativeParams fields."""
    from concurrent.futures import ThreadPoolExecutor

    from splitspec_tools.client import build_request

    def run(seed):
        req = build_request(prompt, max_new_tokens=n, ignore_eos=True, temperature=1.0, top_k=3, seed=seed,
                            method=method)
        req.speculative.draft_sampling = draft_sampling
        for name, value in speculative.items():
            setattr(req.speculative, name, value)
        ids, _, complete = collect(stub.Generate(req, timeout=120))
        return tuple(ids), complete.stats
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, range(samples)))


GARBAGE = b"\xff\xfe garbage \x00\x01"


def garbage_error(address: str, method: str, streaming: bool) -> grpc.RpcError:
    """Send bytes protobuf cannot parse to `method` (e.g. "/splitspec.v1.Target/Session") and
    return the error the service answered with."""
    with grpc.insecure_channel(address) as ch:
        kind = ch.stream_stream if streaming else ch.unary_unary
        call = kind(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            list(call(iter([GARBAGE]), timeout=10)) if streaming else call(GARBAGE, timeout=10)
        except grpc.RpcError as err:
            return err
    raise AssertionError(f"{method} accepted garbage bytes")


class FakeTargetServicer(target_pb2_grpc.TargetServicer):
    """A target without a model for in-process gateway tests: it records every TargetOpen in
    `opens`, describes itself with the tiny tokenizer and `template`, and speaks the Session
    protocol. A subclass's `open` says what a session answers: its TargetOpened and an async
    `token(i)` for each token decoded (i: its place in that Decode; it may abort the call)."""

    max_context = 256

    def __init__(self, tokenizer_json: bytes, template: str, opens: list):
        self.tokenizer_json, self.template, self.opens = tokenizer_json, template, opens

    async def GetInfo(self, request, context):
        return target_pb2.TargetInfo(model_id="fake", vocab_size=VOCAB, max_context=self.max_context,
                                     eos_token_ids=[0], tokenizer_json=self.tokenizer_json, max_num_batched_tokens=64,
                                     tokenizer_config_json=json.dumps({"chat_template": self.template}))

    async def open(self, request: target_pb2.TargetOpen, context):
        raise NotImplementedError

    async def Session(self, request_iterator, context):
        length, token = 0, None
        async for req in request_iterator:
            kind = req.WhichOneof("kind")
            if kind == "open":
                self.opens.append(req.open)
                opened, token = await self.open(req.open, context)
                length = opened.length
                yield target_pb2.TargetResponse(opened=opened)
            elif kind == "decode":
                for i in range(req.decode.n):
                    token_id = await token(i)
                    length += 1
                    yield target_pb2.TargetResponse(token=target_pb2.TargetToken(token_id=token_id, length=length))
            elif kind == "close":
                yield target_pb2.TargetResponse(closed=target_pb2.TargetClosed())
                return
            else:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"the fake target has no {kind}")


async def asgi_post(app, path: str, body) -> tuple[int, bytes]:
    """One HTTP request straight into the ASGI app (no server, no socket); `body` as JSON, or the
    raw bytes when it is bytes."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent, done = [], asyncio.Event()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await asyncio.wait_for(app(scope, receive, send), 20)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@contextlib.contextmanager
def inproc_gateway(target: str, draft: str, *, measurements=None, method: str = "auto", num_draft_tokens: int = 4,
                   on_backends=None, target_lookahead: bool = True):
    """A gateway in this process (its own event loop thread) over running target and draft
    services: yields its address. `measurements` replaces the gateway's measured prices (a test
    sets the prices auto decides on); `on_backends(backends)` may wrap the backends before it
    serves (count what it opens). target_lookahead=False: n-gram chains from the gateway's own index
    (the path for targets that cannot look ahead), not the target's Decode runs."""
    import threading
    import types

    from gateway.config import GatewayConfig, SpeculativeConfig
    from gateway.server import Backends, GenerationServicer, add_servicer
    from splitspec import logs

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        cfg = GatewayConfig(targets=(target,), draft=draft, target_wait_s=30, draft_timeout_ms=60000,
                            speculative=SpeculativeConfig(method=method, num_steps=num_draft_tokens - 1,
                                                          num_draft_tokens=num_draft_tokens,
                                                          target_lookahead=target_lookahead))
        backends = Backends(cfg)
        await backends.connect(logs.get_logger())
        if measurements is not None:
            backends.measurements = measurements
        if on_backends is not None:
            on_backends(backends)
        server = grpc.aio.server()
        add_servicer(GenerationServicer(backends, types.SimpleNamespace(serving=True)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, backends, f"127.0.0.1:{port}"

    server, backends, address = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield address
    finally:
        async def stop():
            await server.stop(None)
            await backends.close()
        asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def fixed_prices(*, decode_ms: float = 4.0, verify_ms: float = 4.0, width: int = 8, propose_ms: float = 1.0,
                 draft_open_ms: float = 1.0, accept: dict | None = None):
    """Gateway measurements whose prices stay put: a decode forward `decode_ms`, a verify of
    `width` tokens `verify_ms`, a Propose and an Open as given (a GPU's prices by default, where
    drafting pays); accept: acceptance key -> rate, fed as 50 observed 7-token chains."""
    from gateway.cost_model import Costs
    from gateway.policy import Measurements
    m = Measurements()
    token_ms = (verify_ms - decode_ms) / (width - 1)
    m.costs = lambda decode_run=64: Costs(  # noqa: E731 - the prices, fixed for the test
        fixed_ms=decode_ms - token_ms, row_ms=0.0, token_ms=token_ms, rows=1.0, verify_overhead_ms=0.0,
        decode_overhead_ms=0.0, draft_ms={"dflash": propose_ms, "ngram": 0.0})
    for key, rate in (accept or {}).items():
        for _ in range(50):
            m.acceptance(key).update(7, round(7 * rate))
    m.opened_draft(draft_open_ms)
    m.proposal("dflash", propose_ms)
    return m
