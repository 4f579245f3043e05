"""The Kubeflow pipeline: the committed YAML is current, the DAG is the stage list, the parameters are the
config class's fields, and a step's RayJob path works.

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
from tests.helpers import write_tiny_pipeline_config

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


# ---------------------------------------------------------------------- the committed pipeline
@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[str, dict[str, Any]]:
    from pipelines.kfp_pipeline import compile_pipeline

    out = compile_pipeline(DEMO_CONFIG, tmp_path_factory.mktemp("kfp") / "demo-pipeline.yaml")
    text = out.read_text()
    return text, yaml.safe_load(text)


def test_committed_pipeline_equals_a_fresh_compile(compiled) -> None:
    # kfp's output is deterministic (no timestamps or random ids), so nothing is masked.
    assert COMMITTED.read_text() == compiled[0], "infra/kfp/demo-pipeline.yaml is stale: make kfp"


def test_dag_has_the_eight_stages_in_dependency_order(compiled) -> None:
    from pipelines.stages import pipeline_stages

    run_order = [s.name for s in pipeline_stages()]
    assert run_order == [
        "parent",
        "rank",
        "distill_phase1",
        "distill_phase2",
        "export",
        "evaluate",
        "quantize",
        "register",
    ]
    tasks = compiled[1]["root"]["dag"]["tasks"]
    stage_of = {name: task["taskInfo"]["name"] for name, task in tasks.items()}  # task key -> stage
    assert sorted(stage_of.values()) == sorted(run_order)
    deps = {stage_of[name]: [stage_of[d] for d in task.get("dependentTasks", [])] for name, task in tasks.items()}
    assert deps["parent"] == []
    for name, task in tasks.items():
        stage = stage_of[name]
        assert stage == "parent" or deps[stage], f"{stage} has no upstream stage"
        for dep in deps[stage]:  # every edge points backwards in run order
            assert run_order.index(dep) < run_order.index(stage), f"{dep} -> {stage}"
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

    assert ancestors("register") == set(run_order) - {"register"}
    output = compiled[1]["root"]["dag"]["outputs"]["parameters"]["Output"]["valueFromParameter"]
    assert stage_of[output["producerSubtask"]] == "register"


def test_steps_wait_for_their_dependencies_in_the_runners_order(tmp_path) -> None:
    """A stage list out of dependency order (a diamond, listed backwards) compiles to steps that each wait for
    exactly their stage's dependencies, the runner's order is an order Kubeflow may run them in, and the
    pipeline's result is the stage the runner runs last."""
    from kfp import compiler

    from pipelines.config import load_pipeline_config
    from pipelines.kfp_pipeline import build_pipeline, pipeline_dag
    from pipelines.kuberay.render import demo_cluster_config
    from pipelines.runner import PipelineRunner

    def noop(*_: Any) -> Any:
        return None

    depends = {"join": ["left", "right"], "right": ["root"], "left": ["root"], "root": []}
    specs = [StageSpec(name, deps, noop, noop) for name, deps in depends.items()]
    runner_order = [s.name for s in PipelineRunner(specs, None, tmp_path).stages]
    config = load_pipeline_config(write_tiny_pipeline_config(tmp_path))
    compiler.Compiler().compile(
        build_pipeline(pipeline_dag(specs), config, demo_cluster_config()), str(tmp_path / "p.yaml")
    )
    dag = yaml.safe_load((tmp_path / "p.yaml").read_text())["root"]["dag"]

    stage_of = {key: task["taskInfo"]["name"] for key, task in dag["tasks"].items()}
    waits = {
        stage_of[key]: sorted(stage_of[d] for d in task.get("dependentTasks", [])) for key, task in dag["tasks"].items()
    }
    assert waits == {name: sorted(deps) for name, deps in depends.items()}
    for stage, upstream in waits.items():
        assert all(runner_order.index(d) < runner_order.index(stage) for d in upstream), (stage, runner_order)
    assert list(pipeline_dag(specs)) == runner_order
    assert stage_of[dag["outputs"]["parameters"]["Output"]["valueFromParameter"]["producerSubtask"]] == runner_order[-1]


# ---------------------------------------------------------------------- parameters from the config class
RUN_OPTIONS = ["executor", "cluster", "stages_module", "tracking", "timeout_s"]


