"""Speaking to the services a bench measures: one gRPC Generate stream per request, timed by the
client (`Gateway.run` → `Sample`), batches of them with a number of streams in flight, the services'
GetInfo counters, and the target's own step prices (`step_prices`)."""
from __future__ import annotations

import queue
import random
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from splitspec.engine.sample import SamplingParams
from splitspec.v1 import common_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from splitspec_tools.client import build_request


def sampling(temperature: float, top_p: float, seed: int) -> SamplingParams:
    return SamplingParams() if temperature == 0 else SamplingParams(temperature=temperature, top_p=top_p, seed=seed)


@dataclass
class Sample:
    """One request as the client saw it, and the gateway's stats of it."""
    tokens: list[int]
    start_s: float                         # perf_counter() when the request was sent
    wall_s: float                          # request sent -> last token received
    ttft_s: float                          # request sent -> first token received
    step_times: list[float] = field(default_factory=list)   # s since start when each chunk arrived
    step_sizes: list[int] = field(default_factory=list)     # tokens per chunk after the first (τ per step)
    verify_steps: int = 0
    committed: int = 0                     # tokens committed by those steps (the first token excluded)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    wire_ms: float = 0.0
    queue_ms: float = 0.0
    steps_by_method: dict = field(default_factory=dict)
    method_ran: str = ""
    draft_fallbacks: int = 0
    prompt_tokens: int = 0                 # the Complete's Usage
    cached_tokens: int = 0
    finish_reason: str = ""
    text: str = ""                         # the chunks' detokenized text
    stats: object = None                   # the Complete's SpeculativeStats, whole

    @property
    def end_s(self) -> float:
        return self.start_s + self.wall_s

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency after the first token: (t_last - t_first) / (n - 1)."""
        n = len(self.tokens)
        return (self.step_times[-1] - self.ttft_s) / (n - 1) if n > 1 and self.step_times else None


def request(prompt_ids, max_new: int, params: SamplingParams, *, method: str = "", width: int = 0,
            tree: tuple[int, int] | None = None, depth: int | None = None, draft_sampling: str = "greedy",
            salt: str = "", ignore_eos: bool = True):
    """A Generate request of token ids. Without a width the gateway's speculative defaults apply,
    as a plain client gets them; `tree` = (topk, width) drafts a token tree instead of a chain."""
    kw = dict(temperature=params.temperature, seed=params.seed)
    if not params.greedy:
        kw.update(top_p=params.top_p, top_k=params.top_k or None)
    req = build_request(prompt_ids if isinstance(prompt_ids, str) else list(prompt_ids), max_new_tokens=max_new,
                        ignore_eos=ignore_eos, method=method, cache_salt=salt, **kw)
    if method not in ("", "none") and width:
        topk, width = tree or (1, width)
        req.speculative.num_draft_tokens, req.speculative.topk = width, topk
        req.speculative.num_steps = min(width - 1, depth or width - 1)
        req.speculative.draft_sampling = draft_sampling
    return req


class Gateway:
    """Generate requests to one gateway over a real socket. The request's speculative settings:
    `method`, a chain of `width` (root + drafted tokens) or a tree (topk, width), draft sampling; and
    the cache_salt of them all."""

    def __init__(self, address: str, method: str = "", width: int = 0, draft_sampling: str = "greedy",
                 timeout_s: float = 900.0, tree: tuple[int, int] | None = None, depth: int | None = None,
                 salt: str = ""):
        self.address, self.method, self.width, self.tree, self.depth = address, method, width, tree, depth
        self.draft_sampling, self.timeout_s, self.salt = draft_sampling, timeout_s, salt
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = gateway_pb2_grpc.GenerationStub(self.channel)

    def request(self, prompt_ids, max_new: int, params: SamplingParams, **kw):
        return request(prompt_ids, max_new, params, method=self.method, width=self.width, tree=self.tree,
                       depth=self.depth, draft_sampling=self.draft_sampling, salt=self.salt, **kw)

    def run(self, prompt_ids, max_new: int, params: SamplingParams, **kw) -> Sample:
        return self.send(self.request(prompt_ids, max_new, params, **kw))

    def send(self, req) -> Sample:
        """One request; the gateway streams one chunk per step (the prefill's token first)."""
        tokens, sizes, times, text, complete = [], [], [], [], None
        t0 = time.perf_counter()
        for resp in self.stub.Generate(req, timeout=self.timeout_s):
            if resp.HasField("chunk"):
                text.append(resp.chunk.text)
                if resp.chunk.token_ids:
                    tokens.extend(resp.chunk.token_ids)
                    sizes.append(len(resp.chunk.token_ids))
                    times.append(time.perf_counter() - t0)
            else:
                complete = resp.complete
        if complete is None or not times:
            raise RuntimeError(f"{self.address}: Generate ended without tokens or without Complete")
        st = complete.stats
        return Sample(tokens=tokens, start_s=t0, wall_s=time.perf_counter() - t0, ttft_s=times[0], step_times=times,
                      step_sizes=sizes[1:], verify_steps=st.verify_steps,
                      committed=round(st.accept_length * st.verify_steps),
                      accepted_per_position=list(st.accepted_per_position), draft_tokens=st.draft_tokens,
                      draft_ms=st.draft_ms, verify_ms=st.verify_ms, wire_ms=st.wire_ms, queue_ms=st.queue_ms,
                      steps_by_method=dict(st.steps_by_method), method_ran=st.method, draft_fallbacks=st.draft_fallbacks,
                      prompt_tokens=complete.usage.prompt_tokens, cached_tokens=complete.usage.cached_tokens,
                      finish_reason=complete.finish_reason, text="".join(text), stats=st)

    def batch(self, reqs: list, streams: int) -> tuple[list[Sample], float]:
        """The requests with `streams` in flight; (samples in order, the batch's wall time)."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, streams)) as pool:
            out = list(pool.map(self.send, reqs))
        return out, time.perf_counter() - t0

    def info(self):
        return self.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=60)

    def close(self) -> None:
        self.channel.close()


def tok_s(samples: list[Sample], wall_s: float) -> float:
    return sum(len(s.tokens) for s in samples) / wall_s


# ------------------------------------------------------------------------------ the services' own numbers

def target_info(address: str, kind: str = "target"):
    """A target's (or a draft's) GetInfo."""
    with grpc.insecure_channel(address) as ch:
        stub = target_pb2_grpc.TargetStub if kind == "target" else draft_pb2_grpc.DraftStub
        return stub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=30)


def counters(address: str | None, kind: str) -> tuple[int, int] | None:
    """(forward_passes, batched_steps) from a target's or draft's GetInfo; None when unknown."""
    try:
        info = target_info(address, kind) if address else None
    except grpc.RpcError:
        return None
    return (info.forward_passes, info.batched_steps) if info else None


def prometheus(url: str, pattern: str) -> dict[str, float]:
    """{first group: float(second group)} of the lines of a service's /metrics that match `pattern`."""
    import urllib.request
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {k: float(v) for k, v in re.findall(pattern, text, re.MULTILINE)}


