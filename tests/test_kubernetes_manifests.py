"""deploy/kubernetes rendered by kustomize (`kubectl kustomize`, or a `kustomize` binary) for both overlays,
every object validated offline against the Kubernetes schema (kubernetes-validate, which bundles them),
and what the manifests promise checked on the rendered objects: probes that ask each service itself, a
grace period longer than a worker's drain, Redis on a persistent volume, a standby scheduler, workers that
KEDA scales on gauges the gateway really exposes.

KEDA's ScaledObject is a custom resource: kubernetes-validate has no schema for it (SchemaNotFoundError),
so those objects are checked here field by field instead (scaleTargetRef, triggers and the metrics they
read)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from phaseserve import healthcheck, settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("colocated", "disaggregated")
KUBERNETES_VERSION = "1.30.0"


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


pytestmark = pytest.mark.skipif(kustomize_command() is None,
                                reason="no kubectl or kustomize to render with (.ci/run installs kubectl)")


def render(overlay: str) -> list[dict]:
    out = subprocess.run([*kustomize_command(), str(K8S / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> list[dict]:
    return render(request.param)


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def gateway_metric_names() -> set[str]:
    from phaseserve.gateway.metrics import GatewayMetrics

    return {m.name for m in GatewayMetrics("m").registry.collect()}


def test_every_object_validates_against_the_kubernetes_schema(objects):
    custom = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            custom.append(obj["kind"])
    assert set(custom) == {"ScaledObject"}  # only KEDA's custom resource has no bundled schema


def test_probes_ask_each_service_itself(objects):
    workloads = {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}
    for name, workload in workloads.items():
        for c in containers(workload):
            for probe in ("livenessProbe", "readinessProbe"):
                assert probe in c, (name, probe)
            if name == "phaseserve-redis":
                continue
            assert "startupProbe" in c, name
            service = "gateway" if "gateway" in name else "scheduler" if "scheduler" in name else "worker"
            for probe, mode in (("startupProbe", "live"), ("livenessProbe", "live"), ("readinessProbe", "ready")):
                spec = c[probe]
                if service == "gateway":
                    assert spec["httpGet"]["path"] == f"/health/{mode}", (name, probe)
                else:
                    command = spec["exec"]["command"]
                    assert command == ["python", "-m", "phaseserve.healthcheck", service, mode], (name, probe)
                    assert service in healthcheck.CHECKS and mode in healthcheck.MODES


def test_workers_drain_within_their_grace_period_and_load_the_model_from_a_volume(objects):
    from phaseserve.workers.service import DRAIN_MARGIN_S

    config = by_kind(objects, "ConfigMap")["phaseserve-config"]["data"]
    drain = float(config["PHASESERVE_DRAIN_TIMEOUT"])
    workers = {n: d for n, d in by_kind(objects, "Deployment").items() if "worker" in n}
    assert workers
    claims = set(by_kind(objects, "PersistentVolumeClaim"))
    for name, d in workers.items():
        pod = d["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > drain + DRAIN_MARGIN_S, name
        cache = {v["name"]: v for v in pod["volumes"]}["cache"]
        assert cache["persistentVolumeClaim"]["claimName"] in claims
        (worker,) = containers(d)
        assert {"name": "cache", "mountPath": config["PHASESERVE_CACHE_DIR"]} in worker["volumeMounts"]
        assert worker["command"] == ["phaseserve", "worker"]


def test_redis_persists_and_the_scheduler_has_a_standby(objects):
    redis = by_kind(objects, "StatefulSet")["phaseserve-redis"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (container,) = containers(redis)
    assert "--appendonly yes" in container["command"][-1] and {"name": "data", "mountPath": "/data"} \
        in container["volumeMounts"]
    assert by_kind(objects, "Deployment")["phaseserve-scheduler"]["spec"]["replicas"] >= 2
    assert by_kind(objects, "Service")["phaseserve-gateway"]["spec"]["selector"] == \
        by_kind(objects, "Deployment")["phaseserve-gateway"]["spec"]["selector"]["matchLabels"]


def test_every_setting_the_manifests_set_exists(objects):
    known = {s.env for s in settings.SETTINGS}
    config = by_kind(objects, "ConfigMap")["phaseserve-config"]["data"]
    names = set(config)
    for d in by_kind(objects, "Deployment").values():
        for c in containers(d):
            names |= {e["name"] for e in c.get("env", ())}
    assert names - known == set(), names - known


def test_keda_scales_each_worker_pool_on_unmet_demand_the_gateway_exposes(objects):
    deployments = by_kind(objects, "Deployment")
    exposed = gateway_metric_names()
    gateway_service = by_kind(objects, "Service")["phaseserve-gateway"]["metadata"]["name"]
    scaled = by_kind(objects, "ScaledObject")
    targets = set()
    for name, so in scaled.items():
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in deployments, (name, target)
        targets.add(target)
        assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
        for trigger in so["spec"]["triggers"]:
            assert trigger["type"] == "metrics-api", trigger  # never cpu or memory
            meta = trigger["metadata"]
            assert meta["format"] == "prometheus" and meta["url"].startswith(f"http://{gateway_service}.")
            assert meta["url"].endswith("/metrics")
            assert meta["valueLocation"] in exposed, meta["valueLocation"]
            assert float(meta["targetValue"]) > 0
    workers = {n for n in deployments if "worker" in n}
    assert targets == workers  # every pool scaled, each by one ScaledObject


def test_the_disaggregated_overlay_runs_two_pools_that_never_share_pods():
    deployments = by_kind(render("disaggregated"), "Deployment")
    roles = {}
    for name, d in deployments.items():
        for c in containers(d):
            for e in c.get("env", ()):
                if e["name"] == "PHASESERVE_ROLE":
                    roles[name] = e["value"]
    assert roles == {"phaseserve-worker-prefill": "prefill", "phaseserve-worker-decode": "decode"}
    selectors = [deployments[n]["spec"]["selector"]["matchLabels"] for n in roles]
    assert selectors[0] != selectors[1]
    for n in roles:  # a pod of one pool matches only its own selector
        labels = deployments[n]["spec"]["template"]["metadata"]["labels"]
        assert [s.items() <= labels.items() for s in selectors].count(True) == 1
    colocated = by_kind(render("colocated"), "Deployment")
    env = {e["name"]: e["value"] for e in containers(colocated["phaseserve-worker"])[0]["env"]}
    assert env["PHASESERVE_ROLE"] == "mixed"