def test_parameters_are_the_config_fields_then_the_run_options(compiled) -> None:
    from pipelines.config import PipelineConfig

    params = compiled[1]["root"]["inputDefinitions"]["parameters"]
    yaml_keys = [f.alias or name for name, f in PipelineConfig.model_fields.items()]
    assert "register" in yaml_keys and "registry" not in yaml_keys  # the YAML name, not the attribute
    assert sorted(params) == sorted(yaml_keys + RUN_OPTIONS)
    kinds = {name: p["parameterType"] for name, p in params.items()}
    assert kinds["threads"] == "NUMBER_INTEGER" and kinds["tracking"] == "BOOLEAN"
    assert {kinds[k] for k in yaml_keys if k != "threads"} == {"STRING"}  # scalars, optional strings, JSON
    for key in yaml_keys:  # each described by its field
        field = PipelineConfig.model_fields["registry" if key == "register" else key]
        assert params[key]["description"].startswith(field.description.rstrip(".")), key
    # Every step takes every config parameter, bound to the pipeline's.
    for task in compiled[1]["root"]["dag"]["tasks"].values():
        inputs = task["inputs"]["parameters"]
        for key in yaml_keys + RUN_OPTIONS:
            assert inputs[key] == {"componentInputParameter": key}


def test_parameter_defaults_are_the_compiled_config(compiled) -> None:
    from pipelines.config import load_pipeline_config, validate_pipeline
    from pipelines.kfp_params import config_from_parameters
    from pipelines.kuberay.config import ClusterConfig
    from pipelines.kuberay.render import demo_cluster_config
    from pipelines.runner import PipelineRunner
    from pipelines.stages import pipeline_stages

    params = compiled[1]["root"]["inputDefinitions"]["parameters"]
    defaults = {name: p.get("defaultValue") for name, p in params.items()}
    assert defaults["run_name"] == "demo" and defaults["threads"] == 2 and defaults["storage_uri"] == ""
    assert json.loads(defaults["export"]) == {"select": "feasible"}  # the keys the YAML set, nothing more
    assert json.loads(defaults["data"]) is None and json.loads(defaults["serve"]) == {}
    # Decoded, the defaults are the demo config: every stage gets the same config, hence the same key.
    expected = load_pipeline_config(DEMO_CONFIG)
    decoded = validate_pipeline(config_from_parameters(defaults))
    assert decoded.model_dump() == expected.model_dump()
    runners = [PipelineRunner(pipeline_stages(), cfg, cfg.run_dir) for cfg in (expected, decoded)]
    assert runners[0].keys(runners[0].build_configs()) == runners[1].keys(runners[1].build_configs())
    assert ClusterConfig.model_validate_json(defaults["cluster"]) == demo_cluster_config()
    assert defaults["executor"] == "rayjob"
    assert defaults["stages_module"] == "pipelines.stages"
    assert defaults["tracking"] is True
    images = {e["container"]["image"] for e in compiled[1]["deploymentSpec"]["executors"].values()}
    assert images == {demo_cluster_config().image}
    commands = [" ".join(e["container"]["command"]) for e in compiled[1]["deploymentSpec"]["executors"].values()]
    assert not any("pip install" in c for c in commands)  # the image holds kfp; pods need no package index


