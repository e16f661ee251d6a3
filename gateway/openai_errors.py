"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every refusal of
the HTTP API: a gRPC status from the gateway's Generate, a body that fails its declared schema
(gateway/openai_protocol.py), or a check of the routes themselves. `param` names the field."""
from __future__ import annotations

import re

import grpc
from starlette.responses import JSONResponse

from .openai_protocol import OPAQUE_FIELDS, FieldError

# (HTTP status, OpenAI error type) -> the gRPC statuses answered with it; any other: 500 server_error.
_BY_HTTP = {
    (400, "invalid_request_error"): ("INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION"),
    (401, "authentication_error"): ("UNAUTHENTICATED",),
    (403, "permission_error"): ("PERMISSION_DENIED",),
    (404, "not_found_error"): ("NOT_FOUND",),
    (409, "conflict_error"): ("ALREADY_EXISTS", "ABORTED"),
    (429, "rate_limit_error"): ("RESOURCE_EXHAUSTED",),
    (499, "cancelled"): ("CANCELLED",),
    (501, "not_implemented_error"): ("UNIMPLEMENTED",),
    (503, "service_unavailable_error"): ("UNAVAILABLE",),
    (504, "timeout_error"): ("DEADLINE_EXCEEDED",),
}
HTTP_STATUS = {grpc.StatusCode[name]: http for http, names in _BY_HTTP.items() for name in names}
# gRPC SamplingParams field -> the HTTP field a client set.
HTTP_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    return HTTP_STATUS.get(code, (500, "server_error"))


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, details: str, param: str | None = None) -> ApiError:
        status, kind = http_status(code)
        named = re.match(r"(?:sampling|speculative)\.(\w+)", details or "")
        if param is None and named and status == 400:      # the gateway names the field it refused
            field = named.group(1)
            param = HTTP_NAMES.get(field, field) if details.startswith("sampling") else f"speculative.{field}"
        return cls(status, details or code.name, kind, param=param, code=code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_argument")


def too_large(message: str) -> ApiError:
    return ApiError(413, message, param=None, code="request_too_large")


# pydantic error type -> what the field must be, for refusals of the value's type.
MUST_BE = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
           "list_type": "a list", "dict_type": "an object", "model_type": "an object",
           "model_attributes_type": "an object",
           "literal_error": None}


def from_validation(errors: list[dict]) -> ApiError:
    """The first schema error of a body as a 400 naming its field. A union's branches each
    report (e.g. "stop": a string, or a list of strings): they become one message."""
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return bad(str(cause), cause.param)
    param = field_name(first["loc"])
    if first["type"] == "missing":
        return bad(f"{param} is required", param)
    if first["type"] == "extra_forbidden":
        parent = param.rsplit(".", 1)[0]
        return bad(f"{param} is not a field of {parent}", param)
    same = [e for e in errors if field_name(e["loc"]) == param]
    wants = [MUST_BE[e["type"]] for e in same if MUST_BE.get(e["type"])]
    if len(wants) == len(same) and wants:
        return bad(f"{param} must be {' or '.join(dict.fromkeys(wants))}, got {_shown(first.get('input'))}", param)
    reasons = "; or ".join(dict.fromkeys(_reason(e) for e in same))
    return bad(f"{param}: {reasons}, got {_shown(first.get('input'))}", param)


def _reason(error: dict) -> str:
    if error["type"] in MUST_BE and MUST_BE[error["type"]]:
        return f"must be {MUST_BE[error['type']]}"
    msg = error["msg"]
    return msg[0].lower() + msg[1:] if msg else error["type"]


def _shown(value) -> str:
    text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= 80 else text[:77] + "..."


# A union branch or validator in pydantic's location, not a field: "str", "list[int]",
# "function-wrap[...]", "constrained-int", a model's class name.
_LABEL = re.compile(r"^(?:[A-Z]\w*|str|int|float|bool|list|dict|none|.*[\[\-].*)$")


def field_name(loc) -> str:
    """pydantic's location as the field a client wrote: messages[2].content, speculative.topk."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue              # FastAPI's prefix
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if _LABEL.match(part):
            continue
        if out.split("[")[0] in OPAQUE_FIELDS:
            break
        out += f".{part}" if out else part
    return out or "body"
