"""The benchmark's configurations. Each runner takes one prompt (token ids) and returns a
`Sample`: the tokens it produced, client-side timings, and what it knows of its speculation.

    target         (a) target-only decoding through the target service: a Generate request with
                       speculative.method = "none" to the gateway, which Opens a session on the
                       target service and streams Decode{n} from it (one message per token). The
                       baseline every speedup is a ratio to.
    dflash-grpc    (b) DFlash speculation through the full gRPC stack: client -> gateway -> draft
                       service (Propose) -> target service (Verify), real loopback sockets.
    dflash-inproc  (c) the same speculative loop in one process without gRPC
                       (`splitspec_tools.speculate.speculative_generate` over `TargetSequence` and
                       `DFlashProposer`): (b) - (c) is the cost of disaggregation.
    ngram-grpc     (d) n-gram (prompt lookup) speculation through the gRPC stack.
    hf             (e) Hugging Face transformers `generate` on the same weights.
    hf-pld         (f) transformers prompt-lookup decoding (`prompt_lookup_num_tokens`).
    auto-grpc      (g) method "auto" through the services: per step the gateway picks DFlash, its own
                       n-gram index or a target-only step, and the draft length, by expected
                       committed tokens per second (gateway/cost_model.py).
    dflash-tree-grpc (h) (b) with token trees (`--tree TOPK:WIDTH`, default topk 4, 16-wide verify).
    auto-tree-grpc   (i) (g) with token trees: auto may draft trees and cuts each to the size it prices best.
    llamacpp       (j) llama.cpp on the same weights (converted to GGUF f32), in the bench's process with
                       its thread count; optional (`pip install -e '.[llamacpp]'`, splitspec_tools/bench/llamacpp.py).

Every run generates exactly max_new_tokens tokens (eos is ignored), so every configuration does
the same amount of work on the same prompts.
"""
from __future__ import annotations

import os
import queue
import random
import statistics
import time
from dataclasses import dataclass, field

import grpc

from splitspec_tools.client import build_request
from splitspec.v1 import common_pb2, draft_pb2_grpc, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from splitspec.engine.sample import SamplingParams


@dataclass(frozen=True)
class ConfigInfo:
    key: str
    letter: str
    kind: str          # grpc | inproc | hf | llamacpp
    method: str        # speculative method: none | dflash | ngram
    speculative: bool
    description: str
    tree: bool = False     # requests carry the bench's --tree (topk > 1) instead of a chain


CONFIGS = {c.key: c for c in (
    ConfigInfo("target", "a", "grpc", "none", False,
               "target-only decoding through the target service (gateway, method none; the baseline)"),
    ConfigInfo("dflash-grpc", "b", "grpc", "dflash", True, "DFlash speculation through gateway + draft + target services"),
    ConfigInfo("dflash-inproc", "c", "inproc", "dflash", True, "the same DFlash loop in one process, no gRPC"),
    ConfigInfo("ngram-grpc", "d", "grpc", "ngram", True, "n-gram (prompt lookup) speculation through the services"),
    ConfigInfo("hf", "e", "hf", "none", False, "transformers generate on the same weights"),
    ConfigInfo("hf-pld", "f", "hf", "ngram", True, "transformers prompt-lookup decoding"),
    ConfigInfo("auto-grpc", "g", "grpc", "auto", True,
               "auto: the gateway picks DFlash, n-gram or none and the draft length per step"),
    ConfigInfo("dflash-tree-grpc", "h", "grpc", "dflash", True,
               "DFlash token trees (--tree) through the services", tree=True),
    ConfigInfo("auto-tree-grpc", "i", "grpc", "auto", True,
               "auto with token trees: chain or tree and its size per step", tree=True),
    ConfigInfo("llamacpp", "j", "llamacpp", "none", False, "llama.cpp on the same weights (GGUF f32)"),
)}
# Configurations whose drafts can be greedy or sampled at temperature > 0.
DRAFT_SAMPLING_CONFIGS = ("dflash-grpc", "dflash-inproc", "auto-grpc", "dflash-tree-grpc", "auto-tree-grpc")


