"""What a request will run, decided before any session opens: its method and widths, checked
against what the drafters behind this gateway can do (their GetInfo). A parameter no drafter can
honour is refused with INVALID_ARGUMENT naming the limit; it is never silently changed. With
`method = "auto"` the numbers the client gives are upper bounds, and the stats say what ran.

Only values the client set are held against the limits: the gateway's own defaults (its flags)
are fitted to the draft it found."""
from __future__ import annotations

from dataclasses import dataclass

from splitspec.v1 import common_pb2, draft_pb2, target_pb2

from .config import SpeculativeConfig
from .request import RequestError

NGRAM_MAX_WIDTH = 64      # n-gram chains beyond this are never worth a verify
NGRAM_MAX_TOPK = 8        # the gateway's own n-gram tries (the draft service's: its GetInfo.max_topk)
MAX_TREE_NODES = 64       # drafted nodes of a tree (the draft service's: its GetInfo.max_draft_nodes)


@dataclass
class Plan:
    """What the servicer decided for a request before any backend call."""
    method: str                                        # "auto", "dflash", "ngram" or "none"
    layer_ids: list[int]                               # target layers the DFlash draft reads
    speculative: common_pb2.SpeculativeParams | None   # what the draft session opens with (None: no draft session)
    tokenizer_hash: str = ""
    max_k: int = 0                                     # auto: most tokens a step may draft
    local_ngram: bool = False                          # the gateway's own n-gram index drafts
    hidden_stream: str = ""                            # the stream the draft's taps read (Attention Residuals)
    ngram_tree: tuple[int, int, int] | None = None     # the gateway's n-gram tries: (nodes, depth, topk)
    lookahead: int = 0                                 # auto: prompt-lookup tokens the target's Decode runs may verify


def plan_request(spec: SpeculativeConfig, raw: common_pb2.SpeculativeParams, *, has_draft: bool,
                 draft: draft_pb2.DraftInfo | None, target: target_pb2.TargetInfo) -> Plan:
    """spec: the request's values over the gateway's defaults; raw: what the client sent (to
    know which values it set). draft: the draft's GetInfo, None while it is unreachable (the
    request then runs without it: a fallback, not the client's error)."""
    method = spec.method
    if method == "none":
        return Plan("none", [], None)
    auto = method == "auto"
    explicit = {name: getattr(raw, name) for name in ("num_steps", "topk", "num_draft_tokens") if raw.HasField(name)}
    dflash_ok = draft is not None and draft.method == "dflash"
    if not auto:
        if not has_draft and method == "dflash":
            raise RequestError("speculative.method = dflash, but this gateway has no draft service (--draft); "
                               "use auto, ngram (the gateway's own prompt lookup) or none")
        if draft is not None and method == "dflash" and not dflash_ok:
            raise RequestError(f"speculative.method = dflash, but the draft {draft.model_id!r} serves "
                               f"{draft.method} only; use auto, ngram or none")
    if method == "dflash" or (auto and dflash_ok):
        limit = draft.block_size if draft is not None and draft.block_size else spec.num_draft_tokens
        limit_name = f"the draft's block size ({limit})"
        max_topk = (draft.max_topk or 1) if draft is not None else 1
        max_nodes = (draft.max_draft_nodes or limit - 1) if draft is not None else limit - 1
        topk_name = f"the draft {draft.model_id!r}" if draft is not None else "the draft"
    else:
        limit = min(NGRAM_MAX_WIDTH, target.max_num_batched_tokens or NGRAM_MAX_WIDTH)
        limit_name = f"the n-gram limit ({limit})"
        remote_ngram = draft is not None and method == "ngram"
        max_topk = (draft.max_topk or 1) if remote_ngram else NGRAM_MAX_TOPK
        max_nodes = (draft.max_draft_nodes or limit - 1) if remote_ngram else MAX_TREE_NODES
        topk_name = "n-gram lookup"
    max_nodes = min(max_nodes, (target.max_num_batched_tokens or max_nodes + 1) - 1)
    topk = min(spec.eagle_topk, max_topk) if auto else spec.eagle_topk
    if not auto and topk > max_topk:
        raise RequestError(f"speculative.topk = {topk} is above what {topk_name} offers per node ({max_topk}"
                           f"{'; it drafts chains only' if max_topk == 1 else ''})")
    if topk > 1:
        return _plan_tree(spec, explicit, method, auto, draft, target, limit, limit_name, topk, max_nodes)
    if not auto:
        for name, value in explicit.items():
            if name == "num_draft_tokens" and value > limit:
                raise RequestError(f"speculative.num_draft_tokens = {value} is above {limit_name}: the most a "
                                   f"verify step can check is {limit} (root + {limit - 1} drafted tokens)")
            if name == "num_steps" and value + 1 > limit:
                raise RequestError(f"speculative.num_steps = {value} is above {limit_name} minus one: a chain "
                                   f"drafts at most {limit - 1} tokens per step")
        if "num_draft_tokens" in explicit and "num_steps" in explicit \
                and explicit["num_draft_tokens"] > explicit["num_steps"] + 1:
            raise RequestError(f"speculative.num_draft_tokens = {explicit['num_draft_tokens']} needs a chain of "
                               f"{explicit['num_draft_tokens'] - 1} tokens, but num_steps = {explicit['num_steps']}")
    width = max(2, min(spec.num_draft_tokens, spec.num_steps + 1, limit))
    if auto:
        remote = dflash_ok
        params = common_pb2.SpeculativeParams(method="dflash", num_draft_tokens=limit,
                                              draft_sampling=spec.draft_sampling) if remote else None
        # Chains of prompt lookup run inside the target's Decode runs where it can (no round trip,
        # every token a chance: target_service/lookahead.py); an older target leaves them here.
        lookahead = min(width - 1, target.max_lookahead) if spec.target_lookahead else 0
        return Plan("auto", list(draft.target_layer_ids) if remote else [], params, target.tokenizer_hash,
                    max_k=width - 1, local_ngram=not lookahead, lookahead=lookahead,
                    hidden_stream=draft.target_hidden_stream if remote else "")
    if method == "ngram" and draft is None:
        # No draft service (or none reachable yet): the gateway's own prompt lookup honours it.
        return Plan("ngram", [], None, max_k=width - 1, local_ngram=True)
    if draft is None:
        return Plan(method, [], None)      # dflash while the draft is unreachable: target-only until it is back
    params = common_pb2.SpeculativeParams(method=method, num_steps=width - 1, topk=1, num_draft_tokens=width,
                                          draft_sampling=spec.draft_sampling)
    dflash = method == "dflash"
    return Plan(method, list(draft.target_layer_ids) if dflash else [], params, target.tokenizer_hash,
                max_k=width - 1, hidden_stream=draft.target_hidden_stream if dflash else "")


