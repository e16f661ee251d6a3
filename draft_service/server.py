"""gRPC adapter of the draft service: `Draft.Session` (Open, Propose, Close per sequence) and
`GetInfo`, over a proposer per session (`dflash` or model-free `ngram`), plus the
`splitspec-draft` command. Every drafter forward runs on one engine-loop thread, as on the
target, so gRPC handlers never call the model.

    splitspec-draft --model-path models/splitspec-code-draft \
        --target-model-path models/splitspec-code-target --port 50052
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from splitspec import logs, tracing
from splitspec.colocation import HostShare
from splitspec.colocation import follow_from_now
from splitspec.colocation import start as start_share
from splitspec.flags import apply_env, check_ranges
from splitspec.metrics import serve_engine_metrics
from splitspec.serving import (AdmissionError, DrainingError, ProtocolError, Server, add_lenient_servicer,
                               add_model_flags, add_server_flags, end_session, read_message, run_main, start_observing,
                               status_for)
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from splitspec.wire import (WireError, check_token_ids, dtype_name, dtype_to_pb, sampling_from_pb, tensor_from_pb,
                            tensor_to_pb)
from splitspec.models.config import ConfigError, ModelConfig
from splitspec.models.loader import CheckpointError, model_folder, parse_dtype, resolve_device, resolve_dtype, tokenizer_hash
from splitspec.engine.kv_pool import KVPool, PoolExhausted
from splitspec.engine.tree import MAX_DRAFT_NODES
from splitspec.engine.loop import EngineLoop

from .architectures import load_draft
from .dflash import BLOCK_SIZE_MEANINGS
from .proposer import (MAX_NGRAM_TOPK, DFlashProposer, NgramProposer, ProposerError, StaleProposeError,
                       check_hidden_start, context_window, max_topk)
from .scheduler import DraftScheduler

SERVICE = "splitspec.v1.Draft"
METHODS = ("dflash", "ngram")


class CompatError(Exception):
    """The caller's target is not the one this draft was built for: FAILED_PRECONDITION."""


def draft_status(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, StaleProposeError):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, CompatError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, PoolExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    from splitspec.grammar import GrammarBusy
    return status_for(exc, [(GrammarBusy, grpc.StatusCode.RESOURCE_EXHAUSTED)])


