"""``star-elastic plan CONFIG``: the memory, fit and time plan of a pipeline config's distillation phases.

The plan needs only the parent's ``config.json``. It is read from ``--parent-config`` (a file or a
checkpoint folder), else from the pipeline's ``parent.uri`` (a local folder, or just that one object
of an ``s3://`` prefix), else from ``pipelines/assets/parent-configs/<last part of parent.uri>.json``:
copies of the configs of the parents the shipped pipeline configs name, so a team can plan without
credentials for the bucket. Each distillation phase's config is built by the pipeline's own stage
(defaults filled in, data inherited), so the plan sees exactly the phase that would run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets" / "parent-configs"


def add_plan_parser(sub: Any) -> None:
    """Register the ``plan`` subcommand on the CLI's subparsers. The hardware options fill
    :class:`~components.plan.PlanHardware` (each option's ``dest`` is the field it sets; unset: the field's
    default); ``--checkpointing`` / ``--kd-chunk`` override what each phase's config says."""
    from components.plan import PlanHardware

    hw = PlanHardware.model_fields
    p = sub.add_parser("plan", help="per-rank memory, fit verdict, time and tokens of every distillation phase")
    p.add_argument("config", help="pipeline YAML, e.g. pipelines/configs/real.yaml")
    p.add_argument("--gpus", type=int, help="ranks to plan for (default: each phase's num_workers)")
    for flag, dest, kind, text in (
        ("--gpu-mem", "gpu_mem_gb", float, "memory of one accelerator in GB"),
        ("--host-mem", "host_mem_gb", float, "host memory of one node in GB"),
        ("--gpus-per-node", "gpus_per_node", int, "ranks per node"),
        ("--peak-tflops", "peak_tflops", float, "bf16 dense peak per accelerator (H100: 989)"),
        ("--utilization", "utilization", float, "fraction of the peak sustained"),
        ("--interconnect-gbps", "interconnect_gbps", float, "network Gb/s per rank for ZeRO's collectives"),
    ):
        p.add_argument(flag, dest=dest, type=kind, help=f"{text} (default {hw[dest].default:g})")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when the phases use GPUs, else cpu")
    p.add_argument("--parent-config", help="the parent's config.json (or its checkpoint folder)")
    p.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        help="plan with / without activation checkpointing (default: each phase's activation_checkpointing)",
    )
    p.add_argument("--kd-chunk", type=int, help="token rows per KD loss chunk (default: each phase's kd_chunk_tokens)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON ('-': print JSON instead of tables)")
    p.add_argument("--tracking-uri", help="log the plan into a new MLflow run 'plan' of the config's experiment")
    p.set_defaults(func=cmd_plan)


def parent_config_path(parent_uri: str | None, override: str | None) -> Path:
    """Where the parent's ``config.json`` is read from (see the module docstring for the order)."""
    if override:
        path = Path(override)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"--parent-config {override}: no config.json there")
        return path
    if not parent_uri:
        raise ValueError(
            "parent.uri is null (the pipeline trains its parent): pass --parent-config with the parent's config.json"
        )
    from components.storage import is_s3

    if not is_s3(parent_uri):
        path = Path(parent_uri) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"parent.uri {parent_uri}: no config.json; pass --parent-config")
        return path
    fetched = _fetch_s3_config(parent_uri)
    if fetched is not None:
        return fetched
    bundled = ASSETS / f"{parent_uri.rstrip('/').rsplit('/', 1)[-1]}.json"
    if bundled.is_file():
        return bundled
    raise FileNotFoundError(
        f"parent.uri {parent_uri}: its config.json could not be read and there is no copy at {bundled}; "
        "pass --parent-config"
    )


def _fetch_s3_config(uri: str) -> Path | None:
    """Download only ``<uri>/config.json`` into a temporary file; None when S3 cannot be reached."""
    import tempfile

    try:
        from components.storage import s3_client, split_s3

        bucket, prefix = split_s3(uri)
        key = f"{prefix.rstrip('/')}/config.json" if prefix else "config.json"
        out = Path(tempfile.mkdtemp(prefix="plan-")) / "config.json"
        s3_client().download_file(bucket, key, str(out))
        return out
    except Exception:  # no credentials, no endpoint, no object: fall back to the bundled copy
        return None


def distill_configs(pipeline: Any) -> dict[str, Any]:
    """Each distillation phase's config (a DistillConfig) as the pipeline's own stage builds it, by name."""
    from pipelines.runner import StageContext
    from pipelines.stages import build_distill1, build_distill2

    builders = {"distill_phase1": build_distill1, "distill_phase2": build_distill2}
    return {name: build(StageContext(pipeline, pipeline.run_dir, name)) for name, build in builders.items()}


def phase_shapes(pipeline: Any, checkpointing: bool | None = None, kd_chunk: int | None = None) -> list[Any]:
    """The plan's view of each distillation section: its own ``activation_checkpointing`` and
    ``kd_chunk_tokens`` unless ``checkpointing`` / ``kd_chunk`` override them."""
    from components.plan import PhaseShape

    overrides = {"activation_checkpointing": checkpointing, "kd_chunk_tokens": kd_chunk}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return [PhaseShape.of(name, cfg).model_copy(update=overrides) for name, cfg in distill_configs(pipeline).items()]


def cmd_plan(args: argparse.Namespace) -> int:
    """Print (and optionally write / log) the plan; exit status 1 when a phase does not fit."""
    from components.plan import PlanHardware, format_plan, log_plan, make_plan, plan_json
    from model.config import HybridConfig
    from pipelines.config import load_pipeline_config

    pipeline = load_pipeline_config(args.config, args.set or [])
    source = parent_config_path(pipeline.parent.uri, args.parent_config)
    model_config = HybridConfig.from_json_file(source)
    phases = phase_shapes(pipeline, args.checkpointing, args.kd_chunk)
    gpu = any(cfg.use_gpu for cfg in distill_configs(pipeline).values())
    given = {f: getattr(args, f) for f in PlanHardware.model_fields if getattr(args, f, None) is not None}
    hw = PlanHardware(**{"device": "cuda" if gpu else "cpu", **given})
    plan = make_plan(model_config, phases, hw)
    data = {**plan_json(plan), "parent_config": str(source)}
    if args.json == "-":
        print(json.dumps(data, indent=2))
    else:
        print(f"parent config: {source}")
        print(format_plan(plan))
        if args.json:
            Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    if args.tracking_uri:
        from components.tracking import make_tracker

        tracker = make_tracker(args.tracking_uri, pipeline.experiment, run_name="plan")
        try:
            log_plan(plan, tracker)
        finally:
            tracker.finish()
    return 0 if plan.fits else 1
