"""Offline validation of the Kubernetes manifests (no cluster needed).

- KubeRay kinds are checked against the operator's CRD schemas (``$STAR_ELASTIC_SCHEMAS/kuberay``, by default
  ``shared/schemas/kuberay`` beside the repository; tests that need them skip when they are absent) the way
  the API server reads them: unknown fields are errors (``kubectl apply --validate=strict``), ``nullable``
  admits null, ``x-kubernetes-list-type`` entries must be unique, and a field guarded by CEL rules is
  reported (they cannot be evaluated here). ``metadata`` is checked as ObjectMeta, ``serveConfigV2``
  against Ray Serve's own schema.
- Kubernetes' own kinds are checked by ``kubernetes_validate`` in strict mode.
- The committed files under ``infra/k8s`` must equal a fresh rendering, so they never go stale.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from jsonschema.exceptions import ValidationError

from components.serving.config import AutoscalingSettings, ServingConfig
from pipelines.cli import main
from pipelines.kuberay.config import ClusterConfig, RunsVolume, WorkerGroup
from pipelines.kuberay.manifests import mlflow_server_manifests, ray_cluster_manifest, ray_job_manifest
from pipelines.kuberay.render import demo_cluster_config, real_cluster_config, render_manifests, stale_manifests
from pipelines.kuberay.serve import ServeApp, ray_service_manifest
from tests.conftest import schema_dir

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "infra" / "k8s"
K8S_VERSION = "1.33"  # a release kubernetes_validate ships schemas for
CRD_FILES = {"RayCluster": "rayclusters", "RayJob": "rayjobs", "RayService": "rayservices"}
COMMITTED = sorted(render_manifests(demo_cluster_config(), real_cluster_config()))
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader reads the 1 MB CRDs ~10x faster


# CRD schema -> validator with the API server's structural-schema semantics.

_BASE = jsonschema.Draft4Validator  # OpenAPI v3.0 schemas are a dialect of JSON Schema draft 4


def _type(validator, types, instance, schema) -> Iterator[ValidationError]:
    if instance is None and schema.get("nullable"):
        return
    yield from _BASE.VALIDATORS["type"](validator, types, instance, schema)


def _properties(validator, properties, instance, schema) -> Iterator[ValidationError]:
    yield from _BASE.VALIDATORS["properties"](validator, properties, instance, schema)
    # The API server prunes (or, with strict field validation, rejects) fields a structural schema
    # does not declare; jsonschema would silently accept them, hiding typos.
    open_object = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
    if validator.is_type(instance, "object") and not open_object:
        for key in instance:
            if key not in properties:
                yield ValidationError(f"unknown field {key!r}", path=[key])


def _list_type(validator, list_type, instance, schema) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "array") or list_type not in ("map", "set"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    item_props = schema.get("items", {}).get("properties", {})
    seen: dict[str, int] = {}
    for index, item in enumerate(instance):
        if list_type == "map" and isinstance(item, dict):
            # A missing key takes its schema default (e.g. a port's protocol defaults to TCP).
            ident = {key: item.get(key, item_props.get(key, {}).get("default")) for key in keys}
        else:
            ident = item
        text = json.dumps(ident, sort_keys=True)
        if text in seen:
            yield ValidationError(f"duplicate entry {text} (also at index {seen[text]})", path=[index])
        seen.setdefault(text, index)


def _cel(validator, rules, instance, schema) -> Iterator[ValidationError]:
    # Fail loudly rather than pretend: a manifest that starts using such a field needs a hand-written check.
    listed = "; ".join(rule["rule"] for rule in rules)
    yield ValidationError(f"field is guarded by CEL rules that cannot be evaluated offline: {listed}")


_CrdValidator = jsonschema.validators.extend(
    _BASE,
    {"type": _type, "properties": _properties, "x-kubernetes-list-type": _list_type, "x-kubernetes-validations": _cel},
)


@functools.cache
def _crd(kind: str) -> tuple[str, Any]:
    """(apiVersion, validator) of the first (served, stored) version of ``kind``'s CRD."""
    path = schema_dir("kuberay") / f"ray.io_{CRD_FILES[kind]}.yaml"
    crd = yaml.load(path.read_text(), Loader=_Loader)
    version = crd["spec"]["versions"][0]
    assert version["served"] and version["storage"], f"{path}: versions[0] is not the served, stored version"
    return f"{crd['spec']['group']}/{version['name']}", _CrdValidator(version["schema"]["openAPIV3Schema"])


