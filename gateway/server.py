"""gRPC adapter of the gateway: `Generation.Generate` (server stream) and `GetModelInfo`, plus
the `splitspec-gateway` command. Needs no model files: the tokenizer comes from the target's
GetInfo unless --tokenizer-path is given.

    splitspec-gateway --target 127.0.0.1:50051 --port 50050
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import time
from pathlib import Path

import grpc
from tokenizers import Tokenizer

from splitspec import logs, tracing
from splitspec.flags import ListFlag, apply_env, check_ranges
from splitspec.metrics import new_registry, start_exporter
from splitspec.security import ApiKeyInterceptor, ApiKeys, add_api_key_flags, client_credentials, load_api_keys
from splitspec.serving import Server, Unparsable, add_lenient_servicer, add_server_flags, run_main, start_observing
from splitspec.v1 import draft_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2

from .backends import BackendError, DraftClient, TargetClient
from .chat import ChatTemplate, ChatTemplateError
from .config import ALGORITHMS, DRAFT_SAMPLING, ROUTING_POLICIES, GatewayConfig, SpeculativeConfig
from .failover import Health, ResilientSource
from .plan import plan_request
from .policy import Measurements
from .generation import Stats, stream_response
from .http_server import start_http
from .metrics import GatewayMetrics
from .request import ModelLimits, RequestError, parse_request
from .routing import BALANCE_ABS, BLOCK_SIZE, LOAD_FACTOR, PrefixRouter, prefix_key

SERVICE = "splitspec.v1.Generation"


class StartupError(RuntimeError):
    """The gateway cannot start serving (no target, no tokenizer)."""


class IncompatibleDraftError(StartupError):
    """The draft was built for another target: FAILED_PRECONDITION, refused at start-up."""


def check_pair(target: target_pb2.TargetInfo, draft: draft_pb2.DraftInfo) -> None:
    """Refuse a draft/target pair that cannot work together, naming the mismatch, before any
    request runs (never by failing mid-generation)."""
    problems = []
    if draft.target_vocab_size and draft.target_vocab_size != target.vocab_size:
        problems.append(f"vocab size: draft expects {draft.target_vocab_size}, target has {target.vocab_size}")
    if draft.method == "dflash":
        if draft.target_hidden_size != target.hidden_size:
            problems.append(f"hidden size: draft expects {draft.target_hidden_size}, target has {target.hidden_size}")
        if draft.target_num_layers and draft.target_num_layers != target.num_layers:
            problems.append(f"layer count: draft expects {draft.target_num_layers}, target has {target.num_layers}")
        bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {list(draft.target_layer_ids)}: {bad} not in the target's "
                            f"0..{target.num_layers - 1}")
    if draft.target_tokenizer_hash and target.tokenizer_hash and draft.target_tokenizer_hash != target.tokenizer_hash:
        problems.append(f"tokenizer: draft was built for {draft.target_tokenizer_hash}, target has "
                        f"{target.tokenizer_hash}")
    if problems:
        raise IncompatibleDraftError(
            f"FAILED_PRECONDITION: draft {draft.model_id!r} does not fit target {target.model_id!r}: "
            + "; ".join(problems))


class Backends:
    """Target replicas and the draft, their health, and what the gateway learned from them at
    start-up. A failed backend is skipped by new requests until a health probe brings it back
    (gateway/failover.py)."""

    def __init__(self, cfg: GatewayConfig, log=None, credentials: grpc.ChannelCredentials | None = None):
        self.cfg = cfg
        self.log = log or logs.get_logger()
        self.targets = [TargetClient(a, cfg.max_message_mb, cfg.reconnect_max_s, credentials) for a in cfg.targets]
        self._next = itertools.cycle(range(len(self.targets)))
        # Router names: the address, made unique when one is given twice (two clients, as before).
        self._names = {id(c): c.address if cfg.targets.count(c.address) == 1 else f"{c.address}#{i}"
                       for i, c in enumerate(self.targets)}
        self._by_name = {self._names[id(c)]: c for c in self.targets}
        self.router = PrefixRouter(self._names.values(), load_factor=cfg.routing_load_factor,
                                   balance_abs=cfg.routing_balance_abs)
        self._health = {id(c): Health("target", c.address, c.channel, self.log,
                                      max_backoff_s=cfg.reconnect_max_s) for c in self.targets}
        self.draft = DraftClient(cfg.draft, cfg.max_message_mb, cfg.reconnect_max_s, credentials) if cfg.draft else None
        self.draft_health = Health("draft", cfg.draft or "", self.draft.channel if self.draft else None, self.log,
                                   max_backoff_s=cfg.reconnect_max_s, verify=self._recheck_draft)
        self.draft_info: draft_pb2.DraftInfo | None = None
        self.measurements = Measurements()     # what the auto policy of every request learns from
        self.info: target_pb2.TargetInfo | None = None
        self._chat_template = None
        self.tokenizer: Tokenizer | None = None
        self.limits: ModelLimits | None = None

    def target_health(self, client: TargetClient) -> Health:
        return self._health[id(client)]

    def single_name(self) -> bool:
        """One --target: a dns:/// name may stand for several replicas, so retrying it is useful."""
        return len(self.targets) == 1

    def routing_key(self, prompt_ids, cache_salt: str = "") -> bytes | None:
        """The prefix-affinity key of a prompt, cut at the block size the target reported: its
        prefix cache reuses only whole blocks of that size (BLOCK_SIZE for a target that reports 0)."""
        block = self.info.kv_block_size if self.info is not None else 0
        return prefix_key(prompt_ids, cache_salt, block_size=block or BLOCK_SIZE)

    def pick_target(self, exclude: set[int] | None = None, key: bytes | None = None) -> TargetClient | None:
        """The replica for a request: with a `key` (routing_key) and
        --routing-policy prefix, the one its prompt prefix hashes to, unless that one is over its
        share of the requests in flight; otherwise the next healthy replica in turn (round robin
        over --target addresses). With `exclude` (ids of clients a request already tried): one
        not tried, healthy first, or None. Without: a healthy one, or the next one anyway (it
        answers UNAVAILABLE)."""
        if key is not None and self.cfg.routing_policy == "prefix" and len(self.targets) > 1:
            name = self.router.pick(key, exclude={self._names[i] for i in exclude or ()},
                                    healthy=lambda n: self._health[id(self._by_name[n])].healthy)
            return None if name is None else self._by_name[name]
        start = next(self._next)
        order = self.targets[start:] + self.targets[:start]
        candidates = [c for c in order if exclude is None or id(c) not in exclude]
        for c in candidates:
            if self._health[id(c)].healthy:
                return c
        if candidates:
            return candidates[0]
        return None

    @contextlib.contextmanager
    def serving(self, client: TargetClient):
        """Count one request on `client` while an attempt of it runs there: the in-flight
        numbers the load bound of prefix routing compares."""
        name = self._names[id(client)]
        self.router.acquire(name)
        try:
            yield
        finally:
            self.router.release(name)

    async def _recheck_draft(self) -> bool:
        """A draft that came back must still fit the target (it may have been replaced)."""
        try:
            info = await self.draft.get_info()
            check_pair(self.info, info)
        except (BackendError, IncompatibleDraftError) as exc:
            self.log.warning("draft_recheck_failed", error=str(exc))
            return False
        self.draft_info = info
        return True

    async def connect(self, log) -> None:
        """Wait for a target to serve, then take the model's limits and tokenizer from it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.target_wait_s
        while True:
            client = self.pick_target()
            try:
                self.info = await client.get_info(wait_s=max(1.0, min(10.0, deadline - loop.time())))
                break
            except BackendError as exc:
                if loop.time() > deadline:
                    raise StartupError(f"no target answered GetInfo within {self.cfg.target_wait_s:g} s "
                                     f"(--target {','.join(self.cfg.targets)}): {exc}") from None
                log.info("waiting_for_target", address=client.address, code=exc.code.name)
                await asyncio.sleep(0.5)
        self.tokenizer = load_tokenizer(self.cfg.tokenizer_path, self.info)
        self.limits = ModelLimits(vocab_size=self.info.vocab_size, max_context=self.info.max_context,
                                  eos_token_ids=tuple(self.info.eos_token_ids))
        if self.draft is not None:
            try:
                self.draft_info = await self.draft.get_info(wait_s=max(self.cfg.draft_wait_s, 0.1))
            except BackendError as exc:
                # A missing draft only costs speed: serve target-only now; the health probe
                # re-checks the pair (_recheck_draft) and speculation starts when it answers.
                log.warning("draft_unavailable_at_start", address=self.cfg.draft, code=exc.code.name,
                            waited_s=self.cfg.draft_wait_s)
                self.draft_health.mark_failed(f"no GetInfo answer at start-up: {exc}")
                return
            check_pair(self.info, self.draft_info)

    def chat_template(self) -> ChatTemplate | None:
        """The target's own chat template (from its tokenizer_config.json), for gRPC chat input;
        rebuilt when the target's model changes (a replica serving another checkpoint)."""
        info = self.info
        if info is None:
            return None
        if self._chat_template is None or self._chat_template.model_id != info.model_id:
            try:
                self._chat_template = ChatTemplate(info.tokenizer_config_json, info.model_id)
            except ChatTemplateError:
                return None
        return self._chat_template

    async def close(self) -> None:
        for h in [*self._health.values(), self.draft_health]:
            h.close()
        for t in self.targets:
            await t.close()
        if self.draft is not None:
            await self.draft.close()


