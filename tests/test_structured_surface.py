"""Structured outputs and tool calls at the gateway (issue 41, "The API surface" and "Bad input"):
gateway/structured.py maps response_format, structured_outputs, the legacy guided_* fields and
tools / tool_choice to one Constraint, refuses what it cannot honour with a 400 naming the field,
and turns `<tool_call>` blocks into OpenAI tool_calls (streamed as deltas too); every constraint
it emits compiles with xgrammar (what the target uses) and accepts what it should; the
Constraint reaches every TargetOpen; a target's refusal of it comes back as a 400 naming the
field it came from; gRPC's sampling.constraint is shape-checked.

No model: the HTTP and gRPC tests run the gateway in process against fake targets that record
every TargetOpen and answer a scripted text. A few seconds for the whole file."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import types
from pathlib import Path

import grpc
import pytest
from service_helpers import FakeTargetServicer
from service_helpers import asgi_post as post

from gateway import inproc
from gateway import structured as S
from gateway.config import GatewayConfig
from gateway.http_api import create_app
from gateway.server import Backends, GenerationServicer
from splitspec import logs
from splitspec_tools.client import build_request
from splitspec.security import ApiKeys
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 6, 7, 8, 9, 10, 11]
TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }}"
            "\n{% endfor %}{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}"
            "[call {{ c.function.name }} city={{ c.function.arguments.city }}]"
            "{% endfor %}{% endif %}\n{% endfor %}<|assistant|>")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CALL2 = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                                           "size": {"enum": ["S", "M", "L"]}},
          "required": ["name", "size"]}


def rf_schema(schema=SCHEMA, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, **extra}}


def refused(body: dict, *, chat: bool = True) -> S.StructuredError:
    with pytest.raises(S.StructuredError) as err:
        S.from_request(body, chat=chat)
    return err.value


# --- mapping ---------------------------------------------------------------------------------

def test_response_format_maps_to_a_constraint():
    assert S.from_request({}, chat=True).constraint is None
    assert S.from_request({"response_format": {"type": "text"}}, chat=True).constraint is None
    got = S.from_request({"response_format": {"type": "json_object"}}, chat=False)
    assert got.constraint == common_pb2.Constraint(json_object=True) and got.source == "response_format"
    got = S.from_request({"response_format": rf_schema(strict=True, description="a thing")}, chat=True)
    assert json.loads(got.constraint.json_schema) == SCHEMA and got.constraint.strict
    assert got.source == "response_format"
    got = S.from_request({"response_format": rf_schema()}, chat=True)
    assert not got.constraint.strict            # OpenAI's default: strict false
    got = S.from_request({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, chat=True)
    assert got.constraint.json_schema == "{}"   # no schema: any JSON value


@pytest.mark.parametrize("fmt, words", [
    ({"type": "yaml"}, "'yaml' is not supported"),
    ("json", "must be an object"),
    ({"type": 3}, "must be an object with a string `type`"),
    ({"type": "json_object", "schema": {}}, "unknown key(s) schema"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "name must be 1-64"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name must be 1-64"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}}, "name must be 1-64"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}, "unknown key(s) extra"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "strict must be a boolean"),
    (rf_schema([1, 2]), "must be a JSON Schema object"),
    (rf_schema({"type": 5}), "type must be a string or a list of strings"),
    (rf_schema({"type": "objectx"}), "'objectx' is not a JSON Schema type"),
    (rf_schema({"type": "object", "properties": {"a": {"type": ["string", "nope"]}}}),
     "schema.properties.a.type 'nope'"),
    (rf_schema({"type": "array", "items": {"anyOf": [{"type": "dict"}]}}), "items.anyOf[0].type 'dict'"),
    (rf_schema({"type": "object", "properties": {"a": 3}}), "properties.a must be a JSON Schema"),
    (rf_schema({"type": "object", "required": "a"}), "required must be a list"),
    (rf_schema({"enum": []}), "enum must be a non-empty list"),
    (rf_schema({"type": "number", "maximum": float("nan")}), "not valid JSON"),
])
def test_response_format_refusals_name_the_field(fmt, words):
    err = refused({"response_format": fmt})
    assert err.param == "response_format" and words in err.message, err.message


def test_a_schema_over_64_kb_is_refused_clearly():
    big = {"type": "object", "properties": {f"p{i:05d}": {"type": "string", "description": "x" * 60}
                                            for i in range(1000)}}
    err = refused({"response_format": rf_schema(big)})
    assert err.param == "response_format" and "at most 65536 bytes (64 KB)" in err.message
    err = refused({"structured_outputs": {"regex": "a" * 70000}})
    assert err.param == "structured_outputs" and "64 KB" in err.message


@pytest.mark.parametrize("key, value, want", [
    ("json", SCHEMA, common_pb2.Constraint(json_schema=json.dumps(SCHEMA))),
    ("json", json.dumps(SCHEMA), common_pb2.Constraint(json_schema=json.dumps(SCHEMA))),
    ("regex", r"\d{3}-[a-z]+", common_pb2.Constraint(regex=r"\d{3}-[a-z]+")),
    ("choice", ["yes", "no"], common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["yes", "no"]))),
    ("grammar", 'root ::= "a" | "b"', common_pb2.Constraint(grammar='root ::= "a" | "b"')),
])
def test_structured_outputs_and_guided_aliases_map_the_same(key, value, want):
    got = S.from_request({"structured_outputs": {key: value}}, chat=True)
    assert got.constraint == want and got.source == "structured_outputs"
    legacy = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
              "grammar": "guided_grammar"}[key]
    got = S.from_request({legacy: value}, chat=False)
    assert got.constraint == want and got.source == legacy


def test_structured_outputs_options():
    got = S.from_request({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True,
                                                 "disable_fallback": True, "regex": None}}, chat=True)
    assert got.constraint.strict and got.constraint.json_schema
    got = S.from_request({"structured_outputs": {"json_object": True}}, chat=True)
    assert got.constraint == common_pb2.Constraint(json_object=True)
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    got = S.from_request({"structured_outputs": {"structural_tag": tag}}, chat=True)
    assert json.loads(got.constraint.structural_tag) == tag


@pytest.mark.parametrize("so, param, words", [
    ({"choice": ["a"], "backend": "xgrammar"}, "structured_outputs.backend", "structured_outputs.backend is not"),
    ({"regex": "a", "grammar": "root ::= \"a\""}, "structured_outputs", "exactly one of"),
    ({}, "structured_outputs", "got none"),
    ("json", "structured_outputs", "must be an object"),
    ({"choice": []}, "structured_outputs", "non-empty list"),
    ({"choice": ["a", 3]}, "structured_outputs", "non-empty list of non-empty strings"),
    ({"choice": ["a", ""]}, "structured_outputs", "non-empty strings"),
    ({"regex": ""}, "structured_outputs", "non-empty string"),
    ({"grammar": 7}, "structured_outputs", "non-empty string"),
    ({"json": "{not json"}, "structured_outputs", "not valid JSON"),
    ({"json": [1]}, "structured_outputs", "JSON Schema object"),
    ({"json": {"type": "int"}}, "structured_outputs", "'int' is not a JSON Schema type"),
    ({"json_object": "yes"}, "structured_outputs", "must be true"),
    ({"structural_tag": "[1]"}, "structured_outputs", "JSON object"),
    ({"regex": "a", "disable_additional_properties": True}, "structured_outputs.disable_additional_properties",
     "json only"),
    ({"json": {}, "disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace", "not supported"),
    ({"json": {}, "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", "not supported"),
])
def test_structured_outputs_refusals(so, param, words):
    err = refused({"structured_outputs": so})
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": rf_schema(), "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "tools"),
    ({"structured_outputs": {"regex": "a"}, "tools": [WEATHER]}, "structured_outputs"),  # auto: calls impossible
])
def test_one_constraint_per_request(body, param):
    err = refused(body)
    assert err.param == param, err.message
    assert "one constraint per request" in err.message or "could never be made" in err.message


def test_a_format_with_tools_that_are_not_called_is_fine():
    got = S.from_request({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "none"},
                         chat=True)
    assert got.constraint.json_object and got.source == "response_format" and not got.parse_tools
    assert got.tools == [WEATHER]       # still described to the model, as OpenAI and vLLM do


def tag_format(c: common_pb2.Constraint) -> dict:
    assert c.WhichOneof("kind") == "structural_tag"
    tag = json.loads(c.structural_tag)
    assert tag["type"] == "structural_tag"
    return tag["format"]


def test_tool_choice_constraints():
    tools = [WEATHER, TIME, NOARGS]
    # none: described, not constrained, nothing parsed.
    got = S.from_request({"tools": tools, "tool_choice": "none"}, chat=True)
    assert got.constraint is None and not got.parse_tools and got.tools == tools
    # auto (the default with tools), no strict tool: free text, calls parsed.
    got = S.from_request({"tools": tools}, chat=True)
    assert got.tool_choice == "auto" and got.constraint is None and got.parse_tools
    assert got.names == {"get_weather", "get_time", "ping"}
    # auto with a strict tool: a triggered structural tag; the strict tool's schema, any object for the others.
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    got = S.from_request({"tools": [strict, TIME], "tool_choice": "auto"}, chat=True)
    fmt = tag_format(got.constraint)
    assert got.source == "tools" and fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]
    assert not fmt["at_least_one"] and not fmt["stop_after_first"]
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == [WEATHER["function"]["parameters"], {"type": "object"}]
    # auto without parallel calls: constrained so that one call ends the answer.
    fmt = tag_format(S.from_request({"tools": tools, "parallel_tool_calls": False}, chat=True).constraint)
    assert fmt["type"] == "triggered_tags" and fmt["stop_after_first"]
    # required: calls only, one or more (one without parallel calls), every tool's schema.
    got = S.from_request({"tools": tools, "tool_choice": "required"}, chat=True)
    fmt = tag_format(got.constraint)
    assert got.source == "tools" and fmt["type"] == "tags_with_separator" and fmt["at_least_one"]
    assert not fmt["stop_after_first"] and fmt["separator"] == "\n"
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == [
        WEATHER["function"]["parameters"], TIME["function"]["parameters"], S.EMPTY_PARAMETERS]
    assert tag_format(S.from_request({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False},
                                     chat=True).constraint)["stop_after_first"]
    # named: exactly one call to it.
    got = S.from_request({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                         chat=True)
    fmt = tag_format(got.constraint)
    assert got.tool_choice == "named" and fmt["type"] == "tag"
    assert fmt["begin"] == '<tool_call>{"name": "get_time", "arguments": ' and fmt["end"] == "}</tool_call>"
    assert fmt["content"]["json_schema"] == TIME["function"]["parameters"]


@pytest.mark.parametrize("body, param, words", [
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [WEATHER] * 2}, "tools", "defined twice"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools", "at most 128"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "type \"object\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "got type 'array'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "float"}}}}}]}, "tools",
     "tools[0].function.parameters.properties.x.type 'float'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "strict must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]}, "tools", "unknown key(s) args"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in tools (defined: get_weather)"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice",
     "allowed_tools is not supported"),
    ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice", "string or an object"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "not in tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
])
def test_tool_refusals_name_the_field(body, param, words):
    err = refused(body)
    assert err.param == param and words in err.message, err.message


def test_tools_are_chat_only():
    assert refused({"tools": [WEATHER]}, chat=False).param == "tools"
    assert refused({"tool_choice": "none"}, chat=False).param == "tools"
    assert S.from_request({"tools": []}, chat=False).constraint is None


# --- every constraint compiles with xgrammar and means what it says -------------------------

@pytest.fixture(scope="module")
def compiler():
    """The target's own compiler (splitspec/grammar.py: xgrammar's GrammarCompiler over
    TokenizerInfo.from_huggingface of the default target's tokenizer, vocab 8192), so each
    constraint is compiled exactly as the target compiles it."""
    pytest.importorskip("xgrammar")
    from splitspec.grammar import Grammars
    return Grammars(ROOT / "models" / "splitspec-code-target", 8192, [0])


def compile_constraint(compiler, c: common_pb2.Constraint):
    """json_schema: compile_json_schema(strict_mode=strict); json_object: the schema
    {"type": "object"}; regex: compile_regex; choice: compile_grammar of the quoted alternatives;
    grammar: compile_grammar; structural_tag: compile_structural_tag."""
    return compiler.compile(c)


def matches(compiled, text: str) -> bool:
    import xgrammar as xgr
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


def constraint(body: dict, chat: bool = True) -> common_pb2.Constraint:
    return S.from_request(body, chat=chat).constraint


def test_json_constraints_compile_and_hold(compiler):
    g = compile_constraint(compiler, constraint({"response_format": rf_schema(strict=True)}))
    assert matches(g, '{"name": "ab", "tags": ["x"], "size": "M"}')
    assert not matches(g, '{"name": "ab", "size": "XL"}')
    assert not matches(g, '{"name": "ab", "size": "M", "extra": 1}')        # strict: no undeclared keys
    g = compile_constraint(compiler, constraint({"response_format": rf_schema(strict=False)}))
    assert matches(g, '{"name": "ab", "size": "M", "extra": 1}')
    g = compile_constraint(compiler, constraint({"response_format": {"type": "json_object"}}, chat=False))
    assert matches(g, '{"a": [1, {"b": null}]}') and not matches(g, "[1]") and not matches(g, "hello")
    g = compile_constraint(compiler, constraint({"structured_outputs": {"json": json.dumps(SCHEMA)}}))
    assert matches(g, '{"name": "", "size": "S"}')
    g = compile_constraint(compiler, constraint({"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "x"}}}))
    assert matches(g, "[1, 2]") and matches(g, '"s"')


def test_regex_choice_grammar_compile_and_hold(compiler):
    g = compile_constraint(compiler, constraint({"guided_regex": r"\d{3}-[a-z]+"}))
    assert matches(g, "123-abc") and not matches(g, "12-abc")
    choices = ["a.b", "x|y", "new\nline", "(paren)", "[br]", "{c}", "é😀", "back\\slash", "^$", "q?*+", "-", "plain"]
    g = compile_constraint(compiler, constraint({"structured_outputs": {"choice": choices}}))
    assert all(matches(g, c) for c in choices)
    assert not matches(g, "ab") and not matches(g, "xy") and not matches(g, "a.bplain")
    g = compile_constraint(compiler, constraint({"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}}))
    assert matches(g, "yes!") and not matches(g, "maybe!")


def test_tool_constraints_compile_and_hold(compiler):
    tools = [WEATHER, TIME, NOARGS]
    named = compile_constraint(compiler, constraint(
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert matches(named, CALL)
    assert matches(named, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>')
    assert not matches(named, CALL2)                                            # another function
    assert not matches(named, "Sure. " + CALL)                                  # no text
    assert not matches(named, CALL + "\n" + CALL)                               # exactly one call
    assert not matches(named, '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert not matches(named, '<tool_call>{"name": "get_weather", "arguments": {"days": 3}}</tool_call>')
    assert matches(named, '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>')
    assert not matches(named, '<tool_call>{"name": "get_weather", "arguments": {"city":  \n "Paris"}}</tool_call>')

    required = compile_constraint(compiler, constraint({"tools": tools, "tool_choice": "required"}))
    assert matches(required, CALL) and matches(required, CALL2) and matches(required, CALL + "\n" + CALL2)
    assert matches(required, '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    assert not matches(required, "") and not matches(required, "hello") and not matches(required, "hi " + CALL)
    assert not matches(required, '<tool_call>{"name": "get_time", "arguments": {"zone": 3}}</tool_call>')
    single = compile_constraint(compiler, constraint({"tools": tools, "tool_choice": "required",
                                                      "parallel_tool_calls": False}))
    assert matches(single, CALL) and not matches(single, CALL + "\n" + CALL2)

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    auto = compile_constraint(compiler, constraint({"tools": [strict, TIME]}))
    assert matches(auto, "") and matches(auto, "just text") and matches(auto, "let me see " + CALL + " done")
    assert matches(auto, CALL + "\n" + CALL2)
    assert matches(auto, '<tool_call>{"name": "get_time", "arguments": {"anything": [1]}}</tool_call>')  # not strict
    assert not matches(auto, '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert not matches(auto, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    once = compile_constraint(compiler, constraint({"tools": tools, "parallel_tool_calls": False}))
    assert matches(once, "text " + CALL) and not matches(once, CALL + CALL2)

    vllm_tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
        {"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": {"type": "object"}},
         "end": "</f>"}]}}
    g = compile_constraint(compiler, constraint({"structured_outputs": {"structural_tag": json.dumps(vllm_tag)}}))
    assert matches(g, 'x <f=a>{"k": 1}</f>')


# --- parsing the answer ------------------------------------------------------------------------

NAMES = {"get_weather", "get_time", "ping"}


def test_parse_tool_calls():
    content, calls = S.parse_tool_calls(CALL, NAMES)
    assert content is None and len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    content, calls = S.parse_tool_calls(f"Let me check.\n{CALL}\n{CALL2}\n", NAMES)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2
    content, calls = S.parse_tool_calls(f"{CALL}\nDone.", NAMES)
    assert content == "Done." and len(calls) == 1
    # Hermes spacing, arguments given as a JSON string, and no arguments at all.
    content, calls = S.parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n'
                                        '</tool_call><tool_call>{"name": "ping"}</tool_call>', NAMES)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": "CET"}, {}]
    # Not calls: text as written (no tools named, unknown function, bad JSON, unclosed block).
    for text in ("plain answer", "  spaced  ", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 "<tool_call>{not json}</tool_call>", '<tool_call>{"name": "get_weather", "arguments": 3}</tool_call>',
                 '<tool_call>{"name": "get_weather", "arguments": {"city"', "a <tool_ca", "x < y <tool"):
        assert S.parse_tool_calls(text, NAMES) == (text, []), text
    content, calls = S.parse_tool_calls("<tool_call>{bad}</tool_call>" + CALL, NAMES)
    assert content == "<tool_call>{bad}</tool_call>" and len(calls) == 1


@pytest.mark.parametrize("text", [
    CALL, f"Let me check.\n{CALL}\n{CALL2}\n", f"{CALL}\nDone.", "plain answer <tool no call",
    f"a <tool_call>{{bad}}</tool_call> b {CALL}", "  lead\n" + CALL + "  \n", "x<tool_call>unclosed",
    "<<tool_call>" + CALL[len("<tool_call>"):] + "<",
])
def test_streamed_parse_equals_the_whole_parse(text):
    """Any split of the answer into chunks gives the same content and calls, and no content
    delta ever holds part of a tool-call tag."""
    def norm(calls):
        return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    want_content, want_calls = S.parse_tool_calls(text, NAMES)
    rng = random.Random(len(text))
    splits = [[1] * len(text), [len(text)], *[[rng.randint(1, 7) for _ in range(len(text))] for _ in range(20)]]
    for sizes in splits:
        p = S.ToolCallParser(NAMES)
        content, calls, pos = [], [], 0
        for n in sizes:
            if pos >= len(text):
                break
            piece, got = p.feed(text[pos:pos + n])
            pos += n
            content.append(piece)
            calls += got
            if want_calls and "{bad}" not in text and "unclosed" not in text:
                assert "<tool_call" not in piece and "</tool_call" not in piece, piece
        content.append(p.finish())
        got_content = "".join(content)
        assert (got_content or None if calls else got_content) == want_content, sizes
        assert norm(calls) == norm(want_calls)


# --- gRPC sampling.constraint: shape checks ----------------------------------------------------

@pytest.mark.parametrize("c, words", [
    (common_pb2.Constraint(), "sampling.constraint is set but empty"),
    (common_pb2.Constraint(json_schema="{nope"), "sampling.constraint.json_schema is not valid JSON"),
    (common_pb2.Constraint(json_schema="[1]"), "sampling.constraint.json_schema must be a JSON object"),
    (common_pb2.Constraint(json_schema='{"type": "objectx"}'), "sampling.constraint.json_schema.type 'objectx'"),
    (common_pb2.Constraint(json_schema=json.dumps({"description": "x" * 70000})),
     "sampling.constraint.json_schema is 70019 bytes; at most 65536"),
    (common_pb2.Constraint(json_object=False), "sampling.constraint.json_object must be true"),
    (common_pb2.Constraint(regex=""), "sampling.constraint.regex is empty"),
    (common_pb2.Constraint(grammar="x" * 65537), "sampling.constraint.grammar is 65537 bytes"),
    (common_pb2.Constraint(choice=common_pb2.ChoiceList()), "sampling.constraint.choice has no choices"),
    (common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["a", ""])), "sampling.constraint.choice.choices[1]"),
    (common_pb2.Constraint(structural_tag="nope"), "sampling.constraint.structural_tag is not valid JSON"),
    (common_pb2.Constraint(regex="a", strict=True), "sampling.constraint.strict applies to json_schema only"),
])
def test_constraint_problems(c, words):
    assert S.constraint_problem(c).startswith(words), S.constraint_problem(c)


def test_good_constraints_have_no_problem():
    for c in (common_pb2.Constraint(json_schema='{"type": "object"}', strict=True),
              common_pb2.Constraint(json_object=True), common_pb2.Constraint(regex="a+"),
              common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["a"])),
              common_pb2.Constraint(grammar='root ::= "a"'),
              constraint({"tools": [WEATHER], "tool_choice": "required"})):
        assert S.constraint_problem(c) is None


# --- through the gateway: fake targets that record TargetOpen ----------------------------------

class FakeTarget(FakeTargetServicer):
    """Answers `script.text` then eos (0); with `script.refuse` set it refuses a constrained open
    as the real target refuses a spec that does not compile."""

    max_context = 4096

    def __init__(self, tokenizer_json: bytes, opens: list, script):
        from tokenizers import Tokenizer
        super().__init__(tokenizer_json, TEMPLATE, opens)
        self.script = script
        self.tok = Tokenizer.from_str(tokenizer_json.decode())

    async def open(self, request, context):
        c = request.sampling.constraint
        if self.script.refuse and request.sampling.HasField("constraint"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"sampling.constraint.{c.WhichOneof('kind')}: {self.script.refuse}")
        answer = self.tok.encode(self.script.text, add_special_tokens=False).ids + [0]
        rest = iter(answer[1:])

        async def token(i):
            return next(rest, 0)       # eos again once the answer is out
        return target_pb2.TargetOpened(session_id=request.session_id, first_token_id=answer[0],
                                       length=len(request.prompt_token_ids) + 1), token


@contextlib.asynccontextmanager
async def stack(tokenizer_json: bytes, text: str = "ok", refuse: str = ""):
    """A fake target, the gateway's Generate servicer over it and its HTTP app. Yields
    (servicer, app, the TargetOpens received, the script: .text and .refuse can be changed)."""
    opens: list[target_pb2.TargetOpen] = []
    script = types.SimpleNamespace(text=text, refuse=refuse)
    srv = grpc.aio.server()
    target_pb2_grpc.add_TargetServicer_to_server(FakeTarget(tokenizer_json, opens, script), srv)
    address = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
    await srv.start()
    backends = Backends(GatewayConfig(targets=(address,), target_wait_s=10, max_new_tokens_cap=512))
    await backends.connect(logs.get_logger())
    servicer = GenerationServicer(backends, types.SimpleNamespace(serving=True))
    try:
        yield servicer, create_app(servicer, ApiKeys([])), opens, script
    finally:
        await backends.close()
        await srv.stop(None)


def events(body: bytes) -> list:
    return [json.loads(line[6:]) for line in body.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "weather?"}]


def test_http_refusals_name_the_field_and_reach_no_target(tokenizer_json):
    cases = [
        (CHAT, {"response_format": {"type": "yaml"}}, "response_format"),
        ("/v1/completions", {"response_format": "json"}, "response_format"),
        (CHAT, {"response_format": rf_schema({"type": "objectx"})}, "response_format"),
        (CHAT, {"structured_outputs": {"choice": ["a"], "backend": "x"}}, "structured_outputs.backend"),
        ("/v1/completions", {"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
        (CHAT, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
        ("/v1/completions", {"tools": [WEATHER]}, "tools"),
        (CHAT, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        (CHAT, {"tools": [WEATHER], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ]

    async def main():
        async with stack(tokenizer_json) as (_, app, opens, _):
            for path, extra, param in cases:
                base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
                for stream in (False, True):
                    status, raw = await post(app, path, {**base, "max_tokens": 8, "stream": stream, **extra})
                    assert status == 400, (extra, raw)
                    err = json.loads(raw)["error"]
                    assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
            assert opens == []
    asyncio.run(main())


CONSTRAINED = [
    (CHAT, {"response_format": rf_schema(strict=True)},
     common_pb2.Constraint(json_schema=json.dumps(SCHEMA), strict=True)),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, common_pb2.Constraint(json_object=True)),
    ("/v1/completions", {"structured_outputs": {"regex": "[ab]+"}}, common_pb2.Constraint(regex="[ab]+")),
    (CHAT, {"structured_outputs": {"choice": ["yes", "no"]}},
     common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["yes", "no"]))),
    (CHAT, {"guided_grammar": 'root ::= "a"'}, common_pb2.Constraint(grammar='root ::= "a"')),
    (CHAT, {"tools": [WEATHER], "tool_choice": "required"},
     S.from_request({"tools": [WEATHER], "tool_choice": "required"}, chat=True).constraint),
]


def test_the_constraint_reaches_every_target_open(tokenizer_json):
    async def main():
        async with stack(tokenizer_json) as (_, app, opens, _):
            for path, extra, want in CONSTRAINED:
                base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
                for stream in (False, True):
                    opens.clear()
                    status, raw = await post(app, path, {**base, "max_tokens": 8, "n": 2, "stream": stream, **extra})
                    assert status == 200, raw
                    assert [o.sampling.constraint for o in opens] == [want, want], extra
            opens.clear()
            status, raw = await post(app, CHAT, {"messages": MESSAGES, "max_tokens": 8})
            assert status == 200 and not opens[0].sampling.HasField("constraint")
    asyncio.run(main())


def test_a_target_refusal_is_a_400_naming_the_source_field(tokenizer_json):
    cases = [(CHAT, {"response_format": rf_schema()}, "response_format"),
             ("/v1/completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
             (CHAT, {"guided_json": {"type": "object"}}, "guided_json"),
             (CHAT, {"tools": [WEATHER], "tool_choice": "required"}, "tools"),
             (CHAT, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
              "tools")]

    async def main():
        async with stack(tokenizer_json, refuse="does not compile (fake)") as (_, app, opens, _):
            for path, extra, param in cases:
                base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
                for stream in (False, True):
                    status, raw = await post(app, path, {**base, "max_tokens": 8, "n": 2, "stream": stream, **extra})
                    assert status == 400, raw
                    err = json.loads(raw)["error"]
                    assert err["param"] == param and "sampling.constraint." in err["message"], err
                    assert "does not compile (fake)" in err["message"]
    asyncio.run(main())


async def with_tools(app, script, text: str, **extra) -> bytes:
    """The body of a 200 to a chat offering the weather and time tools, the fake target answering `text`."""
    script.text = text
    status, raw = await post(app, CHAT, {"messages": MESSAGES, "tools": [WEATHER, TIME], **extra})
    assert status == 200, raw
    return raw


def test_tool_calls_come_back_in_openais_shape(tokenizer_json):
    async def main():
        async with stack(tokenizer_json) as (_, app, opens, script):
            # Calls only: content null, finish_reason tool_calls.
            raw = await with_tools(app, script, f"{CALL}\n{CALL2}", tool_choice="required")
            choice = json.loads(raw)["choices"][0]
            msg = choice["message"]
            assert choice["finish_reason"] == "tool_calls" and msg["content"] is None
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
                ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
            assert all(c["type"] == "function" and c["id"].startswith("call_") for c in msg["tool_calls"])
            # The tools reached the template (and so the prompt).
            prompt = FakeTarget(tokenizer_json, [], script).tok.decode(list(opens[-1].prompt_token_ids))
            assert "<|tools|>get_weather:" in prompt and "get_time:" in prompt

            # auto: text and a call.
            raw = await with_tools(app, script, f"Checking.\n{CALL}")
            choice = json.loads(raw)["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
            assert len(choice["message"]["tool_calls"]) == 1

            # none: the block is text, no calls; a plain answer under auto is plain too.
            for extra in ({"tool_choice": "none"}, {}):
                raw = await with_tools(app, script, CALL if extra else "It is sunny.", **extra)
                choice = json.loads(raw)["choices"][0]
                assert choice["finish_reason"] == "stop" and choice["message"]["content"] == script.text
                assert "tool_calls" not in choice["message"]

            # A conversation with an earlier call: its arguments reach the template as an object.
            opens.clear()
            history = MESSAGES + [
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12C"}]
            await with_tools(app, script, "Sunny.", messages=history)
            prompt = FakeTarget(tokenizer_json, [], script).tok.decode(list(opens[-1].prompt_token_ids))
            assert "[call get_weather city=Oslo]" in prompt and "<|tool|>12C" in prompt
    asyncio.run(main())


def test_streamed_tool_calls_are_deltas(tokenizer_json):
    async def main():
        async with stack(tokenizer_json) as (_, app, _, script):
            raw = await with_tools(app, script, f"Let me look.\n{CALL}\n{CALL2}", stream=True,
                                   stream_options={"include_usage": True})
            chunks = [e for e in events(raw) if e["choices"]]
            deltas = [e["choices"][0]["delta"] for e in chunks]
            content = "".join(d.get("content") or "" for d in deltas)
            assert content == "Let me look."
            assert not any("<tool" in (d.get("content") or "") for d in deltas)
            calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
            assert [c["index"] for c in calls] == [0, 1]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
                ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
            assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
            assert events(raw)[-1]["usage"]["completion_tokens"] > 0

            # tool_choice none: streamed as text, finish stop.
            raw = await with_tools(app, script, CALL, tool_choice="none", stream=True)
            chunks = [e for e in events(raw) if e["choices"]]
            assert "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks) == CALL
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    asyncio.run(main())


def test_the_openai_client_reads_our_tool_calls(tokenizer_json):
    """The official client (over an in-process ASGI transport) parses the shapes: message
    tool_calls, and the streamed deltas accumulated by its stream helper."""
    openai = pytest.importorskip("openai")
    try:
        import httpx2 as httpx      # what openai >= 3 is built on
    except ImportError:
        httpx = pytest.importorskip("httpx")

    async def main():
        async with stack(tokenizer_json, text=f"{CALL}") as (_, app, _, _):
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
            client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=http, max_retries=0)
            got = await client.chat.completions.create(
                model="fake", messages=MESSAGES, tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            msg = got.choices[0].message
            assert got.choices[0].finish_reason == "tool_calls" and msg.content is None
            assert msg.tool_calls[0].function.name == "get_weather"
            assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
            async with client.chat.completions.stream(model="fake", messages=MESSAGES, tools=[WEATHER],
                                                      tool_choice="required") as stream:
                async for _ in stream:
                    pass
                final = await stream.get_final_completion()
            call = final.choices[0].message.tool_calls[0]
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
            await http.aclose()
    asyncio.run(main())


def test_grpc_constraint_is_checked_and_forwarded(tokenizer_json):
    async def run(servicer, req):
        return [r async for r in inproc.generate(servicer, req)]

    async def main():
        async with stack(tokenizer_json, text='{"a": 1}') as (servicer, _, opens, _):
            bad_ones = [(common_pb2.Constraint(json_schema="[1]"), "sampling.constraint.json_schema"),
                        (common_pb2.Constraint(choice=common_pb2.ChoiceList()), "sampling.constraint.choice"),
                        (common_pb2.Constraint(regex=""), "sampling.constraint.regex"),
                        (common_pb2.Constraint(), "sampling.constraint")]
            for c, words in bad_ones:
                req = build_request(PROMPT, max_new_tokens=8)
                req.sampling.constraint.CopyFrom(c)
                with pytest.raises(inproc.LocalRpcError) as err:
                    await run(servicer, req)
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details.startswith(words), err.value.details
            req = build_request(PROMPT, max_new_tokens=8, ignore_eos=True)
            req.sampling.constraint.json_object = True
            with pytest.raises(inproc.LocalRpcError) as err:
                await run(servicer, req)
            assert "ignore_eos" in err.value.details
            assert opens == []
            good = common_pb2.Constraint(json_schema='{"type": "object"}', strict=True)
            req = build_request(PROMPT, max_new_tokens=8)
            req.sampling.constraint.CopyFrom(good)
            got = await run(servicer, req)
            assert opens[0].sampling.constraint == good
            assert got[-1].complete.finish_reason == "eos"
    asyncio.run(main())
