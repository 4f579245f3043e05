"""The driver-side stages run their model work as Ray tasks: real local Ray, a tiny model, MLflow on SQLite.

The pipeline runner runs export, evaluate, quantize and register over a tiny phase-2 output (written
directly, without training) while the driver's ``HybridLM`` constructor is wrapped to count calls:
the driver never builds a model (not even on the meta device), and every stage records the task
that did the work, in another process. The consolidation that ends a distillation phase runs the
same way, and so does the rank stage's permutation (after its calibration tasks). Errors raised in a
task reach the driver with their type and message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from components.data.tokenizer import TextTokenizer, build_demo_tokenizer
from components.distill.ckpt import STATE_FILE, TrainState
from components.distill.config import DistillConfig
from components.distill.export import run_export
from components.distill.stage import consolidate_output
from components.progress import in_ray_task
from components.rank import CalibrationConfig, RankConfig, run_rank
from components.stage_task import RemoteTraceback, TaskResources, run_task
from components.tracking import MlflowTracker, NullTracker
from model.checkpoint import iter_tensors, to_canonical
from model.config import HybridConfig
from model.elastic import ElasticSpace
from model.elastic.budgets import BudgetSet
from model.elastic.importance import Rankings
from model.elastic.router import BudgetRouter, RouterConfig
from model.hybrid import HybridLM
from pipelines.config import load_pipeline_config
from pipelines.runner import MARKER, PipelineRunner
from pipelines.stages import pipeline_stages
from tests.conftest import TINY
from tests.helpers import save_rank_parent
from tests.unit.test_export_stream import BUDGETS, SPACE, build_distill_output

pytestmark = pytest.mark.integration

DEMO = Path(__file__).resolve().parents[2] / "pipelines" / "configs" / "demo.yaml"
DRIVER_STAGES = ["export", "evaluate", "quantize", "register"]
FEW = [
    "export.allow_off_target=true",
    "evaluate.levels=[1]",
    "evaluate.n_per_level=2",
    "evaluate.think_caps=[0]",
    "evaluate.elastic_pairs=[]",
    "evaluate.think_limit=4",
    "evaluate.max_answer_tokens=4",
    "evaluate.batch_size=2",
    "quantize.formats=[fp8]",
    "quantize.calibration.num_batches=1",
    "quantize.calibration.batch_size=2",
    "quantize.calibration.seq_len=16",
    "register.model_name=stage-tasks",
    "register.gate.default_min_accuracy=0.0",
]


@pytest.fixture
def driver_constructions():
    """Calls of ``HybridLM.__init__`` in this (the driver's) process while the test runs."""
    calls: list[int] = []
    original = HybridLM.__init__

    def counting(self, *args, **kwargs):
        calls.append(os.getpid())
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HybridLM, "__init__", counting)
        yield calls


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> dict[str, Path]:
    tok_dir = TextTokenizer(build_demo_tokenizer()).save(tmp_path_factory.mktemp("tok") / "tokenizer")
    return {p.name: p for p in tok_dir.iterdir()}


