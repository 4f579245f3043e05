"""The pipeline's DAG compiled for Kubeflow Pipelines v2: one step per stage, each submitting a RayJob.

A step creates a KubeRay RayJob (:func:`pipelines.kuberay.manifests.ray_job_manifest`) whose
entrypoint is ``star-elastic kfp run-stage`` and polls it (``executor="local"`` runs the stage in
the step). One lightweight component serves every stage, copied under each stage's name; steps pass
stage folder URIs, so every DAG edge is a data dependency. The DAG is ``pipeline_stages()``; the
config travels as parameters derived from ``PipelineConfig``; Kubeflow's cache is off.

Design notes: docs/kubernetes.md ("The Kubeflow pipeline").
"""

# No ``from __future__ import annotations``: kfp reads the pipeline's parameter types from live
# annotations, and postponed (string) annotations would be taken as artifact types.
import base64
import copy
import hashlib
import inspect
import json
import re
import shlex
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from pipelines.kfp_components import (
    DEFAULT_STAGES_MODULE,
    check_upstream,
    load_stages,
    run_stage_only,
    sanitize_run_key,
    stage_uri,
)
from pipelines.kfp_params import config_from_parameters, config_parameters, parameter_defaults, step_function
from pipelines.kuberay.config import DEFAULT_NAMESPACE, ClusterConfig
from pipelines.runner import StageSpec, topological

PIPELINE_NAME = "star-elastic"
MAX_UPSTREAM = 4  # input slots of the step component; a stage with more direct dependencies is refused
UPSTREAM = tuple(f"upstream_{i}" for i in range(1, MAX_UPSTREAM + 1))
DEFAULT_TIMEOUT_S = 7 * 24 * 3600  # per stage, as ray_job_manifest's default deadline
EXECUTORS = ("rayjob", "local")
# The images' WORKDIR (infra/docker): relative config paths (runs/, pipelines/assets/...) resolve there.
IMAGE_WORKDIR = "/app"
# Inputs of every step besides the config parameters and the upstream URIs.
STEP_INPUTS: tuple[tuple[str, type], ...] = (
    ("stage", str),
    ("executor", str),
    ("cluster", str),
    ("stages_module", str),
    ("run_key", str),
    ("tracking", bool),
    ("timeout_s", int),
)


def run_step(
    stage: str,
    executor: str,
    cluster: str,
    stages_module: str,
    run_key: str,
    tracking: bool,
    timeout_s: int,
    **inputs: Any,
) -> str:
    """Body of every step: the config from its parameters, then the stage (as a RayJob, or in this pod).

    ``inputs``: the config parameters and ``upstream_1`` ... (the URIs of the direct upstream stages).
    Returns the URI of the stage's output folder.
    """
    upstream = [inputs.pop(slot) for slot in UPSTREAM if slot in inputs]
    text = yaml.safe_dump(config_from_parameters(inputs), sort_keys=False)
    return execute_step(
        stage,
        text,
        executor=executor,
        cluster_json=cluster,
        stages_module=stages_module,
        run_key=run_key,
        tracking=tracking,
        timeout_s=timeout_s,
        upstream=[uri for uri in upstream if uri],
    )


# ---------------------------------------------------------------------- a step on Kubernetes
def rayjob_name(stage: str, run_key: str) -> str:
    """A DNS-1035 RayJob name, unique per (Kubeflow run, stage) and stable across retries of the step."""
    digest = hashlib.sha256(f"{run_key}/{stage}".encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9-]", "-", stage.lower()).strip("-")[:32] or "stage"
    return f"se-{slug}-{digest}"


def stage_entrypoint(
    stage: str,
    config_text: str,
    *,
    storage_uri: str,
    stages_module: str,
    run_key: str,
    tracking: bool,
    upstream: Sequence[str],
    workdir: str = IMAGE_WORKDIR,
) -> str:
    """The RayJob entrypoint: ``star-elastic kfp run-stage ...``, the config inline as base64.

    KubeRay pastes the entrypoint into a shell script, so it is one simple command with every word
    quoted; the config travels inline so that the job needs nothing but the image and the storage.
    """
    argv = ["star-elastic", "kfp", "run-stage", stage, "--workdir", workdir]
    argv += ["--config-b64", base64.b64encode(config_text.encode()).decode()]
    argv += ["--storage-uri", storage_uri, "--stages-module", stages_module, "--run-key", run_key]
    if not tracking:
        argv.append("--no-tracking")
    for uri in upstream:
        argv += ["--upstream", uri]
    return shlex.join(argv)


