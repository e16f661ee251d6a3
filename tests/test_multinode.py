"""Issue 38: a tensor-parallel target across nodes. Two launchers on this machine (`--nnodes 2`,
one rank each, loopback) serve a TP=2 model whose greedy output equals TP=1; killing the second
node's launcher takes the replica out of service (NOT_SERVING) and the request fails over to
another replica; bad flags and an unreachable node 0 fail fast with a clear error."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from service_helpers import (collect, finish_with_one_failover, gateway_stub, running_gateway, running_target,
                             target_info, tiny_target_dir, wait_not_serving)
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import free_port
from target_service.engine import generate, load_model


@pytest.fixture(autouse=True)
def dist_secret(monkeypatch):
    """Every node of these tests shares a secret, from the environment as a container would."""
    monkeypatch.setenv("SPLITSPEC_DIST_AUTH_KEY", "multinode-test-secret-0123456789")


def _node(path, port: int, rank: int, log, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "target_service.server", "--model-path", str(path),
                             "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(rank),
                             "--dist-init-addr", f"127.0.0.1:{port}", "--torch-threads", "1", *extra],
                            stdout=log, stderr=subprocess.STDOUT)


def _free_pair() -> int:
    """A port whose successor is free too (torch.distributed at P, the control channels at P + 1)."""
    while True:
        p = free_port()
        try:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue


def test_two_nodes_serve_like_one_and_a_lost_node_fails_over(tmp_path):
    path = tiny_target_dir(256)
    model = load_model(path)
    prompt, n = [7, 300, 12, 99, 41], 120
    want = generate(model, prompt, n)
    port = _free_pair()
    log = open(tmp_path / "node1.log", "w")
    node1 = _node(path, port, 1, log)
    try:
        with running_target(path, tmp_path, "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
                            "--dist-init-addr", f"127.0.0.1:{port}", "--torch-threads", "1") as node0, \
                running_target(path, tmp_path, "--torch-threads", "1") as tp1, \
                running_gateway(f"{node0.address},{tp1.address}", tmp_path, "--speculative-algorithm", "NONE",
                                "--reconnect-max-s", "0.5") as gw:
            info = target_info(node0.address)
            assert info.tensor_parallel_size == 2 and "tp=2" in info.parallel_layout
            ch, stub = gateway_stub(gw.address)
            with ch:
                for _ in range(2):      # round robin: one of the two runs on the two-node replica
                    ids, _, _ = collect(stub.Generate(build_request(prompt, max_new_tokens=n, ignore_eos=True,
                                                                    method="none"), timeout=300))
                    assert ids == want
                calls = [stub.Generate(build_request(prompt, max_new_tokens=n, ignore_eos=True, method="none"),
                                       timeout=300) for _ in range(2)]
                firsts = [list(next(c).chunk.token_ids) for c in calls]
                assert target_info(node0.address).active_sessions == 1
                children = _children(node1.pid)
                node1.send_signal(signal.SIGKILL)           # the whole second node goes: launcher and rank
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                finish_with_one_failover(calls, firsts, want)
            wait_not_serving(node0.address)
            assert node0.proc.poll() is None
    finally:
        if node1.poll() is None:
            node1.kill()
        log.close()


def _children(pid: int) -> list[int]:
    """The processes `pid` started (any thread), from /proc."""
    from pathlib import Path
    return [int(k) for task in Path(f"/proc/{pid}/task").iterdir() for k in (task / "children").read_text().split()]


@pytest.mark.parametrize("extra, message", [
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1234"], "--node-rank 2 must be in 0..1"),
    (["--nnodes", "2", "--node-rank", "1"], "--nnodes > 1 needs --dist-init-addr"),
    (["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "nohost"], "expected HOST:PORT"),
    (["--tensor-parallel-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1234"],
     "must be a multiple of --nnodes 2"),
])
def test_bad_node_flags_exit_naming_the_flag(extra, message):
    args = ["--tensor-parallel-size", "2"] if "--tensor-parallel-size" not in extra else []
    r = subprocess.run([sys.executable, "-m", "target_service.server", "--model-path", str(tiny_target_dir(256)),
                        *args, *extra], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and message in r.stderr + r.stdout


def test_a_node_whose_node_0_never_answers_exits_non_zero(tmp_path):
    port = _free_pair()
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "target_service.server", "--model-path", str(tiny_target_dir(256)),
                        "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                        "--dist-init-addr", f"127.0.0.1:{port}", "--tp-timeout-s", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and time.monotonic() - t < 60
    assert f"127.0.0.1:{port + 1} did not answer" in r.stdout + r.stderr


def test_node_0_without_its_other_nodes_exits_naming_them():
    port = _free_pair()
    r = subprocess.run([sys.executable, "-m", "target_service.server", "--model-path", str(tiny_target_dir(256)),
                        "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0", "--port", "0",
                        "--dist-init-addr", f"127.0.0.1:{port}", "--tp-timeout-s", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"did not form at 127.0.0.1:{port}" in r.stderr and "start the other nodes (--node-rank 1..1)" in r.stderr


def test_leaderworkerset_variables_configure_the_nodes(monkeypatch):
    import target_service.server as server
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "target-0.target")
    args = server.build_parser().parse_args(["--model-path", str(tiny_target_dir(256)), "--tensor-parallel-size", "2"])
    server.check_args(args)
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (2, 1, "target-0.target:20000")