@dataclass
class Sample:
    tokens: list[int]
    wall_s: float                          # request sent -> last token received
    ttft_s: float                          # request sent -> first token received
    step_sizes: list[int]                  # tokens committed per step after the first token (tau per step)
    step_times: list[float] = field(default_factory=list)   # seconds since start when each step's tokens arrived
    accepted_per_position: list[int] = field(default_factory=list)
    verify_steps: int = 0
    committed: int = 0                     # tokens committed by those steps (the first token excluded)
    draft_tokens: int | None = None
    draft_ms: float | None = None
    verify_ms: float | None = None
    wire_ms: float | None = None
    queue_ms: float | None = None          # steps' waits in the services' batch queues
    steps_by_method: dict = field(default_factory=dict)   # auto: steps per drafter that ran
    hidden_state_bytes: int | None = None
    method_ran: str = ""
    draft_fallbacks: int = 0
    start_s: float = 0.0                   # perf_counter() when the request was sent

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency after the first token: (t_last - t_first) / (n - 1)."""
        n = len(self.tokens)
        if n < 2 or not self.step_times:
            return None
        return (self.step_times[-1] - self.ttft_s) / (n - 1)


def positions_from_steps(step_sizes: list[int]) -> list[int]:
    """accepted_per_position from per-step committed counts (accepted drafts + 1 bonus)."""
    out: list[int] = []
    for size in step_sizes:
        k = size - 1
        if len(out) < k:
            out.extend([0] * (k - len(out)))
        for i in range(k):
            out[i] += 1
    return out


def sampling_pb_kwargs(params: SamplingParams) -> dict:
    kw = dict(temperature=params.temperature, seed=params.seed)
    if not params.greedy:
        kw.update(top_p=params.top_p, top_k=params.top_k or None)
    return kw


class GatewayRunner:
    """(a), (b), (d): one Generate stream to the gateway over a real socket."""

    def __init__(self, address: str, method: str, width: int, draft_sampling: str = "greedy",
                 timeout_s: float = 600.0, tree: tuple[int, int] | None = None):
        """tree: (topk, verify width) for token trees; None: a chain of `width`."""
        self.address, self.method, self.width, self.tree = address, method, width, tree
        self.draft_sampling, self.timeout_s = draft_sampling, timeout_s
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = gateway_pb2_grpc.GenerationStub(self.channel)

    def request(self, prompt_ids, max_new: int, params: SamplingParams):
        req = build_request(list(prompt_ids), max_new_tokens=max_new, ignore_eos=True, method=self.method,
                            **sampling_pb_kwargs(params))
        if self.method != "none":
            req.speculative.num_draft_tokens = self.width
            req.speculative.num_steps = self.width - 1
            req.speculative.draft_sampling = self.draft_sampling
            if self.tree is not None:
                req.speculative.topk, req.speculative.num_draft_tokens = self.tree
        return req

    def run(self, prompt_ids, max_new: int, params: SamplingParams, on_chunk=None) -> Sample:
        """One request; `on_chunk()`, if given, is called as each chunk of tokens arrives."""
        req = self.request(prompt_ids, max_new, params)
        tokens, sizes, times, complete = [], [], [], None
        t0 = time.perf_counter()
        for resp in self.stub.Generate(req, timeout=self.timeout_s):
            now = time.perf_counter() - t0
            if resp.HasField("chunk"):
                if resp.chunk.token_ids:
                    tokens.extend(resp.chunk.token_ids)
                    sizes.append(len(resp.chunk.token_ids))
                    times.append(now)
                    if on_chunk is not None:
                        on_chunk()
            else:
                complete = resp.complete
        wall = time.perf_counter() - t0
        if complete is None or not times:
            raise RuntimeError(f"{self.address}: Generate ended without tokens or without Complete")
        st = complete.stats
        # The gateway streams one chunk per step: b0 from the prefill first, then each step's
        # committed tokens (one per Decode step target-only).
        return Sample(tokens=tokens, wall_s=wall, ttft_s=times[0], step_sizes=sizes[1:], step_times=times,
                      accepted_per_position=list(st.accepted_per_position), verify_steps=st.verify_steps,
                      committed=round(st.accept_length * st.verify_steps), draft_tokens=st.draft_tokens,
                      draft_ms=st.draft_ms, verify_ms=st.verify_ms, wire_ms=st.wire_ms, queue_ms=st.queue_ms,
                      steps_by_method=dict(st.steps_by_method),
                      hidden_state_bytes=st.hidden_state_bytes, method_ran=st.method,
                      draft_fallbacks=st.draft_fallbacks, start_s=t0)

    def close(self) -> None:
        self.channel.close()


class InprocRunner:
    """(c): `speculative_generate` over the target model and the DFlash draft in this process."""

    def __init__(self, model, draft, width: int, draft_sampling: str = "greedy"):
        self.model, self.draft, self.width, self.draft_sampling = model, draft, width, draft_sampling

    def run(self, prompt_ids, max_new: int, params: SamplingParams) -> Sample:
        from draft_service.proposer import DFlashProposer
        from splitspec_tools.speculate import speculative_generate
        from target_service.engine import TargetSequence

        times, sizes = [], []
        t0 = time.perf_counter()
        max_len = len(prompt_ids) + max_new + self.width + 1
        seq = TargetSequence(self.model, list(prompt_ids), params, max_len=max_len,
                             hidden_layers=tuple(self.draft.cfg.target_layer_ids))
        proposer = DFlashProposer(self.draft, num_draft_tokens=self.width, max_len=max_len,
                                  sampling=params if self.draft_sampling == "sample" else None)
        prefill, verify = seq.prefill, seq.verify

        def timed_prefill():
            out = prefill()
            times.append(time.perf_counter() - t0)
            return out

        def timed_verify(tree, draft_probs=None):
            out = verify(tree, draft_probs)
            times.append(time.perf_counter() - t0)
            sizes.append(len(out.committed))
            return out

        seq.prefill, seq.verify = timed_prefill, timed_verify
        tokens, st = speculative_generate(seq, proposer, max_new, eos_ids=())
        wall = time.perf_counter() - t0
        return Sample(tokens=tokens, wall_s=wall, ttft_s=times[0], step_sizes=sizes, step_times=times,
                      accepted_per_position=list(st.accepted_per_position), verify_steps=st.verify_steps,
                      committed=st.committed, draft_tokens=st.draft_tokens, draft_ms=st.draft_ms,
                      verify_ms=st.verify_ms, wire_ms=0.0, hidden_state_bytes=0, method_ran="dflash")


class _Clock:
    """A transformers streamer that records when each step's tokens arrive."""

    def __init__(self, t0: float):
        self.t0, self.times, self.sizes, self.prompt_seen = t0, [], [], False

    def put(self, value) -> None:
        if not self.prompt_seen:        # generate() first puts the prompt
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.t0)
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


