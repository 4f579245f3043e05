"""The committed manifests (a CPU demo cluster and a real-scale GPU cluster) and their YAML rendering.

``star-elastic kuberay render infra/k8s`` rewrites ``infra/k8s/``; ``--check`` only compares, for CI.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Any

import yaml

from components.serving.config import AutoscalingSettings, ServingConfig
from pipelines.kuberay.config import (
    DEFAULT_NAMESPACE,
    IMAGE_WORKDIR,
    MLFLOW_PORT,
    ClusterConfig,
    RunsVolume,
    WorkerGroup,
)
from pipelines.kuberay.manifests import (
    mlflow_server_manifests,
    ray_cluster_manifest,
    ray_job_manifest,
    runs_volume_claim,
)
from pipelines.kuberay.serve import ServeApp, ray_service_manifest


def _image(registry: str, flavour: str) -> str:
    # Tagged with the project version so a node never runs a stale image cached under a moving tag.
    return f"{registry.rstrip('/') + '/' if registry else ''}star-elastic:{_dist_version('star-elastic')}-{flavour}"


def _tracking_uri(namespace: str) -> str:
    return f"http://mlflow.{namespace}.svc.cluster.local:{MLFLOW_PORT}"


def demo_cluster_config(registry: str = "", namespace: str = DEFAULT_NAMESPACE) -> ClusterConfig:
    """A small CPU-only cluster (two fixed workers) for a laptop cluster such as kind or minikube.

    Its runs volume is ReadWriteOnce, which every pod can mount on a one-node cluster (the access mode
    is per node) and which the local-path class of kind accepts; demo.yaml's relative ``runs`` is
    ``/app/runs`` in the pods.
    """
    runs = RunsVolume(
        claim_name="star-elastic-runs-demo",
        mount_path=f"{IMAGE_WORKDIR}/runs",
        size="10Gi",
        access_mode="ReadWriteOnce",
    )
    return ClusterConfig(
        image=_image(registry, "cpu"),
        namespace=namespace,
        head_cpus=2,
        head_memory="4Gi",
        worker_groups=[WorkerGroup(name="cpu", replicas=2, min_replicas=2, max_replicas=2, cpus=4, memory="8Gi")],
        storage_uri="s3://star-elastic/runs",
        mlflow_tracking_uri=_tracking_uri(namespace),
        runs_volume=runs,
    )


def real_cluster_config(registry: str = "", namespace: str = DEFAULT_NAMESPACE) -> ClusterConfig:
    """Real scale: 8 x H100 per worker node, autoscaled between 1 and 8 nodes, artifacts on S3.

    8 nodes hold the 64 one-GPU distillation workers of ``pipelines/configs/real.yaml``; ``star-elastic
    plan pipelines/configs/real.yaml`` gives their memory per GPU. The run folders live on a ReadWriteMany
    volume at real.yaml's ``runs_dir`` (/mnt/runs): about 0.3 TB per run (the permuted parent, both phase
    outputs and the nested checkpoint at 63 GB each in bf16, its FP8 and NVFP4 copies), so 2 TiB holds several.
    """
    gpu = WorkerGroup(
        name="gpu-h100",
        replicas=1,
        min_replicas=1,
        max_replicas=8,
        cpus=96,
        memory="960Gi",
        gpus=8,
        gpu_type="NVIDIA-H100-80GB-HBM3",
    )
    return ClusterConfig(
        image=_image(registry, "cuda"),
        namespace=namespace,
        head_cpus=8,
        head_memory="32Gi",
        worker_groups=[gpu],
        autoscaling=True,
        env={"NCCL_DEBUG": "WARN", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        storage_uri="s3://star-elastic/runs",
        mlflow_tracking_uri=_tracking_uri(namespace),
        runs_volume=RunsVolume(claim_name="star-elastic-runs", mount_path="/mnt/runs", size="2Ti"),
    )


def cluster_config(kind: str, registry: str = "", namespace: str = DEFAULT_NAMESPACE) -> ClusterConfig:
    """The ``demo`` or ``real`` cluster config, its images under ``registry``, its objects in ``namespace``."""
    makers = {"demo": demo_cluster_config, "real": real_cluster_config}
    if kind not in makers:
        raise ValueError(f"cluster {kind!r}: expected one of {sorted(makers)}")
    return makers[kind](registry, namespace)


def real_serve_app() -> ServeApp:
    """Serving the registered model: one GPU per replica, 2 to 16 replicas (two of the eight nodes).

    Two replicas at least, and two ingress replicas, so that one replica's death leaves one serving."""
    serving = ServingConfig(
        num_cpus_per_replica=8,
        num_gpus_per_replica=1,
        ingress_replicas=2,
        autoscaling=AutoscalingSettings(min_replicas=2, max_replicas=16, target_ongoing_requests=8),
    )
    return ServeApp(model_uri="models:/star-elastic@champion", serving=serving)  # the alias the gate moves