@dataclass
class DraftState:
    args: argparse.Namespace
    method: str
    target_cfg: ModelConfig | None
    target_tok_hash: str
    model: object = None            # DFlashDraft once loaded (dflash only)
    engine: EngineLoop | None = None
    scheduler: DraftScheduler | None = None
    pool: KVPool | None = None
    active: int = 0
    accepting: bool = True
    grammars: object = None         # splitspec.grammar.Grammars (the target's tokenizer), for constraints

    @property
    def block_size(self) -> int:
        return self.model.cfg.block_size if self.model is not None else self.args.speculative_num_draft_tokens

    @property
    def vocab_size(self) -> int | None:
        return self.target_cfg.vocab_size if self.target_cfg else None

    @property
    def hidden_dtype(self) -> torch.dtype | None:
        """The dtype hidden states must arrive in (DraftInfo.hidden_dtype): --hidden-dtype, by
        default the weights'. None for ngram (it takes none)."""
        if self.model is None:
            return None
        if self.args.hidden_dtype != "auto":
            return parse_dtype(self.args.hidden_dtype)
        return next(self.model.parameters()).dtype

    def hidden(self, msg, field: str, shape) -> torch.Tensor:
        """Decode hidden states, refusing any dtype but the negotiated one by name: a gateway
        that opened its target session without asking for it would otherwise have them cast
        here, silently, on every step."""
        want = self.hidden_dtype
        return tensor_from_pb(msg, field=field, shape=shape, allowed=(want,),
                              expected=f"this draft takes {dtype_name(dtype_to_pb(want))} hidden states, "
                                       f"DraftInfo.hidden_dtype: open the target session with that hidden_dtype")


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, state: DraftState, server: Server):
        self.state = state
        self.server = server

    async def GetInfo(self, request, context):
        st = self._ready_state()
        if st is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the draft is loading; retry when health is SERVING")
        info = draft_pb2.DraftInfo(method=st.method, block_size=st.block_size, active_sessions=st.active,
                                   max_sessions=st.args.max_running_requests,
                                   target_tokenizer_hash=st.target_tok_hash,
                                   model_id=st.args.served_model_name or (Path(st.args.model_path).name
                                                                          if st.args.model_path else "ngram"))
        info.max_topk = max_topk(st.model) if st.model is not None else MAX_NGRAM_TOPK
        info.max_draft_nodes = MAX_DRAFT_NODES
        if st.target_cfg is not None:
            info.target_vocab_size = st.target_cfg.vocab_size
            info.target_num_layers = st.target_cfg.num_hidden_layers
            info.target_hidden_size = st.target_cfg.hidden_size
        if st.model is not None:
            cfg = st.model.cfg
            info.architecture = cfg.ARCHITECTURE
            info.target_hidden_stream = cfg.aux_hidden_stream
            info.mask_token_id = cfg.mask_token_id
            info.target_layer_ids.extend(cfg.target_layer_ids)
            info.dtype = str(next(st.model.parameters()).dtype).removeprefix("torch.")
            info.hidden_dtype = dtype_to_pb(st.hidden_dtype)
            info.context_window = context_window(st.model)
        if st.pool is not None:
            info.kv_block_size = st.pool.block_size
            info.kv_blocks_used = st.pool.used_blocks
            info.kv_blocks_free = st.pool.free_blocks
        if st.scheduler is not None:
            info.forward_passes = st.scheduler.forwards
            info.batched_steps = st.scheduler.rows
            info.busy_ms = st.scheduler.busy_ms
        return info

    def _ready_state(self) -> DraftState | None:
        return self.state if self.server.serving and self.state.engine is not None else None

    @tracing.serve_stream("draft.session")      # the caller's traceparent parents the stream's span
    async def Session(self, request_iterator, context):
        st = self._ready_state()
        if st is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the draft is loading; retry when health is SERVING")
        proposer, session_id, counted = None, None, False
        log = logs.get_logger(peer=context.peer())
        try:
            while True:
                req = await self._read(context, idle=proposer is not None)
                if req is grpc.aio.EOF:
                    break
                kind = req.WhichOneof("kind")
                if kind == "open":
                    if proposer is not None:
                        raise ProtocolError("a second Open on one stream; open a new stream per sequence")
                    if not st.accepting:
                        raise DrainingError("the draft is draining (shutting down)")
                    if st.active >= st.args.max_running_requests:
                        raise AdmissionError(f"the draft already has {st.active} open sessions "
                                             f"(--max-running-requests {st.args.max_running_requests})")
                    st.active += 1
                    counted = True
                    session_id = req.open.session_id or uuid.uuid4().hex
                    log = log.bind(session_id=session_id)
                    proposer, width = await self._open(st, req.open)
                    log.info("session_opened", method=req.open.speculative.method or st.method, num_draft_tokens=width,
                             prompt_len=len(req.open.prompt_token_ids), active_sessions=st.active)
                    await context.write(draft_pb2.DraftResponse(opened=draft_pb2.DraftOpened(
                        session_id=session_id, method="ngram" if isinstance(proposer, NgramProposer) else "dflash",
                        num_draft_tokens=width)))
                elif kind is None:
                    raise WireError("DraftRequest.kind is not set: send open, propose or close")
                elif proposer is None:
                    raise ProtocolError(f"{kind} before open: the first message must be Open")
                elif kind == "propose":
                    await context.write(await self._propose(st, proposer, req.propose))
                else:
                    await context.write(draft_pb2.DraftResponse(closed=draft_pb2.DraftClosed()))
                    break
        except (asyncio.CancelledError, Exception) as exc:     # ends this stream only, never the service
            await end_session(context, exc, draft_status, log)
        finally:
            if isinstance(proposer, DFlashProposer):
                st.scheduler.close(proposer)
            if counted:
                st.active -= 1
                log.info("session_closed", active_sessions=st.active)

    async def _read(self, context, idle: bool):
        timeout = self.state.args.idle_timeout_s if idle and self.state.args.idle_timeout_s > 0 else None
        return await read_message(context, timeout, "its draft cache was freed")

    async def _open(self, st: DraftState, msg: draft_pb2.DraftOpen):
        if st.target_tok_hash and msg.target_tokenizer_hash and msg.target_tokenizer_hash != st.target_tok_hash:
            raise CompatError(f"open.target_tokenizer_hash {msg.target_tokenizer_hash} differs from the tokenizer "
                              f"this draft was built for ({st.target_tok_hash}): pair the draft with its own target")
        prompt = list(msg.prompt_token_ids)
        if not prompt:
            raise WireError("open.prompt_token_ids is empty: at least one token id is needed")
        if st.vocab_size:
            check_token_ids(prompt, st.vocab_size, "open.prompt_token_ids")
        if len(prompt) >= st.args.max_context:
            raise WireError(f"open.prompt_token_ids has {len(prompt)} tokens; the draft's max context is "
                            f"{st.args.max_context} (--max-context)")
        spec = msg.speculative
        method = spec.method.lower() or st.method
        if method not in METHODS:
            raise WireError(f"open.speculative.method = {spec.method!r}: this draft serves {' or '.join(METHODS)}")
        if method == "dflash" and st.model is None:
            raise CompatError("open.speculative.method = dflash, but this draft service runs --method ngram "
                              "without a DFlash model")
        if spec.draft_sampling not in ("", "greedy", "sample"):
            raise WireError(f"open.speculative.draft_sampling = {spec.draft_sampling!r}: expected greedy or sample")
        default_width = st.block_size if method == "dflash" else st.args.speculative_num_draft_tokens
        width = spec.num_draft_tokens if spec.HasField("num_draft_tokens") and spec.num_draft_tokens else default_width
        steps = spec.num_steps if spec.HasField("num_steps") and spec.num_steps else None
        topk = spec.topk if spec.HasField("topk") and spec.topk else 1
        if topk == 1 and steps is not None and steps + 1 < width:
            width = steps + 1
        sampling = sampling_from_pb(msg.sampling)
        if method == "ngram":
            if width < 2:
                raise WireError(f"open.speculative.num_draft_tokens = {width} must be >= 2")
            try:
                proposer = NgramProposer(num_draft_tokens=width, min_n=st.args.ngram_min, max_n=st.args.ngram_max,
                                         num_steps=steps, topk=topk)
            except ProposerError as exc:
                raise WireError(f"open.{exc}") from exc
            if msg.prompt_hidden_start:
                raise WireError(f"open.prompt_hidden_start = {msg.prompt_hidden_start}, but an ngram session takes "
                                "no features (DraftInfo.context_window = 0): send 0")
            proposer.open(prompt)
            return proposer, proposer.width
        cfg = st.model.cfg
        start = msg.prompt_hidden_start
        try:
            check_hidden_start(st.model, len(prompt), start)
        except ProposerError as exc:
            raise WireError(f"open.{exc}") from exc
        rows = len(prompt) - start
        dims = list(msg.prompt_hidden.shape)
        if start and dims and dims[0] != rows:
            raise WireError(f"open.prompt_hidden.shape is {dims}, but open.prompt_hidden_start = {start} of a "
                            f"{len(prompt)}-token prompt needs {rows} rows: send the features of prompt positions "
                            f"{start} .. {len(prompt) - 1}, or prompt_hidden_start = {len(prompt) - dims[0]}")
        hidden = st.hidden(msg.prompt_hidden, "open.prompt_hidden", (rows, cfg.target_feature_size))

        try:
            p = DFlashProposer(st.model, num_draft_tokens=width, max_len=st.args.max_context, num_steps=steps,
                               topk=topk, sampling=sampling if spec.draft_sampling == "sample" else None, pool=st.pool)
        except ProposerError as exc:      # the shape the client asked for: name its field on the wire
            raise WireError(f"open.{exc}") from exc
        if msg.sampling.HasField("constraint") and st.grammars is not None:
            # Drafts that respect the request's grammar (a chain: the target masks and prunes
            # whatever it gets; this only saves it rejected drafts). The output so far has
            # already moved the grammar on.
            from splitspec.grammar import Guide
            p.guide = Guide(await st.grammars.compile_async(msg.sampling.constraint), st.vocab_size)
            if msg.generated_tokens:
                p.guide.advance(prompt[-msg.generated_tokens:])
        try:
            await st.scheduler.open(p, prompt, hidden, start)
        except BaseException:
            st.scheduler.close(p)
            raise
        return p, p.width

    async def _propose(self, st: DraftState, proposer, msg: draft_pb2.DraftPropose):
        new_ids = list(msg.new_token_ids)
        if st.vocab_size:
            check_token_ids(new_ids, st.vocab_size, "propose.new_token_ids")
        hidden = None
        ngram = isinstance(proposer, NgramProposer)
        if msg.HasField("new_hidden") and not ngram:
            hidden = st.hidden(msg.new_hidden, "propose.new_hidden", (None, st.model.cfg.target_feature_size))
        queue_ms, batch = 0.0, 1
        if ngram:
            prop = proposer.propose(msg.base_len, new_ids)      # microseconds: no need for the engine
        else:
            drafted = await st.scheduler.propose(proposer, msg.base_len, new_ids, hidden)
            prop, queue_ms, batch = drafted.proposal, drafted.queue_ms, drafted.batch_size
        resp = draft_pb2.DraftResponse()        # filled in place: no Proposal (and probs) to copy into it
        out = resp.proposal
        out.base_len, out.draft_ms, out.queue_ms, out.batch_size = msg.base_len, prop.draft_ms, queue_ms, batch
        out.tree.token_ids.extend(prop.tree.token_ids)
        out.tree.parents.extend(prop.tree.parents)
        if prop.draft_probs is not None:
            tensor_to_pb(prop.draft_probs, torch.float32, out=out.draft_probs)
        return resp


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec-draft", description="The draft (proposer) gRPC service.")
    a = p.add_argument
    a("--model-path", default=None, help="DFlash draft folder (config.json + model.safetensors); "
                                         "not needed with --method ngram")
    a("--target-model-path", default=None,
      help="the target's Hugging Face folder: embed_tokens/lm_head, vocab and tokenizer come from it")
    a("--method", default="dflash", choices=METHODS, help="dflash (block diffusion) or ngram (prompt lookup)")
    add_server_flags(p, port=50052)
    add_model_flags(p, threads_help="intra-op CPU threads for this service's forwards (0: auto, its share of the "
                    "cores it may use with the targets and drafts on this host, see --core-sharing; with "
                    "--core-sharing off, torch's default, one per core)",
                    dtype_help="draft weights dtype (auto: as the target's auto, bfloat16 on CUDA and on CPUs "
                    "with native bf16, float32 elsewhere)")
    a("--hidden-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
      help="dtype the target's hidden states cross the wire in (DraftInfo.hidden_dtype; the gateway asks the "
           "target for it, others are refused); auto: the draft's weights dtype. bfloat16 with float32 weights "
           "halves the bytes per step at a rounding of the draft's inputs (verification stays exact)")
    a("--block-size-means", default="verify_width", choices=BLOCK_SIZE_MEANINGS,
      help="how to read the checkpoint's block_size: the verify width B (z-lab, SGLang) or the "
           "number of drafted tokens B - 1")
    a("--speculative-num-draft-tokens", type=int, default=8,
      help="verify width for --method ngram (dflash uses the checkpoint's block size)")
    a("--ngram-min", type=int, default=1, help="shortest suffix n-gram to look up (ngram)")
    a("--ngram-max", type=int, default=4, help="longest suffix n-gram to look up (ngram)")
    a("--max-running-requests", type=int, default=256,
      help="open sessions at once (all are batched together); more get RESOURCE_EXHAUSTED")
    a("--max-num-batched-tokens", type=int, default=2048,
      help="context rows appended + block tokens drafted in one batched draft forward")
    a("--kv-cache-budget-mb", type=int, default=1024,
      help="size of the draft's paged context KV pool for all sessions (blocks are touched only when used)")
    a("--kv-block-size", type=int, default=16, help="tokens per draft KV block")
    a("--max-context", type=int, default=4096, help="longest sequence a session may reach")
    a("--idle-timeout-s", type=float, default=300.0, help="close a session silent for this long (0: never)")
    return apply_env(p)


