"""Elastic distillation: router + shared weights trained by KD from the frozen permuted parent, on Ray Train
with DeepSpeed, in two phases (short then long context), and the export of the one nested checkpoint.

* :class:`DistillConfig` - one phase, validated (:mod:`.config`).
* :func:`run_distill` - run a phase on Ray Train; :class:`DistillOutputs` (:mod:`.stage`).
* :func:`run_export` - the nested checkpoint from a distillation output (:mod:`.export`).
* :func:`train_loop_per_worker` - what each Ray Train worker runs (:mod:`.worker`).
"""

from components.distill.config import DistillConfig, preflight
from components.distill.export import run_export
from components.distill.stage import DistillOutputs, run_distill

__all__ = ["DistillConfig", "DistillOutputs", "preflight", "run_distill", "run_export"]