def _where(path: Iterable[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".") or "<root>"


def _object_meta_errors(meta: Any) -> list[str]:
    # ObjectMeta is the same type in every kind; kubernetes_validate ships it only inside the
    # built-in kinds, so check it as the metadata of an otherwise empty ConfigMap.
    try:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}, K8S_VERSION, True)
    except kubernetes_validate.ValidationError as error:
        return [f"{_where(error.path)}: {error.message}"]
    return []


def _serve_config_errors(text: str) -> list[str]:
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        RayActorOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
    )

    where = "spec.serveConfigV2"
    config = yaml.safe_load(text)
    try:
        ServeDeploySchema.model_validate(config)
    except ValueError as error:  # pydantic's ValidationError
        return [f"{where}: {error}"]
    checks = [
        (config, ServeDeploySchema, where),
        (config.get("http_options", {}), HTTPOptionsSchema, f"{where}.http_options"),
    ]
    for i, app in enumerate(config["applications"]):
        checks.append((app, ServeApplicationSchema, f"{where}.applications[{i}]"))
        for j, deployment in enumerate(app.get("deployments", [])):
            at = f"{where}.applications[{i}].deployments[{j}]"
            checks.append((deployment, DeploymentSchema, at))
            checks.append((deployment.get("ray_actor_options", {}), RayActorOptionsSchema, f"{at}.ray_actor_options"))
            checks.append((deployment.get("autoscaling_config") or {}, AutoscalingConfig, f"{at}.autoscaling_config"))
    # Ray Serve's schemas ignore unknown keys, so a misspelt option would silently keep its default.
    errors = [
        f"{at}.{key}: unknown field {key!r}"
        for data, model, at in checks
        for key in data
        if key not in model.model_fields
    ]
    for data, model, at in checks:
        if model is AutoscalingConfig:  # DeploymentSchema types it as a plain dict; check it against its model
            try:
                model.model_validate(data)
            except ValueError as error:
                errors.append(f"{at}: {error}")
    return errors


def manifest_errors(doc: dict[str, Any]) -> list[str]:
    """Every problem found in one manifest, each as ``path: message``; empty when it is valid."""
    kind = doc.get("kind")
    if kind not in CRD_FILES:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            return [f"{_where(error.path)}: {error.message}"]
        return []
    api_version, validator = _crd(kind)
    errors = [f"{_where(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
    if doc.get("apiVersion") != api_version:
        errors.append(f"apiVersion: expected {api_version!r}, got {doc.get('apiVersion')!r}")
    errors += _object_meta_errors(doc.get("metadata"))
    if kind == "RayService" and isinstance(doc.get("spec", {}).get("serveConfigV2"), str):
        errors += _serve_config_errors(doc["spec"]["serveConfigV2"])
    return errors


def assert_valid(doc: dict[str, Any]) -> None:
    errors = manifest_errors(doc)
    assert not errors, f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}:\n  " + "\n  ".join(errors)


# Configs and manifests under test.


_COMMON = {"image": "star-elastic:test", "storage_uri": "/data/runs", "mlflow_tracking_uri": "http://mlflow:5000"}


def _cpu_only() -> ClusterConfig:
    group = WorkerGroup(name="cpu", replicas=1, min_replicas=1, max_replicas=1, cpus=0.5, memory="1Gi")
    extra = {"s3_credentials_secret": None, "env": {"OMP_NUM_THREADS": "1"}}
    return ClusterConfig(**_COMMON, **extra, head_cpus=1, head_memory="2Gi", worker_groups=[group])


