"""Builders of KubeRay (RayCluster, RayJob) and MLflow server manifests, as plain dicts.

Every Ray manifest (the RayService of :mod:`pipelines.kuberay.serve` too) embeds
:func:`ray_cluster_spec`, so one :class:`ClusterConfig` yields consistent clusters for long-lived
use, for a pipeline run and for serving. Containers get the tracking URI,
the storage root and the S3 endpoint as environment and S3 credentials from a Secret (``envFrom``).
The pods that run pipeline code (RayCluster, RayJob) mount the shared runs volume
(:func:`runs_volume_claim`) at the pipeline's ``runs_dir``; serving pods mount it only to serve a
checkpoint folder on it (a registered model is read from MLflow).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelines.kuberay.config import (
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    MLFLOW_PORT,
    SERVE_PORT,
    ClusterConfig,
    WorkerGroup,
    check_name,
)


def _cpu(cores: float) -> str:
    """CPU quantity as a string: whole cores as '4', fractions in millicores ('500m')."""
    if float(cores).is_integer():
        return str(int(cores))
    return f"{round(cores * 1000)}m"


def _labels(instance: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "star-elastic",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
    }


def object_metadata(name: str, namespace: str, component: str) -> dict[str, Any]:
    """``metadata`` of a namespaced object: name, namespace and the project's labels."""
    return {"name": name, "namespace": namespace, "labels": _labels(name, component)}


def _env(cfg: ClusterConfig) -> list[dict[str, str]]:
    """Environment of every Ray container: tracking, storage, S3 endpoint, then the user's extras."""
    env = [
        {"name": "MLFLOW_TRACKING_URI", "value": cfg.mlflow_tracking_uri},
        {"name": "STAR_ELASTIC_STORAGE_URI", "value": cfg.storage_uri},
    ]
    if cfg.s3_endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": cfg.s3_endpoint_url})
    env.extend({"name": key, "value": cfg.env[key]} for key in sorted(cfg.env))
    return env


def _env_from(secret: str | None) -> list[dict[str, Any]]:
    # Not optional: a missing credentials Secret should stop the pod, not surface later as an S3 403.
    return [{"secretRef": {"name": secret}}] if secret else []


RUNS_VOLUME = "runs"  # the pod-level name of the runs volume
RUN_AS_GROUP = 1000  # the images' user (uid 1000, infra/docker); fsGroup makes a fresh volume writable for it


