"""TLS / mTLS between every service and API keys at the gateway (issue 18): a plaintext client
of a TLS server fails cleanly; mTLS refuses a client without a certificate; a wrong or missing
key gets UNAUTHENTICATED / 401 while health and reflection stay open; the whole stack streams
over mTLS; no secret reaches a log."""
from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_helpers import ROOT, collect, running, tiny_target_dir

from splitspec_tools.ops import certs
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import free_port, health_status
from splitspec.security import ApiKeys, channel_credentials, load_api_keys
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2_grpc
from target_service.engine import generate
from splitspec.models.loader import load_model

KEY = "sk-tls-test-secret-4242"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    out = tmp_path_factory.mktemp("pki")
    certs.write_dev_certs(out)
    return out


def tls_flags(pki, name: str) -> list[str]:
    return ["--tls-cert", str(pki / f"{name}.pem"), "--tls-key", str(pki / f"{name}-key.pem"),
            "--tls-ca", str(pki / "ca.pem")]


def client_creds(pki, name: str = "client"):
    return channel_credentials(str(pki / f"{name}.pem"), str(pki / f"{name}-key.pem"), str(pki / "ca.pem"))


@pytest.fixture(scope="module")
def stack(pki, tmp_path_factory):
    target_dir = tiny_target_dir(1024)
    logs = tmp_path_factory.mktemp("logs")
    key_file = logs / "keys.txt"
    key_file.write_text(f"# accepted keys\n{KEY}\nsk-second\n")
    creds = client_creds(pki)
    http_port = free_port()
    with running("target", ["--model-path", str(target_dir), *tls_flags(pki, "target")], logs,
                 credentials=creds) as target, \
            running("draft", ["--method", "ngram", "--target-model-path", str(target_dir), *tls_flags(pki, "draft")],
                    logs, credentials=creds) as draft, \
            running("gateway", ["--target", target.address, "--draft", draft.address, "--speculative-algorithm",
                                "NGRAM", "--api-key-file", str(key_file), "--http-port", str(http_port),
                                *tls_flags(pki, "gateway")], logs, credentials=creds) as gw:
        yield dict(target=target, draft=draft, gateway=gw, http_port=http_port, logs=logs, model=load_model(target_dir))


def test_plaintext_client_of_a_tls_server_fails_cleanly(stack, pki):
    address = stack["target"].address
    assert health_status(address, timeout_s=2) is None                 # UNREACHABLE, not a hang or a crash
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        target_pb2_grpc.TargetStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # The server is unharmed: a TLS client still gets through.
    assert health_status(address, timeout_s=5, credentials=client_creds(pki)) == health_pb2.HealthCheckResponse.SERVING


def test_mtls_refuses_a_client_without_a_certificate(stack, pki):
    ca_only = channel_credentials(ca=str(pki / "ca.pem"))
    for svc in ("target", "draft", "gateway"):
        assert health_status(stack[svc].address, timeout_s=3, credentials=ca_only) is None, svc
        assert health_status(stack[svc].address, timeout_s=5, credentials=client_creds(pki)) == \
            health_pb2.HealthCheckResponse.SERVING, svc
    # A certificate from another CA is refused too.
    other = certs.write_dev_certs(pki / "other")
    stranger = channel_credentials(str(other["client"]), str(pki / "other" / "client-key.pem"), str(pki / "ca.pem"))
    assert health_status(stack["target"].address, timeout_s=3, credentials=stranger) is None


def test_full_stack_streams_over_mtls_with_an_api_key(stack, pki):
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 11]
    with grpc.secure_channel(stack["gateway"].address, client_creds(pki)) as ch:
        stub = gateway_pb2_grpc.GenerationStub(ch)
        ids, _, complete = collect(stub.Generate(build_request(prompt, max_new_tokens=30, ignore_eos=True),
                                                 metadata=[("authorization", f"Bearer {KEY}")], timeout=120))
    assert ids == generate(stack["model"], prompt, 30)
    assert complete.stats.method == "ngram"          # the gateway reached the draft over mTLS too


def test_wrong_or_missing_api_key_is_unauthenticated(stack, pki):
    with grpc.secure_channel(stack["gateway"].address, client_creds(pki)) as ch:
        stub = gateway_pb2_grpc.GenerationStub(ch)
        for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", KEY)]):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(build_request([5, 6], max_new_tokens=2), metadata=metadata, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert "API key" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The second key of the file works; health and reflection need no key.
        list(stub.Generate(build_request([5, 6], max_new_tokens=2), timeout=30,
                           metadata=[("authorization", "Bearer sk-second")]))
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10))
        assert "splitspec.v1.Generation" in {s.name for s in resp.list_services_response.service}
    assert health_status(stack["gateway"].address, timeout_s=5, credentials=client_creds(pki)) == \
        health_pb2.HealthCheckResponse.SERVING


