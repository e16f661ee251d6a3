"""gRPC adapter of the target service: `Target.Session` (one bidi stream per sequence) and
`GetInfo` over the scheduler's engine loop, plus the `splitspec-target` command.

    splitspec-target --model-path models/splitspec-code-target --port 50051
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import grpc
import torch

from splitspec import logs, serving, tracing
from splitspec.colocation import HostShare
from splitspec.colocation import follow_from_now
from splitspec.colocation import start as start_share
from splitspec.flags import apply_env, check_ranges
from splitspec.limits import MAX_CACHE_SALT
from splitspec.metrics import serve_engine_metrics
from splitspec.serving import (IdleError, ProtocolError, Server, UnparsableError, add_lenient_servicer,
                               add_model_flags, add_server_flags, await_message, end_session, run_main,
                               start_observing)
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc
from splitspec.wire import (WireError, check_token_ids, dtype_from_pb, logprob_to_pb, sampling_from_pb,
                            tensor_from_pb, tensor_to_pb, tree_from_pb)

from target_service.flashinfer_backend import BackendError, make_verifier
from splitspec.models.gguf_packed import is_packed
from splitspec.models.loader import (cpu_has_native_bf16, load_model, model_folder, parse_dtype, resolve_device, resolve_dtype,
                                     serves_packed, tokenizer_hash)
from splitspec.models.config import ConfigError
from splitspec.models.loader import CheckpointError
from target_service.scheduler import AdmissionError, ClosedError, ContextError, DrainingError, Scheduler, StaleError, StepFailed
from splitspec.engine.flashinfer_attention import AttentionBackendError
from splitspec.engine.flashinfer_attention import check_available as check_attention_backend
from target_service import preflight
from splitspec.grammar import GrammarBusy, Grammars, Guide
from target_service.pools import make_pool
from target_service.parallel import TensorParallelError
from splitspec.engine.loop import EngineLoop
from splitspec.engine.tree import TreeError

SERVICE = "splitspec.v1.Target"
MAX_TREE_NODES = 256

# The target's own exceptions -> the status a client can act on (splitspec.serving.STATUS has
# the ones every server shares).
_STATUS = [
    (TensorParallelError, grpc.StatusCode.UNAVAILABLE),
    (StepFailed, grpc.StatusCode.INTERNAL),     # the gateway resumes the request (gateway/failover.py)
    (GrammarBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ClosedError, grpc.StatusCode.CANCELLED),
    (ContextError, grpc.StatusCode.OUT_OF_RANGE),
    (StaleError, grpc.StatusCode.ABORTED),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    return serving.status_for(exc, _STATUS)


class TargetState:
    """Everything the servicer needs; `scheduler` is None until the weights are loaded."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.scheduler: Scheduler | None = None
        self.grammars: Grammars | None = None      # structured output, once the model is loaded
        self.model = None
        self.replica_id = f"{socket.gethostname()}-{os.getpid()}"
        path = Path(args.model_path)
        self.model_id = args.served_model_name or path.name
        tok = path / "tokenizer.json"
        self.tokenizer_json = tok.read_bytes() if tok.is_file() else b""
        tok_cfg = path / "tokenizer_config.json"
        self.tokenizer_config_json = tok_cfg.read_text() if tok_cfg.is_file() else ""
        self.tokenizer_hash = tokenizer_hash(path)
        self.failure: str | None = None     # why this replica is out of service for good (a lost TP rank)


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, state: TargetState, server: Server):
        self.state = state
        self.server = server

    async def GetInfo(self, request, context):
        sched = await self._scheduler(context)
        # Read on the engine thread, between forwards, like every read of the scheduler's state
        # that is more than one counter: the numbers then belong to one moment.
        return await sched.engine.submit("info", lambda: self._info(sched))

    def _info(self, sched: Scheduler) -> target_pb2.TargetInfo:
        cfg, args = sched.cfg, self.state.args
        return target_pb2.TargetInfo(
            model_id=self.state.model_id, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
            dtype=str(sched.dtype).removeprefix("torch."), eos_token_ids=list(cfg.eos_token_ids),
            max_context=sched.max_context, tokenizer_hash=self.state.tokenizer_hash,
            tokenizer_json=self.state.tokenizer_json,
            tokenizer_config_json=self.state.tokenizer_config_json,
            active_sessions=sched.active_sessions, max_sessions=sched.max_running,
            kv_cache_bytes=sched.kv_bytes, kv_cache_budget_bytes=sched.kv_budget_bytes,
            sampling_backend=args.sampling_backend, replica_id=self.state.replica_id,
            running_sessions=len(sched.running), waiting_sessions=len(sched.waiting),
            max_queued_requests=sched.max_queued, kv_block_size=sched.pool.block_size,
            kv_blocks_used=sched.pool.used_blocks, kv_blocks_free=sched.pool.free_blocks,
            forward_passes=sched.forwards, batched_steps=sched.rows, busy_ms=sched.busy_ms,
            max_num_batched_tokens=sched.max_batched_tokens,
            tensor_parallel_size=getattr(sched.model, "world", 1),
            parallel_layout=sched.model.describe() if hasattr(sched.model, "describe") else "tp=1",
            max_lookahead=sched.lookahead.max_draft)

    async def _scheduler(self, context) -> Scheduler:
        if self.state.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this target replica is out of service: "
                                f"{self.state.failure}")
        if self.state.scheduler is None or not self.server.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the target is loading its model; retry when "
                                "grpc.health.v1 reports SERVING")
        return self.state.scheduler

    @tracing.serve_stream("target.session")     # the caller's traceparent parents the stream's span
    async def Session(self, request_iterator, context):
        sched = await self._scheduler(context)
        session = None
        log = logs.get_logger(peer=context.peer())
        # A Decode run streams from its own task while this loop keeps reading, so that a Decode
        # sent before the run's last token extends the run (the session never sits out a forward);
        # any other message waits for the run to end, so messages still act in the order sent.
        run: asyncio.Task | None = None
        run_hidden = False
        reading: asyncio.Task | None = None
        try:
            while True:
                if reading is None:
                    reading = asyncio.ensure_future(context.read())
                if run is not None:
                    await asyncio.wait((reading, run), return_when=asyncio.FIRST_COMPLETED)
                    if run.done():
                        task, run = run, None
                        task.result()                  # a failed run ends the session here
                        if not reading.done():
                            continue                   # now waited on with the idle timeout
                req = await self._next(reading, idle=session is not None)
                reading = None
                if req is grpc.aio.EOF:
                    break
                kind = req.WhichOneof("kind")
                if kind == "decode" and run is not None and session is not None:
                    if req.decode.return_hidden != run_hidden:
                        raise ProtocolError("decode.return_hidden differs from the run it would extend: end the "
                                            "run first, or send the same value")
                    if sched.extend(session, req.decode.n):
                        continue
                if run is not None:
                    task, run = run, None
                    await task
                if kind == "open":
                    if session is not None:
                        raise ProtocolError("a second Open on one stream; open a new stream per sequence")
                    tracing.bind_session(req.open.session_id)    # its queue wait, prefill, forwards
                    session, resp = await self._open(sched, req.open)
                    log = log.bind(session_id=session.session_id)
                    log.info("session_opened", prompt_len=session.prompt_len, max_len=session.max_len,
                             kv_blocks_reserved=session.reserve_blocks, queue_ms=round(resp.opened.queue_ms, 2),
                             active_sessions=sched.active_sessions)
                    await context.write(resp)
                elif kind is None:
                    raise WireError("TargetRequest.kind is not set: send open, decode, verify or close")
                elif session is None:
                    raise ProtocolError(f"{kind} before open: the first message must be Open")
                elif kind == "decode":
                    run_hidden = req.decode.return_hidden
                    run = asyncio.ensure_future(self._decode(sched, session, req.decode, context))
                elif kind == "verify":
                    await context.write(await self._verify(sched, session, req.verify))
                else:
                    await context.write(target_pb2.TargetResponse(closed=target_pb2.TargetClosed()))
                    break
            if run is not None:
                await run
        except (asyncio.CancelledError, Exception) as exc:     # ends this stream only, never the service
            await end_session(context, exc, status_for, log)
        finally:
            for task in (reading, run):
                if task is not None and not task.done():
                    task.cancel()
                elif task is not None and not task.cancelled():
                    task.exception()    # seen: a read the abort ended is no "never retrieved" error
            if session is not None:
                sched.close(session)
                closed = dict(length=session.length, active_sessions=sched.active_sessions,
                              seconds=round(time.monotonic() - session.opened_at, 3))
                # The lookahead's tables are the engine thread's: read them there (a snapshot
                # taken here once met a dict the engine was inserting into, `dict changed size`).
                sched.engine.post("log", lambda: log.info("session_closed", lookahead=sched.lookahead.snapshot(),
                                                          **closed))

    async def _next(self, reading: asyncio.Future, idle: bool):
        timeout = self.state.args.idle_timeout_s if idle and self.state.args.idle_timeout_s > 0 else None
        return await await_message(reading, timeout, "its KV cache was freed")

    async def _open(self, sched: Scheduler, msg: target_pb2.TargetOpen):
        prompt = check_token_ids(msg.prompt_token_ids, sched.cfg.vocab_size, "open.prompt_token_ids")
        if not prompt:
            raise WireError("open.prompt_token_ids is empty: at least one token id is needed")
        if msg.hidden_last < 0:
            raise WireError(f"open.hidden_last = {msg.hidden_last} is negative: send 0 for every prompt "
                            "position's features, or n > 0 for the last n")
        if len(msg.cache_salt) > MAX_CACHE_SALT:
            raise WireError(f"open.cache_salt has {len(msg.cache_salt)} characters; at most {MAX_CACHE_SALT} "
                            "are accepted (send a tenant id or a hash of one; empty: the shared prefix cache)")
        params = sampling_from_pb(msg.sampling)
        guide = None
        if msg.sampling.HasField("constraint"):
            if params.ignore_eos:
                raise WireError("open.sampling.constraint cannot be combined with sampling.ignore_eos: a constrained "
                                "answer ends (eos) where its grammar does")
            guide = Guide(await self.state.grammars.compile_async(msg.sampling.constraint), sched.cfg.vocab_size)
            if 0 < msg.generated_tokens <= len(prompt):
                # A resumed request (the gateway's failover): the prompt ends with tokens this
                # answer already generated under the grammar, so its state starts after them, as
                # the draft's does; a fresh matcher would mask the rest from the grammar's start.
                guide.resume(prompt[-msg.generated_tokens:], "open.generated_tokens")
        # The dtype the caller's draft takes hidden states in (DraftInfo.hidden_dtype), cast here once
        # per step; unset: the model's own (TargetInfo.dtype).
        wire_dtype = dtype_from_pb(msg.hidden_dtype, "open.hidden_dtype") if msg.hidden_dtype else sched.dtype
        session, step = await sched.open(msg.session_id or uuid.uuid4().hex, prompt, params,
                                        hidden_layers=tuple(msg.hidden_layer_ids),
                                        max_new_tokens=msg.max_new_tokens,
                                        hidden_stream=msg.hidden_stream, generated_tokens=msg.generated_tokens,
                                        cache_salt=msg.cache_salt, hidden_last=msg.hidden_last, guide=guide,
                                        wire_dtype=wire_dtype)
        # Built inside the response: a TargetOpened wrapped afterwards would copy the prompt's
        # hidden states (the largest message of a session) once more.
        resp = target_pb2.TargetResponse()
        opened = resp.opened
        opened.session_id, opened.first_token_id, opened.length = session.session_id, step.out.committed[0], session.length
        opened.forward_ms, opened.queue_ms = step.forward_ms, step.queue_ms
        opened.batch_size, opened.batch_tokens = step.batch_size, step.batch_tokens
        opened.cached_tokens = getattr(step, "cached_tokens", 0)     # prompt tokens taken from the prefix cache
        if step.out.hidden is not None:
            hidden = step.out.hidden
            if msg.hidden_last > 0:
                # A windowed draft reads only the trailing positions: ship just those.
                hidden = hidden[-msg.hidden_last:]
            tensor_to_pb(hidden, wire_dtype, out=opened.hidden)
        if step.out.logprobs:
            opened.first_logprob.CopyFrom(logprob_to_pb(step.out.logprobs[0]))
        opened.prompt_logprobs.extend(logprob_to_pb(lp) for lp in session.seq.prompt_logprobs)
        return session, resp

    async def _decode(self, sched: Scheduler, session, msg: target_pb2.TargetDecode, context) -> None:
        async for step in sched.decode(session, msg.n, msg.lookahead):
            # One message per forward, filled in place (no TargetToken to copy into it): one token,
            # or with lookahead all those a verified prompt-lookup draft committed.
            resp = target_pb2.TargetResponse()
            tok = resp.token
            committed = step.out.committed
            tok.token_id, tok.length = committed[0], step.length
            tok.forward_ms, tok.queue_ms = step.forward_ms, step.queue_ms
            tok.batch_size, tok.batch_tokens = step.batch_size, step.batch_tokens
            tok.batch_verify_rows = step.verify_rows
            if len(committed) > 1:
                tok.more_token_ids.extend(committed[1:])
            if step.drafted:
                tok.drafted, tok.accepted = step.drafted, step.accepted
            if msg.return_hidden and step.out.hidden is not None:
                tensor_to_pb(step.out.hidden, session.wire_dtype, out=tok.hidden)
            if step.out.logprobs:
                tok.logprob.CopyFrom(logprob_to_pb(step.out.logprobs[0]))
                tok.more_logprobs.extend(logprob_to_pb(lp) for lp in step.out.logprobs[1:])
            await context.write(resp)

    async def _verify(self, sched: Scheduler, session, msg: target_pb2.TargetVerify):
        tree = tree_from_pb(msg.tree, sched.cfg.vocab_size, MAX_TREE_NODES)
        draft_probs = None
        if msg.HasField("draft_probs"):
            # A view over the message's bytes: the scheduler checks and casts it on the engine thread
            # (torch work on this event loop's thread would start a second OpenMP team here).
            draft_probs = tensor_from_pb(msg.draft_probs, field="verify.draft_probs",
                                         shape=(len(tree), sched.cfg.vocab_size))
        step = await sched.verify(session, msg.base_len, tree, draft_probs)
        resp = target_pb2.TargetResponse()      # filled in place: no copy of the hidden states
        verified = resp.verified
        verified.step, verified.length, verified.num_accepted = msg.step, session.length, step.out.result.num_accepted
        verified.num_forced = step.forced
        verified.committed_token_ids.extend(step.out.committed)
        verified.forward_ms, verified.queue_ms = step.forward_ms, step.queue_ms
        verified.batch_size, verified.batch_tokens = step.batch_size, step.batch_tokens
        verified.batch_verify_rows = step.verify_rows
        if step.out.hidden is not None:
            tensor_to_pb(step.out.hidden, session.wire_dtype, out=verified.hidden)
        if step.out.logprobs:
            verified.logprobs.extend(logprob_to_pb(lp) for lp in step.out.logprobs)
        return resp


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec-target", description="The target (verifier) gRPC service.")
    a = p.add_argument
    a("--model-path", required=True, help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    add_server_flags(p, port=50051)
    add_model_flags(p, threads_help="intra-op CPU threads for this service's forwards (0: auto, the cores it may use "
                    "divided among the targets on this host, see --core-sharing; with --core-sharing off, torch's "
                    "default, one per core)",
                    dtype_help="weights and KV cache dtype (auto: bfloat16 on CUDA and on CPUs with native bf16 "
                    "(AVX512-BF16 / AMX), float32 on other CPUs and for a GGUF target whose weights stay packed, "
                    "where only activations take the dtype)")
    a("--gguf-weights", default="packed", choices=["packed", "dequantized"],
      help="a .gguf target on CPU: packed keeps its Q4_0 / Q4_1 projections 4-bit and multiplies them with torch's "
           "int4 kernel (a third of the bytes a token streams; rows stay bit-identical at every batch size); "
           "dequantized loads float weights, the reference. Other quant types, CUDA and CPUs without AVX2 load "
           "dequantized, said at start-up (docs/real-model.md)")
    a("--gguf-head", default="int8", choices=["int8", "int4"],
      help="with --gguf-weights packed, how a head whose weights are not 4-bit in the file (SmolLM2's tied Q8_0 "
           "embedding) is requantized: int8 per output channel (NLL as the file's) or int4 groups of 32 (faster, "
           "measurably less exact: docs/real-model.md)")
    a("--verify-torch-threads", type=int, default=0,
      help="intra-op threads for forwards that verify a model draft while sessions drafting with the model are at "
           "least half of those running (0: auto, --torch-threads "
           "less the share of the draft services on this host, so a co-located draft keeps its cores while it "
           "drafts for the other sessions; as --torch-threads when none is found)")
    a("--max-running-requests", type=int, default=64,
      help="sessions scheduled at once (each holds a KV reservation); more wait in a FIFO queue")
    a("--max-queued-requests", type=int, default=512,
      help="sessions waiting for admission; an Open beyond them gets RESOURCE_EXHAUSTED")
    a("--max-num-batched-tokens", type=int, default=512,
      help="query tokens in one batched forward (prefill chunks + decode + verify rows)")
    a("--chunked-prefill-size", type=int, default=128,
      help="prompt tokens per forward, all prompts together, while other sessions are decoding, so "
           "prompts do not stall them (with no one decoding, prompts take the whole --max-num-batched-tokens)")
    a("--kv-cache-budget-mb", type=int, default=4096,
      help="size of the paged KV pool for all sessions (on CPU, pages are mapped only as blocks are used, "
           "and blocks already used are reused first: see --prefix-cache-reserve-mb)")
    a("--kv-block-size", type=int, default=16, help="tokens per KV block")
    a("--disable-radix-cache", action="store_true",
      help="turn the prefix cache off: every prompt is computed in full (by default full KV blocks of committed "
           "tokens are kept and reused by any session whose prompt starts the same, within one cache_salt)")
    a("--prefix-cache-hidden-mb", type=int, default=256,
      help="memory for the target tap rows stored with cached blocks, so a drafter opened on a prefix hit gets "
           "the features it reads (a hit is shortened where they are missing); 0: none stored")
    a("--prefix-cache-reserve-mb", type=int, default=256,
      help="on CPU, the cached blocks nobody holds that the pool keeps in resident memory: past this, such a block "
           "is reused before a never-touched one, so RSS settles at the most KV held at once plus this; up to "
           "--kv-cache-budget-mb: a bigger cache, RSS growing toward the budget (on a GPU the cache uses the pool)")
    a("--prefix-cache-state-slots", type=int, default=32,
      help="recurrent (KDA) targets: state checkpoints kept at block boundaries (each prompt's last full "
           "block and chunk ends), one state slot each; a hit ends at the deepest checkpoint")
    a("--max-context", type=int, default=0, help="longest sequence (0: the model's max_position_embeddings)")
    a("--kda-rollback", default="snapshot", choices=["snapshot", "replay"],
      help="hybrid (KDA) targets: how a verify undoes rejected drafts in the recurrent state: snapshot (keep the "
           "state after every draft position until the step commits; fastest) or replay (keep each position's "
           "k, v, gate and beta and re-run the accepted ones; (w + 1) times less memory per verify). "
           "See docs/hybrid-targets.md")
    a("--idle-timeout-s", type=float, default=300.0,
      help="close a session that sends nothing for this long (0: never)")
    a("--attention-backend", default="torch", choices=["torch", "flashinfer"],
      help="attention over the paged KV pool: torch (SDPA over gathered blocks, any device) or flashinfer "
           "(CUDA: batch prefill over the paged cache with the rows' tree masks)")
    a("--batch-invariant", default="auto", choices=["auto", "on", "off"],
      help="compute each decode and verify token the same way whatever else is in its forward, so greedy "
           "speculation equals target-only decoding bit for bit (docs/speculation.md, 'Exact at bf16'); auto: on "
           "for bfloat16 / float16 with --attention-backend torch on one rank of a dense model")
    a("--tensor-parallel-size", "--tp-size", type=int, default=1,
      help="shard the model over this many ranks on torch.distributed (gloo on CPU, NCCL on CUDA: rank r on "
           "the r-th GPU from --device); the service process is rank 0 and spawns the others. Llama / Qwen2 / "
           "Qwen3 and the Kimi / DeepSeek-V3 family; --kv-cache-budget-mb is per rank")
    a("--nnodes", type=int, default=None,
      help="nodes the tensor-parallel group spans (SGLang's name; default: LWS_GROUP_SIZE under a "
           "LeaderWorkerSet, else 1); each node runs this command and holds --tensor-parallel-size / --nnodes ranks")
    a("--node-rank", type=int, default=None,
      help="this node's index, 0..--nnodes - 1 (default: LWS_WORKER_INDEX, else 0). Node 0 serves gRPC; "
           "another node only runs its ranks and exits when one of them does")
    a("--dist-init-addr", default=None, metavar="HOST:PORT",
      help="node 0's address for torch.distributed (PORT) and the ranks' control channels (PORT + 1) "
           "(default: LWS_LEADER_ADDRESS:20000 under a LeaderWorkerSet)")
    a("--dist-auth-key", default=None,
      help="with --nnodes > 1, required: the secret (16 bytes at least, the same on every node) the ranks and "
           "node 0's control port prove to each other (HMAC) before anything is read; whoever holds it drives "
           "the ranks. Prefer SPLITSPEC_DIST_AUTH_KEY or --dist-auth-key-file to a flag others can see in ps")
    a("--dist-auth-key-file", default=None, metavar="PATH",
      help="read --dist-auth-key from this file (e.g. a mounted Kubernetes Secret); wins over the flag")
    a("--device-memory-gb", type=float, default=None,
      help="memory of each rank's device for the start-up preflight (default: the CUDA device's free memory, "
           "or this host's available memory divided among the ranks it spawns)")
    a("--memory-reserve-mb", type=int, default=256,
      help="per rank, what the preflight keeps for activations, workspace and allocator slack on top of the "
           "weights, the KV pool and the KDA state")
    a("--tp-timeout-s", type=float, default=120.0,
      help="with --tensor-parallel-size > 1: the longest a collective may wait for a rank before the replica "
           "gives up and goes out of service (NOT_SERVING)")
    a("--sampling-backend", default="torch", choices=["torch", "flashinfer"],
      help="verification/sampling kernels: torch (reference, any device) or flashinfer (CUDA)")
    return apply_env(p)


def metrics_state(state: TargetState) -> dict:
    """What the metrics exporter reads at scrape time (no lock: lengths and counters only)."""
    sched = state.scheduler
    if sched is None:
        return {}
    return dict(running=len(sched.running), waiting=len(sched.waiting), kv_blocks_used=sched.pool.used_blocks,
                kv_blocks_free=sched.pool.free_blocks, forwards=sched.forwards, rows=sched.rows,
                prefix_cache_queries=sched.prefix_queries, prefix_cache_hits=sched.prefix_hits,
                lookahead_drafts=sched.lookahead.drafts, lookahead_draft_tokens=sched.lookahead.draft_tokens,
                lookahead_accepted_tokens=sched.lookahead.accepted_tokens)


def nodes_from_lws(args: argparse.Namespace) -> None:
    """Fill --nnodes / --node-rank / --dist-init-addr left unset from the variables a
    LeaderWorkerSet injects (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS)."""
    env = os.environ
    if args.nnodes is None:
        args.nnodes = int(env.get("LWS_GROUP_SIZE", "1"))
    if args.node_rank is None:
        args.node_rank = int(env.get("LWS_WORKER_INDEX", "0"))
    if args.dist_init_addr is None and env.get("LWS_LEADER_ADDRESS") and args.nnodes > 1:
        args.dist_init_addr = f"{env['LWS_LEADER_ADDRESS']}:20000"


def check_args(args: argparse.Namespace) -> None:
    check_ranges(args, positive=("max_running_requests", "max_num_batched_tokens", "chunked_prefill_size",
                                 "kv_cache_budget_mb", "kv_block_size", "max_message_mb"),
                 non_negative=("max_queued_requests", "prefix_cache_hidden_mb", "prefix_cache_state_slots",
                               "prefix_cache_reserve_mb", "max_context"))
    if args.tensor_parallel_size < 1:
        raise SystemExit("--tensor-parallel-size must be >= 1")
    nodes_from_lws(args)
    if args.nnodes < 1:
        raise SystemExit("--nnodes must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.nnodes > 1:
        if args.tensor_parallel_size % args.nnodes:
            raise SystemExit(f"--tensor-parallel-size {args.tensor_parallel_size} must be a multiple of --nnodes "
                             f"{args.nnodes}: every node holds the same number of ranks")
        if not args.dist_init_addr:
            raise SystemExit("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        from target_service.tp_worker import auth_key, split_addr
        try:
            split_addr(args.dist_init_addr)
            args.dist_auth_key = auth_key(args.dist_auth_key, args.dist_auth_key_file, args.nnodes).decode()
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if args.tensor_parallel_size > 1 and args.attention_backend != "torch":
        raise SystemExit("--tensor-parallel-size > 1 runs --attention-backend torch only")
    if args.tp_timeout_s <= 0:
        raise SystemExit("--tp-timeout-s must be positive")
    if not Path(args.model_path).exists():
        raise SystemExit(f"--model-path {args.model_path}: no such file or folder")
    # A .gguf file (or a folder holding one) becomes the folder of JSON files built from its
    # metadata, once, here: everything after reads a folder (splitspec/models/gguf.py).
    try:
        args.model_path = str(model_folder(args.model_path))
    except CheckpointError as exc:
        raise SystemExit(f"--model-path: {exc}") from None
    if not (Path(args.model_path) / "config.json").is_file():
        raise SystemExit(f"--model-path {args.model_path}: no config.json there; expected a Hugging Face model "
                         "folder or a .gguf file")


def attention_mode(args: argparse.Namespace, model) -> str:
    """The runner's attention: the backend, or "torch-exact" where --batch-invariant asks for it.
    At float32 the BLAS's own row-count dependence is below the argmax's resolution here (0 of
    200 prompts diverged) and the exact path only costs; at bfloat16 greedy speculation left
    target-only decoding on 93 of 200 prompts without it, 0 with it (docs/speculation.md)."""
    dtype = next(model.parameters()).dtype
    possible = (args.attention_backend == "torch" and getattr(args, "tensor_parallel_size", 1) == 1
                and getattr(model.cfg, "hybrid", None) is None)
    if args.batch_invariant == "on" and not possible:
        raise ConfigError("--batch-invariant on needs --attention-backend torch, one rank and a dense (Llama / Qwen) "
                          "model")
    # Packed GGUF weights: on at every dtype, as it costs little there (the int4 kernel's rows are
    # invariant already; attention is one native call a layer).
    on = args.batch_invariant == "on" or (args.batch_invariant == "auto" and possible
                                          and (dtype in (torch.bfloat16, torch.float16) or is_packed(model)))
    logs.get_logger().info("batch_invariant", on=on, requested=args.batch_invariant, dtype=str(dtype))
    return "torch-exact" if on else args.attention_backend


def _load(args: argparse.Namespace):
    device = resolve_device(args.device)
    packed = getattr(args, "tensor_parallel_size", 1) == 1 and serves_packed(args.model_path, device,
                                                                           getattr(args, "gguf_weights", "packed"))
    dtype = resolve_dtype(args.dtype, device, packed)
    logs.get_logger().info("serving_dtype", dtype=dtype, requested=args.dtype, device=str(device),
                           cpu_native_bf16=device.type == "cpu" and cpu_has_native_bf16(), packed_weights=packed)
    # Before anything is allocated: refuse a target that cannot fit, with the numbers. Host memory
    # is shared by the ranks of this node only.
    nodes = getattr(args, "nnodes", 1) or 1
    mem = preflight.check(args.model_path, world=getattr(args, "tensor_parallel_size", 1), dtype=dtype, device=device,
                          local_ranks=getattr(args, "tensor_parallel_size", 1) // nodes,
                          kv_budget_mb=args.kv_cache_budget_mb, max_sessions=args.max_running_requests + (
                              0 if getattr(args, "disable_radix_cache", True) else args.prefix_cache_state_slots),
                          reserve_mb=args.memory_reserve_mb, device_memory_gb=args.device_memory_gb)
    logs.get_logger().info("memory_preflight", per_rank_gib=round(mem.total / preflight.GIB, 3),
                           experts_gib=round(mem.experts / preflight.GIB, 3), trunk_gib=round(mem.trunk / preflight.GIB, 3),
                           kv_gib=round(mem.kv / preflight.GIB, 3), device=mem.device_name)
    logs.get_logger().info("memory_plateau", **preflight.plateau(mem, device=device, features_mb=0 if getattr(
        args, "disable_radix_cache", True) else args.prefix_cache_hidden_mb))
    if getattr(args, "tensor_parallel_size", 1) > 1:
        from target_service import tp_worker
        model = tp_worker.start(args.model_path, args.tensor_parallel_size, dtype=parse_dtype(dtype), device=device,
                                timeout_s=args.tp_timeout_s, torch_threads=args.torch_threads,
                                nnodes=getattr(args, "nnodes", 1) or 1, dist_init_addr=getattr(args, "dist_init_addr", None),
                                auth_key=(getattr(args, "dist_auth_key", None) or "").encode())
        return model, make_verifier(args.sampling_backend, device)
    model = load_model(args.model_path, dtype=parse_dtype(dtype), device=device,
                       gguf_weights=getattr(args, "gguf_weights", "packed"), gguf_head=getattr(args, "gguf_head", "int8"))
    if args.attention_backend == "flashinfer":
        check_attention_backend(device)
    return model, make_verifier(args.sampling_backend, device)


async def serve(args: argparse.Namespace, *, load=_load, started=None, share: HostShare | None = None) -> None:
    """Listen at once (health NOT_SERVING), load and warm up on the engine thread, then go
    SERVING. `load` and `started` (called with the Server once listening) are seams for tests.
    `share`: this process's entry in the host's core registry (splitspec/colocation.py)."""
    log = logs.get_logger()
    server = Server.from_args([SERVICE], args)
    state = TargetState(args)
    metrics = serve_engine_metrics(args, lambda: metrics_state(state), log)
    add_lenient_servicer(server.grpc, SERVICE, TargetServicer(state, server), {
        "Session": ("stream_stream", target_pb2.TargetRequest, target_pb2.TargetResponse),
        "GetInfo": ("unary_unary", common_pb2.GetInfoRequest, target_pb2.TargetInfo)})
    port = await server.start(args.host, args.port)
    log.info("listening", host=args.host, port=port, model_path=str(args.model_path))
    if started is not None:
        started(server)
    engine = EngineLoop()
    tp_driver = []      # rank 0's TensorParallelDriver once loaded, stopped with the service

    async def startup():
        t = time.perf_counter()
        model, verifier = await engine.submit("load", lambda: load(args))
        cfg = model.cfg
        if hasattr(model, "on_failure"):
            loop = asyncio.get_running_loop()

            def out_of_service(why: str):
                # From the TP monitor thread: refuse new streams and leave load balancers' rotation.
                state.failure = why
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(server.set_serving(False)))
            model.on_failure = out_of_service
            tp_driver.append(model)
        max_context = args.max_context or cfg.max_position_embeddings
        if max_context > cfg.max_position_embeddings:
            raise ConfigError(f"--max-context {max_context} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        if cfg.hybrid is not None and args.attention_backend != "torch":
            raise ConfigError(f"--attention-backend {args.attention_backend} does not run {cfg.architecture}'s "
                              f"MLA / KDA layers; use --attention-backend torch")
        # A hybrid (KDA / MLA) target gets a pool of MLA latent rows plus one recurrent-state slot
        # per running session (pools.py); an attention model the plain KV pool.
        pool = make_pool(model, budget_bytes=args.kv_cache_budget_mb * 1024 * 1024, block_size=args.kv_block_size,
                         max_sessions=args.max_running_requests, rollback=args.kda_rollback,
                         prefix_cache=not args.disable_radix_cache,
                         feature_budget_bytes=args.prefix_cache_hidden_mb * 1024 * 1024,
                         state_checkpoints=args.prefix_cache_state_slots,
                         cache_reserve_bytes=args.prefix_cache_reserve_mb * 1024 * 1024)
        sched = Scheduler(model, verifier=verifier, pool=pool, max_running=args.max_running_requests,
                          max_queued=args.max_queued_requests, max_batched_tokens=args.max_num_batched_tokens,
                          chunked_prefill_size=args.chunked_prefill_size, max_context=max_context, engine=engine,
                          attention=attention_mode(args, model), verify_threads=args.verify_torch_threads,
                          model_id=state.model_id)
        load_s = time.perf_counter() - t
        warm_ms = await sched.warmup()
        if metrics is not None:
            sched.on_forward = metrics.on_forward
        if tracing.enabled():
            sched.on_batch = tracing.forward
        if share is not None:
            # The engine thread switches to these before each forward (Scheduler.verify_threads).
            def apply(plan):
                sched.threads, sched.verify_threads = plan.threads, plan.verify_threads
            server.keep(follow_from_now(share, apply, log))
        state.grammars = Grammars(args.model_path, cfg.vocab_size, cfg.eos_token_ids)
        state.scheduler = sched
        log.info("serving", model_id=state.model_id, architecture=cfg.architecture, layers=cfg.num_hidden_layers,
                 vocab_size=cfg.vocab_size, max_context=max_context, dtype=str(sched.dtype).removeprefix("torch."),
                 kv_blocks=pool.capacity_blocks, kv_block_size=pool.block_size, attention_backend=args.attention_backend,
                 prefix_cache=pool.cache is not None,
                 state_checkpoint_mb=round(pool.cache.state_slots * pool.states.bytes_per_slot / 2**20, 1)
                 if pool.cache is not None and pool.states is not None else 0,
                 load_s=round(load_s, 3), warmup_ms=round(warm_ms, 1), sampling_backend=verifier.name,
                 tensor_parallel_size=getattr(model, "world", 1))

    def refuse_new():
        if state.scheduler is not None:
            state.scheduler.accepting = False
    try:
        await server.run(startup(), args.drain_timeout_s, on_drain=refuse_new)
    finally:
        engine.stop()
        for driver in tp_driver:
            driver.close()


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_args(args)
    start_observing("target", args)
    if args.node_rank > 0:
        # Another node of a multi-node group: no gRPC; its ranks join node 0's and serve its forwards.
        from target_service import tp_worker
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        sys.exit(tp_worker.launch_node(args.model_path, args.tensor_parallel_size, nnodes=args.nnodes,
                                       node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
                                       dtype=parse_dtype(dtype), device=device, timeout_s=args.tp_timeout_s,
                                       torch_threads=args.torch_threads, auth_key=args.dist_auth_key.encode()))
    share = start_share("target", args, logs.get_logger())      # sets this process's threads
    run_main("splitspec-target", serve(args, share=share), (BackendError, AttentionBackendError, ConfigError,
                                                            CheckpointError, ValueError, preflight.PreflightError,
                                                            TensorParallelError), share)


if __name__ == "__main__":
    main()