class HFRunner:
    """(e), (f): transformers `generate` (optionally with prompt lookup) on the same weights."""

    def __init__(self, hf_model, prompt_lookup_tokens: int | None = None, max_ngram: int = 4):
        self.model, self.pld, self.max_ngram = hf_model, prompt_lookup_tokens, max_ngram
        # generate() fills a passed GenerationConfig's unset fields from the model's own, eos
        # included: clear it there, so every configuration ignores eos alike.
        hf_model.generation_config.eos_token_id = None
        hf_model.generation_config.pad_token_id = 0

    def run(self, prompt_ids, max_new: int, params: SamplingParams) -> Sample:
        import torch
        from transformers import GenerationConfig

        kw = dict(max_new_tokens=max_new, min_new_tokens=0, do_sample=not params.greedy, num_beams=1,
                  eos_token_id=None, pad_token_id=0, use_cache=True)
        if not params.greedy:
            kw.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        if self.pld:
            kw.update(prompt_lookup_num_tokens=self.pld, max_matching_ngram_size=self.max_ngram)
        config = GenerationConfig(**kw)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        ids = torch.tensor([list(prompt_ids)])
        t0 = time.perf_counter()
        clock = _Clock(t0)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      streamer=clock)
        wall = time.perf_counter() - t0
        tokens = out[0, ids.shape[1]:].tolist()
        # Plain generate puts the prefill's token, then one token per decode step. Assisted
        # generation puts the accepted drafts + the bonus token per verify step, and its first
        # step is the prefill and a verify at once, so it counts as a step.
        steps = clock.sizes if self.pld else clock.sizes[1:]
        return Sample(tokens=tokens, wall_s=wall, ttft_s=clock.times[0], step_sizes=steps,
                      step_times=clock.times, accepted_per_position=positions_from_steps(steps),
                      verify_steps=len(steps), committed=sum(steps), method_ran="ngram" if self.pld else "none")


# ------------------------------------------------------------------------------ service counters