def mean_batch(before, after) -> float | None:
    """Steps per forward between two `counters` readings; None with no forward."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


class _Session:
    """A blocking Target.Session stream, one request at a time."""

    def __init__(self, stub):
        self.q: queue.Queue = queue.Queue()
        self.responses = stub.Session(iter(self.q.get, None), timeout=600)

    def ask(self, **kw):
        self.q.put(target_pb2.TargetRequest(**kw))
        return next(self.responses)

    def close(self) -> None:
        try:
            self.ask(close=target_pb2.TargetClose())
        finally:
            self.q.put(None)


def step_prices(address: str, prompts: list[list[int]], widths: list[int], rounds: int = 8) -> dict[int, float]:
    """Median forward_ms the target reports for a decode step (width 1) and for a Verify of w nodes
    (random drafts, so they are rejected), widths taking turns round by round so drift cancels; the
    first round warms up and is not counted."""
    rng, vocab = random.Random(0), target_info(address).vocab_size
    per: dict[int, list[float]] = {w: [] for w in [1, *widths]}
    with grpc.insecure_channel(address) as ch:
        stub = target_pb2_grpc.TargetStub(ch)
        for i, prompt in enumerate(prompts):
            s = _Session(stub)
            try:
                length = s.ask(open=target_pb2.TargetOpen(
                    session_id=f"bench-steps-{i}", prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(temperature=0.0),
                    max_new_tokens=(rounds + 1) * (2 + sum(widths)) + 8)).opened.length
                for r in range(rounds + 1):
                    tok = s.ask(decode=target_pb2.TargetDecode(n=1)).token
                    length = tok.length
                    if r:
                        per[1].append(tok.forward_ms)
                    for w in widths:
                        tree = common_pb2.TokenTree(token_ids=[rng.randrange(vocab) for _ in range(w - 1)],
                                                    parents=list(range(-1, w - 2)))
                        v = s.ask(verify=target_pb2.TargetVerify(step=r, base_len=length, tree=tree)).verified
                        length = v.length
                        if r:
                            per[w].append(v.forward_ms)
            finally:
                s.close()
    return {w: statistics.median(v) for w, v in per.items() if v}