def test_driver_stages_run_in_tasks_and_build_no_model(ray_runtime, tmp_path, tokenizer_files, driver_constructions):
    cfg = load_pipeline_config(DEMO, [*FEW, f"runs_dir={tmp_path / 'runs'}"])
    vocab = TextTokenizer.load(next(iter(tokenizer_files.values())).parent).vocab_size
    runner = PipelineRunner(pipeline_stages(), cfg, cfg.run_dir)
    keys = runner.keys(runner.build_configs())
    build_distill_output(cfg.run_dir / "distill_phase2" / "student", vocab_size=vocab, extra_files=tokenizer_files)
    for name in ("parent", "rank", "distill_phase1", "distill_phase2"):  # upstream stages: done
        (cfg.run_dir / name).mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / name / MARKER).write_text(json.dumps({"key": keys[name], "outputs": {}}))
    driver_constructions.clear()  # building the tiny student above is the test's own doing

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "stage-tasks", run_name="pipeline")
    with tracker:
        results = {r.name: r for r in runner.run(tracker, only=DRIVER_STAGES)}

    assert driver_constructions == []  # no HybridLM was built in the driver, not even on the meta device
    assert [results[n].status for n in DRIVER_STAGES] == ["ran"] * 4
    pids = [results[n].outputs["task"]["pid"] for n in DRIVER_STAGES]
    assert os.getpid() not in pids and len(set(pids)) == 4  # each stage in its own worker process
    assert all(results[n].outputs["task"]["resources"] == "2 CPU" for n in DRIVER_STAGES)

    export = results["export"].outputs
    assert [b["name"] for b in export["budgets"]] == ["full", "small"]
    assert (Path(export["checkpoint_uri"]) / "model.safetensors").is_file()
    evaluate = results["evaluate"].outputs
    assert set(evaluate["accuracy"]) == {"full", "small"}
    resolved = json.loads(Path(evaluate["results_json"]).read_text())["config"]
    assert (resolved["device"], resolved["dtype"]) == ("cpu", "float32")  # a CPU task evaluates on cpu
    quantize = results["quantize"].outputs
    assert set(quantize["recovery"]) == {"fp8"} and Path(quantize["checkpoints"]["fp8"]).is_dir()
    register = results["register"].outputs
    assert register["registered"] and set(register["versions"]) == {"dense", "fp8"}
    stage_runs = tracker.client.search_runs(
        [tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}' and tags.stage = 'evaluate'"
    )
    assert len(stage_runs) == 1 and "acc/full" in stage_runs[0].data.metrics  # the task logged into its stage run


def test_consolidation_runs_in_a_task(ray_runtime, tmp_path, tokenizer_files, driver_constructions):
    from ray.train import Checkpoint

    vocab = TextTokenizer.load(next(iter(tokenizer_files.values())).parent).vocab_size
    model_config = HybridConfig(**{**TINY, "vocab_size": vocab})
    student = HybridLM(model_config).init_weights(0)
    space, budgets = ElasticSpace.model_validate(SPACE), BudgetSet.model_validate({"budgets": BUDGETS})
    router = BudgetRouter(model_config, space, budgets, RouterConfig())
    module = {f"student.{k}": v for k, v in student.state_dict().items()}
    module |= {f"router.{k}": v for k, v in router.state_dict().items()}
    folder = tmp_path / "checkpoint"
    (folder / "deepspeed" / "zero").mkdir(parents=True)  # the ZeRO-0/1/2 layout: rank 0's replicated weights
    torch.save({"module": module}, folder / "deepspeed" / "zero" / "mp_rank_00_model_states.pt")
    state = TrainState(next_step=4, world_size=1, zero_stage=1, history=[{"step": 3, "kd_loss": 1.5}])
    (folder / STATE_FILE).write_text(state.model_dump_json())
    teacher = next(iter(tokenizer_files.values())).parent  # only its tokenizer files are read
    config = DistillConfig(
        teacher_uri=str(teacher), output_dir=str(tmp_path / "out"), space=SPACE, budgets=BUDGETS, steps=4, zero_stage=1
    )
    driver_constructions.clear()

    (out, summary, got_state), task = run_task(
        consolidate_output, Checkpoint(path=str(folder)), config, model_config,
        resources=config.consolidation, name="consolidate", field="distill_phase1.consolidation", pass_tracker=False,
    )  # fmt: skip

    assert task.pid != os.getpid() and driver_constructions == []
    written = to_canonical(iter_tensors(out))  # the published layout, read back under the model's names
    reference = student.state_dict()
    assert written.keys() == reference.keys()
    assert all(torch.equal(written[k], reference[k]) for k in reference)
    assert summary["steps"] == 4 and got_state.history == [{"step": 3, "kd_loss": 1.5}]
    assert (Path(out) / "tokenizer.json").is_file() and (Path(out) / "router.safetensors").is_file()


def test_task_errors_keep_their_type_and_message(ray_runtime, tmp_path):
    with pytest.raises(FileNotFoundError, match="no distill.json; not a distillation output folder") as err:
        run_task(
            run_export, tmp_path / "missing", tmp_path / "out", resources=TaskResources(num_cpus=1),
            name="export", field="export.resources", pass_tracker=False, progress=False,
        )  # fmt: skip
    assert isinstance(err.value.__cause__, RemoteTraceback) and "run_export" in str(err.value.__cause__)


