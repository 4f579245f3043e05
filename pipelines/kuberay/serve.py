"""The serving application on Kubernetes: a RayService whose Serve config comes from a :class:`ServingConfig`.

Design choices:

* A declarative Serve config (``serveConfigV2``) overrides the options the application's builder
  sets, so every deployment option written there is derived from the one :class:`ServingConfig`
  (:meth:`~components.serving.config.ServingConfig.deployment_options`, the same call
  ``star-elastic serve`` makes), never typed in a second time. In particular Serve's
  ``max_ongoing_requests`` stays above what a replica admits, so that overload reaches the replica
  and is answered with its JSON 503 instead of queueing at the proxy.
* The same settings travel to the replicas as the application's ``config`` argument, so the limits
  Serve routes by and the limits each replica enforces cannot disagree.
* Two deployments: the ingress that answers HTTP (no model, no CPU reserved) and the model replicas
  behind it, so a replica's death is answered by the ingress (JSON 503s, ``/health`` saying 503), not
  by the proxy. Kubernetes probes stay KubeRay's own (the Serve proxy's ``/-/healthz`` on the workers,
  the raylet on every pod): they check the pod, never a replica that Serve replaces by itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from components.serving.config import APP_NAME, ServingConfig
from pipelines.kuberay.config import SERVE_PORT, ClusterConfig, check_name
from pipelines.kuberay.manifests import object_metadata, ray_cluster_spec


class ServeApp(BaseModel):
    """The Ray Serve application a RayService runs: one weight copy per replica, every budget as a model id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_uri: str = Field(description="Nested checkpoint to serve: an MLflow models:/ URI, s3:// or a path.")
    import_path: str = Field(default="components.serving.app:build_app", description="Serve application builder.")
    route_prefix: str = Field(default="/", description="HTTP route of the application.")
    serving: ServingConfig = Field(
        default_factory=ServingConfig,
        description="The serving settings (a pipeline config's serve section): request limits, admission, "
        "replica resources and autoscaling; the Serve deployment options are derived from them.",
    )


def serve_deploy_config(app: ServeApp) -> dict[str, Any]:
    """Ray Serve's declarative config (the ``serve deploy`` schema) for the one ``star-elastic`` application."""
    # Only the settings that differ from the defaults: the replica fills in the rest from the same class.
    settings = app.serving.model_dump(mode="json", exclude_defaults=True)
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": app.route_prefix,
                "import_path": app.import_path,
                "args": {"model_uri": app.model_uri, **({"config": settings} if settings else {})},
                # the ingress (HTTP, probes, 503s for a dead replica) and the model replicas behind it
                "deployments": [app.serving.ingress_options(), app.serving.deployment_options()],
            }
        ],
    }


def _on_runs_volume(model_uri: str, cfg: ClusterConfig) -> bool:
    mount = cfg.runs_volume.mount_path.rstrip("/") + "/"
    return model_uri.startswith(mount)


def ray_service_manifest(cfg: ClusterConfig, name: str, serve_config: Mapping[str, Any] | ServeApp) -> dict[str, Any]:
    """A ``RayService``: a cluster from ``cfg`` running the Serve app described by ``serve_config``.

    ``serve_config`` is a :class:`ServeApp` or a dict of its fields (at least ``model_uri``). Serve
    autoscaling adds replicas; the Ray autoscaler (``cfg.autoscaling``) adds the pods they need.
    """
    check_name("RayService", name)
    app = serve_config if isinstance(serve_config, ServeApp) else ServeApp.model_validate(dict(serve_config))
    serving = app.serving
    needed = serving.num_gpus_per_replica * serving.autoscaling.max_replicas
    if needed > cfg.max_gpus:
        raise ValueError(
            f"serving.autoscaling.max_replicas = {serving.autoscaling.max_replicas} replicas x "
            f"{serving.num_gpus_per_replica} GPUs need {needed:g} GPUs, but the cluster has at most {cfg.max_gpus}; "
            "replicas beyond that would stay pending forever: lower max_replicas or add GPU workers"
        )
    spec = {
        "serveConfigV2": yaml.safe_dump(serve_deploy_config(app), sort_keys=False),
        # replicas load from MLflow or S3; a checkpoint folder on the runs volume needs the volume
        "rayClusterConfig": ray_cluster_spec(cfg, mount_runs=_on_runs_volume(app.model_uri, cfg)),
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": object_metadata(name, cfg.namespace, "ray-service"),
        "spec": spec,
    }