def load_tokenizer(path: str | None, info: target_pb2.TargetInfo) -> Tokenizer:
    if path:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        try:
            return Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise StartupError(f"--tokenizer-path {path}: cannot load {file}: {exc}") from None
    if not info.tokenizer_json:
        raise StartupError("the target's GetInfo carries no tokenizer.json (its model folder has none); "
                         "pass --tokenizer-path")
    return Tokenizer.from_str(info.tokenizer_json.decode("utf-8"))


def add_servicer(servicer: "GenerationServicer", server: grpc.aio.Server) -> None:
    """gateway_pb2_grpc.add_GenerationServicer_to_server, with a Generate request parser that
    turns garbage bytes into INVALID_ARGUMENT."""
    add_lenient_servicer(server, SERVICE, servicer, {
        "Generate": ("unary_stream", gateway_pb2.GenerateRequest, gateway_pb2.GenerateResponse),
        "GetModelInfo": ("unary_unary", gateway_pb2.GetModelInfoRequest, gateway_pb2.ModelInfo)})


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, backends: Backends, server: Server, metrics=None):
        self.backends = backends
        self.server = server
        self.cfg = backends.cfg
        self.active = 0
        self.metrics = metrics      # gateway/metrics.GatewayMetrics with --metrics-port, else None

    async def GetModelInfo(self, request, context):
        await self._ready(context)
        info, spec = self.backends.info, self.cfg.speculative
        return gateway_pb2.ModelInfo(
            model_id=info.model_id, vocab_size=info.vocab_size, max_context=info.max_context,
            eos_token_ids=list(info.eos_token_ids),
            draft_model_id=self.backends.draft_info.model_id if self.backends.draft_info else "",
            speculative_method=self._default_method(), num_draft_tokens=spec.num_draft_tokens,
            max_new_tokens_cap=self.cfg.max_new_tokens_cap,
            chat_template=bool((t := self.backends.chat_template()) and t.available))

    def _default_method(self) -> str:
        return self.cfg.speculative.method

    def _count_sessions(self) -> None:
        """What the auto policy prices a target-only step with: the requests sharing a replica."""
        self.backends.measurements.sessions = self.active / max(1, len(self.backends.targets))

    async def _ready(self, context) -> None:
        if self.backends.limits is None or not self.server.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is not connected to a target yet")

    async def Generate(self, request, context):
        if isinstance(request, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        await self._ready(context)
        try:
            # In a worker thread: tokenizing a long text, rendering a chat template and reading a
            # schema take time that grows with the request, and this loop serves every other one.
            req = await asyncio.to_thread(parse_request, request, self.cfg, self.backends.limits,
                                          self.backends.tokenizer, self.backends.chat_template())
            plan = plan_request(req.speculative, request.speculative, has_draft=self.backends.draft is not None,
                                draft=self.backends.draft_info, target=self.backends.info)
        except RequestError as exc:
            logs.get_logger(request_id=request.request_id).info("request_refused", code=exc.code.name,
                                                                 message=str(exc))
            await context.abort(exc.code, str(exc))
        if self.active >= self.cfg.max_sessions:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the gateway is serving {self.active} requests (gateway --max-sessions "
                                f"{self.cfg.max_sessions}); retry later")
        trace = tracing.start_request(context.invocation_metadata(), req.request_id)   # None when off
        log = logs.get_logger(request_id=req.request_id)
        log.info("request_started", prompt_tokens=len(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                 method=req.speculative.method, deadline_s=context.time_remaining())
        self.active += 1
        self._count_sessions()
        stats = Stats(trace=trace)
        marks = [] if self.metrics is not None else None    # (time, tokens) per chunk, for the metrics
        failure = None
        if marks is not None:
            self.metrics.waiting.inc()
        source = ResilientSource(self.backends, req, stats, plan, log,
                                 timeout_s=context.time_remaining)   # the client's deadline, propagated
        complete, finished = None, False
        try:
            # Written with context.write from this coroutine (not yielded): a client that goes
            # away cancels this very task, so the except clauses below always free the sessions.
            steps = source.steps()
            responses = stream_response(req, steps, self.backends.tokenizer, stats)
            async with contextlib.aclosing(steps), contextlib.aclosing(responses):
                async for resp in responses:
                    if resp.HasField("complete"):
                        complete = resp.complete
                        break
                    if marks is not None:
                        if not marks:
                            self.metrics.waiting.dec()
                        marks.append((time.perf_counter(), len(resp.chunk.token_ids)))
                    await context.write(resp)
            await source.close()        # free both sessions before telling the client we are done
            await context.write(gateway_pb2.GenerateResponse(complete=complete))
            finished = True
        except BackendError as exc:
            source.cancel()
            code = exc.code
            failure = code.name
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                left = context.time_remaining()
                code = grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0.05 \
                    else grpc.StatusCode.UNAVAILABLE
            log.info("request_failed", code=exc.code.name, message=str(exc),
                     completion_tokens=len(source.history), draft_fallbacks=stats.draft_fallbacks,
                     target_failovers=stats.target_failovers)
            await context.abort(code, str(exc))
        except asyncio.CancelledError:
            source.cancel()       # the client went away (cancel or deadline): free both sessions now
            failure = "CANCELLED"
            log.info("request_cancelled", completion_tokens=len(source.history))
            raise
        except Exception as exc:  # a bug here must fail this request only
            source.cancel()
            failure = "CANCELLED" if context.cancelled() or context.done() else "INTERNAL"
            if context.cancelled() or context.done():
                log.info("request_cancelled", completion_tokens=len(source.history))
                return
            log.exception("request_failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"gateway error: {exc}")
        finally:
            if not finished:
                source.cancel()   # whatever ended the request early, never leave a session open
            self.active -= 1
            self._count_sessions()
            if marks is not None:
                self._record(req, stats, complete if finished else None, failure, marks, len(source.history))
            if trace is not None:
                trace.end(stats, model=self.backends.info.model_id, prompt_tokens=len(req.prompt_ids),
                          complete=complete if finished else None, failure=failure)
        log.info("request_finished", finish_reason=complete.finish_reason,
                 completion_tokens=complete.usage.completion_tokens, method=complete.stats.method,
                 draft_fallbacks=stats.draft_fallbacks, target_failovers=stats.target_failovers,
                 ttft_ms=round(complete.stats.time_to_first_token_ms, 1))

    def _record(self, req, stats, complete, failure, marks, history_len) -> None:
        try:
            self._record_metrics(req, stats, complete, failure, marks, history_len)
        except Exception:  # noqa: BLE001 - a metrics bug must never fail or hide a request's outcome
            logs.get_logger(request_id=req.request_id).exception("metrics_record_failed")

    def _record_metrics(self, req, stats, complete, failure, marks, history_len) -> None:
        if not marks:
            self.metrics.waiting.dec()
        if complete is not None:
            self.metrics.request_ended(stats, prompt_tokens=len(req.prompt_ids), chunk_marks=marks,
                                       completion_tokens=complete.usage.completion_tokens,
                                       finish_reason=complete.finish_reason)
        else:
            self.metrics.request_ended(stats, prompt_tokens=len(req.prompt_ids), chunk_marks=marks,
                                       completion_tokens=min(history_len, req.max_new_tokens),
                                       code=failure or "UNKNOWN")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec-gateway", description="The client-facing gRPC gateway.")
    a = p.add_argument
    a("--target", action=ListFlag, default=[], required=True,
      help="target address host:port, or dns:///name:port for all replicas behind a name (round_robin); "
           "repeatable or comma-separated")
    a("--draft", default=None, help="draft service address (speculative decoding)")
    a("--tokenizer-path", default=None, help="tokenizer.json or a folder holding it (default: the target's)")
    add_server_flags(p, port=50050, in_flight="requests")
    a("--max-new-tokens-cap", type=int, default=2048, help="largest max_new_tokens a request may ask for")
    a("--default-max-new-tokens", type=int, default=256, help="max_new_tokens when a request does not set it")
    a("--max-sessions", type=int, default=256, help="concurrent requests; more get RESOURCE_EXHAUSTED")
    a("--speculative-algorithm", default=None, type=str.upper, choices=list(ALGORITHMS),
      help="default method for requests that do not choose one (default: AUTO with --draft, else NONE; "
           "AUTO picks drafter and draft length per step)")
    a("--speculative-num-steps", type=int, default=7, help="draft depth per branch")
    a("--speculative-eagle-topk", type=int, default=1,
      help="branching factor per step (1 = chain; > 1: token trees, see docs/speculation.md)")
    a("--speculative-num-draft-tokens", type=int, default=8, help="verify width: root + drafted tokens")
    a("--speculative-draft-sampling", default="greedy", choices=list(DRAFT_SAMPLING),
      help="greedy drafts (target-only verification) or sampled drafts with min(1, p/q)")
    a("--target-lookahead", default="on", choices=["on", "off"],
      help="auto: let the target draft n-gram chains inside its Decode runs (no round trip; see "
           "docs/speculation.md); off: the gateway drafts them from its own index between runs")
    a("--target-wait-s", type=float, default=600.0, help="how long to wait for a target at start-up")
    a("--draft-wait-s", type=float, default=30.0,
      help="how long to wait for the draft at start-up; after that the gateway serves target-only and "
           "starts speculating once the draft answers")
    a("--max-prompt-tokens", type=int, default=0,
      help="longest prompt in tokens; longer ones get OUT_OF_RANGE (0: up to the model's context)")
    a("--draft-timeout-ms", type=float, default=2000.0,
      help="deadline of one draft step (Propose; Open gets 4x); past it the request goes on target-only")
    a("--reconnect-max-s", type=float, default=5.0,
      help="longest wait between health probes of a failed draft or target (exponential backoff from 0.1 s)")
    a("--target-failover-attempts", type=int, default=3,
      help="how many times one request may move to another target replica before failing UNAVAILABLE")
    a("--routing-policy", default="prefix", choices=list(ROUTING_POLICIES),
      help="how requests are spread over several --target replicas: prefix sends prompts that start "
           "alike to the same replica (its prefix cache), within --routing-load-factor; round_robin "
           "takes them in turn")
    a("--routing-load-factor", type=float, default=LOAD_FACTOR,
      help="prefix routing: a replica holding more than this times the mean number of requests in "
           "flight is passed over for the next one (>= 1; lower balances, higher keeps prefixes together)")
    a("--routing-balance-abs-threshold", type=int, default=BALANCE_ABS,
      help="prefix routing: the load bound applies only to a replica holding at least this many more requests "
           "than the least loaded one (SGLang router's balance_abs_threshold; 0: always)")
    a("--http-port", type=int, default=0,
      help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) "
           "on this port of --host (0: off)")
    a("--http-timeout-s", type=float, default=600.0,
      help="deadline of one HTTP request, as a gRPC client's deadline (0: none); a client may ask for less "
           "with an x-request-timeout header (seconds)")
    a("--chat-template", default=None,
      help="chat template for /v1/chat/completions, a file or the Jinja text itself (as vLLM's flag); "
           "wins over the model's own (tokenizer_config.json's chat_template), for models that have none")
    add_api_key_flags(p)
    return apply_env(p)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if not args.target:
        raise SystemExit("--target is required (host:port or dns:///name:port)")
    check_ranges(args, positive=("max_new_tokens_cap", "default_max_new_tokens", "max_sessions", "max_message_mb",
                                 "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                                 "draft_timeout_ms", "reconnect_max_s"),
                 non_negative=("max_prompt_tokens", "target_failover_attempts"))
    if args.routing_load_factor < 1:
        raise SystemExit("--routing-load-factor must be >= 1")
    if args.routing_balance_abs_threshold < 0:
        raise SystemExit("--routing-balance-abs-threshold must be >= 0")
    method = ALGORITHMS[args.speculative_algorithm or ("AUTO" if args.draft else "NONE")]
    if method == "dflash" and not args.draft:
        method = "none"         # logged as speculation_without_draft at start-up
    spec = SpeculativeConfig(method=method,
                             num_steps=args.speculative_num_steps, eagle_topk=args.speculative_eagle_topk,
                             num_draft_tokens=args.speculative_num_draft_tokens,
                             draft_sampling=args.speculative_draft_sampling,
                             target_lookahead=args.target_lookahead == "on")
    return GatewayConfig(targets=tuple(args.target), draft=args.draft, tokenizer_path=args.tokenizer_path,
                         max_new_tokens_cap=args.max_new_tokens_cap,
                         # a cap below the default lowers the default with it
                         default_max_new_tokens=min(args.default_max_new_tokens, args.max_new_tokens_cap),
                         max_sessions=args.max_sessions,
                         max_message_mb=args.max_message_mb, target_wait_s=args.target_wait_s,
                         draft_wait_s=args.draft_wait_s,
                         max_prompt_tokens=args.max_prompt_tokens, draft_timeout_ms=args.draft_timeout_ms,
                         reconnect_max_s=args.reconnect_max_s,
                         target_failover_attempts=args.target_failover_attempts,
                         routing_policy=args.routing_policy, routing_load_factor=args.routing_load_factor,
                         routing_balance_abs=args.routing_balance_abs_threshold,
                         speculative=spec)


async def serve(args: argparse.Namespace, cfg: GatewayConfig) -> None:
    log = logs.get_logger()
    keys = ApiKeys(load_api_keys(args))
    server = Server.from_args([SERVICE], args, interceptors=(ApiKeyInterceptor(keys),) if keys else ())
    backends = Backends(cfg, credentials=client_credentials(args))
    servicer = GenerationServicer(backends, server, metrics=gateway_metrics(args, lambda: servicer.active, log))
    add_servicer(servicer, server.grpc)
    port = await server.start(args.host, args.port)
    log.info("listening", host=args.host, port=port, targets=list(cfg.targets), draft=cfg.draft,
             tls=server.credentials is not None, api_keys=len(keys))      # how many, never which
    http = await start_http(servicer, keys, args, log) if args.http_port else None
    if args.speculative_algorithm == "DFLASH" and not cfg.draft:
        log.warning("speculation_without_draft", detail="--speculative-algorithm DFLASH needs --draft; "
                    "requests that do not choose a method decode target-only")
    async def startup():
        await backends.connect(log)
        log.info("serving", model_id=backends.info.model_id, vocab_size=backends.info.vocab_size,
                 max_context=backends.info.max_context, replica=backends.info.replica_id,
                 draft=backends.draft_info.model_id if backends.draft_info else None,
                 draft_method=backends.draft_info.method if backends.draft_info else None,
                 default_method=cfg.speculative.method)
    try:
        await server.run(startup(), args.drain_timeout_s, on_drain=http.drain if http else None)
    finally:
        if http is not None:
            await http.stop()
        await backends.close()


def gateway_metrics(args, running, log) -> GatewayMetrics | None:
    """The gateway's exporter on --metrics-port (None when off); `running` reads the number of
    requests in flight at scrape time."""
    if not args.metrics_port:
        return None
    registry = new_registry()
    metrics = GatewayMetrics(registry)
    metrics.running.set_function(running)
    port = start_exporter(registry, args.host, args.metrics_port)
    log.info("metrics_listening", host=args.host, port=port)
    return metrics


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    start_observing("gateway", args)
    run_main("splitspec-gateway", serve(args, cfg), (StartupError, OSError, ValueError))


if __name__ == "__main__":
    main()
