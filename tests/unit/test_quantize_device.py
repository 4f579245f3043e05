"""Where the quantize stage runs its FP8 calibration: on the task's GPU when it reserves one that torch sees,
otherwise on the CPU, with the checkpoint written the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from components.quantize import calibration_device
from components.stage_task import TaskResources
from model.quant import quantize_checkpoint
from tests.unit.test_quant_checkpoint import build_nested, calib_batches, file_tensors


def test_calibration_runs_on_cuda_only_when_the_task_reserves_a_visible_gpu():
    gpu = TaskResources(num_gpus=1)
    cpu = TaskResources(num_gpus=0)
    assert calibration_device(gpu, cuda_available=True) == "cuda"
    assert calibration_device(TaskResources(num_gpus=0.5), cuda_available=True) == "cuda"  # a GPU share
    assert calibration_device(cpu, cuda_available=True) == "cpu"  # a GPU on the node that the task did not reserve
    assert calibration_device(cpu, cuda_available=False) == "cpu"
    with pytest.warns(UserWarning, match=r"quantize.resources reserves 1.0 GPU\(s\) but torch sees none"):
        assert calibration_device(gpu, cuda_available=False) == "cpu"


def test_an_explicit_cpu_device_writes_what_the_default_writes(tmp_path: Path):
    nested = build_nested(tmp_path / "nested")
    default = quantize_checkpoint(nested, tmp_path / "default", "fp8", "default", calib_batches())
    on_cpu = quantize_checkpoint(
        nested, tmp_path / "cpu", "fp8", "default", calib_batches(), device=torch.device("cpu")
    )
    got, want = file_tensors(on_cpu), file_tensors(default)
    assert got.keys() == want.keys()
    assert any(k.endswith("input_scale") for k in want)  # the calibration's output is among the compared tensors
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