def _plan_tree(spec: SpeculativeConfig, explicit: dict, method: str, auto: bool, draft, target, limit: int,
               limit_name: str, topk: int, max_nodes: int) -> Plan:
    """A tree request (topk > 1): at most num_draft_tokens - 1 nodes, num_steps deep, topk
    children a node. Depth is bounded by the drafter's block (n-gram: its limit) and the node
    count by the verify cap; with auto they are upper bounds, trimmed to fit, else refused."""
    depth_cap, nodes = limit - 1, spec.num_draft_tokens - 1
    if not auto:
        if "num_steps" in explicit and spec.num_steps > depth_cap:
            raise RequestError(f"speculative.num_steps = {spec.num_steps} is above {limit_name} minus one: a "
                               f"branch drafts at most {depth_cap} tokens")
        if "num_draft_tokens" in explicit and nodes > max_nodes:
            raise RequestError(f"speculative.num_draft_tokens = {spec.num_draft_tokens} is above the verify cap: a "
                               f"tree holds at most {max_nodes} drafted nodes (num_draft_tokens <= {max_nodes + 1})")
    depth = max(1, min(spec.num_steps, depth_cap))
    nodes = max(2, min(nodes, max_nodes))
    # An explicit ngram goes to the draft service's index when there is one (as for chains).
    remote = draft is not None and (method in ("dflash", "ngram") or draft.method == "dflash")
    params = common_pb2.SpeculativeParams(method="dflash" if auto else method, num_steps=depth, topk=topk,
                                          num_draft_tokens=nodes + 1,
                                          draft_sampling=spec.draft_sampling) if remote else None
    dflash = remote and params.method == "dflash"
    local = auto or (method == "ngram" and draft is None)
    ngram_topk = min(topk, NGRAM_MAX_TOPK)
    return Plan("auto" if auto else method, list(draft.target_layer_ids) if dflash else [], params,
                target.tokenizer_hash, max_k=nodes, local_ngram=local,
                hidden_stream=draft.target_hidden_stream if dflash else "",
                ngram_tree=(min(nodes, MAX_TREE_NODES), min(depth, NGRAM_MAX_WIDTH - 1), ngram_topk) if local else None)
