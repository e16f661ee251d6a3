"""OpenTelemetry traces across the split: one trace per request, holding the gateway's request
span (and the HTTP request above it), one span per speculative step, the target's and the
draft's session spans, the target's queue wait, prefill chunks and batched forwards.

Off unless `--otlp-traces-endpoint` is set (`pip install splitspec[otel]`). Off, every hook
here returns after one test of a module global: nothing is imported, allocated or sent.

The services call this module only at their edges:
- `add_flags` / `configure` / `shutdown`: the command line and the process's lifetime;
- gateway: `asgi` wraps the HTTP app (a `traceparent` header becomes the parent),
  `start_request` / `RequestTrace` around `Generate`, `step` from `record_step`, and
  `outgoing` for the metadata of each backend stream (the W3C `traceparent` of the request);
- target and draft: `serve_stream` decorates the `Session` handler (a `traceparent` in the
  stream's metadata becomes the parent), `bind_session` ties a session id to that span, and
  the target's scheduler calls `forward` after each batched forward.

Export never slows a request: finished spans go into a bounded queue that one daemon thread
sends in batches; a full queue or a failed export drops spans and counts them (`dropped`, and
the `splitspec:trace_spans_dropped_total` counter every service exports).
A malformed `traceparent` is ignored by the W3C propagator: the request starts a new trace."""
from __future__ import annotations

import collections
import contextvars
import functools
import threading
import time

ENDPOINT_HELP = ("send OpenTelemetry traces over OTLP/gRPC to this collector, e.g. http://jaeger:4317 "
                 "(needs splitspec[otel]; unset: tracing off, at no cost)")

# Set by configure(); None means tracing is off and every hook returns at once.
_tracer = None
_processor: "BoundedExport | None" = None
_api = None             # the opentelemetry modules, imported only when tracing is on (see _import)

# Target: session id -> SessionTrace of the Session stream that opened it, for `forward`.
_sessions: dict[str, "SessionTrace"] = {}
# The session ids a Session handler bound, so that it unbinds them when the stream ends.
_bound: contextvars.ContextVar[list | None] = contextvars.ContextVar("splitspec_trace_bound", default=None)


def add_flags(parser) -> None:
    parser.add_argument("--otlp-traces-endpoint", default=None, help=ENDPOINT_HELP)
    parser.add_argument("--otlp-traces-sample-ratio", type=float, default=1.0,
                        help="share of new traces recorded (0..1); a request arriving with a traceparent joins "
                             "its trace, and follows its sampled flag where the caller is trusted (see "
                             "--otlp-traces-trust-remote-sampling)")
    parser.add_argument("--otlp-traces-trust-remote-sampling", action="store_true",
                        help="follow the sampled flag of every caller's traceparent; without it the flag is "
                             "followed only where callers authenticate (gateway: --api-key; target and draft: "
                             "--tls-ca, mTLS), and other callers' traces are sampled at the ratio, so an "
                             "anonymous client cannot force every request to be traced")


def enabled() -> bool:
    return _tracer is not None


class _Api:
    """The opentelemetry names this module uses, imported once when tracing is turned on."""

    def __init__(self):
        from opentelemetry import context, trace
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        self.context, self.trace = context, trace
        self.Link, self.SpanKind, self.Status, self.StatusCode = Link, SpanKind, Status, StatusCode
        self.propagator = TraceContextTextMapPropagator()


def configure(service: str, args, log=None) -> bool:
    """Turn tracing on for this process when --otlp-traces-endpoint is set; True if on."""
    global _tracer, _processor, _api
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    if not endpoint:
        return False
    ratio = args.otlp_traces_sample_ratio
    if not 0.0 <= ratio <= 1.0:
        raise SystemExit(f"--otlp-traces-sample-ratio {ratio}: expected a share between 0 and 1")
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise SystemExit(f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'splitspec[otel]' ({exc})") from None
    _api = _Api()
    trusted = trusts_remote_sampling(args)
    ratio_sampler = TraceIdRatioBased(ratio)
    # Untrusted: a remote parent's trace id is kept, its sampled flag is not; the ratio decides on
    # the trace id, so services sampling at one ratio still keep or drop a trace together.
    sampler = (ParentBased(ratio_sampler) if trusted else
               ParentBased(ratio_sampler, remote_parent_sampled=ratio_sampler, remote_parent_not_sampled=ratio_sampler))
    provider = TracerProvider(resource=Resource.create({"service.name": f"splitspec-{service}"}), sampler=sampler)
    # Plain text unless the endpoint says https: a collector beside the services (compose, a pod's
    # sidecar) listens without TLS.
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=5)
    _processor = BoundedExport(exporter, log)
    provider.add_span_processor(_processor)
    _tracer = provider.get_tracer("splitspec")
    if log is not None:
        log.info("tracing_on", endpoint=endpoint, sample_ratio=ratio,
                 remote_sampled_flag="followed" if trusted else "ignored: sampled at the ratio")
    return True


