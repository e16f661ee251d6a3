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
from pathlib import Path

import grpc
from tokenizers import Tokenizer

from splitspec import logs
from splitspec.flags import ListFlag, apply_env
from splitspec.serving import Server
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc, target_pb2

from .backends import BackendError, TargetClient
from .config import ALGORITHMS, DRAFT_SAMPLING, GatewayConfig, SpeculativeConfig
from .generation import Stats, stream_response, target_only_steps
from .request import ModelLimits, RequestError, parse_request

SERVICE = "splitspec.v1.Generation"


class StartupError(RuntimeError):
    """The gateway cannot start serving (no target, no tokenizer)."""


class Backends:
    """Target replicas (and, later, drafts) plus what the gateway learned from them at start-up."""

    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.targets = [TargetClient(a, cfg.max_message_mb) for a in cfg.targets]
        self._next = itertools.cycle(range(len(self.targets)))
        self.info: target_pb2.TargetInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.limits: ModelLimits | None = None

    def pick_target(self) -> TargetClient:
        return self.targets[next(self._next)]

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


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, backends: Backends, server: Server):
        self.backends = backends
        self.server = server
        self.cfg = backends.cfg
        self.active = 0

    async def GetModelInfo(self, request, context):
        await self._ready(context)
        info, spec = self.backends.info, self.cfg.speculative
        return gateway_pb2.ModelInfo(
            model_id=info.model_id, vocab_size=info.vocab_size, max_context=info.max_context,
            eos_token_ids=list(info.eos_token_ids), draft_model_id="",
            speculative_method=self._default_method(), num_draft_tokens=spec.num_draft_tokens,
            max_new_tokens_cap=self.cfg.max_new_tokens_cap)

    def _default_method(self) -> str:
        return "none"   # until a draft is wired in, everything runs target-only

    async def _ready(self, context) -> None:
        if self.backends.limits is None or not self.server.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is not connected to a target yet")

    async def Generate(self, request, context):
        await self._ready(context)
        try:
            req = parse_request(request, self.cfg, self.backends.limits, self.backends.tokenizer)
        except RequestError as exc:
            logs.get_logger(request_id=request.request_id).info("request_refused", code=exc.code.name,
                                                                 message=str(exc))
            await context.abort(exc.code, str(exc))
        if self.active >= self.cfg.max_sessions:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the gateway is serving {self.active} requests (--max-sessions "
                                f"{self.cfg.max_sessions}); retry later")
        log = logs.get_logger(request_id=req.request_id)
        log.info("request_started", prompt_tokens=len(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                 method=req.speculative.method)
        self.active += 1
        stats = Stats()
        target = self.backends.pick_target().session()
        complete = None
        try:
            steps = target_only_steps(target, req, stats)
            responses = stream_response(req, steps, self.backends.tokenizer, stats)
            async with contextlib.aclosing(steps), contextlib.aclosing(responses):
                async for resp in responses:
                    if resp.HasField("complete"):
                        complete = resp.complete
                        break
                    yield resp
            await target.close()     # free the target session before telling the client we are done
            yield gateway_pb2.GenerateResponse(complete=complete)
        except BackendError as exc:
            target.cancel()
            code = grpc.StatusCode.UNAVAILABLE if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED else exc.code
            log.info("request_failed", code=exc.code.name, message=str(exc))
            await context.abort(code, str(exc))
        except asyncio.CancelledError:
            target.cancel()       # the client went away: free the target session now
            log.info("request_cancelled")
            raise
        except Exception as exc:  # a bug here must fail this request only
            target.cancel()
            log.exception("request_failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"gateway error: {exc}")
        finally:
            self.active -= 1
        log.info("request_finished", finish_reason=complete.finish_reason,
                 completion_tokens=complete.usage.completion_tokens,
                 ttft_ms=round(complete.stats.time_to_first_token_ms, 1))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec-gateway", description="The client-facing gRPC gateway.")
    a = p.add_argument
    a("--target", action=ListFlag, default=[], required=True,
      help="target address host:port, or dns:///name:port for all replicas behind a name (round_robin); "
           "repeatable or comma-separated")
    a("--draft", default=None, help="draft service address (speculative decoding)")
    a("--tokenizer-path", default=None, help="tokenizer.json or a folder holding it (default: the target's)")
    a("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    a("--port", type=int, default=50050, help="port to listen on (0: any free port)")
    a("--max-new-tokens-cap", type=int, default=2048, help="largest max_new_tokens a request may ask for")
    a("--default-max-new-tokens", type=int, default=256, help="max_new_tokens when a request does not set it")
    a("--max-sessions", type=int, default=256, help="concurrent requests; more get RESOURCE_EXHAUSTED")
    a("--speculative-algorithm", default="NONE", type=str.upper, choices=list(ALGORITHMS),
      help="default method for requests that do not choose one")
    a("--speculative-num-steps", type=int, default=7, help="draft depth per branch")
    a("--speculative-eagle-topk", type=int, default=1, help="branching factor per step (1 = chain)")
    a("--speculative-num-draft-tokens", type=int, default=8, help="verify width: root + drafted tokens")
    a("--speculative-draft-sampling", default="greedy", choices=list(DRAFT_SAMPLING),
      help="greedy drafts (target-only verification) or sampled drafts with min(1, p/q)")
    a("--max-message-mb", type=int, default=64, help="largest gRPC message, either direction")
    a("--target-wait-s", type=float, default=600.0, help="how long to wait for a target at start-up")
    a("--drain-timeout-s", type=float, default=30.0, help="on SIGTERM, how long in-flight requests may run")
    a("--log-level", default="info", choices=list(logs.LEVELS), help="JSON log lines at this level and above")
    return apply_env(p)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if not args.target:
        raise SystemExit("--target is required (host:port or dns:///name:port)")
    for name in ("max_new_tokens_cap", "default_max_new_tokens", "max_sessions", "max_message_mb",
                 "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    spec = SpeculativeConfig(method=ALGORITHMS[args.speculative_algorithm],
                             num_steps=args.speculative_num_steps, eagle_topk=args.speculative_eagle_topk,
                             num_draft_tokens=args.speculative_num_draft_tokens,
                             draft_sampling=args.speculative_draft_sampling)
    return GatewayConfig(targets=tuple(args.target), draft=args.draft, tokenizer_path=args.tokenizer_path,
                         max_new_tokens_cap=args.max_new_tokens_cap,
                         # a cap below the default lowers the default with it
                         default_max_new_tokens=min(args.default_max_new_tokens, args.max_new_tokens_cap),
                         max_sessions=args.max_sessions,
                         max_message_mb=args.max_message_mb, target_wait_s=args.target_wait_s,
                         speculative=spec)


async def serve(args: argparse.Namespace, cfg: GatewayConfig) -> None:
    log = logs.get_logger()
    server = Server([SERVICE], max_message_mb=cfg.max_message_mb)
    backends = Backends(cfg)
    gateway_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(backends, server), server.grpc)
    port = await server.start(args.host, args.port)
    log.info("listening", host=args.host, port=port, targets=list(cfg.targets), draft=cfg.draft)
    if cfg.draft or cfg.speculative.method != "none":
        log.warning("speculation_not_available", detail="the draft path is not wired in yet; "
                    "every request decodes target-only")
    async def startup():
        await backends.connect(log)
        log.info("serving", model_id=backends.info.model_id, vocab_size=backends.info.vocab_size,
                 max_context=backends.info.max_context, replica=backends.info.replica_id)
    try:
        await server.run(startup(), args.drain_timeout_s)
    finally:
        for t in backends.targets:
            await t.close()


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    logs.configure("gateway", args.log_level)
    try:
        asyncio.run(serve(args, cfg))
    except (StartupError, OSError, ValueError) as exc:
        logs.get_logger().error("startup_failed", error=str(exc))
        raise SystemExit(f"splitspec-gateway: {exc}") from None
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
