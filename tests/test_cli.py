"""The `splitspec` command: `up --prompt` runs the whole system and prints what the target
would generate in process; the random fallback model loads; flags have env equivalents."""
from __future__ import annotations

import subprocess
import sys

import pytest

from service_helpers import ROOT, tiny_target_dir
from splitspec import cli
from splitspec.flags import apply_env
from splitspec.ops.launch import free_port
from target_service import server as target_server
from gateway import server as gateway_server
from draft_service import server as draft_server


def test_up_with_prompt_streams_the_target_only_generation(tmp_path):
    from target_service.engine import generate
    from target_service.loader import load_checkpoint
    model = tiny_target_dir()
    prompt = "def fibonacci(n):"
    proc = subprocess.run(
        [sys.executable, "-m", "splitspec.cli", "up", "--model-path", str(model), "--prompt", prompt,
         "--max-new-tokens", "24", "--ignore-eos", "--gateway-port", "0", "--log-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ck = load_checkpoint(model)
    ids = generate(ck.model, ck.tokenizer.encode(prompt).ids, 24)
    assert proc.stdout == ck.tokenizer.decode(ids) + "\n"
    assert "finish_reason=length" in proc.stderr and "completion_tokens=24" in proc.stderr
    assert (tmp_path / "target.log").is_file() and (tmp_path / "gateway.log").is_file()


def test_random_fallback_model_is_servable(tmp_path):
    from target_service.loader import load_checkpoint
    from splitspec.random_model import ensure_random_model
    assert cli._model_dir(None, "models/no-such-model") is None
    path = ensure_random_model(tmp_path / "random")
    ck = load_checkpoint(path)
    assert ck.tokenizer.get_vocab_size() == ck.cfg.vocab_size
    assert ck.cfg.eos_token_ids == (0,)
    assert ensure_random_model(tmp_path / "random") == path      # cached


def test_health_command_reports_unreachable():
    proc = subprocess.run([sys.executable, "-m", "splitspec.cli", "health", f"127.0.0.1:{free_port()}",
                           "--timeout-s", "0.5"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout.strip() == "UNREACHABLE"


def test_every_flag_has_an_env_equivalent():
    env = {"SPLITSPEC_MODEL_PATH": "/m", "SPLITSPEC_MAX_RUNNING_REQUESTS": "7", "SPLITSPEC_SAMPLING_BACKEND": "torch"}
    args = apply_env(target_server.build_parser(), env).parse_args([])
    assert (args.model_path, args.max_running_requests) == ("/m", 7)
    args = apply_env(target_server.build_parser(), env).parse_args(["--max-running-requests", "9"])
    assert args.max_running_requests == 9                      # the command line wins
    env = {"SPLITSPEC_TARGET": "a:1,b:2", "SPLITSPEC_SPECULATIVE_ALGORITHM": "dflash"}
    args = apply_env(gateway_server.build_parser(), env).parse_args([])
    assert args.target == ["a:1", "b:2"] and args.speculative_algorithm == "DFLASH"
    args = apply_env(gateway_server.build_parser(), env).parse_args(["--target", "c:3", "--target", "d:4"])
    assert args.target == ["c:3", "d:4"]
    with pytest.raises(SystemExit):
        apply_env(target_server.build_parser(), {"SPLITSPEC_MAX_RUNNING_REQUESTS": "many"})
    for parser in (target_server.build_parser(), gateway_server.build_parser()):
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert "[env SPLITSPEC_" in action.help, action.dest


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
