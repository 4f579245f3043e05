"""Run a stage's work function as a Ray task with the resources it needs, so the driver never holds a model.

The driver-side stages (export, evaluate, quantize, register, and the consolidation that ends each
distillation phase) each name a :class:`TaskResources` in their config. :func:`run_task` runs the
stage's work function in one Ray task with those resources and returns its result; the driver
only builds configs, waits, and records what came back.

Design choices:

* The task runs the same function the stage would run in-process, with the same arguments:
  components keep a plain ``run_*(config, tracker)`` that unit tests and notebooks call directly.
* The tracker crosses as its MLflow address (tracking URI, run id, experiment, registry URI): the task logs into
  the stage's own run (:func:`~components.tracking.tracker_for_worker`), never closes it, and a
  driver without tracking gives the task a :class:`~components.tracking.NullTracker`.
* One task per worker process (``max_calls=1``): the process exits when the task returns, so the
  host and GPU memory of the model it loaded are released at once, not kept by an idle worker.
* No retries (``max_retries=0``): a stage that fails (an exception, or its process killed for
  memory) fails once, with the cause; the pipeline's resume re-runs it after the fix.
* An exception raised in the task is raised again on the driver as the same type with the same
  message (the remote traceback chained as its cause), so callers and tests see what an in-process
  call raises. Ray's own failures (a crashed worker, an out-of-memory kill) pass through as Ray
  raises them.
* A request no node of a local Ray runtime can ever satisfy (a GPU on a laptop, more CPUs than the
  machine has) is refused before submitting, naming the config field. On a cluster the runtime was
  not started by this process and may grow (an autoscaler), so the task is submitted and waits.
* Ray is started locally (2 CPUs or what the task needs, no dashboard) when no runtime is running,
  and shut down again afterwards, as the rank stage does; inside ``star-elastic run`` the pipeline's
  runtime is used.
* The task reads and writes the paths the driver names: on a multi-node cluster the run folder
  (``runs_dir``) must be a filesystem every node mounts, as it already must be for the distillation
  workers that read the rank stage's output.
* Progress: the driver prints one line when the task starts and one when it ends; what the task
  prints is forwarded by Ray, and its progress goes through :func:`components.progress.progress_bar`
  (plain lines, or one line the driver draws when it writes to a terminal).
* A runtime started here gives its workers the pipeline's quiet-library setup
  (:func:`components.console.worker_runtime_env`), as the pipeline's own runtime does.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from components.console import worker_runtime_env
from components.tracking import MlflowTracker, NullTracker, Tracker


class TaskResources(BaseModel):
    """What Ray reserves for one stage task (the defaults fit the demo on a 2-core laptop)."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(
        2, gt=0, description="CPUs reserved for the task; torch in the task runs this many threads (at least 1)."
    )
    num_gpus: float = Field(
        0, ge=0, description="GPUs reserved for the task (0: a CPU task). Ray makes them the task's visible devices."
    )
    memory_gib: float | None = Field(
        None,
        gt=0,
        description="Host memory reserved for the task in GiB, so Ray places it on a node with room for the model "
        "(null: nothing reserved).",
    )
    accelerator_type: str | None = Field(
        None,
        min_length=1,
        description="Ray accelerator type the task's GPU must be (e.g. H100, A100); null: any. Needs num_gpus > 0.",
    )

    @model_validator(mode="after")
    def _accelerator_needs_gpu(self) -> TaskResources:
        if self.accelerator_type is not None and self.num_gpus == 0:
            raise ValueError(
                f"accelerator_type {self.accelerator_type!r} needs a GPU: set num_gpus (e.g. 1) or remove "
                "accelerator_type"
            )
        return self

    @property
    def threads(self) -> int:
        """torch CPU threads in the task: ``num_cpus`` rounded down, at least 1."""
        return max(1, int(self.num_cpus))

    def ray_options(self) -> dict[str, Any]:
        """Keyword arguments of Ray's ``.options()`` for these resources."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_gib is not None:
            options["memory"] = int(self.memory_gib * 2**30)
        if self.accelerator_type is not None:
            options["accelerator_type"] = self.accelerator_type
        return options

    def describe(self) -> str:
        """One line, e.g. ``8 CPU, 1 GPU (H100), 200 GiB``."""
        parts = [f"{self.num_cpus:g} CPU"]
        if self.num_gpus:
            parts.append(f"{self.num_gpus:g} GPU" + (f" ({self.accelerator_type})" if self.accelerator_type else ""))
        if self.memory_gib is not None:
            parts.append(f"{self.memory_gib:g} GiB")
        return ", ".join(parts)


class TaskInfo(BaseModel):
    """Where and how long a stage task ran (recorded in the stage's outputs)."""

    name: str = Field(description="The task's name (the stage, e.g. 'evaluate').")
    pid: int = Field(description="Process id of the worker that ran the task.")
    node: str = Field(description="Host name of the node that ran it.")
    seconds: float = Field(description="Wall time of the work function inside the task.")
    resources: str = Field(description="The reserved resources, as TaskResources.describe() writes them.")


class RemoteTraceback(Exception):
    """The traceback of an exception raised inside a stage task (chained as the re-raised error's cause)."""


# ---------------------------------------------------------------------- the Ray runtime
@contextlib.contextmanager
def ray_runtime(num_cpus: float = 2) -> Iterator[bool]:
    """The running Ray runtime, or a local one started here (at least 2 CPUs, no dashboard) and shut down
    on exit. Yields whether it was started here."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=max(2, math.ceil(num_cpus)),
            include_dashboard=False,
            log_to_driver=True,
            runtime_env=worker_runtime_env(local=True),
        )
    try:
        yield started
    finally:
        if started:
            ray.shutdown()


def _runtime_is_local() -> bool:
    """Whether this process started the Ray runtime it is connected to (a local one that cannot grow)."""
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    return bool(getattr(node, "head", False))


def _node_fits(available: dict[str, float], resources: TaskResources) -> bool:
    need = {"CPU": resources.num_cpus, "GPU": resources.num_gpus}
    if resources.memory_gib is not None:
        need["memory"] = resources.memory_gib * 2**30
    if resources.accelerator_type is not None:
        need[f"accelerator_type:{resources.accelerator_type}"] = 0.001
    return all(available.get(key, 0.0) >= value for key, value in need.items() if value > 0)


def check_feasible(resources: TaskResources, field: str) -> None:
    """Refuse a request no node of a local runtime can ever satisfy; ``field`` names the config field."""
    import ray

    if not _runtime_is_local():
        return  # a cluster may add nodes (an autoscaler): the task waits for them
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if any(_node_fits(n, resources) for n in nodes):
        return
    have = "; ".join(
        f"{n.get('CPU', 0):g} CPU, {n.get('GPU', 0):g} GPU, {n.get('memory', 0) / 2**30:.1f} GiB" for n in nodes
    )
    raise ValueError(
        f"{field}: the task asks for {resources.describe()} but no node of the local Ray runtime has that "
        f"({have or 'no nodes'}); lower {field} to fit this machine, or run on a Ray cluster that has such a node"
    )


# ---------------------------------------------------------------------- the task
def _tracker_address(tracker: Tracker | None) -> tuple[str, str, str, str | None] | None:
    if not isinstance(tracker, MlflowTracker):
        return None
    return tracker.tracking_uri, tracker.run_id, tracker.experiment, tracker.registry_uri


def _execute(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tracking: tuple[str, str, str, str | None] | None,
    with_tracker: bool,
    threads: int,
    name: str,
    resources: str,
) -> tuple[Any, TaskInfo]:
    """The body of every stage task: set the threads, re-attach the tracker, call ``fn``, time it."""
    import torch

    from components.tracking import tracker_for_worker

    torch.set_num_threads(threads)
    if with_tracker:
        kwargs = {**kwargs, "tracker": tracker_for_worker(*tracking) if tracking else NullTracker()}
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    info = TaskInfo(
        name=name,
        pid=os.getpid(),
        node=socket.gethostname(),
        seconds=time.perf_counter() - start,
        resources=resources,
    )
    return result, info


def run_task(
    fn: Callable[..., Any],
    *args: Any,
    resources: TaskResources,
    name: str,
    field: str,
    tracker: Tracker | None = None,
    pass_tracker: bool = True,
    progress: bool = True,
    **kwargs: Any,
) -> tuple[Any, TaskInfo]:
    """``fn(*args, **kwargs, tracker=...)`` run as one Ray task with ``resources``; returns (its result, TaskInfo).

    ``name``: the task's name in Ray and in progress lines; ``field``: the config field holding
    ``resources`` (named in errors). ``tracker``: the stage's tracker, re-attached in the task and
    passed as ``tracker=`` unless ``pass_tracker`` is False. Arguments and the result travel through
    Ray's object store (pickled): pass configs and paths, never tensors or models.
    """
    import ray
    from ray.exceptions import RayTaskError

    with ray_runtime(resources.num_cpus):
        check_feasible(resources, field)
        remote = ray.remote(max_calls=1)(_execute).options(
            name=name, max_retries=0, **resources.ray_options()
        )  # fmt: skip
        if progress:
            print(f"[{name}] running as a Ray task ({resources.describe()})", flush=True)
        start = time.perf_counter()
        ref = remote.remote(
            fn, args, kwargs, _tracker_address(tracker), pass_tracker, resources.threads, name, resources.describe()
        )
        try:
            result, info = ray.get(ref)
        except RayTaskError as err:
            cause = err.cause
            if isinstance(cause, Exception) and not isinstance(cause, RayTaskError):
                raise cause from RemoteTraceback(str(err))  # str(err): the task's traceback, as Ray prints it
            raise
    if progress:
        waited = time.perf_counter() - start
        print(
            f"[{name}] task done in {info.seconds:.1f}s ({waited:.1f}s with start-up) on {info.node}, pid {info.pid}",
            flush=True,
        )
    return result, info
