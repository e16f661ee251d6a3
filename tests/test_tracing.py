"""Traces across the split (issue 55): one HTTP request with a W3C traceparent becomes one trace
holding spans of the gateway, the target and the draft, parented as they called each other,
received by a real OTLP receiver (a TraceService served from opentelemetry-proto's own service
definition on a loopback port). Bad input: a malformed traceparent starts a new trace; an
unreachable collector drops (and counts) spans, never fails a request."""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402
from service_helpers import collect, gateway_stub, running, running_gateway, tiny_target_dir  # noqa: E402

from splitspec import tracing  # noqa: E402
from splitspec_tools.client import build_request  # noqa: E402
from splitspec_tools.ops.launch import free_port  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """What an OTel collector does with OTLP/gRPC traces, minus storage: keep every span with
    its resource's service.name."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            "attrs": {a.key: _value(a.value) for a in s.attributes}})
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if names <= {s["name"] for s in spans}:
                return spans
            time.sleep(0.2)
        got = sorted({(s["service"], s["name"]) for s in self.trace(trace_id)})
        raise AssertionError(f"trace {trace_id}: wanted spans {sorted(names)}, got {got}")


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, f"http://127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def stack(receiver, tmp_path_factory):
    _, endpoint = receiver
    logs = tmp_path_factory.mktemp("logs")
    model = tiny_target_dir()
    otel = ("--otlp-traces-endpoint", endpoint)
    http_port = free_port()
    with running("target", ["--model-path", str(model), *otel], logs) as target, \
            running("draft", ["--method", "ngram", "--target-model-path", str(model), *otel], logs) as draft, \
            running_gateway(target, logs, "--draft", draft.address, "--speculative-algorithm", "NGRAM",
                            "--http-port", str(http_port), *otel) as gw:
        yield gw, http_port


def _model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _post(port: int, body: dict, headers: dict) -> dict:
    body = {"model": _model(port), **body}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def _one(spans: list[dict], name: str) -> dict:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, [(s["service"], s["name"]) for s in spans])
    return found[0]


def test_one_http_request_is_one_trace_across_the_three_services(stack, receiver):
    rec, _ = receiver
    gw, port = stack
    # A repeated prompt, so that the n-gram draft proposes and steps verify drafts.
    out = _post(port, {"prompt": "abc abc abc abc abc abc", "max_tokens": 24, "temperature": 0},
                {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    spans = rec.wait_for(TRACE_ID, {"POST /v1/completions", "gateway.request", "gateway.step", "target.session",
                                    "draft.session", "target.queue_wait", "target.prefill_chunk",
                                    "target.forward"})
    services = {s["name"]: s["service"] for s in spans}
    assert services["gateway.request"] == "splitspec-gateway"
    assert services["target.session"] == services["target.forward"] == "splitspec-target"
    assert services["draft.session"] == "splitspec-draft"

    http = _one(spans, "POST /v1/completions")
    assert http["parent"] == PARENT_ID                # the caller's span parents the whole trace
    assert http["attrs"]["http.response.status_code"] == 200
    request = _one(spans, "gateway.request")
    assert request["parent"] == http["span_id"]
    attrs = request["attrs"]
    assert attrs["splitspec.completion_tokens"] == out["usage"]["completion_tokens"]
    assert attrs["splitspec.finish_reason"] in ("length", "eos", "stop")
    assert attrs["splitspec.method"] == "ngram" and attrs["splitspec.prompt_tokens"] > 0
    assert attrs["splitspec.tau"] >= 1.0 and "splitspec.cached_tokens" in attrs
    assert attrs["splitspec.model"]

    target = _one(spans, "target.session")
    draft = _one(spans, "draft.session")
    assert target["parent"] == request["span_id"] and draft["parent"] == request["span_id"]
    steps = [s for s in spans if s["name"] == "gateway.step"]
    assert all(s["parent"] == request["span_id"] for s in steps)
    assert len(steps) == attrs["splitspec.verify_steps"]
    for s in steps:
        a = s["attrs"]
        assert a["splitspec.drafter"] in ("ngram", "none")
        assert a["splitspec.width"] == a["splitspec.drafted"] + 1 and 0 <= a["splitspec.accepted"] <= a["splitspec.drafted"]
        assert min(a["splitspec.propose_ms"], a["splitspec.verify_ms"], a["splitspec.wire_ms"]) >= 0
    assert any(s["attrs"]["splitspec.drafted"] > 0 for s in steps)     # the draft proposed, the target verified

    for name in ("target.queue_wait", "target.prefill_chunk"):
        assert all(s["parent"] == target["span_id"] for s in spans if s["name"] == name)
    forwards = [s for s in spans if s["name"] == "target.forward"]
    for f in forwards:
        assert f["parent"] == target["span_id"]
        assert (TRACE_ID, target["span_id"]) in f["links"]       # linked to the session it served
        assert f["attrs"]["splitspec.rows"] >= 1

    # The gateway's log lines of this request carry its trace id.
    lines = [json.loads(x) for x in gw.log_path.read_text().splitlines() if x.startswith("{")]
    started = [x for x in lines if x.get("event") == "request_started" and x.get("trace_id") == TRACE_ID]
    assert started and started[0]["span_id"] == request["span_id"]


def test_grpc_metadata_traceparent_parents_the_request(stack, receiver):
    rec, _ = receiver
    gw, _ = stack
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    channel, stub = gateway_stub(gw.address)
    with channel:
        req = build_request(list(range(10, 30)), max_new_tokens=8, request_id="grpc-traced")
        collect(stub.Generate(req, timeout=120, metadata=(("traceparent", f"00-{trace_id}-b7ad6b7169203331-01"),)))
    spans = rec.wait_for(trace_id, {"gateway.request", "target.session"})
    request = _one(spans, "gateway.request")
    assert request["parent"] == "b7ad6b7169203331"
    assert _one(spans, "target.session")["parent"] == request["span_id"]


@pytest.mark.parametrize("header", ["garbage", "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                                    "00-4bf92f3577b34da6a3ce929d0e0e4736-zzzz-01", "ff-" + "a" * 60])
def test_a_malformed_traceparent_starts_a_new_trace(stack, receiver, header):
    rec, _ = receiver
    _, port = stack
    rid = f"bad-{abs(hash(header))}"
    _post(port, {"prompt": "hello", "max_tokens": 4, "temperature": 0},
          {"traceparent": header, "x-request-id": rid})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with rec.lock:
            mine = [s for s in rec.spans if s["name"] == "gateway.request"
                    and s["attrs"].get("splitspec.request_id") == rid]
        if mine:
            break
        time.sleep(0.2)
    assert mine, "the request was not traced"
    trace = rec.trace(mine[0]["trace_id"])
    http = _one(trace, "POST /v1/completions")
    assert http["parent"] == ""                     # a root: the header was ignored
    assert mine[0]["trace_id"] not in ("0" * 32, TRACE_ID)


class _Unreachable:
    """An exporter whose collector never answers."""

    def __init__(self):
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        raise ConnectionError("collector unreachable")

    def shutdown(self):
        pass


def test_an_unreachable_collector_drops_and_counts_spans():
    proc = tracing.BoundedExport(_Unreachable(), max_queue=8, batch=4, interval_s=0.01)
    try:
        for i in range(100):            # on_end only appends (or drops): it never waits on the export
            proc.on_end(object())
        assert proc.force_flush(5000)
        assert proc.dropped == 100 and proc.exported == 0
    finally:
        proc.stop(1.0)


def test_the_span_counts_are_prometheus_counters(monkeypatch):
    """What an operator alerts on: every service's exporter carries the span exporter's counts
    (splitspec.metrics.start_exporter registers them), zero while tracing is off."""
    from prometheus_client import generate_latest

    from splitspec.metrics import TracingCollector, new_registry
    registry = new_registry()
    registry.register(TracingCollector())
    text = generate_latest(registry).decode()
    assert "splitspec:trace_spans_dropped_total 0.0" in text and "splitspec:trace_spans_exported_total 0.0" in text
    proc = tracing.BoundedExport(_Unreachable(), max_queue=8, batch=4, interval_s=0.01)
    monkeypatch.setattr(tracing, "_processor", proc)
    try:
        for _ in range(20):
            proc.on_end(object())
        assert proc.force_flush(5000)
        text = generate_latest(registry).decode()
        assert "splitspec:trace_spans_dropped_total 20.0" in text, text
        assert "splitspec:trace_spans_exported_total 0.0" in text
    finally:
        proc.stop(1.0)


def test_an_unreachable_endpoint_never_fails_a_request(tmp_path):
    """The real exporter against a port nobody listens on: spans are made and dropped, the
    in-process hooks go on working."""
    import argparse
    args = argparse.Namespace(otlp_traces_endpoint=f"http://127.0.0.1:{free_port()}", otlp_traces_sample_ratio=1.0)
    assert tracing.configure("test", args)
    try:
        from gateway.generation import Stats
        trace = tracing.start_request((("traceparent", "not-a-traceparent"),), "r1")
        assert trace.recording
        assert dict(tracing.outgoing())["traceparent"].startswith("00-")
        stats = Stats(trace=trace)
        stats.verify_steps, stats.committed = 1, 3
        tracing.step(stats, "ngram", 4, 2, 3)
        trace.end(stats, model="m", prompt_tokens=5)
        assert tracing.outgoing() is None or "traceparent" not in dict(tracing.outgoing() or ())
    finally:
        tracing.shutdown(timeout_s=0.5)
    assert not tracing.enabled() and tracing.outgoing() is None


def test_off_is_a_no_op():
    assert not tracing.enabled()
    assert tracing.outgoing() is None
    assert tracing.start_request((("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),), "r") is None
    app = object()
    assert tracing.asgi(app) is app
    event = {"event": "x"}
    assert tracing.log_ids(None, None, event) == {"event": "x"}
    tracing.bind_session("s")
    tracing.forward([("s", "prefill", 4)], 0.0, 1.0)       # nothing bound, nothing made


@pytest.mark.parametrize("trust,followed", [
    ({}, False),
    ({"otlp_traces_trust_remote_sampling": True}, True),
    ({"api_key": ["a-key"]}, True),                 # the gateway checks every caller's key
    ({"tls_ca": "ca.pem"}, True),                   # the target and draft require client certificates
])
def test_a_callers_sampled_flag_is_followed_only_from_trusted_callers(trust, followed):
    """At ratio 0 nothing new is traced: a `-01` traceparent from an anonymous caller joins its
    trace id but is not recorded (it cannot force tracing on); from a trusted one it is."""
    import argparse

    from gateway.generation import Stats
    args = argparse.Namespace(otlp_traces_endpoint=f"http://127.0.0.1:{free_port()}", otlp_traces_sample_ratio=0.0,
                              **trust)
    assert tracing.configure("test", args)
    try:
        trace = tracing.start_request((("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),), "r1")
        assert trace.recording is followed
        assert format(trace.span.get_span_context().trace_id, "032x") == TRACE_ID
        trace.end(Stats(trace=trace), model="m", prompt_tokens=1)
        fresh = tracing.start_request((), "r2")
        assert not fresh.recording
        fresh.end(Stats(trace=fresh), model="m", prompt_tokens=1)
    finally:
        tracing.shutdown(timeout_s=0.5)


def test_the_span_counts_add_up_across_threads():
    """Spans end on many threads at once (event loop, engine thread, gRPC's) while the export
    thread counts too: no count is lost."""
    proc = tracing.BoundedExport(_Unreachable(), max_queue=64, batch=16, interval_s=0.001)
    per_thread, threads = 20000, 8
    try:
        workers = [threading.Thread(target=lambda: [proc.on_end(object()) for _ in range(per_thread)])
                   for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert proc.force_flush(10000)
        assert proc.dropped + proc.exported == per_thread * threads and proc.exported == 0
    finally:
        proc.stop(1.0)
