"""Stage task resources: validation, Ray options, the evaluation device a task gets, the configs' sections."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from components.stage_task import TaskResources, _node_fits
from model.checkpoint import CheckpointError, save_model
from model.config import HybridConfig
from model.hybrid import HybridLM
from pipelines.config import load_pipeline_config
from pipelines.runner import PipelineRunner
from pipelines.sections import task_device
from pipelines.stages import check_parent, pipeline_stages
from tests.conftest import TINY

CONFIGS = Path(__file__).resolve().parents[2] / "pipelines" / "configs"


def test_defaults_are_a_small_cpu_task():
    r = TaskResources()
    assert (r.num_cpus, r.num_gpus, r.memory_gib, r.accelerator_type) == (2, 0, None, None)
    assert r.ray_options() == {"num_cpus": 2, "num_gpus": 0}
    assert r.threads == 2
    assert r.describe() == "2 CPU"


def test_ray_options_and_description():
    r = TaskResources(num_cpus=8, num_gpus=1, memory_gib=1.5, accelerator_type="H100")
    assert r.ray_options() == {"num_cpus": 8, "num_gpus": 1, "memory": 1610612736, "accelerator_type": "H100"}
    assert r.describe() == "8 CPU, 1 GPU (H100), 1.5 GiB"
    assert TaskResources(num_cpus=0.5).threads == 1


def test_bad_resources_name_the_field():
    with pytest.raises(ValidationError, match="accelerator_type 'H100' needs a GPU: set num_gpus"):
        TaskResources(accelerator_type="H100")
    with pytest.raises(ValidationError, match="num_cpus"):
        TaskResources(num_cpus=0)
    with pytest.raises(ValidationError, match="gpus"):
        TaskResources(gpus=1)


def test_node_fit():
    node = {"CPU": 16.0, "GPU": 8.0, "memory": 900 * 2**30, "accelerator_type:H100": 1.0}
    assert _node_fits(node, TaskResources(num_cpus=16, num_gpus=8, memory_gib=900, accelerator_type="H100"))
    assert not _node_fits(node, TaskResources(num_cpus=17))
    assert not _node_fits(node, TaskResources(num_gpus=1, accelerator_type="A100"))
    assert not _node_fits({"CPU": 2.0, "memory": 4 * 2**30}, TaskResources(num_gpus=1))
    assert not _node_fits({"CPU": 2.0, "memory": 4 * 2**30}, TaskResources(memory_gib=5))


def test_evaluation_device_follows_the_task():
    cpu, gpu = TaskResources(), TaskResources(num_gpus=1)
    fields = ("evaluate.device", "evaluate.resources")
    assert task_device("auto", cpu, *fields) == "cpu"
    assert task_device("auto", gpu, *fields) == "cuda"
    assert task_device("cpu", gpu, *fields) == "cpu"
    assert task_device("cuda:1", gpu, *fields) == "cuda:1"
    with pytest.raises(ValueError, match=r"evaluate.device: 'cuda' but the task reserves no GPU; set evaluate.reso"):
        task_device("cuda", cpu, *fields)


def test_real_config_evaluates_on_a_gpu_in_bf16(tmp_path):
    cfg = load_pipeline_config(CONFIGS / "real.yaml", [f"runs_dir={tmp_path}"])
    configs = PipelineRunner(pipeline_stages(), cfg, cfg.run_dir).build_configs()
    evaluate, quantize = configs["evaluate"], configs["quantize"]
    assert evaluate.resources.num_gpus == 1 and evaluate.device == "cuda"
    assert evaluate.resolved_dtype() == torch.bfloat16
    assert quantize.resources.num_gpus == 1 and quantize.evaluate["device"] == "cuda"
    assert "resources" not in quantize.evaluate  # the evaluation runs inside the quantize task
    assert configs["export"].resources.num_gpus == 0  # a stream of tensors needs no GPU
    for name in ("export", "evaluate", "quantize", "register"):
        assert configs[name].resources.memory_gib is not None, name


def test_demo_config_runs_cpu_tasks(tmp_path):
    cfg = load_pipeline_config(CONFIGS / "demo.yaml", [f"runs_dir={tmp_path}"])
    configs = PipelineRunner(pipeline_stages(), cfg, cfg.run_dir).build_configs()
    for name in ("export", "evaluate", "quantize", "register"):
        assert configs[name].resources == TaskResources(), name
    assert configs["evaluate"].device == "cpu" and configs["evaluate"].resolved_dtype() == torch.float32
    assert configs["distill_phase1"].consolidation == TaskResources()


def test_cuda_evaluation_without_a_gpu_fails_before_running(tmp_path):
    cfg = load_pipeline_config(CONFIGS / "demo.yaml", [f"runs_dir={tmp_path}", "evaluate.device=cuda"])
    with pytest.raises(ValueError) as err:
        PipelineRunner(pipeline_stages(), cfg, cfg.run_dir).build_configs()
    problems = str(err.value).splitlines()[1:]  # one line per stage: evaluate, and quantize's evaluation
    assert problems == [
        "  evaluate: evaluate.device: 'cuda' but the task reserves no GPU; set evaluate.resources.num_gpus (e.g. 1), "
        "or device: auto",
        "  quantize: evaluate.device: 'cuda' but the task reserves no GPU; set quantize.resources.num_gpus "
        "(e.g. 1), or device: auto",
    ]


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_parent_check_reads_headers_only(tmp_path, layout, monkeypatch):
    model = HybridLM(HybridConfig(**TINY)).init_weights(0)
    folder = save_model(model, tmp_path / "parent", expert_layout=layout)

    import model.checkpoint as checkpoint

    def no_read(*args, **kwargs):
        raise AssertionError("the parent check read tensor data")

    monkeypatch.setattr(checkpoint, "iter_views", no_read)
    assert check_parent(folder) == model.num_parameters() == 31_160  # = count_params(config).total


def test_parent_check_names_bad_tensors(tmp_path):
    model = HybridLM(HybridConfig(**TINY)).init_weights(0)
    folder = save_model(model, tmp_path / "parent")
    wrong = HybridConfig(**{**TINY, "intermediate_size": 40})
    wrong.to_json_file(folder / "config.json")
    (folder / "manifest.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"mis-shaped tensors .*mixer\.up_proj\.weight: file \(48, 32\) vs config"
    ):
        check_parent(folder)