def test_tasks_know_they_are_tasks_and_impossible_requests_are_refused(ray_runtime):
    assert not in_ray_task()
    inside, task = run_task(
        in_ray_task, resources=TaskResources(num_cpus=1), name="probe", field="x", pass_tracker=False
    )
    assert inside and task.pid != os.getpid()  # so progress_bar writes plain lines (or Ray's bar) there
    with pytest.raises(ValueError, match=r"evaluate.resources: the task asks for 1000 CPU but no node of the local"):
        run_task(in_ray_task, resources=TaskResources(num_cpus=1000), name="x", field="evaluate.resources")


@pytest.fixture(scope="module")
def rank_parent(tmp_path_factory, tokenizer_files) -> Path:
    """A tiny random parent with the demo tokenizer beside it, its norms and router bias perturbed so that a
    permutation slip would show in the logits."""
    vocab = TextTokenizer.load(next(iter(tokenizer_files.values())).parent).vocab_size
    return save_rank_parent(tmp_path_factory.mktemp("rank") / "parent", vocab, tokenizer_files)


RANK_FEW = [
    "rank.calibration.num_samples=8",
    "rank.calibration.seq_len=32",
    "rank.calibration.batch_size=4",
    "rank.calibration.exclude_eval_per_level=2",
    "rank.num_tasks=1",
    "rank.depth=true",
    "rank.depth_batches=1",
    "rank.progress=false",
]


def test_rank_stage_permutes_in_a_task_and_builds_no_model(ray_runtime, tmp_path, rank_parent, driver_constructions):
    cfg = load_pipeline_config(DEMO, [*RANK_FEW, f"parent.uri={rank_parent}", f"runs_dir={tmp_path / 'runs'}"])
    runner = PipelineRunner(pipeline_stages(), cfg, cfg.run_dir)
    keys = runner.keys(runner.build_configs())
    (cfg.run_dir / "parent").mkdir(parents=True)
    (cfg.run_dir / "parent" / MARKER).write_text(json.dumps({"key": keys["parent"], "outputs": {}}))
    driver_constructions.clear()

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "rank-task", run_name="pipeline")
    with tracker:
        (result,) = runner.run(tracker, only=["rank"])

    assert driver_constructions == []  # the driver read config.json and the tokenizer, never a model
    out = result.outputs
    assert result.status == "ran" and out["task"]["pid"] != os.getpid() and out["task"]["resources"] == "2 CPU"
    assert out["metrics"]["calibration_tokens"] == 8 * 32
    assert out["metrics"]["permute_max_abs_logit_diff"] <= 1e-5
    rankings = Rankings.from_dict(json.loads(Path(out["rankings_uri"]).read_text()))
    assert rankings.depth is not None and out["depth_order"] == rankings.depth.removal_order
    assert Path(out["plot_uri"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn on the driver
    assert {"rankings.json", "tokenizer.json"} <= {p.name for p in Path(out["permuted_uri"]).iterdir()}

    parent, permuted = HybridLM.from_pretrained(rank_parent), HybridLM.from_pretrained(out["permuted_uri"])
    ids = torch.randint(0, parent.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (permuted(ids).logits - parent(ids).logits).abs().max().item() <= 1e-5
    assert not torch.equal(permuted.model.embeddings.weight, parent.model.embeddings.weight)  # something moved


def test_rank_resources_no_node_has_are_refused_before_calibrating(ray_runtime, tmp_path, rank_parent, monkeypatch):
    import components.rank as rank

    def no_calibration(config):
        raise AssertionError("calibrated before checking the permutation task's resources")

    monkeypatch.setattr(rank, "_run_calibration", no_calibration)
    config = RankConfig(
        parent_uri=str(rank_parent),
        output_dir=str(tmp_path / "rank"),
        calibration=CalibrationConfig(num_samples=4, seq_len=16, batch_size=4, exclude_eval_per_level=0),
        resources=TaskResources(num_cpus=1000),
    )
    with pytest.raises(ValueError, match=r"^rank.resources: the task asks for 1000 CPU but no node of the local"):
        run_rank(config, NullTracker())