def test_a_field_added_to_the_config_classes_becomes_a_parameter(tmp_path) -> None:
    """No list to edit: a new top-level field is a new parameter of the compiled pipeline, typed from its
    annotation; a new field of a stage's section travels in (and is validated by) its section's parameter."""
    from pydantic import Field, create_model

    from pipelines.config import PipelineConfig, RankSection
    from pipelines.kfp_params import config_from_parameters, config_parameters, parameter_defaults
    from pipelines.kfp_pipeline import build_pipeline, pipeline_dag
    from pipelines.kuberay.render import demo_cluster_config

    rank = create_model("RankWithKnob", __base__=RankSection, knob=(int, Field(3, ge=1, description="A knob.")))
    extended = create_model(
        "ExtendedConfig",
        __base__=PipelineConfig,
        notes=(str, Field("none", description="Free text.")),
        replicas=(int, Field(1, description="A count.")),
        rank=(rank, Field(default_factory=rank, description="Rank stage.")),
    )
    data = yaml.safe_load(DEMO_CONFIG.read_text())
    cfg = extended.model_validate({**data, "notes": "kept", "rank": {"knob": 5}})
    params = {p.name: p for p in config_parameters(extended)}
    assert list(params)[-2:] == ["notes", "replicas"]
    assert (params["notes"].type, params["replicas"].type) == (str, int)
    defaults = parameter_defaults(cfg)
    assert (defaults["notes"], defaults["replicas"], json.loads(defaults["rank"])) == ("kept", 1, {"knob": 5})
    back = extended.model_validate(config_from_parameters(defaults, list(params.values())))
    assert back.rank.knob == 5 and back.notes == "kept"
    with pytest.raises(ValueError, match="knob"):
        extended.model_validate(config_from_parameters({**defaults, "rank": '{"knob": 0}'}, list(params.values())))

    from kfp import compiler

    def noop(*_: Any) -> Any:
        return None

    pipeline = build_pipeline(pipeline_dag([StageSpec("a", [], noop, noop)]), cfg, demo_cluster_config())
    compiler.Compiler().compile(pipeline, str(tmp_path / "p.yaml"))
    spec = yaml.safe_load((tmp_path / "p.yaml").read_text())
    root = spec["root"]["inputDefinitions"]["parameters"]
    assert root["notes"] == {"defaultValue": "kept", "description": "Free text.", "isOptional": True,
                             "parameterType": "STRING"}  # fmt: skip
    assert root["replicas"]["parameterType"] == "NUMBER_INTEGER"
    assert {"notes", "replicas"} <= set(spec["components"]["comp-a"]["inputDefinitions"]["parameters"])


def test_a_bad_parameter_value_fails_at_its_yaml_path(tmp_path) -> None:
    from pipelines.config import ConfigError, load_pipeline_config
    from pipelines.kfp_params import parameter_defaults
    from pipelines.kfp_pipeline import run_step

    defaults = parameter_defaults(load_pipeline_config(write_tiny_pipeline_config(tmp_path)))
    step = {"stage": "first", "executor": "local", "cluster": "", "stages_module": __file__, "run_key": "r"}
    step |= {"tracking": False, "timeout_s": 60}
    with pytest.raises(ValueError, match=r"^rank: the Kubeflow parameter is not JSON"):
        run_step(**step, **{**defaults, "rank": "{num_tasks: 2"})
    with pytest.raises(ConfigError) as err:
        run_step(**step, **{**defaults, "rank": '{"num_tasks": 0}', "threads": 0})
    assert [p.split(":")[0] for p in err.value.problems] == ["threads", "rank.num_tasks"]


def test_a_step_runs_its_stage_from_the_parameters(tmp_path) -> None:
    """What each step does in its pod with ``executor=local``: config from the parameters, then the stage."""
    from pipelines.config import load_pipeline_config
    from pipelines.kfp_params import parameter_defaults
    from pipelines.kfp_pipeline import run_step

    defaults = parameter_defaults(load_pipeline_config(write_tiny_pipeline_config(tmp_path)))
    step = {"executor": "local", "cluster": "", "stages_module": __file__, "run_key": "r", "tracking": False}
    uri = run_step(stage="first", timeout_s=60, **step, **defaults)
    assert uri == str((tmp_path / "runs" / "tiny" / "first").resolve())
    renamed = {**defaults, "run_name": "other"}  # a run's edited parameter is the config the stage runs
    second = run_step(stage="first", timeout_s=60, **step, **renamed)
    assert second == str((tmp_path / "runs" / "other" / "first").resolve())
    assert run_step(stage="second", timeout_s=60, upstream_1=uri, **step, **defaults).endswith("tiny/second")
    assert (tmp_path / "runs" / "tiny" / "second" / "out.txt").read_text() == "first;second;"


