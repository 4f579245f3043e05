"""Typed configuration of a Ray cluster on Kubernetes.

Every model forbids unknown fields, so a typo in a YAML or CLI override fails at load time. The checks
mirror what the API server or the KubeRay operator would reject later (label syntax, replica bounds,
name lengths), so a bad config fails before anything is applied.
"""

from __future__ import annotations

import posixpath
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_NAMESPACE = "star-elastic"
MLFLOW_PORT = 5000
SERVE_PORT = 8000
# Environment the builder owns; ``ClusterConfig.env`` may not override these.
RESERVED_ENV = ("MLFLOW_TRACKING_URI", "STAR_ELASTIC_STORAGE_URI", "AWS_ENDPOINT_URL")
# The operator appends a 6-character suffix to RayJob / RayService names to name their cluster,
# and the cluster name itself is capped at 53 (it becomes part of Service names).
_MAX_NAME = {"RayCluster": 53, "RayJob": 47, "RayService": 47}
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
GPU_RESOURCE = "nvidia.com/gpu"
# Node label published by NVIDIA GPU feature discovery; used to pin a group to one GPU model.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# The images' WORKDIR (infra/docker): the project lives there, and a pipeline's relative runs_dir resolves there.
IMAGE_WORKDIR = "/app"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerGroup(_Strict):
    """One KubeRay worker group: identical pods, scaled between ``min_replicas`` and ``max_replicas``."""

    name: str = Field(description="Group name (DNS-1123 label); also the Ray node type name.")
    replicas: int = Field(ge=0, description="Pods at creation (and always, when autoscaling is off).")
    min_replicas: int = Field(ge=0, description="Fewest pods the autoscaler keeps.")
    max_replicas: int = Field(ge=1, description="Most pods the autoscaler may create.")
    cpus: float = Field(ge=0.001, description="CPU cores per pod (request = limit; Ray reads the limit).")
    memory: str = Field(pattern=_QUANTITY, description="Memory per pod as a Kubernetes quantity, e.g. '64Gi'.")
    gpus: int = Field(default=0, ge=0, description="NVIDIA GPUs per pod, requested as nvidia.com/gpu.")
    gpu_type: str | None = Field(
        default=None, description="GPU product label value (e.g. 'NVIDIA-H100-80GB-HBM3') the pods must land on."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Extra node labels the pods require.")

    @field_validator("name")
    @classmethod
    def _name_is_label(cls, value: str) -> str:
        if not _DNS1123.match(value) or len(value) > 63:
            raise ValueError(f"worker group name {value!r} must be a DNS-1123 label")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> WorkerGroup:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"worker group {self.name!r}: need min_replicas <= replicas <= max_replicas, "
                f"got {self.min_replicas} <= {self.replicas} <= {self.max_replicas}"
            )
        if self.gpu_type and not self.gpus:
            raise ValueError(f"worker group {self.name!r}: gpu_type is set but gpus is 0")
        return self


class RunsVolume(_Strict):
    """The volume holding the pipeline's run folders (``runs_dir``), mounted into every Ray pod.

    The driver (on the head) names folders under ``runs_dir``; the stage tasks and the distillation
    workers on the worker pods read and write them (the rank stage's permuted parent, each phase's
    output, the exported and quantized checkpoints). So head and workers mount one claim at one path.
    """

    claim_name: str = Field(
        default="star-elastic-runs",
        description="PersistentVolumeClaim holding the run folders (written to runs-volume-*.yaml beside the "
        "cluster); head and worker pods mount it at mount_path.",
    )
    mount_path: str = Field(
        default="/mnt/runs",
        description="Where every Ray pod mounts the claim: the runs_dir of the pipeline config its RayJob runs "
        f"(a relative runs_dir resolves against the image's working directory {IMAGE_WORKDIR}).",
    )
    size: str = Field(default="2Ti", pattern=_QUANTITY, description="Storage the claim requests, e.g. '2Ti'.")
    storage_class: str | None = Field(
        default=None,
        description="StorageClass of the claim; with ReadWriteMany it must be a shared filesystem (NFS, CephFS, "
        "EFS, Filestore, Azure Files). None: the cluster's default class.",
    )
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        default="ReadWriteMany",
        description="ReadWriteMany: pods on every node mount it (any multi-node cluster). ReadWriteOnce only where "
        "every Ray pod runs on one node (a one-node kind or minikube cluster, whose local-path class refuses "
        "ReadWriteMany).",
    )

    @field_validator("claim_name")
    @classmethod
    def _claim_is_label(cls, value: str) -> str:
        if not _DNS1123.match(value) or len(value) > 63:
            raise ValueError(f"runs_volume.claim_name {value!r} must be a DNS-1123 label")
        return value

    @field_validator("mount_path")
    @classmethod
    def _mount_path(cls, value: str) -> str:
        if not value.startswith("/") or posixpath.normpath(value) != value:
            raise ValueError(f"runs_volume.mount_path {value!r} must be an absolute, normalized path, e.g. /mnt/runs")
        for taken in (IMAGE_WORKDIR, "/dev/shm"):
            if taken == value or taken.startswith(value.rstrip("/") + "/"):
                raise ValueError(
                    f"runs_volume.mount_path {value!r} would hide {taken} (the project or the shared-memory mount); "
                    f"mount it elsewhere, e.g. /mnt/runs or {IMAGE_WORKDIR}/runs"
                )
        return value


