"""The sections of ``benchmarks/gpu_check.py``: one module per check, sharing :mod:`benchmarks.gpu.common`.

* :mod:`~benchmarks.gpu.kernels`: the mamba-ssm / causal-conv1d kernels against the reference scan and conv;
* :mod:`~benchmarks.gpu.decode`: decode tokens/s per budget and batch, eager and CUDA-graph captured
  (:mod:`~benchmarks.gpu.graphs`);
* :mod:`~benchmarks.gpu.distill`: one ZeRO-3 distillation step on NCCL;
* :mod:`~benchmarks.gpu.serve`: the evaluate stage and a serving replica on the device.

Each section module has ``plan(options) -> list[str]`` (the checks it reports, in order) and ``run(ctx)``
(emits one :class:`~benchmarks.gpu.common.Row` per check).
"""
