"""deploy/k8s renders with kustomize, every object validates against the Kubernetes schemas
(kubernetes-validate, strict, offline), and the pieces fit: KEDA watches the stream and group the
code uses, probes hit the services' health endpoints, drains fit in the grace period, GPUs are asked for."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pagedserve.shared import streams
from pagedserve.shared.model_source import DEFAULT_MODEL

K8S = Path(__file__).resolve().parents[2] / "deploy/k8s"
K8S_VERSION = "1.30.0"
# KEDA's kinds are CRDs: kubernetes-validate has no schema for them. They are checked against this
# schema of the fields we use instead (after KEDA's v1alpha1 CRDs), not against KEDA's own CRD.
_KEDA_SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "kind": {"type": "string"},
                            "apiVersion": {"type": "string"},
                        },
                        "additionalProperties": False,
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer"},
                    "cooldownPeriod": {"type": "integer"},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "additionalProperties": False,
                            "properties": {
                                "type": {"enum": ["redis-streams", "redis-sentinel-streams", "redis-cluster-streams"]},
                                "authenticationRef": {"type": "object", "required": ["name"]},
                                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            },
                        },
                    },
                },
            },
        },
    },
    "TriggerAuthentication": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "secretTargetRef": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["parameter", "name", "key"],
                            "additionalProperties": False,
                            "properties": {k: {"type": "string"} for k in ("parameter", "name", "key")},
                        },
                    }
                },
            },
        },
    },
}


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (.ci/run installs it)")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (container,) = _find(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    return dict(container)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_rendered_manifests_validate(overlay: str) -> None:
    docs = _render(overlay)
    crds = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            crds.append(doc["kind"])
            jsonschema.validate(doc, _KEDA_SCHEMAS[doc["kind"]])
    assert sorted(crds) == ["ScaledObject", "TriggerAuthentication"]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [
        ("StatefulSet", "redis"),
        ("Deployment", "gateway"),
        ("Service", "gateway"),
        ("HorizontalPodAutoscaler", "gateway"),
        ("Deployment", "engine"),
        ("Deployment", "tokenizer"),
        ("PodDisruptionBudget", "engine"),
        ("PodDisruptionBudget", "gateway"),
    ]:
        assert expected in kinds, expected
    assert all(d["metadata"].get("namespace") == "pagedserve" for d in docs if d["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_pieces_fit(overlay: str) -> None:
    docs = _render(overlay)
    scaled = _find(docs, "ScaledObject", "engine")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"]["stream"] == streams.generate_stream(DEFAULT_MODEL)
    assert trigger["metadata"]["consumerGroup"] == streams.engine_group(DEFAULT_MODEL)
    assert int(trigger["metadata"]["pendingEntriesCount"]) > 0
    assert scaled["spec"]["scaleTargetRef"]["name"] == "engine"
    auth = _find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert all(
        ref["name"] in secrets and ref["key"] in secrets[ref["name"]]["data"] for ref in auth["spec"]["secretTargetRef"]
    )
    assert _find(docs, "HorizontalPodAutoscaler", "gateway")["spec"]["scaleTargetRef"]["name"] == "gateway"

    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pagedserve-config"))
    drain_s = int(config["data"]["PAGEDSERVE_ENGINE_DRAIN_TIMEOUT_S"])
    engine_pod = _find(docs, "Deployment", "engine")["spec"]["template"]["spec"]
    assert engine_pod["terminationGracePeriodSeconds"] > drain_s
    engine = _container(docs, "engine")
    assert "kill -TERM 1" in engine["lifecycle"]["preStop"]["exec"]["command"][-1]
    for name, port in (("gateway", "http"), ("engine", "ops"), ("tokenizer", "ops")):
        c = _container(docs, name)
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PAGEDSERVE_REDIS_URL"].startswith("redis+sentinel://:$(REDIS_PASSWORD)@$(PAGEDSERVE_SENTINELS)/")
    device = {e["name"]: e.get("value") for e in engine["env"]}["PAGEDSERVE_DEVICE"]
    gpus = engine["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (device, gpus) == (("cuda", 1) if overlay == "gpu" else ("cpu", None))
    redis = _find(docs, "StatefulSet", "redis")["spec"]
    assert redis["replicas"] == 3 and [c["name"] for c in redis["template"]["spec"]["containers"]] == [
        "redis",
        "sentinel",
    ]


def test_redis_scripts_parse() -> None:
    for script in ("redis-start.sh", "sentinel-start.sh"):
        subprocess.run(["sh", "-n", str(K8S / "base" / script)], check=True)
