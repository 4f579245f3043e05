"""The Kubeflow pipeline: the committed YAML is current, the DAG is right, and a step's RayJob path works.

The RayJob path runs against a fake ``CustomObjectsApi``; the manifests it submits are checked
against KubeRay's CRD schema like the committed ones. A tiny two-stage list defined here (loaded by
file path, as a step would) exercises :func:`run_stage_only` with a storage root.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict

from pipelines.runner import MARKER, StageSpec

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "pipelines" / "configs" / "demo.yaml"
COMMITTED = REPO / "infra" / "kfp" / "demo-pipeline.yaml"
README = REPO / "infra" / "kfp" / "README.md"


# ---------------------------------------------------------------------- a tiny stage list (loaded by path)
class _Cfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_name: str
    upstream: str | None = None


def _build_first(ctx) -> BaseModel:
    return _Cfg(run_name=ctx.pipeline.run_name)


def _build_second(ctx) -> BaseModel:
    return _Cfg(run_name=ctx.pipeline.run_name, upstream=str((ctx.dir("first") / "out.txt").resolve()))


def _run(cfg: _Cfg, tracker, ctx) -> dict[str, Any]:
    text = (Path(cfg.upstream).read_text() if cfg.upstream else "") + f"{ctx.name};"
    (ctx.dir() / "out.txt").write_text(text)
    return {"text": text}


def pipeline_stages() -> list[StageSpec]:
    return [StageSpec("first", [], _build_first, _run), StageSpec("second", ["first"], _build_second, _run)]


def _config(tmp_path: Path, **extra: Any) -> Path:
    data = {
        "run_name": "tiny",
        "runs_dir": str(tmp_path / "runs"),
        "elastic": {"space": {"hidden": [64, 32]}, "budgets": [{"name": "full", "fraction": 1.0}]},
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------------- the committed pipeline
@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[str, dict[str, Any]]:
    from pipelines.kfp_pipeline import compile_pipeline

    out = compile_pipeline(DEMO_CONFIG, tmp_path_factory.mktemp("kfp") / "demo-pipeline.yaml")
    text = out.read_text()
    return text, yaml.safe_load(text)


def test_committed_pipeline_equals_a_fresh_compile(compiled) -> None:
    # kfp's output is deterministic (no timestamps or random ids), so nothing is masked.
    assert COMMITTED.read_text() == compiled[0], (
        "infra/kfp/demo-pipeline.yaml is stale: star-elastic kfp compile pipelines/configs/demo.yaml "
        "--out infra/kfp/demo-pipeline.yaml"
    )


def test_dag_has_the_eight_stages_in_dependency_order(compiled) -> None:
    from pipelines.kfp_pipeline import PIPELINE_STAGES

    tasks = compiled[1]["root"]["dag"]["tasks"]
    stage_of = {name: task["taskInfo"]["name"] for name, task in tasks.items()}  # task key -> stage
    assert list(PIPELINE_STAGES) == [
        "parent",
        "rank",
        "distill_phase1",
        "distill_phase2",
        "export",
        "evaluate",
        "quantize",
        "register",
    ]
    assert sorted(stage_of.values()) == sorted(PIPELINE_STAGES)
    deps = {stage_of[name]: [stage_of[d] for d in task.get("dependentTasks", [])] for name, task in tasks.items()}
    assert deps["parent"] == []
    for name, task in tasks.items():
        stage = stage_of[name]
        assert stage == "parent" or deps[stage], f"{stage} has no upstream stage"
        for dep in deps[stage]:  # every edge points backwards in run order
            assert PIPELINE_STAGES.index(dep) < PIPELINE_STAGES.index(stage), f"{dep} -> {stage}"
        # The edges are data: each upstream stage's URI is bound to an input of the step.
        bound = [
            stage_of[p["taskOutputParameter"]["producerTask"]]
            for key, p in sorted(task["inputs"]["parameters"].items())
            if key.startswith("upstream_")
        ]
        assert sorted(bound) == sorted(deps[stage])
        assert task["cachingOptions"] == {}  # Kubeflow's cache is off; the runner's markers decide

    def ancestors(stage: str) -> set[str]:
        return set(deps[stage]).union(*(ancestors(d) for d in deps[stage]))

    assert ancestors("register") == set(PIPELINE_STAGES) - {"register"}
    output = compiled[1]["root"]["dag"]["outputs"]["parameters"]["Output"]["valueFromParameter"]
    assert stage_of[output["producerSubtask"]] == "register"


def test_dag_follows_the_stage_list() -> None:
    from pipelines.kfp_pipeline import PIPELINE_STAGES, pipeline_dag
    from pipelines.stages import pipeline_stages as project_stages

    specs = project_stages()
    assert {s.name for s in specs} <= set(PIPELINE_STAGES), "a new stage needs a place in PIPELINE_STAGES"
    dag = pipeline_dag(specs, PIPELINE_STAGES)
    for spec in specs:
        assert dag[spec.name] == spec.depends


def test_parameters_default_to_the_config_and_cluster(compiled) -> None:
    from components.kuberay import ClusterConfig, demo_cluster_config

    params = compiled[1]["root"]["inputDefinitions"]["parameters"]
    assert json.loads(params["config"]["defaultValue"]) == yaml.safe_load(DEMO_CONFIG.read_text())
    assert ClusterConfig.model_validate_json(params["cluster"]["defaultValue"]) == demo_cluster_config()
    assert params["executor"]["defaultValue"] == "rayjob"
    assert params["stages_module"]["defaultValue"] == "pipelines.stages"
    assert params["tracking"]["defaultValue"] is True
    images = {e["container"]["image"] for e in compiled[1]["deploymentSpec"]["executors"].values()}
    assert images == {demo_cluster_config().image}
    commands = [" ".join(e["container"]["command"]) for e in compiled[1]["deploymentSpec"]["executors"].values()]
    assert not any("pip install" in c for c in commands)  # the image holds kfp; pods need no package index


def test_pipeline_dag_fills_missing_stages_and_refuses_bad_edges() -> None:
    from pipelines.kfp_pipeline import pipeline_dag

    def noop(*_: Any) -> Any:
        return None

    specs = [StageSpec("a", [], noop, noop), StageSpec("b", ["a"], noop, noop)]
    assert pipeline_dag(specs, ["a", "b", "c", "d"]) == {"a": [], "b": ["a"], "c": ["b"], "d": ["c"]}
    with pytest.raises(ValueError, match="unknown stages"):
        pipeline_dag([StageSpec("x", ["nope"], noop, noop)])
    many = [StageSpec(n, [], noop, noop) for n in "pqrst"] + [StageSpec("z", list("pqrst"), noop, noop)]
    with pytest.raises(ValueError, match="direct dependencies"):
        pipeline_dag(many)


# ---------------------------------------------------------------------- RBAC in the README
def test_readme_rbac_equals_the_rendering_and_validates() -> None:
    from pipelines.kfp_pipeline import rayjob_rbac_manifests, rbac_yaml
    from tests.unit.test_manifests import manifest_errors

    blocks = re.findall(r"<!-- rbac -->\s*```yaml\n(.*?)```", README.read_text(), re.S)
    assert blocks == [rbac_yaml()], "infra/kfp/README.md: paste `rbac_yaml()` after <!-- rbac -->"
    for doc in rayjob_rbac_manifests():
        assert manifest_errors(doc) == []
    assert rayjob_rbac_manifests()[0]["rules"][0]["verbs"] == ["create", "get", "delete"]


# ---------------------------------------------------------------------- the RayJob path
class FakeApi:
    """Records calls like ``CustomObjectsApi``; ``get`` answers with the queued statuses."""

    def __init__(self, statuses: list[dict[str, str]], exists: dict[str, Any] | None = None) -> None:
        self.statuses = statuses
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.existing = exists

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        from kubernetes.client.rest import ApiException

        assert (group, version, plural) == ("ray.io", "v1", "rayjobs")
        if self.existing is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        self.created.append(copy.deepcopy(body))
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        from kubernetes.client.rest import ApiException

        if self.existing is not None:
            return self.existing
        if not self.created:
            raise ApiException(status=404, reason="NotFound")
        return {"status": self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.deleted.append(name)
        self.existing = None


def _status(deployment: str, job: str, **extra: str) -> dict[str, str]:
    return {"jobDeploymentStatus": deployment, "jobStatus": job, **extra}


def test_rayjob_step_submits_a_valid_rayjob_and_returns_the_stage_uri(tmp_path) -> None:
    from components.kuberay import demo_cluster_config
    from components.kuberay.config import check_name
    from pipelines.kfp_components import main
    from pipelines.kfp_pipeline import execute_step
    from tests.unit.test_manifests import manifest_errors

    config = _config(tmp_path)
    cluster = demo_cluster_config()
    api = FakeApi([_status("Initializing", ""), _status("Running", "RUNNING"), _status("Complete", "SUCCEEDED")])
    uri = execute_step(
        "second",
        config.read_text(),
        cluster_json=cluster.model_dump_json(),
        stages_module=__file__,
        run_key="run-123",
        upstream=["s3://star-elastic/runs/tiny/first"],
        api=api,
        poll_s=0,
    )
    assert uri == "s3://star-elastic/runs/tiny/second"
    (manifest,) = api.created
    assert manifest_errors(manifest) == []
    name = manifest["metadata"]["name"]
    check_name("RayJob", name)
    assert manifest["metadata"]["labels"]["star-elastic/stage"] == "second"
    assert manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] == (
        cluster.image
    )
    # The entrypoint is one shell-safe command that the job's driver can parse back.
    argv = shlex.split(manifest["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "pipelines.kfp_components", "second"]
    opts = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert base64.b64decode(opts["--config-b64"]).decode() == config.read_text()
    assert opts["--storage-uri"] == "s3://star-elastic/runs" and opts["--workdir"] == "/app"
    assert opts["--upstream"] == "s3://star-elastic/runs/tiny/first"
    with pytest.raises(SystemExit):  # the same options parse (stopped at --help to run nothing)
        main([*argv[3:], "--help"])


def test_rayjob_failure_raises_with_the_job_message(tmp_path) -> None:
    from components.kuberay import demo_cluster_config
    from pipelines.kfp_pipeline import RayJobFailed, execute_step

    api = FakeApi(
        [
            _status("Running", "FAILED"),  # not final: the operator may retry on a fresh cluster
            _status("Retrying", "FAILED"),
            _status("Failed", "FAILED", reason="AppFailed", message="stage 'first' failed: boom"),
        ]
    )
    with pytest.raises(RayJobFailed, match="AppFailed.*stage 'first' failed: boom"):
        execute_step(
            "first",
            _config(tmp_path).read_text(),
            cluster_json=demo_cluster_config().model_dump_json(),
            stages_module=__file__,
            run_key="r",
            api=api,
            poll_s=0,
        )


def test_rayjob_step_refuses_a_stale_pipeline_and_local_storage(tmp_path) -> None:
    from components.kuberay import demo_cluster_config
    from pipelines.kfp_pipeline import execute_step

    kwargs = {"stages_module": __file__, "run_key": "r", "api": FakeApi([]), "poll_s": 0}
    cluster = demo_cluster_config().model_dump_json()
    with pytest.raises(ValueError, match="older than the stage list"):
        execute_step("second", _config(tmp_path).read_text(), cluster_json=cluster, upstream=[], **kwargs)
    local = demo_cluster_config().model_copy(update={"storage_uri": "/data"}).model_dump_json()
    with pytest.raises(ValueError, match="s3:// storage root"):
        execute_step("first", _config(tmp_path).read_text(), cluster_json=local, **kwargs)


def test_wait_times_out_and_deletes_the_job() -> None:
    from pipelines.kfp_pipeline import wait_for_rayjob

    api = FakeApi([_status("Running", "RUNNING")])
    api.created.append({})
    ticks = iter(range(100))
    with pytest.raises(TimeoutError):
        wait_for_rayjob(api, "ns", "job", timeout_s=3, poll_s=1, clock=lambda: next(ticks), sleep=lambda s: None)
    assert api.deleted == ["job"]


def test_wait_rides_out_api_errors_but_not_a_deleted_job() -> None:
    from kubernetes.client.rest import ApiException

    from pipelines.kfp_pipeline import wait_for_rayjob

    class Flaky(FakeApi):
        def __init__(self, errors: list[int]) -> None:
            super().__init__([_status("Complete", "SUCCEEDED")])
            self.created.append({})
            self.errors = errors

        def get_namespaced_custom_object(self, *args):
            if self.errors:
                raise ApiException(status=self.errors.pop(0))
            return super().get_namespaced_custom_object(*args)

    quiet = {"poll_s": 0, "log": lambda s: None, "sleep": lambda s: None}
    assert wait_for_rayjob(Flaky([503, 500]), "ns", "job", 60, **quiet)["jobStatus"] == "SUCCEEDED"
    with pytest.raises(ApiException):
        wait_for_rayjob(Flaky([404]), "ns", "job", 60, **quiet)


def test_retried_step_follows_a_live_job_and_replaces_a_failed_one() -> None:
    from pipelines.kfp_pipeline import submit_rayjob

    manifest = {"metadata": {"namespace": "ns", "name": "job"}}
    live = FakeApi([], exists={"status": _status("Running", "RUNNING")})
    submit_rayjob(live, manifest, log=lambda s: None)
    assert live.created == [] and live.deleted == []
    failed = FakeApi([], exists={"status": _status("Failed", "FAILED")})
    submit_rayjob(failed, manifest, log=lambda s: None)
    assert failed.deleted == ["job"] and failed.created == [manifest]


def test_rayjob_names_are_short_labels_stable_per_run_and_stage() -> None:
    from components.kuberay.config import check_name
    from pipelines.kfp_pipeline import rayjob_name

    for stage in ("parent", "distill_phase1", "x" * 80):
        check_name("RayJob", rayjob_name(stage, "run"))
    assert rayjob_name("rank", "a") == rayjob_name("rank", "a") != rayjob_name("rank", "b")


# ---------------------------------------------------------------------- one stage here, with a storage root
def test_run_stage_only_pulls_upstream_and_publishes(tmp_path) -> None:
    import shutil

    from pipelines.kfp_components import run_stage_only

    store = tmp_path / "store"
    config = _config(tmp_path, storage_uri=str(store))
    quiet = {"stages_module": __file__, "tracking": False, "log": lambda s: None}
    first = run_stage_only(config, "first", **quiet)
    assert first.status == "ran" and first.uri == f"{store}/tiny/first"
    assert (store / "tiny" / "first" / MARKER).is_file()
    # A fresh machine (a new RayJob cluster): nothing local, the upstream stage comes from storage.
    shutil.rmtree(tmp_path / "runs")
    second = run_stage_only(config, "second", upstream=[first.uri], **quiet)
    assert second.outputs == {"text": "first;second;"}
    assert (store / "tiny" / "second" / "out.txt").read_text() == "first;second;"
    assert (tmp_path / "runs" / "tiny" / "summary.json").is_file()  # the last stage writes the summary
    assert run_stage_only(config, "second", **quiet).status == "cached"


def test_run_stage_only_needs_finished_upstream(tmp_path) -> None:
    from pipelines.kfp_components import run_stage_only

    with pytest.raises(ValueError, match=r"needs \['first'\] finished first"):
        run_stage_only(_config(tmp_path), "second", stages_module=__file__, tracking=False, log=lambda s: None)
    with pytest.raises(FileNotFoundError, match="no finished output"):
        run_stage_only(
            _config(tmp_path, storage_uri=str(tmp_path / "empty")), "second", stages_module=__file__, tracking=False
        )


def test_config_parameter_is_text_or_a_path(tmp_path) -> None:
    from pipelines.kfp_components import read_config_text

    path = _config(tmp_path)
    assert read_config_text(path.read_text()) == path.read_text()
    assert read_config_text(str(path)) == path.read_text()


def test_pipeline_run_is_found_by_its_tag() -> None:
    from types import SimpleNamespace

    from pipelines.kfp_components import RUN_KEY_TAG, find_pipeline_run

    class Client:
        def get_experiment_by_name(self, name):
            return SimpleNamespace(experiment_id="7") if name == "exp" else None

        def search_runs(self, ids, filter_string, max_results):
            assert ids == ["7"] and RUN_KEY_TAG in filter_string
            hit = "'key-1'" in filter_string
            return [SimpleNamespace(info=SimpleNamespace(run_id="abc"))] if hit else []

    assert find_pipeline_run(Client(), "exp", "key-1") == "abc"
    assert find_pipeline_run(Client(), "exp", "key-2") is None
    assert find_pipeline_run(Client(), "other", "key-1") is None
