"""A small Python client of the gateway: build a GenerateRequest and stream the response.
`splitspec generate` and `splitspec up --prompt` print with it; programs can import it."""
from __future__ import annotations

from typing import Iterator

import grpc

from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


def build_request(prompt: str | list[int], *, max_new_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, seed: int | None = None, stop=(), stop_token_ids=(),
                  ignore_eos: bool = False, method: str = "", request_id: str = "",
                  cache_salt: str = "", chat: bool = False) -> gateway_pb2.GenerateRequest:
    """cache_salt: the prefix-cache namespace (only requests with the same salt share cached
    prompt blocks on the target; "" = the shared one). chat: send a text prompt as one user
    message, which the gateway renders with the model's chat template."""
    sampling = common_pb2.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids),
                                         ignore_eos=ignore_eos)
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    req = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling,
                                      speculative=common_pb2.SpeculativeParams(method=method),
                                      cache_salt=cache_salt)
    if isinstance(prompt, str) and chat:
        req.chat.messages.add(role="user", content=prompt)
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def has_chat_template(address: str, *, credentials: grpc.ChannelCredentials | None = None,
                      api_key: str | None = None, timeout_s: float = 10.0) -> bool:
    """Whether the gateway's model has a chat template (GetModelInfo.chat_template)."""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with (grpc.secure_channel(address, credentials) if credentials is not None
          else grpc.insecure_channel(address)) as ch:
        info = gateway_pb2_grpc.GenerationStub(ch).GetModelInfo(gateway_pb2.GetModelInfoRequest(),
                                                                 timeout=timeout_s, metadata=metadata)
    return info.chat_template


def stream(address: str, request: gateway_pb2.GenerateRequest, timeout_s: float | None = None, *,
           credentials: grpc.ChannelCredentials | None = None,
           api_key: str | None = None) -> Iterator[gateway_pb2.GenerateResponse]:
    """Stream a Generate; over TLS with `credentials` (splitspec.security.channel_credentials),
    with `authorization: Bearer api_key` metadata when the gateway wants a key."""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with (grpc.secure_channel(address, credentials) if credentials is not None
          else grpc.insecure_channel(address)) as ch:
        yield from gateway_pb2_grpc.GenerationStub(ch).Generate(request, timeout=timeout_s, metadata=metadata)


def format_stats(complete: gateway_pb2.Complete, elapsed_s: float) -> str:
    s, u = complete.stats, complete.usage
    rate = u.completion_tokens / elapsed_s if elapsed_s > 0 else 0.0
    lines = [f"finish_reason={complete.finish_reason} prompt_tokens={u.prompt_tokens} "
             f"completion_tokens={u.completion_tokens} cached_tokens={u.cached_tokens} time={elapsed_s:.2f}s ({rate:.1f} tok/s) "
             f"ttft={s.time_to_first_token_ms:.0f}ms",
             f"method={s.method} verify_steps={s.verify_steps} accept_length={s.accept_length:.2f} "
             f"verify_ms={s.verify_ms:.0f} draft_ms={s.draft_ms:.0f} wire_ms={s.wire_ms:.0f}"]
    if s.draft_tokens:
        lines.append(f"draft_tokens={s.draft_tokens} accepted_per_position={list(s.accepted_per_position)} "
                     f"hidden_state_bytes={s.hidden_state_bytes}")
    if len(s.steps_by_method) > 1 or s.method == "auto":
        lines.append("steps by drafter: " + " ".join(f"{m}={n}" for m, n in sorted(s.steps_by_method.items())))
    return "\n".join(lines)
