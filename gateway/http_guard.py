"""What the HTTP API checks before a body is parsed (ASGI middleware in front of the routes,
gateway/http_api.py): the API key, then a POST body's size and JSON nesting depth, so that a
hostile body is refused before json.loads or pydantic spends time or stack on it."""
from __future__ import annotations

import re

from splitspec.security import UNAUTHENTICATED_MESSAGE, ApiKeys

from . import web_page
from .openai_errors import ApiError, bad, too_large

MAX_BODY_BYTES = 32 << 20      # a 128k-token prompt as token ids is ~1 MB; this leaves room for batches
MAX_JSON_DEPTH = 64            # OpenAI bodies nest a few levels; JSON schemas in them a few more


# A JSON string (escapes included), and every byte that is not a bracket.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes, limit: int) -> int:
    """The nesting depth of a JSON text, stopping once past `limit`. Strings are cut out and
    the brackets kept with C-speed calls, so a body of 100,000 nested arrays is refused before
    json.loads recurses into it, and a large flat body (a long prompt's token ids) costs a few
    milliseconds."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in brackets:
        if byte in (0x5B, 0x7B):       # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


class Guard:
    """ASGI middleware in front of the routes: the API key (401 before anything about the body),
    then a POST body's size (413) and nesting depth (400), each refused before JSON parsing."""

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
        if json_depth(raw, self.max_depth) > self.max_depth:
            raise bad(f"the body nests deeper than {self.max_depth} levels of arrays and objects")
        return raw
