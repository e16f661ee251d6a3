"""Lifecycle: grpc.health.v1 is NOT_SERVING until the weights are loaded and a warm-up forward
has run, SERVING after; reflection lists the services; SIGTERM drains in-flight sessions."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from service_helpers import running_target, target_stub, tiny_target_dir
from splitspec_tools.ops.launch import free_port, health_status, start_service
from splitspec.v1 import common_pb2, target_pb2
from target_service import server as target_server
from target_service.scheduler import Scheduler

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def gated_target(monkeypatch):
    """An in-process target whose load and warm-up wait for the test to release them."""
    loaded, warmed = threading.Event(), threading.Event()
    warm_started = threading.Event()
    real_warmup = Scheduler.warmup

    async def gated_warmup(self):
        warm_started.set()
        await asyncio.to_thread(warmed.wait, 60)
        return await real_warmup(self)
    monkeypatch.setattr(Scheduler, "warmup", gated_warmup)

    def gated_load(args):
        loaded.wait(60)
        return target_server._load(args)

    args = target_server.build_parser().parse_args(
        ["--model-path", str(tiny_target_dir()), "--port", str(free_port())])
    servers = []
    thread = threading.Thread(target=lambda: asyncio.run(
        target_server.serve(args, load=gated_load, started=servers.append)), daemon=True)
    thread.start()
    assert wait_for(lambda: servers)
    yield f"127.0.0.1:{args.port}", loaded, warmed, warm_started
    loaded.set()
    warmed.set()
    servers[0].request_stop()
    thread.join(30)


def test_not_serving_until_loaded_and_warmed_up(gated_target):
    address, loaded, warmed, warm_started = gated_target
    assert health_status(address) == NOT_SERVING
    assert health_status(address, "splitspec.v1.Target") == NOT_SERVING
    ch, stub = target_stub(address)
    with ch, pytest.raises(grpc.RpcError) as err:
        stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    loaded.set()
    assert warm_started.wait(30)
    assert health_status(address) == NOT_SERVING        # weights in, warm-up not run yet
    warmed.set()
    assert wait_for(lambda: health_status(address) == SERVING)
    assert health_status(address, "splitspec.v1.Target") == SERVING


def list_services(address):
    with grpc.insecure_channel(address) as ch:
        return set(ProtoReflectionDescriptorDatabase(ch).get_services())


def test_reflection_lists_the_target_services(gated_target):
    address = gated_target[0]
    assert {"splitspec.v1.Target", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= list_services(address)
    with grpc.insecure_channel(address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        method = db.FindFileContainingSymbol("splitspec.v1.Target").service[0].method
        assert {m.name for m in method} == {"Session", "GetInfo"}


def test_gateway_not_serving_without_a_target(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    gw = start_service("gateway", ["--target", dead], log_dir=tmp_path)
    try:
        assert wait_for(lambda: health_status(gw.address) is not None)
        assert health_status(gw.address) == NOT_SERVING
        assert "splitspec.v1.Generation" in list_services(gw.address)
    finally:
        assert gw.stop() == 0          # SIGTERM during start-up still exits cleanly


def test_sigterm_drains_in_flight_sessions(tmp_path):
    with running_target(tiny_target_dir(2048), tmp_path) as target:
        ch, stub = target_stub(target.address)
        requests = [target_pb2.TargetRequest(open=target_pb2.TargetOpen(prompt_token_ids=[5, 6], max_new_tokens=200)),
                    target_pb2.TargetRequest(decode=target_pb2.TargetDecode(n=120)),
                    target_pb2.TargetRequest(close=target_pb2.TargetClose())]
        gate = threading.Event()

        def send():
            yield requests[0]
            yield requests[1]
            gate.wait(30)      # Close only after the whole decode arrived
            yield requests[2]
        responses = stub.Session(send(), timeout=60)
        assert next(responses).HasField("opened")
        assert next(responses).HasField("token")
        target.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health_status(target.address) != SERVING, 10)
        tokens = 1 + sum(1 for _ in range(119) if next(responses).HasField("token"))
        assert tokens == 120                       # the in-flight session ran to completion
        gate.set()
        assert next(responses).HasField("closed")
        ch.close()
        assert target.proc.wait(30) == 0
