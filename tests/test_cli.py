"""The `splitspec` command: `up --prompt` runs the whole system and prints what the target
would generate in process; the random fallback model loads; flags have env equivalents."""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

import pytest

from service_helpers import ROOT, tiny_target_dir
from splitspec_tools import cli
from splitspec.flags import PREFIX, ListFlag, apply_env, check_ranges, env_name
from splitspec_tools.ops.launch import free_port
from target_service import server as target_server
from gateway import server as gateway_server
from draft_service import server as draft_server


def test_up_with_prompt_streams_the_target_only_generation(tmp_path):
    from target_service.engine import generate
    from splitspec.models.loader import load_checkpoint
    model = tiny_target_dir()
    prompt = "def fibonacci(n):"
    proc = subprocess.run(
        [sys.executable, "-m", "splitspec_tools.cli", "up", "--model-path", str(model), "--prompt", prompt,
         "--max-new-tokens", "24", "--ignore-eos", "--gateway-port", "0", "--log-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ck = load_checkpoint(model)
    ids = generate(ck.model, ck.tokenizer.encode(prompt).ids, 24)
    assert proc.stdout == ck.tokenizer.decode(ids) + "\n"
    assert "finish_reason=length" in proc.stderr and "completion_tokens=24" in proc.stderr
    assert (tmp_path / "target.log").is_file() and (tmp_path / "gateway.log").is_file()


def test_random_fallback_model_is_servable(tmp_path):
    from splitspec.models.loader import load_checkpoint
    from splitspec_tools.random_model import ensure_random_model
    assert cli._model_dir(None, "models/no-such-model") is None
    path = ensure_random_model(tmp_path / "random")
    ck = load_checkpoint(path)
    assert ck.tokenizer.get_vocab_size() == ck.cfg.vocab_size
    assert ck.cfg.eos_token_ids == (0,)
    assert ensure_random_model(tmp_path / "random") == path      # cached


def test_health_command_reports_unreachable():
    proc = subprocess.run([sys.executable, "-m", "splitspec_tools.cli", "health", f"127.0.0.1:{free_port()}",
                           "--timeout-s", "0.5"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout.strip() == "UNREACHABLE"


def _cli_sub(name: str):
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _every_kind_of_flag():
    """Each kind of flag apply_env converts, including kinds no service uses today (store_false),
    so a conversion that breaks fails here before such a flag is added."""
    p = argparse.ArgumentParser()
    p.add_argument("--no-color", dest="color", action="store_false")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--level", type=str.upper, choices=["LOW", "HIGH"], default="LOW")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--stop-id", type=int, action="append", default=[])
    p.add_argument("--peer", action=ListFlag, default=[])
    p.add_argument("--path", required=True)
    p.add_argument("--rate", type=float, default=1.0)
    return apply_env(p)


# Every parser that reads SPLITSPEC_* variables, rebuilt per call: apply_env reads the
# environment when the parser is built, exactly as the services' and the CLI's main() do.
ENV_PARSERS = {"target": target_server.build_parser, "draft": draft_server.build_parser,
               "gateway": gateway_server.build_parser,
               **{f"cli-{name}": functools.partial(_cli_sub, name) for name in ("up", "generate", "health", "loadtest")},
               "every-kind": _every_kind_of_flag}


def _values(action: argparse.Action) -> list[tuple[list[str], str]]:
    """Two settings of `action`, the first unlike its default, the second unlike the first,
    each as (command-line words, the same setting as its variable's value)."""
    flag = next(s for s in action.option_strings if s.startswith("--"))
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [([flag], "1"), ([], "0")]
    if isinstance(action, ListFlag):
        return [([flag, "h1:1", flag, "h2:2"], "h1:1,h2:2"), ([flag, "h3:3"], "h3:3")]
    convert = action.type or str
    candidates = ([str(c) for c in action.choices] if action.choices is not None else
                  ["7", "3", "0.25", "0.5", "float16", "bfloat16", "x/y", "a/b"])
    typed = []
    for raw in candidates:
        try:
            typed.append((raw, convert(raw)))
        except (TypeError, ValueError):
            continue
    want = next(raw for raw, v in typed if v != action.default and v != [action.default])
    other = next(raw for raw, v in typed if v != convert(want))
    return [([flag, raw], raw) for raw in (want, other)]


def _base_args(parser, skip_dest=None) -> list[str]:
    """What a parse needs besides the flag under test: required options and positionals."""
    out = []
    for a in parser._actions:
        if a.dest == skip_dest or not (a.required or (not a.option_strings and a.nargs is None)):
            continue
        out += ([a.option_strings[0]] if a.option_strings else []) + ["127.0.0.1:1"]
    return out


@pytest.mark.parametrize("name", list(ENV_PARSERS))
def test_every_flag_has_an_env_equivalent(name, monkeypatch):
    """Each flag set through its variable parses to what the flag gives on the command line,
    and the command line wins over the variable (store_false, choices, int/float/dtype types
    and the repeatable flags included)."""
    for var in [v for v in os.environ if v.startswith(PREFIX)]:
        monkeypatch.delenv(var)
    build = ENV_PARSERS[name]
    checked = 0
    for action in build()._actions:
        if not any(s.startswith("--") for s in action.option_strings) or action.dest == "help":
            continue
        var = env_name(action)
        (words, raw), (_, other_raw) = _values(action)
        base = _base_args(build(), action.dest)
        want = getattr(build().parse_args(base + words), action.dest)
        if not action.required:
            assert want != getattr(build().parse_args(base), action.dest), (name, var, "must differ from the default")
        monkeypatch.setenv(var, raw)
        assert getattr(build().parse_args(base), action.dest) == want, (name, var, raw)
        # The command line wins over the variable.
        monkeypatch.setenv(var, other_raw)
        assert getattr(build().parse_args(base + words), action.dest) == want, (name, var, "command line")
        monkeypatch.delenv(var)
        checked += 1
    assert checked >= 3, name


@pytest.mark.parametrize("var, raw", [("SPLITSPEC_MAX_RUNNING_REQUESTS", "many"), ("SPLITSPEC_DTYPE", "int8")])
def test_a_variable_the_flag_would_refuse_is_refused(var, raw, monkeypatch):
    monkeypatch.setenv(var, raw)
    with pytest.raises(SystemExit):
        target_server.build_parser()


def test_a_flag_out_of_its_range_exits_naming_it():
    args = argparse.Namespace(streams=0, duration_s=2.0, spare=-1, zero=0, nan=float("nan"))
    with pytest.raises(SystemExit, match="^splitspec loadtest: --streams must be positive$"):
        check_ranges(args, positive=("duration_s", "streams"), program="splitspec loadtest")
    with pytest.raises(SystemExit, match="^--spare must be >= 0$"):
        check_ranges(args, positive=("duration_s",), non_negative=("zero", "spare"))
    with pytest.raises(SystemExit, match="^--nan must be positive$"):
        check_ranges(args, positive=("nan",))
    check_ranges(args, positive=("duration_s",), non_negative=("zero",))
    with pytest.raises(SystemExit, match="^--max-context must be >= 0$"):
        target_server.check_args(target_server.build_parser().parse_args(["--model-path", "x", "--max-context", "-1"]))


def test_configuration_doc_lists_every_flag_and_variable():
    import argparse
    from splitspec.flags import env_name
    doc = (ROOT / "docs" / "configuration.md").read_text()
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for parser in (target_server.build_parser(), gateway_server.build_parser(), draft_server.build_parser(),
                   sub.choices["up"], sub.choices["generate"]):
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                flag = next(s for s in action.option_strings if s.startswith("--"))
                assert f"`{flag}`" in doc and f"`{env_name(action)}`" in doc, flag