def _pod_template(
    cfg: ClusterConfig,
    role: str,
    cpus: float,
    memory: str,
    gpus: int,
    ports: list[dict[str, Any]],
    mount_runs: bool,
) -> dict[str, Any]:
    """Pod template of a head (``role='ray-head'``) or worker pod; the Ray container must come first.

    ``mount_runs``: mount the runs volume (``cfg.runs_volume``) at its mount path.
    """
    limits: dict[str, str] = {"cpu": _cpu(cpus), "memory": memory}
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)  # extended resources need only a limit; the request defaults to it
    main: dict[str, Any] = {
        "name": role,
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": ports,
        "env": _env(cfg),
        "resources": {"requests": {"cpu": _cpu(cpus), "memory": memory}, "limits": limits},
        # Ray's object store and NCCL use /dev/shm; the container default of 64 MiB is far too small.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if cfg.s3_credentials_secret:
        main["envFrom"] = _env_from(cfg.s3_credentials_secret)
    spec: dict[str, Any] = {
        "containers": [main],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if mount_runs:
        runs = cfg.runs_volume
        main["volumeMounts"].append({"name": RUNS_VOLUME, "mountPath": runs.mount_path})
        spec["volumes"].append({"name": RUNS_VOLUME, "persistentVolumeClaim": {"claimName": runs.claim_name}})
        # OnRootMismatch: change the ownership of the volume's files once, not at every pod start
        spec["securityContext"] = {"fsGroup": RUN_AS_GROUP, "fsGroupChangePolicy": "OnRootMismatch"}
    if cfg.service_account:
        spec["serviceAccountName"] = cfg.service_account
    return {
        "metadata": {"labels": {"app.kubernetes.io/name": "star-elastic", "app.kubernetes.io/component": role}},
        "spec": spec,
    }


def _worker_group_spec(cfg: ClusterConfig, group: WorkerGroup, mount_runs: bool) -> dict[str, Any]:
    ports = [_port("metrics", 8080)]
    template = _pod_template(cfg, "ray-worker", group.cpus, group.memory, group.gpus, ports, mount_runs)
    selector = dict(group.node_selector)
    if group.gpu_type:
        selector[GPU_PRODUCT_LABEL] = group.gpu_type
    if selector:
        template["spec"]["nodeSelector"] = dict(sorted(selector.items()))
    if group.gpus:
        # GPU nodes are usually tainted so that CPU-only pods stay off them.
        template["spec"]["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "groupName": group.name,
        "replicas": group.replicas,
        "minReplicas": group.min_replicas,
        "maxReplicas": group.max_replicas,
        "rayStartParams": {},
        "template": template,
    }


def _port(name: str, number: int) -> dict[str, Any]:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def ray_cluster_spec(cfg: ClusterConfig, mount_runs: bool = True) -> dict[str, Any]:
    """The ``RayClusterSpec`` shared by RayCluster, RayJob (``rayClusterSpec``) and RayService.

    ``mount_runs``: the head and every worker group mount the runs volume (pods that run pipeline code).
    """
    head_params = {"dashboard-host": "0.0.0.0"}
    if cfg.worker_groups:
        # Keep tasks and actors off the head: it hosts the GCS, the dashboard and the job driver.
        head_params["num-cpus"] = "0"
    ports = [
        _port("gcs-server", 6379),
        _port("dashboard", 8265),
        _port("client", 10001),
        _port("serve", SERVE_PORT),
        _port("metrics", 8080),
    ]
    spec: dict[str, Any] = {
        "rayVersion": cfg.ray_version,
        "headGroupSpec": {
            "rayStartParams": head_params,
            "template": _pod_template(cfg, "ray-head", cfg.head_cpus, cfg.head_memory, 0, ports, mount_runs),
        },
        "workerGroupSpecs": [_worker_group_spec(cfg, group, mount_runs) for group in cfg.worker_groups],
    }
    if cfg.autoscaling:
        spec["enableInTreeAutoscaling"] = True
        spec["autoscalerOptions"] = {
            "upscalingMode": "Default",
            "idleTimeoutSeconds": cfg.autoscaler_idle_timeout_s,
            "resources": {
                "requests": {"cpu": "500m", "memory": "512Mi"},
                "limits": {"cpu": "500m", "memory": "512Mi"},
            },
        }
    return spec


def ray_cluster_manifest(cfg: ClusterConfig, name: str) -> dict[str, Any]:
    """A long-lived ``RayCluster`` (submit jobs to it with ``ray job submit``)."""
    check_name("RayCluster", name)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": object_metadata(name, cfg.namespace, "ray-cluster"),
        "spec": ray_cluster_spec(cfg),
    }


def ray_job_manifest(
    cfg: ClusterConfig,
    name: str,
    entrypoint: str,
    shutdown_after_finish: bool = True,
    ttl: int = 3600,
    backoff_limit: int = 1,
    active_deadline_s: int = 7 * 24 * 3600,
) -> dict[str, Any]:
    """A ``RayJob``: the operator creates a cluster from ``cfg``, runs ``entrypoint`` on it, then cleans up.

    ``ttl`` is how long a finished cluster is kept for inspection before deletion (only with
    ``shutdown_after_finish``). ``backoff_limit`` is how many times the operator retries the job on a
    fresh cluster after a failure (a lost node, a preempted pod). ``active_deadline_s`` bounds the
    whole job, retries included, so a hung run cannot hold GPUs for ever.
    """
    check_name("RayJob", name)
    if ttl < 0 or backoff_limit < 0 or active_deadline_s <= 0:
        raise ValueError("ttl and backoff_limit must be >= 0 and active_deadline_s > 0")
    spec: dict[str, Any] = {
        "entrypoint": entrypoint,
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": shutdown_after_finish,
        "backoffLimit": backoff_limit,
        "activeDeadlineSeconds": active_deadline_s,
        "rayClusterSpec": ray_cluster_spec(cfg),
    }
    if shutdown_after_finish:
        spec["ttlSecondsAfterFinished"] = ttl
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": object_metadata(name, cfg.namespace, "ray-job"),
        "spec": spec,
    }


