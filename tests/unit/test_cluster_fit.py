"""The committed clusters hold the training workers of the pipeline configs their RayJobs run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipelines.kuberay.render import (
    PIPELINE_CONFIGS,
    check_cluster_holds,
    check_runs_volume,
    demo_cluster_config,
    real_cluster_config,
    render_manifests,
    train_workers,
)

REAL = PIPELINE_CONFIGS / "real.yaml"


def _with_max_nodes(cfg, nodes: int):
    group = cfg.worker_groups[0].model_copy(update={"max_replicas": nodes, "replicas": 1, "min_replicas": 1})
    return cfg.model_copy(update={"worker_groups": [group]})


def test_real_config_workers_and_the_committed_cluster_agree():
    assert train_workers(REAL) == {"distill_phase1": (64, "GPU"), "distill_phase2": (64, "GPU")}
    assert real_cluster_config().max_gpus == 64  # 8 nodes x 8 GPUs
    check_cluster_holds(real_cluster_config(), REAL, "star-elastic-pipeline")


def test_rendering_refuses_more_workers_than_the_cluster_holds():
    four_nodes = _with_max_nodes(real_cluster_config(), 4)
    with pytest.raises(ValueError) as err:
        render_manifests(demo_cluster_config(), four_nodes)
    text = str(err.value)
    assert "distill_phase1.num_workers = 64 GPU workers" in text
    assert "at most 32 GPUs (4 nodes x 8 GPUs (gpu-h100))" in text and "star-elastic-pipeline" in text


def test_cpu_workers_are_checked_against_worker_cpus(tmp_path: Path):
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump({"distill_phase1": {"num_workers": 9}, "distill_phase2": {}}))
    assert train_workers(config) == {"distill_phase1": (9, "CPU"), "distill_phase2": (2, "CPU")}
    with pytest.raises(ValueError, match=r"9 CPU workers.*at most 8 CPUs \(2 nodes x 4 CPUs \(cpu\)\)"):
        check_cluster_holds(demo_cluster_config(), config, "star-elastic-demo")


def test_workers_are_read_through_the_distill_section_class(tmp_path: Path):
    from pipelines.config import ConfigError

    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump({"distill_phase1": {"num_workerz": 9}, "distill_phase2": {"num_workers": "x"}}))
    with pytest.raises(ConfigError) as err:
        train_workers(config)
    assert err.value.problems == [
        "distill_phase1.num_workerz: unknown key; did you mean 'num_workers'?",
        "distill_phase2.num_workers: Input should be a valid integer, unable to parse string as an integer, got 'x'",
    ]


def test_plan_says_the_real_config_fits_on_the_committed_cluster():
    from components.plan import PlanHardware, make_plan
    from model.config import HybridConfig
    from pipelines.config import load_pipeline_config
    from pipelines.plan_cli import parent_config_path, phase_shapes

    pipeline = load_pipeline_config(REAL)
    parent = HybridConfig.from_json_file(parent_config_path(pipeline.parent.uri, None))
    group = real_cluster_config().worker_groups[0]
    hw = PlanHardware(gpus=real_cluster_config().max_gpus, gpu_mem_gb=80, gpus_per_node=group.gpus, host_mem_gb=960)
    plan = make_plan(parent, phase_shapes(pipeline, checkpointing=True, kd_chunk=1024), hw)
    assert plan.fits, [(p.name, p.total_bytes / 1e9) for p in plan.phases]


def test_rendering_refuses_a_runs_dir_the_cluster_does_not_mount(tmp_path: Path):
    elsewhere = real_cluster_config().model_copy(
        update={"runs_volume": real_cluster_config().runs_volume.model_copy(update={"mount_path": "/data/runs"})}
    )
    with pytest.raises(ValueError) as err:
        render_manifests(demo_cluster_config(), elsewhere)
    assert str(err.value) == (
        f"{REAL}: runs_dir = /mnt/runs, but the cluster of RayJob 'star-elastic-pipeline' mounts its runs volume "
        f"'star-elastic-runs' at /data/runs; set runs_dir: /data/runs in {REAL}, or runs_volume.mount_path in "
        "pipelines/kuberay/render.py"
    )
    config = tmp_path / "p.yaml"  # a relative runs_dir is read where the image's entrypoint runs (/app)
    config.write_text(yaml.safe_dump({"runs_dir": "out/runs"}))
    with pytest.raises(ValueError, match=r"runs_dir = 'out/runs' \(/app/out/runs in the pods\), but the cluster"):
        check_runs_volume(demo_cluster_config(), config, "star-elastic-demo")
    config.write_text(yaml.safe_dump({"run_name": "x"}))  # the default runs_dir, runs: /app/runs
    check_runs_volume(demo_cluster_config(), config, "star-elastic-demo")
