"""Structured outputs and tool calls through the real services with the official `openai`
client (issue 41, "Tests": each API form, streamed and not): the bundled default target and
draft, answers constrained by response_format json_schema (three shapes) and json_object,
structured_outputs regex / choice / grammar (and a legacy guided_* alias), and tool_choice named
/ required, at T = 0 and T = 1, with speculation none / ngram / dflash. Every completed answer
(finish_reason stop, or tool_calls) is valid: it parses and validates against its schema, fully
matches its regex, is one of the choices, is a sentence of the grammar, or is tool calls with
valid JSON arguments. An answer cut by max_tokens (finish_reason length) is counted and not
judged; most must complete. At T = 0 every method gives the same answer as target-only.

Needs xgrammar (splitspec/grammar.py) and the bundled models."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from service_helpers import ROOT, running_stack
from splitspec_tools.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from splitspec_tools.ops.launch import free_port

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
TARGET, DRAFT = ROOT / DEFAULT_TARGET, ROOT / DEFAULT_DRAFT
pytestmark = pytest.mark.skipif(not ((TARGET / "config.json").is_file() and (DRAFT / "config.json").is_file()),
                                reason="needs the bundled models")

TEMPLATE = ("{% if tools %}# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
            "Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
METHODS = ("none", "ngram", "dflash")
MAX_TOKENS = 96

SCHEMAS = {
    "flat": {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]},
                                              "count": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["size", "count"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}},
        "required": ["tags", "meta"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "score": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "null"}]}},
        "required": ["name", "score"]},
}
REGEX = r"[A-Z][a-z]{1,5}-[0-9]{2}"
CHOICES = ["red", "green", "blue", "light blue"]
GRAMMAR = 'root ::= "(" num ("," num)? ")"\nnum ::= [0-9] | [1-9] [0-9]'
GRAMMAR_RE = r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))?\)"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = [{"role": "user", "content": "def describe(item):\n    # answer in the requested format\n"}]

# name -> (endpoint, request fields, check of a completed answer's text)
CASES = {
    "json_schema_flat": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "flat", "schema": SCHEMAS["flat"], "strict": True}}}, "flat"),
    "json_schema_nested": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "nested", "schema": SCHEMAS["nested"]}}}, "nested"),
    "json_schema_nullable": ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "nullable", "schema": SCHEMAS["nullable"], "strict": True}}}, "nullable"),
    "json_object": ("chat", {"response_format": {"type": "json_object"}, "max_tokens": 256}, "object"),
    "regex": ("completions", {"structured_outputs": {"regex": REGEX}}, "regex"),
    "choice": ("chat", {"structured_outputs": {"choice": CHOICES}}, "choice"),
    "grammar": ("completions", {"guided_grammar": GRAMMAR}, "grammar"),
    "tool_named": ("chat", {"tools": [WEATHER, TIME],
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "named"),
    # One call: with parallel calls a small model may go on calling until max_tokens.
    "tool_required": ("chat", {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
                      "required"),
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    port = free_port()
    with running_stack(TARGET, logs, DRAFT, "--http-port", str(port), "--chat-template", TEMPLATE,
                       "--max-new-tokens-cap", "512"):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)


def ask(client, case: str, method: str, temperature: float, stream: bool, seed: int = 0):
    """One request -> (finish_reason, text, [(name, arguments JSON string)] or None)."""
    endpoint, fields, _ = CASES[case]
    fields = dict(fields)
    extra = {"speculative": {"method": method}}
    common = dict(model="", max_tokens=fields.pop("max_tokens", MAX_TOKENS), temperature=temperature, seed=seed,
                  stream=stream)
    if endpoint == "completions":
        got = client.completions.create(prompt="# a value in the requested format:\n", **common,
                                        extra_body={**fields, **extra})
        if not stream:
            return got.choices[0].finish_reason, got.choices[0].text, None
        text, finish = "", None
        for ev in got:
            for ch in ev.choices:
                text += ch.text or ""
                finish = ch.finish_reason or finish
        return finish, text, None
    named = {k: v for k, v in fields.items() if k in ("response_format", "tools", "tool_choice", "parallel_tool_calls")}
    rest = {k: v for k, v in fields.items() if k not in named}
    got = client.chat.completions.create(messages=USER, **common, **named, extra_body={**rest, **extra})
    if not stream:
        msg = got.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls] if msg.tool_calls else None
        return got.choices[0].finish_reason, msg.content, calls
    text, finish, calls = "", None, {}
    for ev in got:
        for ch in ev.choices:
            text += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                assert tc.id and tc.id.startswith("call_") and tc.type == "function"
                assert tc.index not in calls            # one delta per call, whole arguments
                calls[tc.index] = (tc.function.name, tc.function.arguments)
            finish = ch.finish_reason or finish
    return finish, text or None, [calls[i] for i in sorted(calls)] or None


def valid(case: str, text: str | None, calls) -> str | None:
    """Why a completed answer is not valid (None: it is)."""
    kind = CASES[case][2]
    if kind in ("named", "required"):
        if not calls:
            return f"no tool calls (content {text!r})"
        if len(calls) != 1 or (kind == "named" and calls[0][0] != "get_weather"):
            return f"not exactly one call (get_weather when named): {calls}"
        for name, args in calls:
            if name not in PARAMS:
                return f"unknown function {name}"
            try:
                jsonschema.validate(json.loads(args), PARAMS[name])
            except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                return f"{name} arguments {args!r}: {exc}"[:300]
        return None
    if calls:
        return f"unexpected tool calls {calls}"
    text = text or ""
    if kind in SCHEMAS or kind == "object":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON: {text!r} ({exc})"
        try:
            jsonschema.validate(value, SCHEMAS[kind] if kind in SCHEMAS else {"type": "object"})
        except jsonschema.ValidationError as exc:
            return f"{text!r}: {exc.message}"
        return None
    if kind == "regex":
        return None if re.fullmatch(REGEX, text) else f"{text!r} does not match {REGEX}"
    if kind == "choice":
        return None if text in CHOICES else f"{text!r} is not one of {CHOICES}"
    return None if re.fullmatch(GRAMMAR_RE, text) else f"{text!r} is not a sentence of the grammar"


@pytest.mark.parametrize("case", list(CASES))
def test_every_completed_answer_is_valid(client, case):
    runs = [(m, t, s, seed) for m in METHODS for t in (0.0, 1.0) for s in (False, True)
            for seed in ((0,) if t == 0 else (1, 2))]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda r: ask(client, case, *r), runs))
    cut, bad = 0, []
    greedy = {}
    for (method, temp, stream, seed), (finish, text, calls) in zip(runs, results):
        if finish == "length":
            cut += 1
            continue
        tools = CASES[case][2] in ("named", "required")
        assert finish == ("tool_calls" if tools else "stop"), (method, temp, stream, finish, text, calls)
        why = valid(case, text, calls)
        if why:
            bad.append((method, temp, stream, why))
        if temp == 0:
            greedy[(method, stream)] = (text, [(n, json.loads(a)) for n, a in calls or []])
    print(f"{case}: {len(runs) - cut} of {len(runs)} answers completed, {cut} hit max_tokens")
    assert not bad, bad
    # Most complete (json_object, unbounded, is the one that sometimes runs long: more tokens).
    assert 2 * cut < len(runs), f"{cut} of {len(runs)} answers hit max_tokens"
    # Greedy: speculation gives target-only's answer, streamed or not.
    if greedy:
        ref = next(iter(greedy.values()))
        assert all(v == ref for v in greedy.values()), greedy


def test_bad_specs_are_400s_naming_the_field(client):
    """Specs the gateway lets through but the target cannot compile come back as 400s naming
    the request field they came from."""
    cases = [
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": 'root ::= "a" | missing'}}, "structured_outputs"),
        ({"guided_regex": "[z-a]"}, "guided_regex"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="", prompt="x", max_tokens=4, extra_body=body)
        assert err.value.body["param"] == param, err.value.body
        assert "sampling.constraint." in err.value.body["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=USER, max_tokens=4, tools=[tool], tool_choice="required")
    assert err.value.body["param"] == "tools", err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=USER, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a"}}})
    assert err.value.body["param"] == "response_format", err.value.body


@pytest.mark.parametrize("method", ["none", "dflash"])
def test_stop_strings_and_max_tokens_inside_a_constrained_answer(client, method):
    """The gateway's other limits still apply inside a constrained answer: a stop string ends it
    there (finish_reason stop, the string not emitted: a JSON prefix, as asked), max_tokens cuts
    it (length); without them the grammar's end is the answer's (stop)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "flat", "schema": SCHEMAS["flat"], "strict": True}}
    extra = {"speculative": {"method": method}}
    whole = client.chat.completions.create(model="", messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                           response_format=fmt, extra_body=extra)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop" and valid("json_schema_flat", text, None) is None
    # A stop string that occurs in the answer: the answer ends just before it.
    cut = client.chat.completions.create(model="", messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                         response_format=fmt, stop=['"count"'], extra_body=extra)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index('"count"')]
    # max_tokens inside the answer: a prefix of it, finish_reason length.
    short = client.chat.completions.create(model="", messages=USER, max_tokens=3, temperature=0,
                                           response_format=fmt, extra_body=extra)
    assert short.choices[0].finish_reason == "length" and text.startswith(short.choices[0].message.content)
    assert short.usage.completion_tokens == 3