def custom_objects_api() -> Any:
    """A ``CustomObjectsApi`` from the pod's service account, else from the local kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError as err:  # pragma: no cover - kfp depends on it
        raise ImportError("submitting RayJobs needs the kubernetes client: pip install kubernetes") from err
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()


class RayJobFailed(RuntimeError):
    """The RayJob of a stage ended without success."""


def _state(obj: Mapping[str, Any]) -> str:
    """'succeeded', 'failed' or 'running' from a RayJob's status."""
    status = obj.get("status") or {}
    deployment, job = status.get("jobDeploymentStatus", ""), status.get("jobStatus", "")
    if job == "SUCCEEDED":
        return "succeeded"
    # A FAILED jobStatus alone is not final: with backoffLimit the operator retries on a new cluster.
    if deployment == "Failed" or (deployment == "Complete" and job in ("FAILED", "STOPPED")):
        return "failed"
    return "running"


_GROUP, _VERSION, _PLURAL = "ray.io", "v1", "rayjobs"


def submit_rayjob(api: Any, manifest: Mapping[str, Any], log: Callable[[str], None] = print) -> None:
    """Create the RayJob; an existing one of that name (a retried step) is adopted, or replaced if it failed."""
    from kubernetes.client.rest import ApiException

    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        api.create_namespaced_custom_object(_GROUP, _VERSION, namespace, _PLURAL, dict(manifest))
        log(f"created RayJob {namespace}/{name}")
        return
    except ApiException as err:
        if err.status != 409:
            raise
    existing = api.get_namespaced_custom_object(_GROUP, _VERSION, namespace, _PLURAL, name)
    if _state(existing) != "failed":
        log(f"RayJob {namespace}/{name} exists; following it")
        return
    log(f"RayJob {namespace}/{name} failed before; replacing it")
    api.delete_namespaced_custom_object(_GROUP, _VERSION, namespace, _PLURAL, name)
    for _ in range(120):
        try:
            api.get_namespaced_custom_object(_GROUP, _VERSION, namespace, _PLURAL, name)
        except ApiException as err:
            if err.status == 404:
                break
            raise
        time.sleep(1)
    api.create_namespaced_custom_object(_GROUP, _VERSION, namespace, _PLURAL, dict(manifest))


def wait_for_rayjob(
    api: Any,
    namespace: str,
    name: str,
    timeout_s: float,
    poll_s: float = 15.0,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll the RayJob until it succeeds (returns its status) or fails (raises :class:`RayJobFailed`).

    On timeout the RayJob is deleted, so that a hung stage does not keep its cluster, and
    ``TimeoutError`` is raised.
    """
    deadline = clock() + timeout_s
    seen = None
    errors = 0
    while True:
        try:
            obj = api.get_namespaced_custom_object(_GROUP, _VERSION, namespace, _PLURAL, name)
            errors = 0
        except Exception as err:
            # A stage may run for days: ride out an API server restart, but not a deleted job or lost access.
            errors += 1
            if errors > 5 or getattr(err, "status", None) in (401, 403, 404):
                raise
            log(f"RayJob {namespace}/{name}: status unavailable ({type(err).__name__}); retrying")
            sleep(poll_s)
            continue
        status = obj.get("status") or {}
        now = (status.get("jobDeploymentStatus", "-"), status.get("jobStatus", "-"))
        if now != seen:
            log(f"RayJob {namespace}/{name}: deployment {now[0]}, job {now[1]}")
            seen = now
        state = _state(obj)
        if state == "succeeded":
            return status
        if state == "failed":
            reason = status.get("reason") or now[0]
            message = status.get("message") or "no message"
            raise RayJobFailed(
                f"RayJob {namespace}/{name} failed ({reason}): {message}; "
                f"driver logs: kubectl -n {namespace} logs job/{name}"
            )
        if clock() >= deadline:
            api.delete_namespaced_custom_object(_GROUP, _VERSION, namespace, _PLURAL, name)
            raise TimeoutError(f"RayJob {namespace}/{name} did not finish in {timeout_s:.0f}s; deleted it")
        sleep(poll_s)


def execute_step(
    stage: str,
    config_text: str,
    *,
    executor: str = "rayjob",
    cluster_json: str = "",
    stages_module: str = DEFAULT_STAGES_MODULE,
    run_key: str = "",
    tracking: bool = True,
    timeout_s: int = DEFAULT_TIMEOUT_S,
    upstream: Sequence[str] = (),
    api: Any = None,
    poll_s: float = 15.0,
) -> str:
    """Run ``stage`` of the pipeline YAML ``config_text`` with ``executor``; returns the URI of the stage's folder."""
    from pipelines.config import load_pipeline_config

    if executor not in EXECUTORS:
        raise ValueError(f"executor: {executor!r} is not one of {EXECUTORS}; set the executor parameter to one of them")
    text = config_text
    run_key = sanitize_run_key(run_key) or sanitize_run_key(hashlib.sha256(text.encode()).hexdigest())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text)
        if executor == "local":
            result = run_stage_only(
                path, stage, stages_module=stages_module, run_key=run_key, tracking=tracking, upstream=upstream
            )
            print(json.dumps({"stage": stage, "status": result.status, "uri": result.uri}))
            return result.uri
        cfg = load_pipeline_config(path)  # a broken config fails here, before any cluster starts
    from components.storage import is_s3
    from pipelines.kuberay.manifests import ray_job_manifest

    check_upstream(load_stages(stages_module), stage, upstream)
    cluster = ClusterConfig.model_validate_json(cluster_json)
    root = cfg.storage_uri or cluster.storage_uri
    if not is_s3(root):
        raise ValueError(f"executor 'rayjob' needs an s3:// storage root, got {root!r}: outputs must outlive the job")
    name = rayjob_name(stage, run_key)
    entrypoint = stage_entrypoint(
        stage,
        text,
        storage_uri=root,
        stages_module=stages_module,
        run_key=run_key,
        tracking=tracking,
        upstream=upstream,
    )
    # The operator stops the job at the step's own deadline; a short TTL frees the finished cluster soon.
    manifest = ray_job_manifest(cluster, name, entrypoint, ttl=120, active_deadline_s=timeout_s)
    manifest["metadata"]["labels"].update({"star-elastic/stage": stage.replace("_", "-"), "star-elastic/run": run_key})
    api = api or custom_objects_api()
    submit_rayjob(api, manifest)
    wait_for_rayjob(api, cluster.namespace, name, timeout_s + 300, poll_s=poll_s)
    return stage_uri(root, cfg.run_dir, cfg.run_name, stage)