def trusts_remote_sampling(args) -> bool:
    """Whether a caller's traceparent decides if its request is traced: when asked for, or when
    every caller has authenticated (the gateway checks API keys on every RPC and HTTP route it
    serves work on; the target and draft require CA-signed client certificates with --tls-ca)."""
    return bool(getattr(args, "otlp_traces_trust_remote_sampling", False) or getattr(args, "api_key", None)
                or getattr(args, "api_key_file", None) or getattr(args, "tls_ca", None))


def shutdown(timeout_s: float = 2.0) -> None:
    """Send what is queued (waiting at most `timeout_s`) and stop exporting."""
    global _tracer, _processor
    if _processor is not None:
        _processor.stop(timeout_s)
    _tracer = _processor = None


def dropped() -> int:
    """Spans dropped so far (queue full or export failed)."""
    return _processor.dropped if _processor is not None else 0


def exported() -> int:
    """Spans the collector took so far."""
    return _processor.exported if _processor is not None else 0


class BoundedExport:
    """A span processor that never blocks the caller: `on_end` appends to a bounded queue (or
    drops and counts when it is full), one daemon thread exports batches every `interval_s` or
    as soon as a batch is full. An unreachable collector costs that thread its export timeout
    and the spans that did not fit, never a request's time."""

    def __init__(self, exporter, log=None, *, max_queue: int = 4096, batch: int = 512, interval_s: float = 0.5):
        self.exporter, self.log = exporter, log
        self.max_queue, self.batch, self.interval_s = max_queue, batch, interval_s
        self.queue: collections.deque = collections.deque()
        # Spans end on any thread (the event loop, the engine thread, gRPC's) while the export
        # thread counts too: the counts change under this lock only.
        self._count_lock = threading.Lock()
        self.dropped = 0
        self.exported = 0
        self._reported = 0          # drops already logged
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="splitspec-trace-export", daemon=True)
        self._thread.start()

    # The SDK's SpanProcessor interface, duck-typed so that this module imports without the SDK.
    def on_start(self, span, parent_context=None) -> None:
        pass

    def _on_ending(self, span) -> None:
        pass

    def _count(self, dropped: int = 0, exported: int = 0) -> None:
        with self._count_lock:
            self.dropped += dropped
            self.exported += exported

    def on_end(self, span) -> None:
        if len(self.queue) >= self.max_queue:
            self._count(dropped=1)
            return
        self.queue.append(span)
        if len(self.queue) >= self.batch:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._send()

    def _send(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult
        self._idle.clear()
        while self.queue:
            batch = [self.queue.popleft() for _ in range(min(self.batch, len(self.queue)))]
            try:
                ok = self.exporter.export(batch) == SpanExportResult.SUCCESS
            except Exception:  # noqa: BLE001 - an exporter bug must not stop tracing's thread
                ok = False
            if ok:
                self._count(exported=len(batch))
            else:
                self._count(dropped=len(batch))
        self._idle.set()
        if self.dropped > self._reported and self.log is not None:
            self.log.warning("trace_spans_dropped", dropped=self.dropped, exported=self.exported)
            self._reported = self.dropped

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._idle.clear()
        self._wake.set()
        return self._idle.wait(timeout_millis / 1e3)

    def stop(self, timeout_s: float) -> None:
        self.force_flush(int(timeout_s * 1e3))
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    def shutdown(self) -> None:
        self.stop(2.0)


# --- propagation -------------------------------------------------------------------------------

def _carrier(pairs) -> dict:
    """W3C trace headers from gRPC metadata or HTTP headers (first value of each)."""
    out = {}
    for key, value in pairs or ():
        if isinstance(key, bytes):
            key, value = key.decode("latin-1"), value.decode("latin-1")
        key = key.lower()
        if key in ("traceparent", "tracestate") and isinstance(value, str) and key not in out:
            out[key] = value
    return out


def _parent(pairs):
    """The context a server span starts in: the caller's traceparent, else the current context
    (the HTTP request's, for a Generate called in process). A malformed header is ignored."""
    return _api.propagator.extract(_carrier(pairs), context=_api.context.get_current())


def outgoing() -> tuple | None:
    """gRPC metadata carrying the current span's traceparent to a backend; None when off."""
    if _tracer is None:
        return None
    carrier: dict = {}
    _api.propagator.inject(carrier)
    return tuple(carrier.items()) or None


def asgi(app):
    """The HTTP app, with a span per request whose `traceparent` header (if any) is its parent;
    the app itself when tracing is off."""
    if _tracer is None:
        return app

    async def traced(scope, receive, send):
        if scope.get("type") != "http":
            return await app(scope, receive, send)
        span = _tracer.start_span(f"{scope.get('method', 'HTTP')} {scope.get('path', '')}",
                                  context=_parent(scope.get("headers")), kind=_api.SpanKind.SERVER,
                                  attributes={"http.request.method": scope.get("method", ""),
                                              "url.path": scope.get("path", "")})
        token = _api.context.attach(_api.trace.set_span_in_context(span))

        async def send_status(message):
            if message.get("type") == "http.response.start":
                span.set_attribute("http.response.status_code", message.get("status", 0))
                if message.get("status", 0) >= 500:
                    span.set_status(_api.Status(_api.StatusCode.ERROR))
            await send(message)
        try:
            await app(scope, receive, send_status)
        finally:
            span.end()
            _api.context.detach(token)
    return traced


def log_ids(_, __, event: dict) -> dict:
    """structlog processor: the current span's trace_id and span_id on every log line."""
    if _tracer is None:
        return event
    ctx = _api.trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


# --- gateway -----------------------------------------------------------------------------------

def _now_ns() -> int:
    return time.time_ns()


class RequestTrace:
    """The span of one Generate, current while it runs (so `outgoing` carries it to the
    backends), and the per-step spans under it, built from the request's `Stats` as they grow."""

    def __init__(self, span, token):
        self.span, self._token = span, token
        self.recording = span.is_recording()
        self._ctx = _api.trace.set_span_in_context(span)
        self._mark = _now_ns()                  # where the next step span starts
        self._totals = (0.0, 0.0, 0.0, 0.0)     # the Stats time totals at the last step
        self._failovers = self._fallbacks = 0

    def _child(self, name: str, start: int, end: int, attributes: dict) -> None:
        _tracer.start_span(name, context=self._ctx, start_time=start, attributes=attributes).end(end_time=end)

    def step(self, stats, method: str, drafted: int, accepted: int, committed: int) -> None:
        """One target step just recorded: its span runs from the previous step's end to now."""
        if not self.recording:
            return
        now = _now_ns()
        self._events(stats, now)
        totals = (stats.draft_ms, stats.verify_ms, stats.model_ms, stats.queue_ms)
        draft, verify, model, queue = (a - b for a, b in zip(totals, self._totals))
        self._totals = totals
        self._child("gateway.step", self._mark, now, {
            "splitspec.drafter": method, "splitspec.width": drafted + 1, "splitspec.drafted": drafted,
            "splitspec.accepted": accepted, "splitspec.committed": committed,
            "splitspec.propose_ms": round(draft, 3), "splitspec.verify_ms": round(verify, 3),
            "splitspec.queue_ms": round(queue, 3),
            # as Stats.wire_ms: round trips neither inside a model nor queued
            "splitspec.wire_ms": round(max(0.0, draft + verify - model - queue), 3)})
        self._mark = now

    def _events(self, stats, now: int) -> None:
        """Failovers and draft fallbacks since the last step, as spans from its end to now (the
        time the request spent getting over them)."""
        for name, seen, count in (("gateway.target_failover", self._failovers, stats.target_failovers),
                                  ("gateway.draft_fallback", self._fallbacks, stats.draft_fallbacks)):
            for i in range(seen, count):
                self._child(name, self._mark, now, {"splitspec.count": i + 1})
        self._failovers, self._fallbacks = stats.target_failovers, stats.draft_fallbacks

    def end(self, stats, *, model: str, prompt_tokens: int, complete=None, failure: str | None = None) -> None:
        try:
            if self.recording:
                self._events(stats, _now_ns())
                s = self.span
                s.set_attribute("splitspec.model", model)
                s.set_attribute("splitspec.method", stats.method)
                s.set_attribute("splitspec.prompt_tokens", prompt_tokens)
                s.set_attribute("splitspec.cached_tokens", stats.cached_tokens)
                s.set_attribute("splitspec.verify_steps", stats.verify_steps)
                s.set_attribute("splitspec.draft_fallbacks", stats.draft_fallbacks)
                s.set_attribute("splitspec.target_failovers", stats.target_failovers)
                if stats.verify_steps:
                    s.set_attribute("splitspec.tau", round(stats.committed / stats.verify_steps, 4))
                if complete is not None:
                    s.set_attribute("splitspec.completion_tokens", complete.usage.completion_tokens)
                    s.set_attribute("splitspec.finish_reason", complete.finish_reason)
                else:
                    s.set_status(_api.Status(_api.StatusCode.ERROR, failure or "UNKNOWN"))
                    s.set_attribute("splitspec.error_code", failure or "UNKNOWN")
            self.span.end()
        finally:
            _api.context.detach(self._token)


def start_request(metadata, request_id: str) -> RequestTrace | None:
    """The request's trace (None when off), current in this task until `RequestTrace.end`."""
    if _tracer is None:
        return None
    parent = _parent(metadata)
    span = _tracer.start_span("gateway.request", context=parent, kind=_api.SpanKind.SERVER,
                              attributes={"splitspec.request_id": request_id})
    return RequestTrace(span, _api.context.attach(_api.trace.set_span_in_context(span, parent)))


def step(stats, method: str, drafted: int, accepted: int, committed: int) -> None:
    """gateway/speculative.record_step's hook: a span for the step when the request is traced."""
    trace = getattr(stats, "trace", None)
    if trace is not None:
        trace.step(stats, method, drafted, accepted, committed)


# --- target and draft --------------------------------------------------------------------------

class SessionTrace:
    """A target session's span, and when it was bound (its admission queue starts there)."""

    __slots__ = ("span", "bound_ns", "forwards")

    def __init__(self, span):
        self.span, self.bound_ns, self.forwards = span, _now_ns(), 0


def serve_stream(name: str):
    """Decorate a servicer's bidi `Session(self, request_iterator, context)`: the stream runs
    inside a span named `name`, child of the traceparent in its metadata."""
    def wrap(handler):
        @functools.wraps(handler)
        async def call(self, request_iterator, context):
            if _tracer is None:
                return await handler(self, request_iterator, context)
            span = _tracer.start_span(name, context=_parent(context.invocation_metadata()),
                                      kind=_api.SpanKind.SERVER)
            token = _api.context.attach(_api.trace.set_span_in_context(span))
            bound = _bound.set([])
            try:
                return await handler(self, request_iterator, context)
            except BaseException as exc:
                span.set_status(_api.Status(_api.StatusCode.ERROR, type(exc).__name__))
                raise
            finally:
                for session_id in _bound.get() or ():
                    entry = _sessions.get(session_id)
                    if entry is not None and entry.span is span:
                        del _sessions[session_id]
                _bound.reset(bound)
                span.end()
                _api.context.detach(token)
        return call
    return wrap


def bind_session(session_id: str) -> None:
    """Tie `session_id` to the current Session span, so that `forward` finds it; call before
    the session's Open reaches the scheduler (its queue wait and prefill come next)."""
    if _tracer is None or not session_id:
        return
    span = _api.trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("splitspec.session_id", session_id)
    _sessions[session_id] = SessionTrace(span)
    bound = _bound.get()
    if bound is not None:
        bound.append(session_id)


def forward(items, start: float, end: float) -> None:
    """The target scheduler's hook after one batched forward, on the engine thread. `items`:
    (session id, step kind, query tokens) per row; `start` / `end`: perf_counter seconds.

    The forward becomes one span, a child of the first traced session's span and linked to
    every traced session it served; each traced session gets its admission queue wait (before
    its first forward) and its prefill chunks as spans of its own."""
    if _tracer is None or not _sessions:
        return
    try:
        _forward_spans(items, start, end)
    except Exception:  # noqa: BLE001 - a tracing bug must never reach the engine thread's forwards
        global _forward_failed
        if not _forward_failed and _processor is not None and _processor.log is not None:
            _processor.log.exception("trace_forward_failed")
        _forward_failed = True


_forward_failed = False     # logged once


def _forward_spans(items, start: float, end: float) -> None:
    offset = time.time_ns() - time.perf_counter_ns()
    t0, t1 = int(start * 1e9) + offset, int(end * 1e9) + offset
    traced = [(kind, n, _sessions.get(sid)) for sid, kind, n in items]
    traced = [(kind, n, s) for kind, n, s in traced if s is not None]
    if not traced:
        return
    kinds = sorted({kind for kind, _, _ in traced})
    span = _tracer.start_span(
        "target.forward", context=_api.trace.set_span_in_context(traced[0][2].span), start_time=t0,
        links=[_api.Link(s.span.get_span_context()) for _, _, s in traced],
        attributes={"splitspec.rows": len(items), "splitspec.tokens": sum(n for _, _, n in items),
                    "splitspec.traced_rows": len(traced), "splitspec.kinds": ",".join(kinds)})
    span.end(end_time=t1)
    for kind, n, s in traced:
        ctx = _api.trace.set_span_in_context(s.span)
        if s.forwards == 0:
            _tracer.start_span("target.queue_wait", context=ctx, start_time=s.bound_ns).end(end_time=max(t0, s.bound_ns))
        s.forwards += 1
        if kind == "prefill":
            _tracer.start_span("target.prefill_chunk", context=ctx, start_time=t0,
                               attributes={"splitspec.tokens": n}).end(end_time=t1)