class ClusterConfig(_Strict):
    """Everything a Ray cluster on Kubernetes needs; the single source of the KubeRay manifests."""

    image: str = Field(description="Container image for head and workers (the project installed, Ray inside).")
    namespace: str = Field(default=DEFAULT_NAMESPACE, description="Namespace every object is created in.")
    head_cpus: float = Field(ge=0.001, description="CPU cores of the head pod (millicore steps).")
    head_memory: str = Field(pattern=_QUANTITY, description="Memory of the head pod, e.g. '16Gi'.")
    worker_groups: list[WorkerGroup] = Field(default_factory=list, description="Worker groups; empty = head only.")
    autoscaling: bool = Field(default=False, description="Run the in-tree Ray autoscaler (scales worker pods).")
    autoscaler_idle_timeout_s: int = Field(default=60, ge=0, description="Idle seconds before a worker is removed.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every Ray container.")
    storage_uri: str = Field(description="Root URI for run artifacts (s3://bucket/prefix on a real cluster).")
    mlflow_tracking_uri: str = Field(description="MLflow server URL reachable from the pods.")
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint; None = AWS S3 itself.")
    s3_credentials_secret: str | None = Field(
        default="star-elastic-s3",
        description="Secret whose keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) become environment; "
        "None when pods get credentials another way (e.g. workload identity).",
    )
    service_account: str | None = Field(default=None, description="ServiceAccount the pods run as.")
    runs_volume: RunsVolume = Field(
        default_factory=RunsVolume,
        description="Shared volume of the run folders, mounted at the pipeline's runs_dir on the head and on every "
        "worker group, so a task or a training worker on any node sees the folders the driver names.",
    )
    ray_version: str = Field(default="2.60.0", description="Ray version inside the image (the operator reads it).")

    @field_validator("namespace")
    @classmethod
    def _namespace_is_label(cls, value: str) -> str:
        if not _DNS1123.match(value) or len(value) > 63:
            raise ValueError(f"namespace {value!r} must be a DNS-1123 label")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ValueError(f"environment variable name {key!r} is not a C identifier")
            if key in RESERVED_ENV:
                raise ValueError(f"{key} is set from its own field; do not put it in env")
        return value

    @model_validator(mode="after")
    def _unique_groups(self) -> ClusterConfig:
        names = [group.name for group in self.worker_groups]
        if len(names) != len(set(names)):
            raise ValueError(f"worker group names must be unique, got {names}")
        return self

    @property
    def max_gpus(self) -> int:
        """GPUs available when every group is scaled to its maximum."""
        return sum(group.gpus * group.max_replicas for group in self.worker_groups)


def check_name(kind: str, name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a DNS-1035 label short enough for an object of ``kind``."""
    limit = _MAX_NAME.get(kind, 63)
    if not _DNS1035.match(name) or len(name) > limit:
        raise ValueError(f"{kind} name {name!r} must be a DNS-1035 label of at most {limit} characters")