# ---------------------------------------------------------------------- the DAG
def _kfp() -> Any:
    try:
        import kfp
        from kfp import compiler, dsl
    except ImportError as err:  # pragma: no cover - a dependency of the project
        raise ImportError("compiling the Kubeflow pipeline needs kfp: pip install 'kfp>=2.7'") from err
    return kfp, compiler, dsl


def pipeline_dag(stages: Sequence[StageSpec]) -> dict[str, list[str]]:
    """Stage -> direct upstream stages, in the runner's order (:func:`~pipelines.runner.topological`), so a
    step's upstream steps are built before it; a step takes at most :data:`MAX_UPSTREAM` upstream URIs."""
    ordered = topological(stages)
    for spec in ordered:
        if len(spec.depends) > MAX_UPSTREAM:
            n = len(spec.depends)
            raise ValueError(f"stage {spec.name!r} has {n} direct dependencies; steps take {MAX_UPSTREAM}")
    return {spec.name: list(spec.depends) for spec in ordered}


def pipeline_signature(config: Any, cluster: ClusterConfig, stages_module: str) -> inspect.Signature:
    """The pipeline's parameters: one per config field (:mod:`pipelines.kfp_params`), then the run options.

    ``config``: the validated :class:`~pipelines.config.PipelineConfig` whose values become the defaults.
    """
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = config_parameters(type(config))
    defaults = parameter_defaults(config, params)
    fields = [inspect.Parameter(p.name, kind, default=defaults[p.name], annotation=p.type) for p in params]
    options = [
        inspect.Parameter("executor", kind, default="rayjob", annotation=str),
        inspect.Parameter("cluster", kind, default=cluster.model_dump_json(), annotation=str),
        inspect.Parameter("stages_module", kind, default=stages_module, annotation=str),
        inspect.Parameter("tracking", kind, default=True, annotation=bool),
        inspect.Parameter("timeout_s", kind, default=DEFAULT_TIMEOUT_S, annotation=int),
    ]
    return inspect.Signature([*fields, *options], return_annotation=str)


_OPTION_DOCS = {
    "executor": "'rayjob': each stage runs as a KubeRay RayJob; 'local': inside its step's pod.",
    "cluster": "The RayJobs' cluster (pipelines.kuberay.config.ClusterConfig) as JSON.",
    "stages_module": "Module (or .py file) whose pipeline_stages() gives the stage list.",
    "tracking": "Log to MLflow (one parent run per Kubeflow run).",
    "timeout_s": "Seconds each stage may run before its RayJob is deleted.",
}


