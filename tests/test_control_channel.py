"""The multi-node control channel no stranger can drive or stall: with --nnodes > 1 the target
refuses to start on the old public default, an empty or a short secret (flag,
SPLITSPEC_DIST_AUTH_KEY or --dist-auth-key-file); node 0's listener drops a peer with the wrong
secret before reading any of its data, reads an authenticated peer's hello as bounded JSON and
range-checks its rank, and hangs up on a peer that says nothing in time while the others join;
a worker unpickles nothing but plain data and numpy arrays."""
from __future__ import annotations

import multiprocessing.connection
import pickle
import socket
import threading

import numpy as np
import pytest

from service_helpers import tiny_target_dir
from splitspec_tools.ops.launch import free_port
from target_service import server
from target_service import tp_worker

SECRET = "0123456789abcdef-test-secret"


class Trap:
    """Unpickling this runs code: it creates `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def node_args(*extra):
    return server.build_parser().parse_args(["--model-path", str(tiny_target_dir()), "--tensor-parallel-size", "2",
                                             "--nnodes", "2", "--dist-init-addr", "127.0.0.1:29500", *extra])


@pytest.mark.parametrize("extra,message", [
    ([], "none"),
    (["--dist-auth-key", ""], "none"),
    (["--dist-auth-key", "splitspec"], "old public default"),
    (["--dist-auth-key", "short"], "5 bytes"),
])
def test_a_multi_node_target_refuses_a_default_empty_or_short_secret(monkeypatch, extra, message):
    monkeypatch.delenv("SPLITSPEC_DIST_AUTH_KEY", raising=False)
    with pytest.raises(SystemExit) as err:
        server.check_args(node_args(*extra))
    assert message in str(err.value) and "--dist-auth-key" in str(err.value)


def test_the_secret_comes_from_the_flag_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv("SPLITSPEC_DIST_AUTH_KEY", raising=False)
    args = node_args("--dist-auth-key", SECRET)
    server.check_args(args)
    assert args.dist_auth_key == SECRET
    monkeypatch.setenv("SPLITSPEC_DIST_AUTH_KEY", SECRET)
    args = node_args()
    server.check_args(args)
    assert args.dist_auth_key == SECRET
    monkeypatch.delenv("SPLITSPEC_DIST_AUTH_KEY")
    (tmp_path / "key").write_text(SECRET + "\n")
    args = node_args("--dist-auth-key-file", str(tmp_path / "key"))
    server.check_args(args)
    assert args.dist_auth_key == SECRET
    # One node has no control port: nothing to refuse.
    one = server.build_parser().parse_args(["--model-path", str(tiny_target_dir())])
    server.check_args(one)


def accepting(timeout_s: float = tp_worker.HANDSHAKE_TIMEOUT_S, ranks: range = range(1, 2)):
    """Node 0's control listener with its accept thread: (port, accepted, thread, stop)."""
    port = free_port()
    lst = tp_worker.control_listener("127.0.0.1", port)
    accepted, closed = {}, threading.Event()
    t = threading.Thread(target=tp_worker._accept, args=(lst, SECRET.encode(), ranks, accepted, closed, timeout_s),
                         daemon=True)
    t.start()

    def stop():
        closed.set()
        lst.close()
    return port, accepted, t, stop


@pytest.fixture
def listener():
    """Expecting rank 1 of 2."""
    port, accepted, t, stop = accepting()
    yield port, accepted, t
    stop()


def refused(port, send) -> None:
    """Connect and run `send(conn)`; node 0 must hang up (EOF) rather than answer or keep it."""
    with pytest.raises((EOFError, ConnectionError, multiprocessing.AuthenticationError, OSError)):
        conn = multiprocessing.connection.Client(("127.0.0.1", port), authkey=SECRET.encode())
        send(conn)
        conn.recv_bytes()


def test_a_wrong_secret_is_dropped_before_any_data_is_read(listener, tmp_path):
    port, accepted, thread = listener
    trap = tmp_path / "ran"
    # A peer with the wrong secret fails the challenge: it never gets to send a message.
    with pytest.raises(multiprocessing.AuthenticationError):
        multiprocessing.connection.Client(("127.0.0.1", port), authkey=b"not-the-secret-at-all")
    # Raw bytes (a pickle that would run code) in place of the challenge's answer: dropped.
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.recv(4096)                        # node 0's challenge
        payload = pickle.dumps(Trap(trap))
        s.sendall(len(payload).to_bytes(4, "big") + payload)
        assert b"#WELCOME#" not in s.recv(4096)
    # An authenticated peer: a pickled hello is not unpickled, a rank outside 1..1 is refused.
    refused(port, lambda c: c.send(Trap(trap)))
    refused(port, lambda c: tp_worker._send_json(c, {"rank": 7}))
    refused(port, lambda c: c.send_bytes(b"x" * 1000))
    assert not trap.exists() and not accepted and thread.is_alive()
    ok = multiprocessing.connection.Client(("127.0.0.1", port), authkey=SECRET.encode())
    tp_worker._send_json(ok, {"rank": 1})
    thread.join(10)
    assert list(accepted) == [1]
    ok.close()


def dial_in(port: int, rank: int) -> threading.Thread:
    """A rank dialling node 0 (as `tp_worker.dial`), on a thread: a stalled listener would hold it."""
    def run():
        conn = multiprocessing.connection.Client(("127.0.0.1", port), authkey=SECRET.encode())
        tp_worker._send_json(conn, {"rank": rank})
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_silent_connection_holds_up_no_rank_dialling_after_it():
    """A peer that connects and says nothing (a port scanner, a half-open connection) waits out
    its own handshake deadline, here longer than the test's bounds, while the ranks dialling
    after it join."""
    port, accepted, thread, stop = accepting(timeout_s=600, ranks=range(1, 3))
    try:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        dials = [dial_in(port, 1), dial_in(port, 2)]
        for d in dials:
            d.join(60)                          # bounds on a broken test, not measures
        thread.join(60)
        assert sorted(accepted) == [1, 2] and not thread.is_alive()
        for s in silent:
            s.close()
    finally:
        stop()


def test_a_silent_connection_is_hung_up_on_at_its_deadline():
    port, accepted, thread, stop = accepting(timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", port)) as silent:
            silent.settimeout(60)               # a bound on a broken test, not a measure
            got = b""
            while chunk := silent.recv(4096):   # node 0's challenge, then end of stream
                got += chunk
            assert got                          # it was challenged, then hung up on
        assert not accepted and thread.is_alive()
        d = dial_in(port, 1)
        d.join(30)
        thread.join(30)
        assert list(accepted) == [1]
    finally:
        stop()


def test_a_worker_unpickles_plain_data_and_arrays_only(tmp_path):
    msg = {"kind": "forward", "ids": np.arange(4), "moves": [(np.zeros(2, np.int64), np.ones(2, np.int64))],
           "states": ([(0, 0, 4, None, False)], "snapshot"), "flag": np.bool_(True), "x": 1.5}
    got = tp_worker._loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    assert got["kind"] == "forward" and (got["ids"] == np.arange(4)).all() and got["states"][1] == "snapshot"
    with pytest.raises(pickle.UnpicklingError, match="carries no"):
        tp_worker._loads(pickle.dumps(Trap(tmp_path / "ran")))
    assert not (tmp_path / "ran").exists()