def test_http_front_over_mtls_wants_the_key(stack, pki):
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client-key.pem"))
    base = f"https://127.0.0.1:{stack['http_port']}"
    with urllib.request.urlopen(f"{base}/health", context=ctx, timeout=10) as resp:
        assert resp.status == 200
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}).encode()
    for headers, status in (({}, 401), ({"authorization": "Bearer nope"}, 401),
                            ({"authorization": f"Bearer {KEY}"}, 200)):
        req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"content-type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=60) as resp:
                got = resp.status
        except urllib.error.HTTPError as exc:
            got = exc.code
            assert json.loads(exc.read())["error"]["type"] == "authentication_error"
        assert got == status, headers
    plain = ssl.create_default_context(cafile=str(pki / "ca.pem"))     # no client certificate
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"{base}/health", context=plain, timeout=10).read()


def test_cli_clients_speak_tls(stack, pki):
    flags = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"),
             "--tls-key", str(pki / "client-key.pem")]
    health = subprocess.run([sys.executable, "-m", "splitspec_tools.cli", "health", stack["target"].address, *flags],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"
    gen = subprocess.run([sys.executable, "-m", "splitspec_tools.cli", "generate", "--gateway", stack["gateway"].address,
                          "--token-ids", "5,6,7", "--max-new-tokens", "4", *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SPLITSPEC_API_KEY": KEY})
    assert gen.returncode == 0, gen.stderr


def test_no_secret_reaches_a_log(stack, pki):
    """Sends its own accepted and refused keys over gRPC and HTTP (so it holds run alone), then
    reads every service's log."""
    wrong = "sk-wrong-key-9191"
    with grpc.secure_channel(stack["gateway"].address, client_creds(pki)) as ch:
        stub = gateway_pb2_grpc.GenerationStub(ch)
        for key in (KEY, "sk-second"):
            collect(stub.Generate(build_request([5, 6], max_new_tokens=2), timeout=60,
                                  metadata=[("authorization", f"Bearer {key}")]))
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(build_request([5, 6], max_new_tokens=2), timeout=30,
                               metadata=[("authorization", f"Bearer {wrong}")]))
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client-key.pem"))
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}).encode()
    for key in (KEY, wrong):
        req = urllib.request.Request(f"https://127.0.0.1:{stack['http_port']}/v1/completions", data=body,
                                     headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        try:
            urllib.request.urlopen(req, context=ctx, timeout=60).read()
        except urllib.error.HTTPError as exc:
            assert exc.code == 401 and key == wrong
    # The gRPC refusal is logged (so these are the logs the requests wrote), without the keys.
    deadline = time.monotonic() + 30
    while True:
        text = "".join(p.read_text(errors="replace") for p in stack["logs"].glob("*.log"))
        if '"event": "request_unauthenticated"' in text or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert '"event": "request_unauthenticated"' in text
    for secret in (KEY, "sk-second", wrong, "PRIVATE KEY"):
        assert secret not in text, secret


def test_api_keys_and_tls_flags(tmp_path):
    keys = ApiKeys(("a", "bb"))
    assert keys.check("Bearer a") and keys.check("bearer bb") and not keys.check("Bearer b")
    assert not keys.check(None) and not keys.check("a") and not ApiKeys(()).check("Bearer ")
    from gateway.server import build_parser
    f = tmp_path / "k"
    f.write_text("k1\n# comment\n\nk2\n")
    args = build_parser().parse_args(["--target", "t:1", "--api-key", "k0", "--api-key-file", str(f)])
    assert load_api_keys(args) == ("k0", "k1", "k2")
    from splitspec.security import server_credentials
    from target_service.server import build_parser as target_parser
    with pytest.raises(SystemExit, match="go together"):
        server_credentials(target_parser().parse_args(["--model-path", "m", "--tls-cert", "c"]))
    with pytest.raises(SystemExit, match="needs --tls-cert"):
        server_credentials(target_parser().parse_args(["--model-path", "m", "--tls-ca", "c"]))


def test_dev_certificates_name_every_service(pki):
    from cryptography import x509
    cert = x509.load_pem_x509_certificate((pki / "target.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "target", "draft", "gateway"} <= set(san.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "127.0.0.2", "127.0.0.3"} <= ips
    assert oct((pki / "target-key.pem").stat().st_mode & 0o777) == "0o600"