def build_pipeline(
    dag: Mapping[str, Sequence[str]],
    config: Any,
    cluster: ClusterConfig,
    stages_module: str = DEFAULT_STAGES_MODULE,
) -> Any:
    """The ``@dsl.pipeline`` function for ``dag``; parameters default to the given config and cluster.

    ``config``: the validated :class:`~pipelines.config.PipelineConfig`.
    """
    _, _, dsl = _kfp()
    params = config_parameters(type(config))
    step = step_function(
        "stage_step",
        STEP_INPUTS,
        params,
        UPSTREAM,
        "pipelines.kfp_pipeline:run_step",
        "Run one pipeline stage (as a RayJob, or in this pod) and return the URI of its output folder.",
    )
    base = dsl.component(step, base_image=cluster.image, install_kfp_package=False)

    def component_for(stage: str) -> Any:
        # Same code, the stage's name: tasks and components are then named after their stage.
        comp = copy.deepcopy(base)
        comp.component_spec.name = stage
        return comp

    signature = pipeline_signature(config, cluster, stages_module)
    names = list(signature.parameters)
    last = list(dag)[-1]

    def star_elastic(*args: Any) -> Any:
        values = dict(zip(names, args, strict=True))  # kfp passes one channel per parameter, in order
        tasks: dict[str, Any] = {}
        for stage, upstream in dag.items():
            slots = {UPSTREAM[i]: tasks[dep].output for i, dep in enumerate(upstream)}
            task = component_for(stage)(stage=stage, run_key=dsl.PIPELINE_JOB_ID_PLACEHOLDER, **values, **slots)
            task.set_display_name(stage)
            task.set_caching_options(False)
            tasks[stage] = task
        return tasks[last].output

    star_elastic.__signature__ = signature  # type: ignore[attr-defined]
    docs = {p.name: p.description for p in params} | _OPTION_DOCS
    # kfp takes each parameter's description from the pipeline function's docstring (Google style).
    args = "".join(f"    {name}: {docs[name]}\n" for name in names)
    star_elastic.__doc__ = f"The star-elastic pipeline.\n\nArgs:\n{args}"
    return dsl.pipeline(
        name=PIPELINE_NAME,
        description="Parent hybrid LM -> nested elastic budgets in one checkpoint: each step runs one stage "
        "(a KubeRay RayJob by default) and passes the URI of the stage's outputs downstream.",
    )(star_elastic)


def compile_pipeline(
    config_path: str | Path,
    out_path: str | Path,
    cluster: ClusterConfig | None = None,
    *,
    stages_module: str = DEFAULT_STAGES_MODULE,
) -> Path:
    """Validate the config and write the compiled pipeline YAML to ``out_path`` (no cluster needed).

    ``cluster`` defaults to the demo cluster of :mod:`pipelines.kuberay.render`. ``stages_module``
    names the stage list (a module or a ``.py`` file with ``pipeline_stages()``).
    """
    from pipelines.config import load_pipeline_config
    from pipelines.kuberay.render import demo_cluster_config

    _, compiler, _ = _kfp()
    config = load_pipeline_config(config_path)  # an invalid config fails here, not in the first step of a run
    dag = pipeline_dag(load_stages(stages_module))
    pipeline = build_pipeline(dag, config, cluster or demo_cluster_config(), stages_module)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, str(out))
    return out


# ---------------------------------------------------------------------- RBAC
def rayjob_rbac_manifests(
    namespace: str = DEFAULT_NAMESPACE,
    service_account: str = "pipeline-runner",
    service_account_namespace: str = "kubeflow",
    name: str = "star-elastic-kfp-rayjobs",
) -> list[dict[str, Any]]:
    """Role + RoleBinding letting the Kubeflow steps' service account manage RayJobs in ``namespace``.

    ``pipeline-runner`` in ``kubeflow`` is what standalone Kubeflow Pipelines runs steps as; in a
    multi-user install it is ``default-editor`` in the profile's namespace.
    """
    labels = {"app.kubernetes.io/name": "star-elastic", "app.kubernetes.io/component": "kfp-rbac"}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        # create: submit a stage; get: poll its status (and find a retried step's job);
        # delete: replace a failed job on retry, or stop one that ran past the step's timeout.
        "rules": [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["create", "get", "delete"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": service_account_namespace}],
    }
    return [role, binding]


def rbac_yaml(**kwargs: Any) -> str:
    """:func:`rayjob_rbac_manifests` as one multi-document YAML text."""
    return yaml.safe_dump_all(rayjob_rbac_manifests(**kwargs), sort_keys=False)
