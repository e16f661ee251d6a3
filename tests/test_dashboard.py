"""The Grafana dashboard (deploy/grafana/splitspec.json) on the services' real metrics (issue 55):
every metric a PromQL expression names is one the services export, read from a live /metrics
scrape of gateway, target and a DFlash draft under load; with Debian's `prometheus` installed,
every expression evaluated by a real Prometheus scraping that stack returns series. Also the
compose profile `observability` and the ServiceMonitor select what the dashboard reads."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service_helpers import ROOT, collect, gateway_stub, repeating_prompts, running
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import free_port

DASHBOARD = ROOT / "deploy" / "grafana" / "splitspec.json"
METRIC = re.compile(r"splitspec:[a-z0-9_]+")
JOBS = ("gateway", "target", "draft")
# Grafana's variables, as Prometheus would see them after Grafana's substitution.
GRAFANA_VARS = {"$__rate_interval": "30s"}


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", ())]


def evaluable(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr}"
    return expr


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def scrape(port: int) -> set[str]:
    """The series names a service exports: its samples, and those of its declared families that
    have none yet (a labelled counter before its first increment, as request_failure)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(s.name for s in fam.samples)
        names.update(fam.name + suffix for suffix in SUFFIXES.get(fam.type, ()))
    return names


@pytest.fixture(scope="module")
def stack(target_dir, draft_dir, tmp_path_factory):
    """gateway + target + DFlash draft with their exporters on, after some load: auto, dflash,
    ngram and target-only requests, so that every labelled series has appeared."""
    logs = tmp_path_factory.mktemp("logs")
    ports = {job: free_port() for job in JOBS}
    with running("target", ["--model-path", str(target_dir), "--metrics-port", str(ports["target"])], logs) as target, \
            running("draft", ["--method", "dflash", "--model-path", str(draft_dir), "--target-model-path",
                              str(target_dir), "--metrics-port", str(ports["draft"])], logs) as draft, \
            running("gateway", ["--target", target.address, "--draft", draft.address, "--draft-timeout-ms", "60000",
                                "--metrics-port", str(ports["gateway"])], logs) as gw:
        load(gw.address, rounds=1)
        yield gw, ports


def load(address: str, rounds: int) -> None:
    prompts = repeating_prompts(8, 55, (4, 12), repeat=3)
    channel, stub = gateway_stub(address)
    with channel, ThreadPoolExecutor(4) as pool:
        for _ in range(rounds):
            reqs = [build_request(p, max_new_tokens=24, method=m)
                    for p in prompts for m in ("auto", "dflash", "ngram", "none")]
            list(pool.map(lambda r: collect(stub.Generate(r, timeout=120)), reqs))


def test_every_dashboard_metric_is_exported(stack):
    _, ports = stack
    exported = set().union(*(scrape(p) for p in ports.values()))
    exprs = dashboard_exprs()
    assert len(exprs) >= 25
    named = {name for _, expr in exprs for name in METRIC.findall(expr)}
    missing = sorted(named - exported)
    assert not missing, f"the dashboard names metrics no service exports: {missing}"
    # and it covers what issue 55 asks a look at
    for wanted in ("generation_tokens_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "spec_decode_num_accepted_tokens_per_pos_total", "spec_decode_step_time_seconds_sum",
                   "spec_decode_verify_steps_total", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_hits_total", "target_failovers_total", "spec_decode_draft_fallbacks_total"):
        assert "splitspec:" + wanted in named, wanted


def test_dashboard_is_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "splitspec"
    for p in dash["panels"]:
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p.get("targets", ()):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"]
        # every series selector of a metric names its job, so target and gateway gauges of one
        # name (num_requests_running) never mix
        for t in p.get("targets", ()):
            for m in re.finditer(r"(splitspec:[a-z0-9_]+)(\{[^}]*\})?", t["expr"]):
                assert m.group(2) and "job=" in m.group(2), (p["title"], m.group(0))


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (apt-get install prometheus)")
def test_every_expression_returns_series_from_a_real_prometheus(stack, tmp_path):
    gw, ports = stack
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{ports[job]}"]}]}
                                 for job in JOBS]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    try:
        api = f"http://127.0.0.1:{port}/api/v1"
        wait_scraped(api, timeout_s=60)
        # load while Prometheus watches, so the rates of the last 30 s have samples before and after
        load(gw.address, rounds=2)
        time.sleep(3)
        empty = []
        for title, expr in dashboard_exprs():
            result = query(api, evaluable(expr))
            if not result:
                empty.append((title, expr))
        assert not empty, f"expressions with no series: {empty}"
    finally:
        proc.terminate()
        proc.wait(30)


def query(api: str, expr: str) -> list:
    url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_scraped(api: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if len(query(api, 'up{job=~"gateway|target|draft"} == 1')) == len(JOBS):
                return
        except (OSError, AssertionError):
            pass
        time.sleep(0.5)
    raise AssertionError("prometheus never scraped the three services")


def test_compose_profile_observability():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    extra = {n for n, s in services.items() if "observability" in s.get("profiles", ())}
    assert extra == {"prometheus", "grafana", "jaeger"}
    for name in extra:
        for volume in services[name].get("volumes", ()):
            src = volume.split(":")[0]
            assert (ROOT / src).exists(), f"{name} mounts {src}, which is not in the repository"
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c for c in prom["scrape_configs"]}
    assert set(jobs) == set(JOBS)
    for job, cfg in jobs.items():
        (sd,) = cfg["dns_sd_configs"]
        assert sd["names"] == [job] and job in services           # every replica of the compose service
        assert f"--metrics-port" in services[job]["command"]
        assert services[job]["command"][services[job]["command"].index("--metrics-port") + 1] == str(sd["port"])
    # Grafana loads the dashboard from where its provider looks, with the datasource it names
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/splitspec.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert any(v.endswith(f":{path}/splitspec.json:ro") for v in services["grafana"]["volumes"])
    sources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/splitspec.yml").read_text())
    assert {"prometheus", "jaeger"} <= {d["uid"] for d in sources["datasources"]}
    # the services send traces to Jaeger's OTLP port when the variable says so
    for name in JOBS:
        env = services[name].get("environment", {})
        assert "SPLITSPEC_OTLP_TRACES_ENDPOINT" in env, name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (apt-get install prometheus)")
def test_compose_prometheus_config_is_valid():
    proc = subprocess.run(["promtool", "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_servicemonitor_scrapes_each_component_as_its_job():
    base = ROOT / "deploy" / "kubernetes"
    (monitor,) = yaml.safe_load_all((base / "components/monitoring/servicemonitor.yaml").read_text())
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/component"
    selector = monitor["spec"]["selector"]["matchLabels"]
    port = monitor["spec"]["endpoints"][0]["port"]
    selected = {}
    for job in JOBS:
        for doc in yaml.safe_load_all((base / "base" / f"{job}.yaml").read_text()):
            if doc and doc["kind"] == "Service":
                labels = doc["metadata"]["labels"]
                if selector.items() <= labels.items():
                    selected[labels["app.kubernetes.io/component"]] = {p["name"] for p in doc["spec"]["ports"]}
    assert set(selected) == set(JOBS)                    # job values the dashboard selects
    assert all(port in ports for ports in selected.values())
    kustomization = yaml.safe_load((base / "overlays/observability/kustomization.yaml").read_text())
    assert "../../components/monitoring" in kustomization["components"]