def runs_volume_claim(cfg: ClusterConfig) -> dict[str, Any]:
    """The ``PersistentVolumeClaim`` of ``cfg.runs_volume``, which every pod of the cluster's RayCluster / RayJob
    mounts; create it before them (the pods wait, Pending, until it is bound)."""
    runs = cfg.runs_volume
    spec: dict[str, Any] = {"accessModes": [runs.access_mode], "resources": {"requests": {"storage": runs.size}}}
    if runs.storage_class:
        spec["storageClassName"] = runs.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": object_metadata(runs.claim_name, cfg.namespace, "runs-volume"),
        "spec": spec,
    }


def mlflow_server_manifests(
    namespace: str,
    image: str,
    backend_store_uri: str,
    artifact_root: str,
    *,
    name: str = "mlflow",
    storage_size: str = "20Gi",
    storage_class: str | None = None,
    s3_endpoint_url: str | None = None,
    s3_credentials_secret: str | None = None,
    extra_allowed_hosts: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Deployment + Service + PersistentVolumeClaim for one MLflow tracking server.

    The PVC is mounted at ``/mlflow`` (a SQLite backend store lives there, e.g.
    ``sqlite:////mlflow/mlflow.db``). One replica with the ``Recreate`` strategy because SQLite on a
    ReadWriteOnce volume allows a single writer. Artifacts are proxied by the server
    (``--artifacts-destination``), so clients need no credentials for them.
    """
    check_name("Service", name)
    labels = _labels(name, "mlflow")
    # MLflow rejects Host headers other than localhost and private IPs; clients reach it by the
    # Service's DNS names (with the port), so list those. /health is exempt, so probes alone would
    # not reveal a missing entry.
    hosts = [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]
    hosts += ["localhost", "127.0.0.1", *extra_allowed_hosts]
    allowed = ",".join(h for host in hosts for h in (host, f"{host}:*"))
    command = [
        "mlflow", "server",
        "--host", "0.0.0.0",
        "--port", str(MLFLOW_PORT),
        "--backend-store-uri", backend_store_uri,
        "--artifacts-destination", artifact_root,
        "--workers", "1",
        "--allowed-hosts", allowed,
    ]  # fmt: skip
    env = [{"name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "false"}]
    if s3_endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": s3_endpoint_url})
    container: dict[str, Any] = {
        "name": "mlflow",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "ports": [{"name": "http", "containerPort": MLFLOW_PORT, "protocol": "TCP"}],
        "env": env,
        # The first start creates and migrates the database (tens of seconds); the startup probe gives it
        # five minutes before the liveness probe may restart the container.
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 20, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/mlflow"}],
    }
    if s3_credentials_secret:
        container["envFrom"] = _env_from(s3_credentials_secret)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    # The images run as uid 1000; fsGroup makes the fresh volume writable for it.
                    "securityContext": {"fsGroup": 1000},
                    "containers": [container],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": name}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "type": "ClusterIP",
            "selector": dict(labels),
            "ports": [{"name": "http", "port": MLFLOW_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    pvc_spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage_size}}}
    if storage_class:
        pvc_spec["storageClassName"] = storage_class
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": pvc_spec,
    }
    return [deployment, service, pvc]