def service_counters(address: str | None, kind: str) -> tuple[int, int, float] | None:
    """(forward_passes, batched_steps, busy_ms) from the GetInfo of a target or draft service;
    None when the address is unknown or the service does not answer."""
    if not address:
        return None
    stub_class = target_pb2_grpc.TargetStub if kind == "target" else draft_pb2_grpc.DraftStub
    try:
        with grpc.insecure_channel(address) as ch:
            info = stub_class(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
    except grpc.RpcError:
        return None
    return info.forward_passes, info.batched_steps, info.busy_ms


def busy_share(before, after, wall_s: float) -> float | None:
    """Share of wall time the service spent in forwards between two `service_counters` readings."""
    if before is None or after is None or wall_s <= 0:
        return None
    return (after[2] - before[2]) / 1e3 / wall_s


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc), None where unreadable."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mean_batch(before, after) -> float | None:
    """Mean steps per forward between two `service_counters` readings; None with no forwards."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


# ------------------------------------------------------------------------------ step times

class _TargetSession:
    """A blocking Target.Session stream, one request at a time."""

    def __init__(self, stub):
        self.q: queue.Queue = queue.Queue()
        self.responses = stub.Session(iter(self.q.get, None), timeout=600)

    def send(self, req) -> None:
        self.q.put(req)

    def recv(self):
        return next(self.responses)

    def close(self) -> None:
        self.q.put(target_pb2.TargetRequest(close=target_pb2.TargetClose()))
        try:
            self.recv()
        finally:
            self.q.put(None)


def service_step_times(address: str, prompts: list[list[int]], widths: list[int], vocab_size: int,
                       n_rounds: int = 8) -> dict:
    """Median forward_ms the target service reports for a target-only Decode step (width 1) and
    for a Verify over w nodes (root + w - 1 drafted tokens, random so they are rejected), on the
    given prompts. These are t(target step) and t(verify step) of the ideal speedup. The widths
    are interleaved round by round (1, 2, …, W, 1, 2, …) so that machine drift cancels; the first
    round is a warm-up and not counted."""
    rng = random.Random(0)
    per_width: dict[int, list[float]] = {w: [] for w in [1, *widths]}
    with grpc.insecure_channel(address) as ch:
        stub = target_pb2_grpc.TargetStub(ch)
        for i, prompt in enumerate(prompts):
            s = _TargetSession(stub)
            try:
                s.send(target_pb2.TargetRequest(open=target_pb2.TargetOpen(
                    session_id=f"bench-steps-{i}", prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(temperature=0.0),
                    max_new_tokens=(n_rounds + 1) * (2 + sum(widths)) + 8)))
                length = s.recv().opened.length
                for r in range(n_rounds + 1):
                    s.send(target_pb2.TargetRequest(decode=target_pb2.TargetDecode(n=1)))
                    tok = s.recv().token
                    length = tok.length
                    if r:
                        per_width[1].append(tok.forward_ms)
                    for w in widths:
                        tree = common_pb2.TokenTree(token_ids=[rng.randrange(vocab_size) for _ in range(w - 1)],
                                                    parents=list(range(-1, w - 2)))
                        s.send(target_pb2.TargetRequest(verify=target_pb2.TargetVerify(
                            step=r, base_len=length, tree=tree)))
                        v = s.recv().verified
                        length = v.length
                        if r:
                            per_width[w].append(v.forward_ms)
            finally:
                s.close()
    return {w: statistics.median(v) for w, v in per_width.items() if v}


def inproc_step_times(model, prompts: list[list[int]], widths: list[int], n_rounds: int = 8) -> dict:
    """The same measure as `service_step_times`, timed around TargetSequence calls in this process."""
    from target_service.engine import TargetSequence
    from splitspec.engine.tree import Tree

    rng = random.Random(0)
    vocab = model.cfg.vocab_size
    per_width: dict[int, list[float]] = {w: [] for w in [1, *widths]}
    for prompt in prompts:
        seq = TargetSequence(model, list(prompt), SamplingParams(),
                             max_len=len(prompt) + (n_rounds + 1) * (2 + sum(widths)) + 8)
        seq.prefill()
        for r in range(n_rounds + 1):
            t = time.perf_counter()
            seq.decode()
            if r:
                per_width[1].append((time.perf_counter() - t) * 1e3)
            for w in widths:
                tree = Tree.chain([rng.randrange(vocab) for _ in range(w - 1)])
                t = time.perf_counter()
                seq.verify(tree)
                if r:
                    per_width[w].append((time.perf_counter() - t) * 1e3)
    return {w: statistics.median(v) for w, v in per_width.items() if v}