def metrics_state(state: DraftState) -> dict:
    """What the metrics exporter reads at scrape time. n-gram sessions count as running but
    never reach the engine."""
    if state.engine is None:
        return {}
    out = dict(running=state.active)
    if state.pool is not None:
        out.update(kv_blocks_used=state.pool.used_blocks, kv_blocks_free=state.pool.free_blocks)
    if state.scheduler is not None:
        out.update(forwards=state.scheduler.forwards, rows=state.scheduler.rows,
                   proposals_waiting=len(state.scheduler.pending))
    return out


def check_args(args: argparse.Namespace) -> None:
    if args.target_model_path:      # a .gguf target: the folder built from its metadata (splitspec/models/gguf.py)
        if not Path(args.target_model_path).exists():
            raise SystemExit(f"--target-model-path {args.target_model_path}: no such file or folder")
        try:
            args.target_model_path = str(model_folder(args.target_model_path))
        except CheckpointError as exc:
            raise SystemExit(f"--target-model-path: {exc}") from None
    if args.method == "dflash":
        for flag, value in (("--model-path", args.model_path), ("--target-model-path", args.target_model_path)):
            if not value or not (Path(value) / "config.json").is_file():
                raise SystemExit(f"{flag} {value}: no config.json there (--method dflash needs the draft "
                                 f"and its target's folders)")
    check_ranges(args, positive=("max_running_requests", "max_num_batched_tokens", "kv_cache_budget_mb",
                                 "kv_block_size", "max_message_mb", "max_context"))
    if not 1 <= args.ngram_min <= args.ngram_max:
        raise SystemExit("--ngram-min must be >= 1 and <= --ngram-max")


