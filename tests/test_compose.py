"""compose.yaml and the Dockerfile, checked without a Docker engine: the structure compose
needs (one image, read-only model mounts, gRPC health checks, healthy-before-gateway,
scalable backends), and every command they run is a real entry point whose real argparse
parser accepts its flags."""
from __future__ import annotations

import importlib
import importlib.metadata
import shlex

import pytest
import yaml

from service_helpers import ROOT

COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
# splitspec's own services; those of a profile (observability: Prometheus, Grafana, Jaeger)
# are checked in tests/test_dashboard.py.
SERVICES = {name: svc for name, svc in COMPOSE["services"].items() if "profiles" not in svc}


def console_scripts() -> dict[str, str]:
    try:
        import tomllib
    except ImportError:   # Python 3.10: the installed distribution's entry points say the same
        return {ep.name: ep.value for ep in importlib.metadata.distribution("splitspec").entry_points
                if ep.group == "console_scripts"}
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


SCRIPTS = console_scripts()


def parser_for(command: str):
    """The argparse parser behind a console script (module:main -> module.build_parser())."""
    assert command in SCRIPTS, f"{command} is not a console script in pyproject.toml"
    module_name = SCRIPTS[command].split(":")[0]
    # Every service exists now: a module or parser that goes missing must fail, not skip.
    module = importlib.import_module(module_name)
    assert hasattr(module, "build_parser"), f"{module_name} has no build_parser()"
    return module.build_parser()


def parse(argv: list[str]):
    parser = parser_for(argv[0])
    try:
        return parser.parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"{shlex.join(argv)}: rejected by its parser") from exc


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_three_services_from_one_image():
    assert set(SERVICES) == {"target", "draft", "gateway"}
    images = {s["image"] for s in SERVICES.values()}
    assert len(images) == 1
    for svc in SERVICES.values():
        assert svc["build"] == "."
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install" in dockerfile
    # Every package of the project goes into the image (the `splitspec` command lives in the tools').
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert {"splitspec", "splitspec_tools", "target_service", "draft_service", "gateway"} <= set(packages)
    for package in packages:
        assert f"COPY {package} ./{package}" in dockerfile, package


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_commands_are_real_entry_points_with_real_flags(name):
    command = SERVICES[name]["command"]
    assert isinstance(command, list), "exec form, so flags reach argparse unchanged"
    args = parse(command)
    assert args.host == "0.0.0.0"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_grpc_health_checks(name):
    svc = SERVICES[name]
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD"
    args = parse(test[1:])
    assert args.command == "health"
    assert args.address.rsplit(":", 1)[1] == flag(svc["command"], "--port")


def test_models_mounted_read_only():
    for name in ("target", "draft"):
        volumes = SERVICES[name]["volumes"]
        assert volumes and all(v.startswith("./models/") and v.endswith(":ro") for v in volumes)
        mounted = {v.split(":")[1] for v in volumes}
        assert flag(SERVICES[name]["command"], "--model-path") in mounted
    assert "volumes" not in SERVICES["gateway"]       # the gateway needs no model files


def test_gateway_waits_for_healthy_backends():
    deps = SERVICES["gateway"]["depends_on"]
    assert deps == {"target": {"condition": "service_healthy"}, "draft": {"condition": "service_healthy"}}


def test_backends_scale_and_gateway_balances_over_replicas():
    for name in ("target", "draft"):
        # A fixed host port or container name would make `--scale name=2` fail.
        assert "ports" not in SERVICES[name] and "container_name" not in SERVICES[name]
    gw = SERVICES["gateway"]["command"]
    assert flag(gw, "--target") == f"dns:///target:{flag(SERVICES['target']['command'], '--port')}"
    assert flag(gw, "--draft") == f"dns:///draft:{flag(SERVICES['draft']['command'], '--port')}"
    gw_args = parse(gw)
    assert gw_args.target == [flag(gw, "--target")]


def test_gateway_dials_targets_with_round_robin(monkeypatch):
    import json

    from gateway import backends
    seen = {}
    monkeypatch.setattr(backends.grpc.aio, "insecure_channel",
                        lambda address, options: seen.update(address=address, options=dict(options)))
    backends.make_channel("dns:///target:50051")
    config = json.loads(seen["options"]["grpc.service_config"])
    assert seen["address"] == "dns:///target:50051"
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]


def test_drain_fits_in_the_stop_grace_period():
    for name in ("target", "gateway"):
        args = parse(SERVICES[name]["command"])
        grace = int(str(SERVICES[name]["stop_grace_period"]).rstrip("s"))
        assert args.drain_timeout_s < grace


def test_tls_override_sets_real_flags_for_services_and_their_health_checks(tmp_path):
    """compose.tls.yaml configures mTLS and API keys through SPLITSPEC_* variables: each one is a
    flag of the service (and the TLS ones of `splitspec health`, which the health checks run in
    the same environment), and its files are the ones `splitspec certs` writes."""
    import argparse

    from splitspec_tools import cli
    from splitspec_tools.ops import certs
    from splitspec.flags import apply_env, env_name
    override = yaml.safe_load((ROOT / "compose.tls.yaml").read_text())["services"]
    assert set(override) == set(SERVICES)
    written = {p.name for p in [*certs.write_dev_certs(tmp_path).values()]} | \
        {f"{n}-key.pem" for n in certs.SERVICES} | {"api-keys.txt"}
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, svc in override.items():
        env = svc["environment"]
        parser = parser_for(SERVICES[name]["command"][0])
        known = {env_name(a) for a in parser._actions if a.option_strings and a.dest != "help"}
        assert set(env) <= known, set(env) - known
        assert {v.rsplit("/", 1)[1] for v in env.values()} <= written
        assert svc["volumes"] == ["./certs:/certs:ro"]
        args = apply_env(parser_for(SERVICES[name]["command"][0]), env).parse_args(SERVICES[name]["command"][1:])
        assert args.tls_cert == env["SPLITSPEC_TLS_CERT"] and args.tls_ca == env["SPLITSPEC_TLS_CA"]
        health = apply_env(sub.choices["health"], env).parse_args(SERVICES[name]["healthcheck"]["test"][3:])
        assert (health.tls_cert, health.tls_key, health.tls_ca) == (
            env["SPLITSPEC_TLS_CERT"], env["SPLITSPEC_TLS_KEY"], env["SPLITSPEC_TLS_CA"])
    assert override["gateway"]["environment"]["SPLITSPEC_API_KEY_FILE"].endswith("api-keys.txt")


def test_metrics_and_http_are_on_in_compose():
    for name, svc in SERVICES.items():
        assert parse(svc["command"]).metrics_port == 9100, name
    gw = parse(SERVICES["gateway"]["command"])
    assert gw.http_port == 8000 and "8000:8000" in SERVICES["gateway"]["ports"]