class _Dumper(yaml.SafeDumper):
    """Block-style YAML, multi-line strings as literal blocks, and no anchors for repeated sub-trees."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


COMMITTED_HEADER = "Generated by `star-elastic kuberay render infra/k8s`; edit pipelines/kuberay/, not this file."


def to_yaml(docs: Sequence[Mapping[str, Any]], header: str = COMMITTED_HEADER) -> str:
    """Render manifests as one (multi-document) YAML text under a one-line ``# header``."""
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)
    return f"# {header}\n" + body


def train_workers(pipeline_yaml: str | Path) -> dict[str, tuple[int, str]]:
    """Ray Train workers of each distillation phase of a pipeline YAML: section -> (workers, "GPU" or "CPU").

    A Ray Train worker group is placed all at once (one GPU, or one CPU, per worker), so the cluster must
    hold every worker of a phase together. Each section is read through the pipeline's section class, so
    unset fields take the stage's defaults and a malformed section fails naming its YAML path.
    """
    from pydantic import ValidationError

    from pipelines.config import ConfigError, DistillSection, PipelineConfig, describe, read_yaml

    data = read_yaml(pipeline_yaml)
    out, problems = {}, []
    for section in ("distill_phase1", "distill_phase2"):
        try:
            phase = DistillSection.model_validate(data.get(section) or {})
        except ValidationError as err:
            problems += describe(err, (section,), PipelineConfig)
            continue
        out[section] = (phase.num_workers, "GPU" if phase.use_gpu else "CPU")
    if problems:
        raise ConfigError(pipeline_yaml, problems)
    return out


def check_cluster_holds(cfg: ClusterConfig, pipeline_yaml: str | Path, job: str) -> None:
    """Raise ``ValueError`` when a phase of ``pipeline_yaml`` asks for more workers than ``cfg`` can ever hold."""
    for section, (workers, resource) in train_workers(pipeline_yaml).items():
        if resource == "GPU":
            capacity = cfg.max_gpus
            shape = ", ".join(f"{g.max_replicas} nodes x {g.gpus} GPUs ({g.name})" for g in cfg.worker_groups if g.gpus)
        else:
            capacity = int(sum(g.cpus * g.max_replicas for g in cfg.worker_groups))
            shape = ", ".join(f"{g.max_replicas} nodes x {g.cpus:g} CPUs ({g.name})" for g in cfg.worker_groups)
        if workers > capacity:
            raise ValueError(
                f"{pipeline_yaml}: {section}.num_workers = {workers} {resource} workers, but the cluster of RayJob "
                f"{job!r} holds at most {capacity} {resource}s ({shape or 'no worker group'}); lower num_workers or "
                "raise the worker group's max_replicas in pipelines/kuberay/render.py"
            )


def pipeline_runs_dir(pipeline_yaml: str | Path) -> tuple[str, str]:
    """(``runs_dir`` as the pipeline YAML writes it (or its default), the absolute path it is in the pods).

    A relative ``runs_dir`` resolves against the images' working directory, where the RayJob's entrypoint runs.
    """
    from pipelines.config import PipelineConfig, read_yaml

    raw = str(read_yaml(pipeline_yaml).get("runs_dir") or PipelineConfig.model_fields["runs_dir"].default)
    return raw, posixpath.normpath(posixpath.join(IMAGE_WORKDIR, raw))


