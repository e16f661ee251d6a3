"""Server-side connection age (issue 27): with --max-connection-age-s a server sends its clients
GOAWAY once a connection is that old, so they reconnect and re-resolve the service name (how the
gateway learns new replicas behind a Kubernetes headless Service); a stream already running goes
on over the old connection for the grace period. Checked on a real grpc.aio server: the client's
address (its ephemeral port) changes, and a health Watch stream opened before stays alive."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.serving import SERVING, Server, server_options
from target_service import server as target_server


def test_options_follow_the_flags():
    opts = dict(server_options(64, 120, 3600))
    assert opts["grpc.max_connection_age_ms"] == 120_000
    assert opts["grpc.max_connection_age_grace_ms"] == 3_600_000
    off = dict(server_options(64))
    assert "grpc.max_connection_age_ms" not in off and "grpc.max_connection_age_grace_ms" not in off
    # No grace given: gRPC's own default (no limit), so no stream is ever cut by the age.
    assert "grpc.max_connection_age_grace_ms" not in dict(server_options(64, 120))
    with pytest.raises(SystemExit):
        server_options(64, -1)


def test_flags_and_environment_reach_the_parser(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = target_server.build_parser().parse_args(
        ["--model-path", str(tmp_path), "--max-connection-age-s", "90", "--max-connection-age-grace-s", "600"])
    assert (args.max_connection_age_s, args.max_connection_age_grace_s) == (90, 600)
    from splitspec.flags import apply_env
    parser = apply_env(target_server.build_parser(), {"SPLITSPEC_MAX_CONNECTION_AGE_S": "45"})
    assert parser.parse_args(["--model-path", str(tmp_path)]).max_connection_age_s == 45


def _add_peer_method(server: Server) -> None:
    """test.Service/Peer answers with the caller's address (its ephemeral port names the connection)."""
    async def peer(request: bytes, context) -> bytes:
        return context.peer().encode()
    handler = grpc.unary_unary_rpc_method_handler(peer, request_deserializer=None, response_serializer=None)
    server.grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Service", {"Peer": handler}),))


def test_clients_reconnect_after_the_age_and_running_streams_survive():
    async def main():
        server = Server(["test.Service"], max_connection_age_s=0.5, max_connection_age_grace_s=60)
        _add_peer_method(server)
        port = await server.start("127.0.0.1", 0)
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                watch = stub.Watch(health_pb2.HealthCheckRequest(service="test.Service"))
                first = await watch.read()
                assert first.status == SERVING
                peer = ch.unary_unary("/test.Service/Peer")
                peers = {await peer(b"")}
                # Wait for the condition (a second connection), not for a time; bounded.
                for _ in range(600):
                    await asyncio.sleep(0.05)
                    peers.add(await peer(b"", wait_for_ready=True))
                    if len(peers) > 1:
                        break
                assert len(peers) > 1, f"the client never reconnected: {peers}"
                # The Watch stream opened on the first connection is still served a while later
                # (grace 60 s; with a grace of 0.2 s this read fails: the old connection is gone).
                await asyncio.sleep(1.0)
                await server.health.set("test.Service", health_pb2.HealthCheckResponse.NOT_SERVING)
                update = await asyncio.wait_for(watch.read(), 30)
                assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
                watch.cancel()
        finally:
            await server.grpc.stop(0)
    asyncio.run(main())
