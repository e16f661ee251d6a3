"""Prometheus metrics shared by the services: the exporter (`--metrics-port`), and the engine
metrics of the target and the draft (batch size, forward time by step kind, sessions running /
waiting, KV blocks used / free).

Names follow vLLM's `vllm:` metrics where the meaning is the same, prefixed `splitspec:`.
Labels have bounded values only (step kinds, methods, positions), never request ids.

Each service owns a `CollectorRegistry` of its own instead of prometheus_client's global one,
so a test process can build several services' metrics without name clashes. Gauges that
mirror scheduler state are read at scrape time (`StateCollector`), so the engine thread does
no metrics work for them; the only per-forward work is one `observe` in `EngineMetrics`."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from . import tracing

PREFIX = "splitspec:"

# Forward times: sub-millisecond n-gram work up to multi-second prefills of long prompts.
FORWARD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def start_exporter(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` as Prometheus text on http://host:port/metrics from a daemon thread
    (never the event loop or the engine thread); returns the bound port (port 0: any free).
    Every service's exporter carries the span exporter's counts too."""
    registry.register(TracingCollector())
    app = classic_text(make_wsgi_app(registry))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = type("_Server", (_ThreadingServer,), {"address_family": family})
    httpd = make_server(host, port, app, server, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-exporter", daemon=True).start()
    return httpd.server_port


def classic_text(app):
    """Answer every scrape in the classic text format (0.0.4). prometheus_client's OpenMetrics
    answer rewrites the colons of metric names to underscores (splitspec:x -> splitspec_x) for a
    scraper that does not ask for UTF-8 names, as Prometheus 2.x negotiates; the dashboard, the
    autoscalers' queries and vLLM-style names all say splitspec:x."""
    def app_text(environ, start_response):
        environ["HTTP_ACCEPT"] = "text/plain"
        return app(environ, start_response)
    return app_text


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True       # a scrape in flight never holds the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:   # noqa: A002 - the base class's name
        pass                                        # no access log on stderr (the logs are JSON)


def step_kind(kinds) -> str:
    """One label value for the kinds of steps that shared a forward: the kind, or `mixed`."""
    kinds = set(kinds)
    return kinds.pop() if len(kinds) == 1 else "mixed"


class EngineMetrics:
    """What one batched forward of a target or draft engine did. `on_forward` runs on the
    engine thread after each forward: two histogram observations, microseconds."""

    def __init__(self, registry: CollectorRegistry):
        self.batch_size = Histogram(
            PREFIX + "batch_size", "Sessions' steps (rows) run together in one batched forward.",
            buckets=BATCH_BUCKETS, registry=registry)
        self.batch_tokens = Histogram(
            PREFIX + "batch_num_tokens", "Query tokens in one batched forward.",
            buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096), registry=registry)
        self.forward_time = Histogram(
            PREFIX + "forward_time_seconds",
            "Wall time of one batched forward (model + sampling), by the kind of steps in it "
            "(target: prefill, decode, verify; draft: open, propose; mixed: several kinds).",
            ["kind"], buckets=FORWARD_BUCKETS, registry=registry)

    def on_forward(self, kind: str, rows: int, tokens: int, forward_ms: float) -> None:
        self.batch_size.observe(rows)
        self.batch_tokens.observe(tokens)
        self.forward_time.labels(kind=kind).observe(forward_ms / 1e3)


class StateCollector(Collector):
    """Gauges and counters read from a service's live state at scrape time. `read` returns a
    dict with any of: running, waiting, proposals_waiting, kv_blocks_used, kv_blocks_free, forwards, rows; a
    service that is still loading returns {} and exports nothing for them."""

    def __init__(self, read: Callable[[], dict]):
        self.read = read

    def describe(self):
        return []           # names depend on what the state has; skip the registry's duplicate check

    def collect(self):
        state = self.read()
        gauges = [("running", "num_requests_running", "Sessions scheduled (running) now."),
                  ("waiting", "num_requests_waiting", "Sessions waiting for admission."),
                  ("proposals_waiting", "num_proposals_waiting",
                   "Draft Opens and Proposes waiting for the next batched draft forward."),
                  ("kv_blocks_used", "kv_blocks_used", "KV pool blocks holding tokens."),
                  ("kv_blocks_free", "kv_blocks_free", "KV pool blocks free.")]
        for key, name, doc in gauges:
            if key in state:
                yield GaugeMetricFamily(PREFIX + name, doc, value=state[key])
        used, free = state.get("kv_blocks_used"), state.get("kv_blocks_free")
        if used is not None and free is not None:
            yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Share of the KV pool in use (0..1).",
                                    value=used / (used + free) if used + free else 0.0)
        if "forwards" in state:
            yield CounterMetricFamily(PREFIX + "forward_passes", "Batched forwards run.", value=state["forwards"])
        if "rows" in state:
            yield CounterMetricFamily(PREFIX + "batched_steps", "Sessions' steps run in batched forwards.",
                                      value=state["rows"])
        if "prefix_cache_queries" in state:
            # vLLM's meaning, in tokens: hit rate = hits / queries.
            yield CounterMetricFamily(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      value=state["prefix_cache_queries"])
            yield CounterMetricFamily(PREFIX + "prefix_cache_hits",
                                      "Prompt tokens whose K/V came from the prefix cache.",
                                      value=state["prefix_cache_hits"])
        if "lookahead_drafts" in state:
            # The target's prompt lookup inside Decode runs: acceptance = accepted / draft tokens.
            for key, doc in (("lookahead_drafts", "Decode steps the target ran as a verify of its own prompt lookup."),
                             ("lookahead_draft_tokens", "Prompt-lookup tokens the target verified in Decode runs."),
                             ("lookahead_accepted_tokens", "Of them, accepted.")):
                yield CounterMetricFamily(PREFIX + key, doc, value=state[key])



class TracingCollector(Collector):
    """The span exporter's counts (splitspec/tracing.py), read at scrape time; zero while
    tracing is off, so a dashboard's panel has a series either way."""

    def describe(self):
        return []

    def collect(self):
        yield CounterMetricFamily(PREFIX + "trace_spans_exported", "Spans the OTLP collector took.",
                                  value=tracing.exported())
        yield CounterMetricFamily(PREFIX + "trace_spans_dropped", "Spans dropped because the export queue was "
                                  "full or the collector failed (export never waits for it).", value=tracing.dropped())


def add_metrics_flag(parser) -> None:
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: off)")


def serve_engine_metrics(args, read_state: Callable[[], dict], log) -> EngineMetrics | None:
    """Start a target's or draft's exporter when --metrics-port is set: engine metrics plus
    the state `read_state` returns at scrape time. None when metrics are off."""
    if not args.metrics_port:
        return None
    registry = new_registry()
    metrics = EngineMetrics(registry)
    registry.register(StateCollector(read_state))
    port = start_exporter(registry, args.host, args.metrics_port)
    log.info("metrics_listening", host=args.host, port=port)
    return metrics