def _load(args: argparse.Namespace):
    if args.method != "dflash":
        return None
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    return load_draft(args.model_path, args.target_model_path, dtype=parse_dtype(dtype), device=device,
                      block_size_means=args.block_size_means)


def _warmup(model, pool) -> float:
    """One real draft forward over a 1-token context, so the first request pays nothing lazy."""
    if model is None:
        return 0.0
    t = time.perf_counter()
    p = DFlashProposer(model, max_len=8, pool=pool)
    p.open([0], torch.zeros(1, model.cfg.target_feature_size))
    p.propose(2, [0], None)
    p.close()
    return (time.perf_counter() - t) * 1e3


def _pool(args: argparse.Namespace, model) -> KVPool | None:
    if model is None:
        return None
    cfg, p = model.cfg, next(model.parameters())
    return KVPool.from_budget(args.kv_cache_budget_mb * 1024 * 1024, num_layers=len(model.layers),
                              num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                              block_size=args.kv_block_size, dtype=p.dtype, device=p.device)


async def serve(args: argparse.Namespace, *, started=None, share: HostShare | None = None) -> None:
    log = logs.get_logger()
    target_path = Path(args.target_model_path) if args.target_model_path else None
    target_cfg = ModelConfig.from_dir(target_path) if target_path else None
    state = DraftState(args, args.method, target_cfg, tokenizer_hash(target_path) if target_path else "")
    if target_path is not None and (target_path / "tokenizer.json").is_file():
        from splitspec.grammar import Grammars
        state.grammars = Grammars(target_path, target_cfg.vocab_size, target_cfg.eos_token_ids)
    server = Server.from_args([SERVICE], args)
    metrics = serve_engine_metrics(args, lambda: metrics_state(state), log)
    add_lenient_servicer(server.grpc, SERVICE, DraftServicer(state, server), {
        "Session": ("stream_stream", draft_pb2.DraftRequest, draft_pb2.DraftResponse),
        "GetInfo": ("unary_unary", common_pb2.GetInfoRequest, draft_pb2.DraftInfo)})
    port = await server.start(args.host, args.port)
    log.info("listening", host=args.host, port=port, method=args.method, model_path=args.model_path)
    if started is not None:
        started(server)
    engine = EngineLoop("draft-engine-loop")

    async def startup():
        t = time.perf_counter()
        state.model = await engine.submit("load", lambda: _load(args))
        state.pool = _pool(args, state.model)
        warm_ms = await engine.submit("warmup", lambda: _warmup(state.model, state.pool))
        if state.model is not None:
            state.scheduler = DraftScheduler(state.model, max_batched_tokens=args.max_num_batched_tokens,
                                             engine=engine)
            if metrics is not None:
                state.scheduler.on_forward = metrics.on_forward
            if share is not None:
                sched = state.scheduler

                def apply(plan):            # the engine thread switches before its next forward
                    sched.threads = plan.threads
                server.keep(follow_from_now(share, apply, log))
        state.engine = engine
        info = {"block_size": state.block_size}
        if state.model is not None:
            info.update(target_layer_ids=list(state.model.cfg.target_layer_ids),
                        layers=state.model.cfg.num_hidden_layers, mask_token_id=state.model.cfg.mask_token_id)
        log.info("serving", method=args.method, load_s=round(time.perf_counter() - t, 3),
                 warmup_ms=round(warm_ms, 1), **info)

    def refuse_new():
        state.accepting = False
    try:
        await server.run(startup(), args.drain_timeout_s, on_drain=refuse_new)
    finally:
        engine.stop()


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_args(args)
    start_observing("draft", args)
    # An n-gram draft runs no model: it takes no share of the cores from a co-located target.
    share = None
    if args.method == "dflash":
        share = start_share("draft", args, logs.get_logger())      # sets this process's threads
    elif args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    run_main("splitspec-draft", serve(args, share=share), (ConfigError, CheckpointError, ValueError,
                                                           json.JSONDecodeError), share)


if __name__ == "__main__":
    main()
