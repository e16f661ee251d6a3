"""`splitspec bench-structured`: the validator and the tool-call schema on their own, and `--smoke`
end to end through the real services with the bundled models: the report has its fields, every
completed constrained answer is valid against its constraint at T=0 and T=1, greedy speculation
under the grammar equals target-only, and the cost section pairs the same requests. A benchmark,
not a test of speed: no timing thresholds here."""
from __future__ import annotations

import json

import pytest
from service_helpers import bench_smoke

from splitspec_tools.bench.structured import (CHOICES, FLAT, IDENTIFIER, NESTED, VERSION, check_output, main, make_job,
                                        schema_errors, signature)
from splitspec_tools.defaults import DEFAULT_TARGET, model_dir

DFLASH = "models/splitspec-code-draft-dflash"


def test_validator_accepts_and_rejects():
    good = {"kind": "method", "num_args": 3, "returns_value": True, "has_docstring": False}
    assert check_output("json_schema", FLAT, json.dumps(good)) is None
    for bad, why in (({**good, "kind": "lambda"}, "not one of"), ({**good, "num_args": 17}, "maximum"),
                     ({**good, "num_args": True}, "not of type 'integer'"),         # true is not 1
                     ({**good, "returns_value": 1}, "not of type 'boolean'"), ({**good, "extra": 1}, "not allowed"),
                     ({k: v for k, v in good.items() if k != "kind"}, "required")):
        assert why in check_output("json_schema", FLAT, json.dumps(bad)), bad
    sig = {"name": "f", "params": [{"name": "x", "type": "int", "optional": False}] * 4, "returns": "None"}
    assert "$.params: " in check_output("json_schema", NESTED, json.dumps(sig))          # maxItems 3
    sig["params"] = [{"name": "x" * 13, "type": "int", "optional": False}]
    assert "$.params[0].name: 'xxxxxxxxxxxxx' is too long" in check_output("json_schema", NESTED, json.dumps(sig))
    assert "not JSON" in check_output("json_schema", FLAT, '{"kind": "method"')
    assert "RFC 8259" in check_output("json_schema", {"type": "string"}, '"a\tb"')
    assert "duplicate" in check_output("json_schema", FLAT, '{"kind": "method", "kind": "method"}')
    assert check_output("regex", VERSION, "1.22.333") is None and check_output("regex", VERSION, "1.2") is not None
    assert check_output("regex", IDENTIFIER, "parse_x2") is None and check_output("regex", IDENTIFIER, "2x")
    assert check_output("choice", CHOICES, "io") is None and check_output("choice", CHOICES, "io ") is not None
    assert schema_errors("y", {"type": "string", "pattern": "^x"})       # every keyword counts, not a chosen few


def test_tool_schema_from_the_def_line():
    text = ("class A:\n    def run(self, path: str, depth: int = 3, *args, fast=False, key=lambda x: (x, 1),\n"
            "            **kw) -> None:\n        \"\"\"Doc.\"\"\"\n")
    assert [p for p, _, _ in signature(text, "run")] == ["path", "depth", "fast", "key"]     # no self, *args, **kw
    job, prompt = make_job(0, "pkg/a.py:run", text, "tool")
    assert prompt.startswith(text.rstrip("\n")) and prompt.endswith("tool call of the function above:\n")
    args = job.spec["properties"]["arguments"]["properties"]
    assert args["depth"]["type"] == "integer" and args["fast"]["type"] == "boolean" and args["path"]["type"] == "string"
    call = {"name": "run", "arguments": {k: {"integer": 1, "boolean": True, "string": "p"}[v["type"]]
                                         for k, v in args.items()}}
    assert check_output("json_schema", job.spec, json.dumps(call)) is None
    assert "'run' was expected" in check_output("json_schema", job.spec, json.dumps({**call, "name": "walk"}))
    assert job.constraint().strict and json.loads(job.constraint().json_schema) == job.spec


@pytest.mark.skipif(model_dir(None, DEFAULT_TARGET) is None or model_dir(None, DFLASH) is None,
                    reason="the bundled models are missing")
def test_smoke_end_to_end(tmp_path):
    r, md = bench_smoke(main, tmp_path / "out", "splitspec bench-structured")
    assert r["run"]["num_prompts"] == 2 and r["run"]["repeats"] == 1 and r["run"]["shapes"] == ["flat", "choice"]
    assert [q for q in r["requests"] if q["rpc_error"]] == []
    cells = {(c["temperature"], c["name"]): c for c in r["cells"]}
    assert set(cells) == {(t, n) for t in (0.0, 1.0) for n in ("none", "dflash (DFlash)")}
    for (t, name), c in cells.items():
        for f in ("tau", "tokens_per_s", "speedup_vs_none", "validity", "valid", "completed", "truncated",
                  "finish_reasons", "tokens_mean", "ttft_ms_p50", "forced_share", "equal_to_none"):
            assert f in c, f
        assert c["requests"] == 2 and c["errors"] == 0 and c["tokens_per_s"] > 0
        assert c["completed"] >= 1 and c["valid"] == c["completed"] and c["validity"] == 1.0, c
        assert sum(c["finish_reasons"].values()) == 2
        if name == "none":
            assert c["tau"] is None and c["forced_share"] is None
        else:
            assert c["tau"] >= 1 and 0 <= c["forced_share"] < 1 and c["forced_unknown"] == 0
        if t == 0:
            assert c["equal_to_none"] == [2, 2]        # greedy speculation under the grammar = target-only
    for q in r["requests"]:
        if q["variant"] == "constrained" and q["finish_reason"] != "length":
            assert q["valid"], q
    assert {s["shape"] for s in r["shapes"]} == {"flat", "choice"}
    cost = {e["temperature"]: e for e in r["cost"]}
    assert set(cost) == {0.0, 1.0}
    for e in cost.values():
        assert e["pairs"] == 2 and e["lengths_equal"] == 2
        for v in ("constrained", "matched"):
            assert e[v]["tokens_per_s"] > 0 and e[v]["decode_ms_per_token"] > 0
        assert e["matched"]["tokens_mean"] == e["constrained"]["tokens_mean"]       # the same decoding work
        assert e["tokens_per_s_ratio_vs_matched"] > 0
    probe = r["unconstrained_probe"]
    for when in ("before", "after"):
        assert probe[when]["requests"] == 2 and probe[when]["errors"] == [] and probe[when]["decode_ms_per_token"] > 0
    assert probe["decode_ratio"] > 0
    for section in ("## The grammar's cost", "## Unconstrained requests before and after", "τ (validity) by shape",
                    "## Flags"):
        assert section in md, section
