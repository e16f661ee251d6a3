"""What the HTTP API checks before a body is parsed (ASGI middleware in front of the routes,
gateway/http_api.py): the API key, then a POST body's size, encoding and JSON nesting depth, so
that a hostile body is refused before json.loads or pydantic spends time or stack on it. Every
check is one linear pass at C (or numpy) speed, whatever the body holds: a check whose cost grows
faster than the body would be the cheapest way to stall the event loop that serves HTTP and gRPC
alike."""
from __future__ import annotations

import asyncio
import json

import numpy as np

from splitspec.limits import MAX_JSON_DEPTH
from splitspec.security import UNAUTHENTICATED_MESSAGE, ApiKeys

from . import web_page
from .openai_errors import ApiError, bad, too_large

MAX_BODY_BYTES = 32 << 20      # a 128k-token prompt as token ids is ~1 MB; this leaves room for batches

# Bodies above this are scanned in a worker thread (numpy lets go of the GIL): a 32 MiB body of
# brackets and quotes takes a few hundred milliseconds on a busy core.
THREAD_BYTES = 256 << 10

# Every byte but quotes and brackets: what is left is all that decides the depth.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_QUOTE = ord('"')
_CHUNK = 1 << 20               # brackets and quotes per numpy pass: memory stays flat on any body
# (int32 counts: a depth or a quote count never passes MAX_BODY_BYTES)


def json_depth(raw: bytes, limit: int) -> int:
    """The nesting depth of a JSON text's arrays and objects outside its strings (limit + 1 for
    any depth past `limit`). Linear on any input, unterminated strings and long escape runs
    included: the escapes go first (`\\\\` pairs, then `\\"`, left to right as JSON reads them),
    so every quote left opens or closes a string and a running count of them tells inside from
    outside. A backslash outside a string is invalid JSON, refused by json.loads before anything
    after it, so what removing it shifts never reaches the parser."""
    kept = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    depth = deepest = inside = 0
    for start in range(0, len(kept), _CHUNK):
        chunk = np.frombuffer(kept, np.uint8, min(_CHUNK, len(kept) - start), start)
        quotes = chunk == _QUOTE
        in_string = ((np.cumsum(quotes, dtype=np.int32) + inside) & 1).astype(bool)
        # [ { -> +1, ] } -> -1 (the byte's bit of value 4 is set in the closers only); 0 in
        # strings and on the quotes themselves
        step = np.where(quotes | in_string, 0, 1 - ((chunk & 4) >> 1).astype(np.int32))
        levels = np.cumsum(step, dtype=np.int32) + depth
        deepest = max(deepest, int(levels.max()))
        if deepest > limit:
            return limit + 1
        depth, inside = int(levels[-1]), int(in_string[-1])
    return deepest


def is_utf8_json(raw: bytes) -> bool:
    """json.loads reads UTF-16 and UTF-32 too, where a quote or a bracket is not one byte, so
    the depth scan would miss them: only UTF-8 is let through (RFC 8259 allows nothing else)."""
    return json.detect_encoding(raw) in ("utf-8", "utf-8-sig")


class Guard:
    """ASGI middleware in front of the routes: the API key (401 before anything about the body),
    then a POST body's size (413), encoding and nesting depth (400), each refused before JSON
    parsing."""

    OPEN_PATHS = frozenset({"/health", "/openapi.json"})

    def __init__(self, app, keys: ApiKeys, max_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_JSON_DEPTH):
        self.app, self.keys, self.max_bytes, self.max_depth = app, keys, max_bytes, max_depth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if (self.keys and scope["path"] not in self.OPEN_PATHS and not web_page.is_page(scope["path"])
                and not self.keys.check(headers.get("authorization"))):
            error = ApiError(401, UNAUTHENTICATED_MESSAGE, "authentication_error", code="invalid_api_key")
            return await error.response()(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            raw = await self._body(headers, receive)
        except ApiError as error:
            return await error.response()(scope, receive, send)
        replay = [{"type": "http.request", "body": raw, "more_body": False}]
        # The API speaks JSON only: a body sent as a form (curl -d without a content type) is
        # read as the JSON it is, as before the schema was declared.
        scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
                 + [(b"content-type", b"application/json")]}

        async def receive_again():
            # the body once, then the client's own messages (a disconnect, for the routes to see)
            return replay.pop() if replay else await receive()
        return await self.app(scope, receive_again, send)

    async def _body(self, headers: dict, receive) -> bytes:
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise too_large(f"the body has {int(length)} bytes; at most {self.max_bytes} are accepted")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise too_large(f"the body is over {self.max_bytes} bytes, the most accepted")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        if not is_utf8_json(raw):
            raise bad("the body is not UTF-8: JSON bodies must be UTF-8 (RFC 8259)")
        depth = (await asyncio.to_thread(json_depth, raw, self.max_depth) if len(raw) > THREAD_BYTES
                 else json_depth(raw, self.max_depth))
        if depth > self.max_depth:
            raise bad(f"the body nests deeper than {self.max_depth} levels of arrays and objects")
        return raw
