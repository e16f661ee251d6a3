"""Structured outputs and tool calls at the HTTP surface: OpenAI / vLLM request fields -> one
`common_pb2.Constraint` (the grammar the target masks its distribution with, exactly, under any
speculation method), the tools for the chat template, and the generated text -> OpenAI
`tool_calls`. Plain functions; no grammar engine here (the target compiles with xgrammar and
refuses a spec that does not compile with INVALID_ARGUMENT naming `sampling.constraint.<kind>`).

Where a constraint comes from (the `param` of a 400 when the target refuses it):

    response_format {"type": "json_schema", "json_schema": {name, description?, schema?, strict?}}
                                                        -> json_schema (strict = strict)
    response_format {"type": "json_object"}            -> json_object
    structured_outputs {json | regex | choice | grammar | json_object | structural_tag}
    guided_json / guided_regex / guided_choice / guided_grammar  (vLLM's removed aliases: honoured)
    tools + tool_choice (+ parallel_tool_calls), chat only -> structural_tag (see below); the
        source is "tools" for all of them, a named tool_choice's too (the fix is in a tool's
        parameters; a tool_choice naming no defined tool is refused here, as tool_choice)

Tool calls (our format, Hermes-style; the chat template gets `tools` to describe them):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one block per call, blocks separated by a newline. tool_choice "none": no constraint, nothing
parsed; "auto": free text, `<tool_call>` blocks parsed into tool_calls (constrained by a
triggered structural tag when a tool sets strict: true or parallel_tool_calls is false);
"required": one or more calls (exactly one with parallel_tool_calls false) to any of the tools
and nothing else; a named function: exactly one call to it. Arguments follow the function's
`parameters` schema wherever the call is constrained, as JSON with at most one whitespace
character in a row.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from splitspec.limits import CONSTRAINT_KINDS, MAX_JSON_DEPTH, MAX_SPEC_BYTES
from splitspec.v1 import common_pb2

from .http_guard import json_depth

MAX_STRUCTURAL_TAG_BYTES = MAX_SPEC_BYTES  # a structural tag (tools: all their parameter schemas together)
MAX_TOOLS = 128                          # OpenAI's limit on functions per request
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_SEPARATOR = "\n"
ARGS_WHITESPACE = 1                      # the most whitespace characters in a row inside arguments
# Legacy top-level fields (vLLM < 0.12) -> the structured_outputs key they stand for.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# structured_outputs keys: the constraint (exactly one), and vLLM's options we can honour.
SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
SO_OPTIONS = ("disable_additional_properties", "disable_any_whitespace", "disable_fallback", "whitespace_pattern")


class StructuredError(ValueError):
    """A request field that cannot be honoured: HTTP 400 naming `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass
class Structured:
    """What a request asks for beyond free text."""
    constraint: common_pb2.Constraint | None = None    # None: unconstrained
    source: str | None = None           # the request field the constraint came from (a 400's param)
    tools: list[dict] | None = None     # for the chat template (as Hugging Face passes them)
    tool_choice: str = "none"           # "none" | "auto" | "required" | "named"
    parallel: bool = True               # parallel_tool_calls
    names: frozenset[str] = field(default_factory=frozenset)   # the defined functions

    @property
    def parse_tools(self) -> bool:
        """Whether the answer's `<tool_call>` blocks become tool_calls."""
        return self.tool_choice != "none" and bool(self.names)


# --- request -> Constraint ---------------------------------------------------------------------

def from_request(body: dict, *, chat: bool) -> Structured:
    """The constraint (and tools) a request body asks for. Raises StructuredError naming the
    field; at most one source of constraint per request."""
    sources: list[tuple[str, common_pb2.Constraint]] = []
    c = response_format(body.get("response_format"))
    if c is not None:
        sources.append(("response_format", c))
    if body.get("structured_outputs") is not None:
        sources.append(("structured_outputs", structured_outputs(body["structured_outputs"])))
    for name, key in GUIDED.items():
        if body.get(name) is not None:
            sources.append((name, _so_constraint(key, body[name], name)))
    out = Structured()
    tools_given = body.get("tools") not in (None, []) or body.get("tool_choice") is not None
    if tools_given and not chat:
        raise StructuredError("tools / tool_choice are /v1/chat/completions fields", "tools")
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        raise StructuredError(f"{name} (OpenAI's deprecated function calling) is not supported; send tools and "
                              f"tool_choice instead", name)
    if chat:
        _tools(body, out)
        if out.constraint is not None:
            sources.append((out.source, out.constraint))
        elif sources and out.tool_choice == "auto" and out.names:
            # A grammar over the whole answer leaves no room for a tool call: the tools would
            # be dropped without a word. One or the other.
            raise StructuredError(f"{sources[0][0]} constrains the whole answer, so tool calls (tools with "
                                  f"tool_choice 'auto') could never be made; send tool_choice 'none' to answer "
                                  f"in that format, or leave {sources[0][0]} out", sources[0][0])
    if len(sources) > 1:
        names = ", ".join(s for s, _ in sources)
        raise StructuredError(f"one constraint per request: {names} each constrain the output; send only one",
                              sources[1][0])
    if sources:
        out.source, out.constraint = sources[0]
    return out


def _check_named(spec: dict, keys: tuple[str, ...], where: str, param: str) -> None:
    """A response_format's json_schema and a tool's function follow the same rules for what they
    share (no unknown keys; name, description, strict); their schema is the caller's."""
    extra = sorted(set(spec) - set(keys))
    if extra:
        raise StructuredError(f"{where} has unknown key(s) {', '.join(extra)}; expected {', '.join(keys)}", param)
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise StructuredError(f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -, got {name!r}"[:300],
                              param)
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise StructuredError(f"{where}.description must be a string", param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredError(f"{where}.strict must be a boolean, got {strict!r}"[:300], param)


def response_format(fmt) -> common_pb2.Constraint | None:
    """OpenAI's response_format: text (None), json_object, or json_schema."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise StructuredError("response_format must be an object with a string `type`: text, json_object or "
                              "json_schema", "response_format")
    kind = fmt["type"]
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(kind)
    if allowed is None:
        raise StructuredError(f"response_format type {kind!r} is not supported; expected text, json_object or "
                              f"json_schema", "response_format")
    extra = sorted(set(fmt) - allowed)
    if extra:
        raise StructuredError(f"response_format of type {kind!r} has unknown key(s) {', '.join(extra)}"
                              + ("; a schema goes in response_format.json_schema.schema" if kind != "text" else ""),
                              "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.Constraint(json_object=True)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredError("response_format.json_schema must be an object: {name, description?, schema, "
                              "strict?}", "response_format")
    _check_named(spec, ("name", "description", "schema", "strict"), "response_format.json_schema", "response_format")
    strict = spec.get("strict")
    schema = spec.get("schema")
    schema = {} if schema is None else schema
    text = json_schema_text(schema, "response_format.json_schema.schema", "response_format")
    return common_pb2.Constraint(json_schema=text, strict=bool(strict))


def structured_outputs(so) -> common_pb2.Constraint:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object,
    structural_tag; its options are honoured or refused, never dropped."""
    if not isinstance(so, dict):
        raise StructuredError("structured_outputs must be an object with one of: " + ", ".join(SO_KINDS),
                              "structured_outputs")
    for key in so:
        if key not in SO_KINDS and key not in SO_OPTIONS:
            raise StructuredError(f"structured_outputs.{key} is not supported; expected one of "
                                  f"{', '.join(SO_KINDS)} (and the options {', '.join(SO_OPTIONS)})",
                                  f"structured_outputs.{key}")
    kinds = [k for k in SO_KINDS if so.get(k) is not None and so.get(k) is not False]
    if len(kinds) != 1:
        raise StructuredError(f"structured_outputs needs exactly one of {', '.join(SO_KINDS)}, got "
                              f"{', '.join(kinds) or 'none'}", "structured_outputs")
    kind = kinds[0]
    c = _so_constraint(kind, so[kind], "structured_outputs")
    strict = so.get("disable_additional_properties")
    if strict is not None:
        if not isinstance(strict, bool):
            raise StructuredError("structured_outputs.disable_additional_properties must be a boolean",
                                  "structured_outputs.disable_additional_properties")
        if strict and kind != "json":
            raise StructuredError("structured_outputs.disable_additional_properties applies to json only",
                                  "structured_outputs.disable_additional_properties")
        c.strict = strict
    if so.get("disable_any_whitespace") not in (None, False):
        raise StructuredError("structured_outputs.disable_any_whitespace is not supported: the grammar allows "
                              "JSON's whitespace", "structured_outputs.disable_any_whitespace")
    if so.get("whitespace_pattern") is not None:
        raise StructuredError("structured_outputs.whitespace_pattern is not supported",
                              "structured_outputs.whitespace_pattern")
    if so.get("disable_fallback") not in (None, False, True):
        raise StructuredError("structured_outputs.disable_fallback must be a boolean",
                              "structured_outputs.disable_fallback")
    # disable_fallback: there is no fallback backend here; a spec that does not compile is refused.
    return c


def _so_constraint(kind: str, value, param: str) -> common_pb2.Constraint:
    where = f"{param}.{kind}" if param == "structured_outputs" else param
    if kind == "json":
        if isinstance(value, str):
            _limit(value, where, param)
            value = _parsed(value, where, param)
        return common_pb2.Constraint(json_schema=json_schema_text(value, where, param))
    if kind == "json_object":
        if value is not True:
            raise StructuredError(f"{where} must be true", param)
        return common_pb2.Constraint(json_object=True)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise StructuredError(f"{where} must be a non-empty string"
                                  + (" (EBNF with a `root` rule)" if kind == "grammar" else ""), param)
        _limit(value, where, param)
        return common_pb2.Constraint(**{kind: value})
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
            raise StructuredError(f"{where} must be a non-empty list of non-empty strings", param)
        _limit(json.dumps(value), where, param)
        return common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=value))
    if kind == "structural_tag":
        if isinstance(value, dict):
            value = _dumped(value, where, param)
        if not isinstance(value, str) or not value:
            raise StructuredError(f"{where} must be an xgrammar structural tag (a JSON object or its text)", param)
        _limit(value, where, param, MAX_STRUCTURAL_TAG_BYTES)
        if not isinstance(_parsed(value, where, param), dict):
            raise StructuredError(f"{where} must be a JSON object", param)
        return common_pb2.Constraint(structural_tag=value)
    raise AssertionError(kind)


def json_text_problem(text: str, where: str) -> tuple[object, str | None]:
    """(the value of a JSON text held in a string, None), or (None, what is wrong with it). The
    HTTP guard's depth limit holds inside strings too: json.loads recurses once per level, so a
    deeply nested text is refused on its brackets, before it can raise RecursionError."""
    if json_depth(text.encode(), MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        return None, f"{where} nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
    try:
        return json.loads(text), None
    except (json.JSONDecodeError, RecursionError) as exc:
        return None, f"{where} is not valid JSON: {exc}"


def _parsed(text: str, where: str, param: str):
    value, problem = json_text_problem(text, where)
    if problem:
        raise StructuredError(problem, param)
    return value


def _dumped(value, where: str, param: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError) as exc:       # NaN / Infinity, or nesting past the stack
        raise StructuredError(f"{where} is not valid JSON: {exc}", param) from None


def _limit(text: str, where: str, param: str, limit: int = MAX_SPEC_BYTES) -> None:
    size = len(text.encode())
    if size > limit:
        raise StructuredError(f"{where} is {size} bytes serialized; at most {limit} bytes ({limit // 1024} KB) "
                              f"are accepted", param)


def json_schema_text(schema, where: str, param: str) -> str:
    """A JSON Schema (a dict; `true` too) checked for shape and size, as compact JSON text."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise StructuredError(f"{where} must be a JSON Schema object, got {type(schema).__name__}", param)
    problem = schema_problem(schema, where)
    if problem:
        raise StructuredError(problem, param)
    text = _dumped(schema, where, param)
    _limit(text, where, param)
    return text


# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _held(schema: dict, where: str) -> list[tuple[str, object]] | str:
    """(path, schema) of each schema `schema` holds under a schema keyword, in keyword order; the
    problem (a str) where such a keyword holds something else."""
    held = []
    for key in (*_ONE, *_MANY, *_MAP):
        if key not in schema:
            continue
        value, path = schema[key], f"{where}.{key}"
        if key in _MAP:
            if not isinstance(value, dict):
                return f"{path} must be an object of schemas"
            held += [(f"{path}.{name}", sub) for name, sub in value.items()]
        elif key in _MANY or (key == "items" and isinstance(value, list)):     # items as a list: draft-04 tuples
            if not isinstance(value, list):
                return f"{path} must be a list of schemas"
            held += [(f"{path}[{i}]", sub) for i, sub in enumerate(value)]
        else:
            held.append((path, value))
    return held


def schema_problem(schema, where: str, depth: int = 0) -> str | None:
    """What is wrong with a JSON Schema's shape (None: nothing we can tell without compiling):
    each (sub)schema is an object or a boolean, and its `type` a JSON type or a list of them."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} must be a JSON Schema (an object or a boolean), got {type(schema).__name__}"
    if depth > 64:
        return f"{where}: the schema nests deeper than 64 levels"
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) for k in kinds):
            return f"{where}.type must be a string or a list of strings, got {kind!r}"[:300]
        bad = [k for k in kinds if k not in JSON_TYPES]
        if bad:
            return f"{where}.type {bad[0]!r} is not a JSON Schema type ({', '.join(JSON_TYPES)})"[:300]
    held = _held(schema, where)
    if isinstance(held, str):
        return held
    for path, sub in held:
        if p := schema_problem(sub, path, depth + 1):
            return p
    if "required" in schema and not (isinstance(schema["required"], list)
                                     and all(isinstance(r, str) for r in schema["required"])):
        return f"{where}.required must be a list of property names"
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        return f"{where}.enum must be a non-empty list"
    return None


# --- tools -------------------------------------------------------------------------------------

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _tools(body: dict, out: Structured) -> None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise StructuredError(f"parallel_tool_calls must be a boolean, got {parallel!r}"[:300], "parallel_tool_calls")
    out.parallel = True if parallel is None else parallel
    functions = _functions(tools)
    out.names = frozenset(f["name"] for f in functions)
    if functions:
        out.tools = [{"type": "function", "function": f} for f in functions]
    if choice is None:
        out.tool_choice = "auto" if functions else "none"
        named = None
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise StructuredError(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                                  f"\"function\": {{\"name\": ...}}}}, got {choice!r}"[:300], "tool_choice")
        if choice == "required" and not functions:
            raise StructuredError("tool_choice 'required' needs tools", "tool_choice")
        out.tool_choice, named = choice, None
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise StructuredError("tool_choice must name a function as {\"type\": \"function\", \"function\": "
                                  "{\"name\": ...}}" + (" (allowed_tools is not supported)"
                                                        if choice.get("type") == "allowed_tools" else ""),
                                  "tool_choice")
        named = next((f for f in functions if f["name"] == fn["name"]), None)
        if named is None:
            defined = ", ".join(sorted(out.names)) or "none"
            raise StructuredError(f"tool_choice names the function {fn['name']!r}, which is not in tools "
                                  f"(defined: {defined})"[:500], "tool_choice")
        out.tool_choice = "named"
    else:
        raise StructuredError(f"tool_choice must be a string or an object, got {type(choice).__name__}",
                              "tool_choice")
    if out.tool_choice == "none" or not functions:
        return
    if out.tool_choice == "named":
        fmt = _call_tag(named, schema=True)
    elif out.tool_choice == "required":
        fmt = {"type": "tags_with_separator", "tags": [_call_tag(f, schema=True) for f in functions],
               "separator": CALL_SEPARATOR, "at_least_one": True, "stop_after_first": not out.parallel}
    elif any(f.get("strict") for f in functions) or not out.parallel:
        # auto: free text; a `<tool_call>` starts a constrained call (a strict tool's arguments
        # follow its schema, another's are any JSON object); without parallel calls, one call
        # ends the answer.
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN],
               "tags": [_call_tag(f, schema=bool(f.get("strict"))) for f in functions],
               "at_least_one": False, "stop_after_first": not out.parallel}
    else:
        return          # auto without strict tools: free text, calls parsed from it
    text = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
    _limit(text, "the tools' structural tag", "tools", MAX_STRUCTURAL_TAG_BYTES)
    out.constraint, out.source = common_pb2.Constraint(structural_tag=text), "tools"


def _call_tag(function: dict, *, schema: bool) -> dict:
    """One call to `function` in our format: the begin string fixes the name, the content is
    the arguments object (its parameters schema, or any JSON object)."""
    params = function.get("parameters") if schema else None
    content = params if params is not None else (EMPTY_PARAMETERS if schema else {"type": "object"})
    # At most one whitespace character in a row: the arguments stay on one line, as a
    # json_schema answer's do (the target compiles those without free whitespace), so a model
    # cannot pad a call with whitespace until max_tokens.
    return {"type": "tag", "begin": f'{CALL_OPEN}{{"name": "{function["name"]}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": content, "max_whitespace_cnt": ARGS_WHITESPACE},
            "end": "}" + CALL_CLOSE}


def _functions(tools) -> list[dict]:
    """tools -> the function definitions (name, description?, parameters?, strict?), checked."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise StructuredError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise StructuredError(f"tools has {len(tools)} functions; at most {MAX_TOOLS} are accepted", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise StructuredError(f"{where} must be {{\"type\": \"function\", \"function\": {{name, description?, "
                                  f"parameters?, strict?}}}}", "tools")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise StructuredError(f"{where} has unknown key(s) {', '.join(extra)}", "tools")
        fn = tool["function"]
        _check_named(fn, ("name", "description", "parameters", "strict"), f"{where}.function", "tools")
        name, strict = fn["name"], fn.get("strict")
        if name in seen:
            raise StructuredError(f"{where}.function.name {name!r} is defined twice", "tools")
        seen.add(name)
        params = fn.get("parameters")
        entry = {"name": name}
        if fn.get("description") is not None:
            entry["description"] = fn["description"]
        if params is not None:
            ptype = params.get("type") if isinstance(params, dict) else None
            if not isinstance(params, dict) or ptype not in (None, "object"):
                raise StructuredError(f"{where}.function.parameters must be a JSON Schema of type \"object\""
                                      + (f", got type {ptype!r}" if isinstance(params, dict) else ""), "tools")
            json_schema_text(params, f"{where}.function.parameters", "tools")
            entry["parameters"] = params
        if strict is not None:
            entry["strict"] = strict
        out.append(entry)
    return out


# --- constraint (gRPC) -> its problems ---------------------------------------------------------

def constraint_problem(c: common_pb2.Constraint) -> str | None:
    """The shape check of GenerateRequest.sampling.constraint (the target still compiles it):
    a message naming sampling.constraint.<kind>, or None when the shape is fine."""
    kind = c.WhichOneof("kind")
    where = f"sampling.constraint.{kind}"
    if kind is None:
        return f"sampling.constraint is set but empty: set exactly one of {', '.join(CONSTRAINT_KINDS)}"
    if c.strict and kind != "json_schema":
        return f"sampling.constraint.strict applies to json_schema only, not {kind}"
    if kind == "json_object":
        return None if c.json_object else f"{where} must be true (unset the constraint for free text)"
    if kind in ("json_schema", "structural_tag"):
        text = getattr(c, kind)
        limit = MAX_SPEC_BYTES if kind == "json_schema" else MAX_STRUCTURAL_TAG_BYTES
        if len(text.encode()) > limit:
            return f"{where} is {len(text.encode())} bytes; at most {limit} bytes ({limit // 1024} KB) are accepted"
        value, problem = json_text_problem(text, where)
        if problem:
            return problem
        if not isinstance(value, dict):
            return f"{where} must be a JSON object, got {type(value).__name__}"
        return schema_problem(value, where) if kind == "json_schema" else None
    if kind in ("regex", "grammar"):
        text = getattr(c, kind)
        if not text:
            return f"{where} is empty"
        if len(text.encode()) > MAX_SPEC_BYTES:
            return f"{where} is {len(text.encode())} bytes; at most {MAX_SPEC_BYTES} bytes are accepted"
        return None
    choices = list(c.choice.choices)
    if not choices:
        return f"{where} has no choices"
    for i, s in enumerate(choices):
        if not s:
            return f"{where}.choices[{i}] is empty"
    size = sum(len(s.encode()) for s in choices)
    if size > MAX_SPEC_BYTES:
        return f"{where} is {size} bytes; at most {MAX_SPEC_BYTES} bytes are accepted"
    return None


# --- generated text -> content and tool_calls --------------------------------------------------

def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parse_call(inner: str, names: frozenset[str]) -> dict | None:
    """The JSON inside one <tool_call> block -> an OpenAI tool call, or None if it is not one
    (then the block stays in the content as written)."""
    try:
        value = json.loads(inner)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return {"id": _call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallParser:
    """Incremental: `feed(text)` returns (content, calls) newly settled; `finish()` the rest.
    Content is the text outside complete tool-call blocks; what could still be the start of
    `<tool_call>` and whitespace next to a call are held back, so the streamed content equals
    the non-streamed one (`parse_tool_calls` runs this same parser)."""

    def __init__(self, names):
        self.names = frozenset(names)
        self.buf = ""            # unsettled text (outside a block: a possible tag start; inside: the block)
        self.inside = False
        self.pending_ws = ""     # trailing whitespace held back (dropped next to a call)
        self.after_call = False  # leading whitespace after a call is dropped too
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content, calls = [], []
        while True:
            if not self.inside:
                at = self.buf.find(CALL_OPEN)
                if at < 0:
                    keep = _partial_tail(self.buf, CALL_OPEN)
                    content.append(self._text(self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self._text(self.buf[:at]))
                self.buf = self.buf[at:]
                self.inside = True
            end = self.buf.find(CALL_CLOSE)
            if end < 0:
                break
            block = self.buf[:end + len(CALL_CLOSE)]
            self.buf = self.buf[end + len(CALL_CLOSE):]
            self.inside = False
            call = _parse_call(block[len(CALL_OPEN):-len(CALL_CLOSE)], self.names)
            if call is None:
                content.append(self._text(block))
            else:
                self.pending_ws = ""          # whitespace next to a call is not content
                self.after_call = True
                self.calls += 1
                calls.append(call)
        return "".join(content), calls

    def _text(self, text: str) -> str:
        if not text:
            return ""
        full = self.pending_ws + text
        if self.after_call:
            full = full.lstrip()
            if not full:
                self.pending_ws = ""
                return ""
            self.after_call = False
        body = full.rstrip()
        self.pending_ws = full[len(body):]
        return body

    def finish(self) -> str:
        """The text still held back, as content (an unclosed block stays text): call at the end."""
        rest, self.buf, self.inside = self.buf, "", False
        out = self._text(rest)
        if not self.calls:
            out += self.pending_ws
        self.pending_ws = ""
        return out


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str, names) -> tuple[str | None, list[dict]]:
    """The answer -> (content, tool_calls). Content is None when the answer is only calls."""
    p = ToolCallParser(names)
    content, calls = p.feed(text)
    content += p.finish()
    if calls:
        return (content or None), calls
    return content, calls