def test_pipeline_dag_refuses_bad_edges() -> None:
    from pipelines.kfp_pipeline import pipeline_dag

    def noop(*_: Any) -> Any:
        return None

    specs = [StageSpec("b", ["a"], noop, noop), StageSpec("a", [], noop, noop)]
    assert pipeline_dag(specs) == {"a": [], "b": ["a"]}  # run order
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
    from pipelines.cli import build_parser
    from pipelines.kfp_pipeline import execute_step
    from pipelines.kuberay.config import check_name
    from pipelines.kuberay.render import demo_cluster_config
    from tests.unit.test_manifests import manifest_errors

    config = write_tiny_pipeline_config(tmp_path)
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
    # The entrypoint is one shell-safe star-elastic command that the job's driver parses back.
    argv = shlex.split(manifest["spec"]["entrypoint"])
    assert argv[:4] == ["star-elastic", "kfp", "run-stage", "second"]
    args = build_parser().parse_args(argv[1:])
    assert args.stage == "second" and args.config is None
    assert base64.b64decode(args.config_b64).decode() == config.read_text()
    assert (args.storage_uri, args.workdir, args.run_key) == ("s3://star-elastic/runs", "/app", "run-123")
    assert args.upstream == ["s3://star-elastic/runs/tiny/first"] and args.stages_module == __file__
    assert args.no_tracking is False


def test_rayjob_failure_raises_with_the_job_message(tmp_path) -> None:
    from pipelines.kfp_pipeline import RayJobFailed, execute_step
    from pipelines.kuberay.render import demo_cluster_config

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
            write_tiny_pipeline_config(tmp_path).read_text(),
            cluster_json=demo_cluster_config().model_dump_json(),
            stages_module=__file__,
            run_key="r",
            api=api,
            poll_s=0,
        )


def test_rayjob_step_refuses_a_stale_pipeline_and_local_storage(tmp_path) -> None:
    from pipelines.kfp_pipeline import execute_step
    from pipelines.kuberay.render import demo_cluster_config

    kwargs = {"stages_module": __file__, "run_key": "r", "api": FakeApi([]), "poll_s": 0}
    cluster = demo_cluster_config().model_dump_json()
    with pytest.raises(ValueError, match="older than the stage list"):
        execute_step(
            "second", write_tiny_pipeline_config(tmp_path).read_text(), cluster_json=cluster, upstream=[], **kwargs
        )
    local = demo_cluster_config().model_copy(update={"storage_uri": "/data"}).model_dump_json()
    with pytest.raises(ValueError, match="s3:// storage root"):
        execute_step("first", write_tiny_pipeline_config(tmp_path).read_text(), cluster_json=local, **kwargs)


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
    from pipelines.kfp_pipeline import rayjob_name
    from pipelines.kuberay.config import check_name

    for stage in ("parent", "distill_phase1", "x" * 80):
        check_name("RayJob", rayjob_name(stage, "run"))
    assert rayjob_name("rank", "a") == rayjob_name("rank", "a") != rayjob_name("rank", "b")


# ---------------------------------------------------------------------- one stage here, with a storage root
def test_run_stage_only_pulls_upstream_and_publishes(tmp_path) -> None:
    import shutil

    from pipelines.kfp_components import run_stage_only

    store = tmp_path / "store"
    config = write_tiny_pipeline_config(tmp_path, storage_uri=str(store))
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
        run_stage_only(
            write_tiny_pipeline_config(tmp_path), "second", stages_module=__file__, tracking=False, log=lambda s: None
        )
    with pytest.raises(FileNotFoundError, match="no finished output"):
        run_stage_only(
            write_tiny_pipeline_config(tmp_path, storage_uri=str(tmp_path / "empty")),
            "second",
            stages_module=__file__,
            tracking=False,
        )


def test_pipeline_run_of_a_step_has_the_source_tags_of_star_elastic_run(tmp_path, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    from components.tracking import config_hash, git_commit
    from pipelines.config import load_pipeline_config
    from pipelines.kfp_components import RUN_KEY_TAG, run_stage_only

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = write_tiny_pipeline_config(tmp_path, tracking_uri=uri, experiment="kfp-tags")
    run_stage_only(config, "first", stages_module=__file__, run_key="run-7", config_file="conf.yaml", log=print)
    cfg = load_pipeline_config(config)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("kfp-tags").experiment_id
    (parent,) = client.search_runs([experiment], filter_string=f"tags.`{RUN_KEY_TAG}` = 'run-7'")
    tags = parent.data.tags
    assert tags["config_sha256"] == config_hash(cfg.model_dump(mode="json", by_alias=True))
    assert (tags["run_dir"], tags["config_file"]) == (str(cfg.run_dir), "conf.yaml")
    commit = git_commit()
    assert tags.get("git_commit") == tags.get("mlflow.source.git.commit") == (commit[0] if commit else None)


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