def check_runs_volume(cfg: ClusterConfig, pipeline_yaml: str | Path, job: str) -> None:
    """Raise ``ValueError`` unless the pods of RayJob ``job`` mount the runs volume at ``pipeline_yaml``'s runs_dir:
    the driver on the head names folders there that tasks and training workers on other pods read and write."""
    raw, in_pods = pipeline_runs_dir(pipeline_yaml)
    runs = cfg.runs_volume
    if in_pods != runs.mount_path:
        shown = raw if raw == in_pods else f"{raw!r} ({in_pods} in the pods)"
        raise ValueError(
            f"{pipeline_yaml}: runs_dir = {shown}, but the cluster of RayJob {job!r} mounts its runs volume "
            f"{runs.claim_name!r} at {runs.mount_path}; set runs_dir: {runs.mount_path} in {pipeline_yaml}, or "
            "runs_volume.mount_path in pipelines/kuberay/render.py"
        )


PIPELINE_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
"""The shipped pipeline configs the committed RayJobs run (as /app/pipelines/configs/ in the image)."""


DEMO_JOB, REAL_JOB = "star-elastic-demo", "star-elastic-pipeline"  # the RayJobs running demo.yaml and real.yaml


def render_manifests(demo_cfg: ClusterConfig, real_cfg: ClusterConfig) -> dict[str, str]:
    """File name -> YAML text of every committed manifest.

    Raises ``ValueError`` when a RayJob's pipeline config asks for more training workers than its cluster holds,
    or writes its runs somewhere other than where its cluster mounts the runs volume.
    """
    for cfg, config, job in ((demo_cfg, "demo.yaml", DEMO_JOB), (real_cfg, "real.yaml", REAL_JOB)):
        check_cluster_holds(cfg, PIPELINE_CONFIGS / config, job)
        check_runs_volume(cfg, PIPELINE_CONFIGS / config, job)
    mlflow = mlflow_server_manifests(
        real_cfg.namespace,
        demo_cfg.image,  # the server needs the project's Python packages, not CUDA
        backend_store_uri="sqlite:////mlflow/mlflow.db",
        artifact_root="s3://star-elastic/mlflow-artifacts",
        s3_endpoint_url=real_cfg.s3_endpoint_url,
        s3_credentials_secret=real_cfg.s3_credentials_secret,
    )
    docs: dict[str, list[dict[str, Any]]] = {
        "raycluster-cpu.yaml": [ray_cluster_manifest(demo_cfg, "star-elastic-cpu")],
        "rayjob-demo.yaml": [ray_job_manifest(demo_cfg, DEMO_JOB, "star-elastic run /app/pipelines/configs/demo.yaml")],
        "runs-volume-cpu.yaml": [runs_volume_claim(demo_cfg)],
        "raycluster-gpu.yaml": [ray_cluster_manifest(real_cfg, "star-elastic-gpu")],
        "rayjob-pipeline.yaml": [
            ray_job_manifest(real_cfg, REAL_JOB, "star-elastic run /app/pipelines/configs/real.yaml")
        ],
        "runs-volume-gpu.yaml": [runs_volume_claim(real_cfg)],
        "rayservice.yaml": [ray_service_manifest(real_cfg, "star-elastic-serve", real_serve_app())],
        "mlflow.yaml": mlflow,
    }
    return {name: to_yaml(manifests) for name, manifests in docs.items()}


def write_manifests(out_dir: str | Path, demo_cfg: ClusterConfig, real_cfg: ClusterConfig) -> list[Path]:
    """Write every manifest of :func:`render_manifests` into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_manifests(demo_cfg, real_cfg).items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


def stale_manifests(out_dir: str | Path, demo_cfg: ClusterConfig, real_cfg: ClusterConfig) -> list[str]:
    """Names of the files in ``out_dir`` that are missing or differ from a fresh rendering."""
    out = Path(out_dir)
    rendered = render_manifests(demo_cfg, real_cfg)
    return [name for name, text in rendered.items() if not (out / name).is_file() or (out / name).read_text() != text]
