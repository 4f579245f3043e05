"""Kubernetes manifests (KubeRay RayCluster / RayJob / RayService, MLflow server) built from one typed config.

Design choices:

- One pydantic :class:`ClusterConfig` describes a Ray cluster (image, head, worker groups, autoscaling,
  storage and tracking endpoints). The RayCluster, the RayJob and the RayService all embed the cluster
  spec built from it, so the three cannot drift apart.
- Builders return plain dicts (no Kubernetes client needed). The committed files under ``infra/k8s/``
  are rendered from them by :func:`write_manifests`, and a test regenerates them and fails when they
  differ, so the YAML is never edited by hand.
- Quantities are always emitted as strings: KubeRay's CRDs declare them ``int-or-string``, so a YAML
  float such as ``0.5`` is rejected by the API server while ``"500m"`` is accepted.
- Names are checked against what the KubeRay operator enforces (DNS-1035 labels, lengths that leave
  room for the suffix it appends), so a bad name fails here instead of in the cluster.

Modules: ``config`` (the pydantic models), ``manifests`` (the builders), ``render`` (the committed
defaults, YAML rendering and the command line). Regenerate the committed files with
``python -m components.kuberay infra/k8s``.
"""

from components.kuberay.config import ClusterConfig, ServeApp, ServeAutoscaling, WorkerGroup
from components.kuberay.manifests import (
    mlflow_server_manifests,
    ray_cluster_manifest,
    ray_cluster_spec,
    ray_job_manifest,
    ray_service_manifest,
    serve_deploy_config,
)
from components.kuberay.render import (
    demo_cluster_config,
    main,
    real_cluster_config,
    real_serve_app,
    render_manifests,
    stale_manifests,
    to_yaml,
    write_manifests,
)

__all__ = [
    "ClusterConfig",
    "ServeApp",
    "ServeAutoscaling",
    "WorkerGroup",
    "demo_cluster_config",
    "main",
    "mlflow_server_manifests",
    "ray_cluster_manifest",
    "ray_cluster_spec",
    "ray_job_manifest",
    "ray_service_manifest",
    "real_cluster_config",
    "real_serve_app",
    "render_manifests",
    "serve_deploy_config",
    "stale_manifests",
    "to_yaml",
    "write_manifests",
]