def _gpu_autoscaling() -> ClusterConfig:
    gpu_kw = {"gpus": 4, "gpu_type": "NVIDIA-A100-SXM4-80GB", "node_selector": {"pool": "gpu"}}
    gpu = WorkerGroup(name="gpu-a100", replicas=0, min_replicas=0, max_replicas=3, cpus=32, memory="256Gi", **gpu_kw)
    cpu = WorkerGroup(name="cpu", replicas=1, min_replicas=1, max_replicas=8, cpus=8, memory="32Gi")
    urls = {"mlflow_tracking_uri": "http://mlflow.ml.svc.cluster.local:5000", "s3_endpoint_url": "http://minio:9000"}
    extra = {"namespace": "ml", "storage_uri": "s3://bucket/runs", "service_account": "ray", **urls}
    return ClusterConfig(
        **{**_COMMON, **extra}, head_cpus=4, head_memory="16Gi", worker_groups=[gpu, cpu], autoscaling=True
    )


def _head_only() -> ClusterConfig:
    return ClusterConfig(**_COMMON, head_cpus=4, head_memory="8Gi")


CONFIGS = {"cpu-only": _cpu_only, "gpu-autoscaling": _gpu_autoscaling, "head-only": _head_only}


def _built(cfg: ClusterConfig) -> list[dict[str, Any]]:
    gpus = 1.0 if cfg.max_gpus else 0.0
    app = {
        "model_uri": "s3://bucket/model",
        "serving": {"num_gpus_per_replica": gpus, "autoscaling": {"max_replicas": 2}},
    }
    return [
        ray_cluster_manifest(cfg, "test-cluster"),
        ray_job_manifest(cfg, "test-job", "star-elastic run /app/pipelines/configs/demo.yaml"),
        ray_service_manifest(cfg, "test-serve", app),
    ]


def _pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"].get("rayClusterSpec") or doc["spec"].get("rayClusterConfig") or doc["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for t in _pod_templates(doc) for c in t["spec"]["containers"]]


def _runs_mounts(template: dict[str, Any]) -> list[tuple[str, str]]:
    """(claim name, mount path in the Ray container) of every PersistentVolumeClaim the pod template mounts."""
    volumes = template["spec"]["volumes"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}
    ray_container = template["spec"]["containers"][0]
    return [(claims[m["name"]], m["mountPath"]) for m in ray_container["volumeMounts"] if m["name"] in claims]


def _committed_in(folder: Path, name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((folder / name).read_text()) if doc]


def _committed(name: str) -> list[dict[str, Any]]:
    return _committed_in(K8S_DIR, name)


# The committed files.


def test_committed_folder_holds_exactly_the_rendered_files() -> None:
    assert sorted(p.name for p in K8S_DIR.glob("*.yaml")) == COMMITTED


@pytest.mark.parametrize("name", COMMITTED)
def test_committed_manifest_validates(name: str) -> None:
    docs = _committed(name)
    assert docs, f"{name} holds no manifest"
    for doc in docs:
        assert_valid(doc)


def test_committed_manifests_equal_a_fresh_rendering() -> None:
    stale = stale_manifests(K8S_DIR, demo_cluster_config(), real_cluster_config())
    assert not stale, f"stale: {stale}; regenerate with `star-elastic kuberay render infra/k8s`"
    assert main(["kuberay", "render", "--check", str(K8S_DIR)]) == 0


def test_cli_writes_and_checks(tmp_path: Path, capsys) -> None:
    assert main(["kuberay", "render", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == COMMITTED
    assert main(["kuberay", "render", "--check", str(tmp_path)]) == 0
    (tmp_path / "rayservice.yaml").write_text("# edited by hand\n")
    capsys.readouterr()
    assert main(["kuberay", "render", "--check", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"stale: {tmp_path / 'rayservice.yaml'}")
    # --registry and --namespace reach every object and image.
    assert main(["kuberay", "render", str(tmp_path), "--registry", "ghcr.io/acme", "--namespace", "ml"]) == 0
    (job,) = _committed_in(tmp_path, "rayjob-pipeline.yaml")
    assert job["metadata"]["namespace"] == "ml"
    assert all(c["image"].startswith("ghcr.io/acme/star-elastic:") for c in _containers(job))


def test_committed_tracking_uri_names_the_committed_mlflow_service() -> None:
    deployment, service, pvc = _committed("mlflow.yaml")
    meta = service["metadata"]
    url = f"http://{meta['name']}.{meta['namespace']}.svc.cluster.local:{service['spec']['ports'][0]['port']}"
    for name in ("rayjob-pipeline.yaml", "rayservice.yaml", "raycluster-gpu.yaml"):
        for container in _containers(_committed(name)[0]):
            assert {"name": "MLFLOW_TRACKING_URI", "value": url} in container["env"], name
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]


def test_committed_real_scale_shape() -> None:
    (cluster,) = _committed("raycluster-gpu.yaml")
    (worker,) = cluster["spec"]["workerGroupSpecs"]
    assert (worker["minReplicas"], worker["maxReplicas"]) == (1, 8)  # 64 GPUs: real.yaml's 64 workers
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    (job,) = _committed("rayjob-pipeline.yaml")
    assert job["spec"]["entrypoint"] == "star-elastic run /app/pipelines/configs/real.yaml"


# Every pod that runs pipeline code mounts the runs volume where its RayJob's pipeline config writes.
RUNS = {  # committed manifest -> (its claim's file, the pipeline config its cluster runs, runs_dir in the pods)
    "rayjob-demo.yaml": ("runs-volume-cpu.yaml", "demo.yaml", "/app/runs"),
    "raycluster-cpu.yaml": ("runs-volume-cpu.yaml", "demo.yaml", "/app/runs"),
    "rayjob-pipeline.yaml": ("runs-volume-gpu.yaml", "real.yaml", "/mnt/runs"),
    "raycluster-gpu.yaml": ("runs-volume-gpu.yaml", "real.yaml", "/mnt/runs"),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_committed_pipeline_pods_mount_the_runs_volume_at_runs_dir(name: str) -> None:
    claim_file, pipeline, in_pods = RUNS[name]
    (claim,) = _committed(claim_file)
    assert claim["kind"] == "PersistentVolumeClaim"
    runs_dir = yaml.safe_load((REPO / "pipelines" / "configs" / pipeline).read_text())["runs_dir"]
    assert {"demo.yaml": "runs", "real.yaml": "/mnt/runs"}[pipeline] == runs_dir  # relative: under /app
    (doc,) = _committed(name)
    templates = _pod_templates(doc)
    assert len(templates) == 2  # the head and the one worker group
    for template in templates:
        assert _runs_mounts(template) == [(claim["metadata"]["name"], in_pods)]


def test_committed_runs_volumes() -> None:
    (gpu,) = _committed("runs-volume-gpu.yaml")
    assert gpu["metadata"]["name"] == "star-elastic-runs"
    assert gpu["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on 8 nodes share it
    assert gpu["spec"]["resources"]["requests"]["storage"] == "2Ti"
    (cpu,) = _committed("runs-volume-cpu.yaml")
    assert cpu["spec"]["accessModes"] == ["ReadWriteOnce"]  # a one-node kind cluster
    (service,) = _committed("rayservice.yaml")  # serving reads models from MLflow: no run folders
    assert all(_runs_mounts(t) == [] for t in _pod_templates(service))


def test_a_served_checkpoint_on_the_runs_volume_mounts_it() -> None:
    app = {"model_uri": "/mnt/runs/nano/export/nested", "serving": {"num_gpus_per_replica": 1}}
    doc = ray_service_manifest(real_cluster_config(), "s", app)
    assert all(_runs_mounts(t) == [("star-elastic-runs", "/mnt/runs")] for t in _pod_templates(doc))
    assert_valid(doc)


# Freshly built manifests.


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_built_manifests_validate(config: str) -> None:
    for doc in _built(CONFIGS[config]()):
        assert_valid(doc)


def test_cluster_shape_gpus_tolerations_head_cpus_autoscaling() -> None:
    spec = ray_cluster_manifest(_gpu_autoscaling(), "c")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    assert spec["headGroupSpec"]["rayStartParams"] == {"dashboard-host": "0.0.0.0", "num-cpus": "0"}
    gpu, cpu = spec["workerGroupSpecs"]
    gpu_pod, cpu_pod = gpu["template"]["spec"], cpu["template"]["spec"]
    assert gpu_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert gpu_pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert gpu_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "pool": "gpu"}
    assert "nvidia.com/gpu" not in cpu_pod["containers"][0]["resources"]["limits"]
    assert "tolerations" not in cpu_pod and "nodeSelector" not in cpu_pod
    assert gpu_pod["serviceAccountName"] == "ray"
    # A head-only cluster keeps its CPUs for work and has nothing to autoscale.
    head_only = ray_cluster_manifest(_head_only(), "c")["spec"]
    assert head_only["headGroupSpec"]["rayStartParams"] == {"dashboard-host": "0.0.0.0"}
    assert head_only["workerGroupSpecs"] == [] and "enableInTreeAutoscaling" not in head_only


def test_every_container_gets_tracking_storage_and_s3_settings() -> None:
    for doc in _built(_gpu_autoscaling()):
        for container in _containers(doc):
            env = {item["name"]: item["value"] for item in container["env"]}
            assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.ml.svc.cluster.local:5000"
            assert env["STAR_ELASTIC_STORAGE_URI"] == "s3://bucket/runs"
            assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
            assert container["envFrom"] == [{"secretRef": {"name": "star-elastic-s3"}}]
    for container in _containers(ray_cluster_manifest(_cpu_only(), "c")):
        assert "envFrom" not in container and {"name": "OMP_NUM_THREADS", "value": "1"} in container["env"]
        assert container["resources"]["limits"]["cpu"] in ("1", "500m")


def test_ray_job_fields() -> None:
    spec = ray_job_manifest(_cpu_only(), "j", "echo hi", ttl=600, backoff_limit=2, active_deadline_s=3600)["spec"]
    assert spec["submissionMode"] == "K8sJobMode" and spec["shutdownAfterJobFinishes"] is True
    assert (spec["ttlSecondsAfterFinished"], spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (600, 2, 3600)
    assert spec["rayClusterSpec"] == ray_cluster_manifest(_cpu_only(), "c")["spec"]
    kept = ray_job_manifest(_cpu_only(), "j", "echo hi", shutdown_after_finish=False)["spec"]
    assert kept["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in kept


def test_ray_service_serve_config() -> None:
    serving = ServingConfig(
        max_ongoing_requests=8,
        max_queued_requests=4,
        num_gpus_per_replica=1,
        autoscaling=AutoscalingSettings(min_replicas=0, max_replicas=12),
    )
    doc = ray_service_manifest(_gpu_autoscaling(), "s", ServeApp(model_uri="models:/m@prod", serving=serving))
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (application,) = config["applications"]
    assert application["name"] == "star-elastic"
    assert application["import_path"] == "components.serving.app:build_app"
    # The replicas get the same settings, so that they admit what Serve was told they would.
    assert application["args"] == {
        "model_uri": "models:/m@prod",
        "config": {
            "max_ongoing_requests": 8,
            "max_queued_requests": 4,
            "num_gpus_per_replica": 1.0,
            "autoscaling": {"min_replicas": 0, "max_replicas": 12},
        },
    }
    ingress, deployment = application["deployments"]
    assert (ingress["name"], deployment["name"]) == ("StarElasticIngress", "StarElasticServer")
    assert ingress == serving.ingress_options() and ingress["ray_actor_options"] == {"num_cpus": 0}
    # Serve may send a replica its 8 running + 4 waiting, and 8 more to be refused with the replica's JSON 503.
    assert deployment["max_ongoing_requests"] == 20
    assert deployment["max_queued_requests"] == 1024  # the proxy's queue while no replica can take a request
    assert deployment["autoscaling_config"] == {
        "min_replicas": 0,
        "max_replicas": 12,
        "target_ongoing_requests": 4.0,
        "upscale_delay_s": 10.0,
        "downscale_delay_s": 120.0,
        "look_back_period_s": 30.0,
        "metrics_interval_s": 10.0,
        "aggregation_function": "mean",
    }
    assert deployment["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert deployment == serving.deployment_options()  # what `star-elastic serve` deploys, option for option
    assert_valid(doc)


def test_committed_ray_service_admits_what_the_replicas_admit() -> None:
    (service,) = _committed("rayservice.yaml")
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    ingress, deployment = application["deployments"]
    replica = ServingConfig.model_validate(application["args"]["config"])
    # at least two model replicas and two ingress replicas: one death leaves one of each serving
    assert deployment["autoscaling_config"]["min_replicas"] == 2 and ingress["num_replicas"] == 2
    assert replica.max_ongoing_requests == 32 and replica.max_queued_requests == 64  # the serving defaults
    assert deployment["max_ongoing_requests"] == 2 * 32 + 64  # not the replica's own 32: overload reaches it
    assert deployment["autoscaling_config"]["max_replicas"] == 16
    assert deployment["ray_actor_options"] == {"num_cpus": 8.0, "num_gpus": 1.0}


def test_rayservice_command_derives_serve_options_from_a_pipeline_serve_section(tmp_path: Path, capsys) -> None:
    pipeline = tmp_path / "pipeline.yaml"
    serve = {"max_ongoing_requests": 4, "max_queued_requests": 0, "num_gpus_per_replica": 1}
    pipeline.write_text(yaml.safe_dump({"elastic": {}, "serve": {**serve, "autoscaling": {"max_replicas": 3}}}))
    assert main(["kuberay", "rayservice", "models:/m@champion", "--config", str(pipeline), "--namespace", "ml"]) == 0
    (doc,) = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert doc["kind"] == "RayService" and doc["metadata"]["namespace"] == "ml"
    (application,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    assert application["deployments"][1]["max_ongoing_requests"] == 8
    assert application["deployments"][1]["autoscaling_config"]["max_replicas"] == 3
    assert application["args"]["config"]["max_ongoing_requests"] == 4
    assert_valid(doc)


def test_mlflow_server_manifests() -> None:
    docs = mlflow_server_manifests(
        "ml", "img:1", "sqlite:////mlflow/mlflow.db", "s3://b/artifacts", s3_endpoint_url="http://minio:9000",
        s3_credentials_secret="creds", storage_class="fast", extra_allowed_hosts=["mlflow.example.com"],
    )  # fmt: skip
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "PersistentVolumeClaim"]
    for doc in docs:
        assert_valid(doc)
    container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:2] == ["mlflow", "server"]
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "5000" and flags["--workers"] == "1"
    assert flags["--backend-store-uri"] == "sqlite:////mlflow/mlflow.db"
    assert flags["--artifacts-destination"] == "s3://b/artifacts"
    assert {"mlflow.ml.svc.cluster.local:*", "mlflow.example.com"} <= set(flags["--allowed-hosts"].split(","))
    assert {"name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "false"} in container["env"]
    assert container["envFrom"] == [{"secretRef": {"name": "creds"}}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert docs[2]["spec"]["storageClassName"] == "fast"


# The validator catches what the API server (or the operator) would reject.


def _cluster() -> dict[str, Any]:
    return ray_cluster_manifest(_gpu_autoscaling(), "c")  # a fresh dict on every call


@pytest.mark.parametrize("value, ok", [(4, True), ("4", True), ("3500m", True), (4.5, False), (True, False)])
def test_int_or_string_quantities_accept_int_and_string_only(value: Any, ok: bool) -> None:
    doc = _cluster()
    doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = value
    where = "spec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.cpu: "
    assert manifest_errors(doc) == ([] if ok else [f"{where}{value!r} is not valid under any of the given schemas"])


def test_quantity_strings_must_parse() -> None:
    doc = _cluster()
    doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] = "4 GB"
    (error,) = manifest_errors(doc)
    assert error.startswith("spec.headGroupSpec.template.spec.containers[0].resources.requests.memory: '4 GB' does not")


def test_typo_field_fails_naming_its_path() -> None:
    job = ray_job_manifest(_cpu_only(), "j", "echo hi")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    head["rayStartParms"] = head.pop("rayStartParams")
    assert manifest_errors(job) == ["spec.rayClusterSpec.headGroupSpec.rayStartParms: unknown field 'rayStartParms'"]


def test_wrong_type_fails_naming_its_path() -> None:
    doc = _cluster()
    doc["spec"]["workerGroupSpecs"][1]["replicas"] = "2"
    assert manifest_errors(doc) == ["spec.workerGroupSpecs[1].replicas: '2' is not of type 'integer'"]


def test_builtin_kind_typo_fails_naming_its_path() -> None:
    deployment = mlflow_server_manifests("ml", "img:1", "sqlite:////mlflow/db", "/mlflow/artifacts")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    (error,) = manifest_errors(deployment)
    assert error.startswith("spec.template.spec.containers[0]:") and "'readinesProbe' was unexpected" in error


def test_duplicate_list_map_key_fails() -> None:
    doc = _cluster()
    container = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    container["env"].append(dict(container["env"][0]))
    (error,) = manifest_errors(doc)
    assert error.startswith(f"spec.headGroupSpec.template.spec.containers[0].env[{len(container['env']) - 1}]:")


def test_cel_guarded_field_is_reported_not_skipped() -> None:
    doc = _cluster()
    doc["spec"]["managedBy"] = "ray.io/kuberay-operator"
    (error,) = manifest_errors(doc)
    assert error.startswith("spec.managedBy: field is guarded by CEL rules")


def test_metadata_and_api_version_are_checked() -> None:
    doc = _cluster()
    doc["metadata"]["labels"]["replicas"] = 3
    doc["apiVersion"] = "ray.io/v1alpha1"
    errors = manifest_errors(doc)
    assert any(e.startswith("apiVersion:") for e in errors)
    assert any(e.startswith("metadata.labels.replicas:") for e in errors)


def test_serve_config_is_checked_against_ray_serve() -> None:
    doc = ray_service_manifest(_gpu_autoscaling(), "s", {"model_uri": "m"})  # CPU replicas on a GPU cluster
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    deployment = config["applications"][0]["deployments"][1]
    deployment["autoscaling_config"]["max_replica"] = deployment["autoscaling_config"].pop("max_replicas")
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    errors = manifest_errors(doc)
    assert any("autoscaling_config.max_replica: unknown field" in e for e in errors)


# The typed config refuses what would fail later in the cluster.


_WG = {"name": "g", "replicas": 1, "min_replicas": 1, "max_replicas": 1, "cpus": 1, "memory": "1Gi"}


def _cfg(**changes: Any) -> ClusterConfig:
    return ClusterConfig.model_validate({**_cpu_only().model_dump(), **changes})


@pytest.mark.parametrize(
    "build",
    [
        lambda: WorkerGroup(**{**_WG, "replicas": 5}),
        lambda: WorkerGroup(**{**_WG, "gpu_type": "NVIDIA-H100-80GB-HBM3"}),  # a GPU type but no GPUs
        lambda: WorkerGroup(**{**_WG, "name": "Bad_Name"}),
        lambda: WorkerGroup(**{**_WG, "memory": "lots"}),
        lambda: _cfg(typo=1),
        lambda: _cfg(env={"MLFLOW_TRACKING_URI": "x"}),
        lambda: _cfg(worker_groups=[_WG, _WG]),
        lambda: ServeApp(model_uri="m", serving={"autoscaling": {"min_replicas": 3, "max_replicas": 2}}),
        lambda: ServeApp(
            model_uri="m", serving={"max_ongoing_requests": 2, "autoscaling": {"target_ongoing_requests": 4}}
        ),
        lambda: ServeApp(model_uri="m", num_gpus_per_replica=1),  # a serving setting outside its section
        lambda: RunsVolume(mount_path="runs"),  # relative
        lambda: RunsVolume(mount_path="/mnt/runs/"),  # not normalized
        lambda: RunsVolume(mount_path="/app"),  # would hide the project
        lambda: RunsVolume(mount_path="/"),
        lambda: RunsVolume(access_mode="ReadOnlyMany"),
        lambda: RunsVolume(claim_name="Runs_Volume"),
        lambda: ray_job_manifest(_cpu_only(), "Job", "echo"),
        lambda: ray_job_manifest(_cpu_only(), "j" * 48, "echo"),
        lambda: ray_service_manifest(_cpu_only(), "s", {"model_uri": "m", "serving": {"num_gpus_per_replica": 1}}),
        lambda: ray_service_manifest(
            _gpu_autoscaling(),
            "s",
            {"model_uri": "m", "serving": {"num_gpus_per_replica": 1, "autoscaling": {"max_replicas": 13}}},
        ),
    ],
)
def test_bad_configs_are_refused(build) -> None:
    with pytest.raises(ValueError):
        build()
