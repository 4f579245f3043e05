"""The ``star-elastic`` command line. Every subcommand is a thin shell over one validated config.

Nothing is parsed at import time, so the module is safe to import from Ray workers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from components.data.inherit import Inherited
    from components.parent import ParentTrainConfig
    from components.rank import RankConfig


def _load_yaml(path: str | None) -> dict:
    """A YAML file's top-level mapping (``{}`` without a path); errors name the file and line."""
    from pipelines.config import read_yaml

    return read_yaml(path) if path else {}


def _is_pipeline_yaml(raw: dict) -> bool:
    """Whether a YAML mapping is a pipeline config (any top-level key of one) rather than one stage's fields."""
    from pipelines.config import PipelineConfig

    keys = {f.alias or name for name, f in PipelineConfig.model_fields.items()} | set(PipelineConfig.model_fields)
    return bool(keys & set(raw))


def _inherited(raw: dict) -> tuple[Inherited, list[str]]:
    """A pipeline YAML's top-level ``data`` / ``markers`` and one line per problem in them (nothing else of the
    pipeline is validated: a subcommand needs only its section)."""
    from pydantic import ValidationError

    from components.data.inherit import Inherited
    from pipelines.config import PipelineConfig, describe

    try:
        return Inherited.of(raw), []
    except ValidationError as err:
        return Inherited(), describe(err, model=PipelineConfig)


def parent_train_config(args: argparse.Namespace) -> ParentTrainConfig:
    """``parent train``'s config: the pipeline's parent stage builds it (:func:`pipelines.sections.parent_train_config`,
    the top-level data and markers inherited) from ``--config``'s ``parent.train`` section, or from a YAML of
    ParentTrainConfig fields; then the flags."""
    from pydantic import ValidationError

    from components.data.inherit import Inherited
    from components.parent import ParentTrainConfig
    from pipelines.config import ConfigError, PipelineConfig, describe
    from pipelines.sections import parent_train_config as build

    raw = _load_yaml(args.config)
    inherit, problems, prefix = Inherited(), [], ()
    if _is_pipeline_yaml(raw):  # a pipeline YAML: its parent.train section
        inherit, problems = _inherited(raw)
        raw, prefix = dict((raw.get("parent") or {}).get("train") or {}), ("parent", "train")
    flags = {"output_dir": args.out, "steps": args.steps, "threads": args.threads}
    try:
        cfg = build(raw, inherit, **{k: v for k, v in flags.items() if v})
    except ValidationError as err:  # one line per problem, at its path in the pipeline YAML
        model = PipelineConfig if prefix else ParentTrainConfig  # the class the paths start from
        problems = describe(err, prefix, model) + problems
    if problems:
        raise ConfigError(args.config or "parent train", problems)
    return cfg


def _cmd_parent_train(args: argparse.Namespace) -> int:
    from components.parent import train_parent
    from components.tracking import make_tracker

    cfg = parent_train_config(args)
    tracker = make_tracker(args.tracking_uri, "star-elastic-parent", run_name="parent-train")
    metrics = train_parent(cfg, tracker)
    tracker.finish()
    print(json.dumps(metrics, indent=2))
    return 0


def _cmd_example_chat(args: argparse.Namespace) -> int:
    from pipelines.example_assets import make_chat_example

    print(json.dumps(make_chat_example(args.out, seed=args.seed), indent=2))
    return 0


def rank_config(args: argparse.Namespace) -> RankConfig:
    """``rank``'s config: the pipeline's rank stage builds it (:func:`pipelines.sections.rank_config`, the
    calibration inheriting the top-level data and markers) from ``--config``'s ``rank`` section, or from a YAML
    of RankConfig fields; then ``--set`` on that section, ``--parent`` and ``--out``."""
    from pydantic import ValidationError

    from components.data.inherit import Inherited
    from components.rank import RankConfig
    from pipelines.config import ConfigError, apply_overrides, describe
    from pipelines.sections import rank_config as build

    raw = _load_yaml(args.config)
    inherit, problems = Inherited(), []
    if _is_pipeline_yaml(raw):  # a pipeline YAML: take its rank section
        inherit, problems = _inherited(raw)
        raw = dict(raw.get("rank") or {})
    apply_overrides(raw, args.set or [])
    flags = {"parent_uri": args.parent, "output_dir": args.out}
    try:
        cfg = build(raw, inherit, **{k: v for k, v in flags.items() if v})
    except ValidationError as err:  # one line per problem, like the pipeline's config
        problems = describe(err, model=RankConfig) + problems
    if problems:
        raise ConfigError(args.config or "rank", problems)
    return cfg


def _cmd_rank(args: argparse.Namespace) -> int:
    """Rank and permute a parent: the pipeline's ``rank`` section (or a bare RankConfig mapping) + flags."""
    from components.rank import run_rank
    from components.tracking import make_tracker

    cfg = rank_config(args)
    tracker = make_tracker(args.tracking_uri, "star-elastic-rank", run_name="rank")
    try:
        out = run_rank(cfg, tracker)
    finally:
        tracker.finish()
    print(json.dumps(out.model_dump(), indent=2, default=str))
    return 0


def _cmd_extract(args: argparse.Namespace) -> int:
    """Any nested checkpoint the pipeline writes: dense (export) or FP8 / NVFP4 (quantize), local or s3://."""
    import torch

    from components.storage import materialize
    from model.checkpoint import inspect_checkpoint

    folder = materialize(args.checkpoint)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{args.checkpoint}: not a checkpoint folder (no config.json)")
    info = inspect_checkpoint(folder, verify=False)  # extraction checks the manifest as it reads
    algo = info.raw["quantization_config"]["quant_algo"] if info.quantized else None
    shards = {} if args.max_shard_size is None else {"max_shard_size": args.max_shard_size}
    if algo:  # the quantize stage's output: slice the quantized tensors, never requantize
        from model.quant.nesting import extract_quantized_budget

        if args.dtype:
            raise ValueError(f"--dtype: {args.checkpoint} is {algo}-quantized; its tensors are written as they are")
        out = extract_quantized_budget(folder, args.budget, args.out, **shards)
        what = f"{algo} nemotron_h checkpoint"
    else:
        from model.elastic.export import extract_budget

        dtype = getattr(torch, args.dtype) if args.dtype else None
        out = extract_budget(folder, args.budget, args.out, dtype=dtype, **shards)
        what = "nemotron_h checkpoint"
    print(f"wrote budget {args.budget!r} as a standalone {what}: {out}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Check everything first (one line per problem, exit 2); then print the plan (--dry-run) or run."""
    from pipelines.preflight import check_pipeline, dry_run, report

    overrides = args.set or []
    if args.dry_run:
        return dry_run(args.config, overrides, args.only, args.from_stage)
    checked = check_pipeline(args.config, overrides, args.only, args.from_stage)
    if checked.problems:
        report(checked.problems)
        return 2
    from pipelines.run import run_pipeline

    return run_pipeline(args.config, overrides, force_from=args.from_stage, only=args.only, checked=checked)


def _cmd_kfp_compile(args: argparse.Namespace) -> int:
    from pipelines.kfp_pipeline import compile_pipeline
    from pipelines.kuberay.render import cluster_config

    out = compile_pipeline(args.config, args.out, cluster_config(args.cluster, args.registry, args.namespace))
    print(f"wrote Kubeflow pipeline {out}")
    return 0


def _cmd_kfp_run_stage(args: argparse.Namespace) -> int:
    """One stage by itself, as a Kubeflow step's RayJob runs it: upstream pulled, output published."""
    import base64
    import os
    import tempfile
    from pathlib import Path

    from pipelines.kfp_components import DEFAULT_STAGES_MODULE, run_stage_only
    from pipelines.runner import StageFailed

    if args.workdir:
        os.chdir(args.workdir)  # before reading --config: relative paths resolve where the stages run
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.config) if args.config else Path(tmp) / "config.yaml"
        if args.config_b64:
            path.write_text(base64.b64decode(args.config_b64).decode())
        try:
            result = run_stage_only(
                path,
                args.stage,
                args.set or [],
                stages_module=args.stages_module or DEFAULT_STAGES_MODULE,
                storage_uri=args.storage_uri,
                run_key=args.run_key,
                tracking=not args.no_tracking,
                upstream=args.upstream,
                config_file=args.config,
            )
        except StageFailed as err:
            print(f"star-elastic: stage {args.stage!r} failed: {err}", file=sys.stderr)
            return 1
    print(json.dumps({"stage": result.stage, "status": result.status, "uri": result.uri}))
    return 0


def _cmd_kfp_rbac(args: argparse.Namespace) -> int:
    from pipelines.kfp_pipeline import rbac_yaml

    text = rbac_yaml(
        namespace=args.namespace,
        service_account=args.service_account,
        service_account_namespace=args.service_account_namespace,
    )
    print(text, end="")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from components.serving.loading import preflight

    preflight(args.model_uri, args.config)  # a broken local checkpoint is one line, before Ray starts
    from components.serving.app import serve_foreground

    config = args.config
    if args.model_uri.startswith("models:/"):  # the pipeline's store by default; a bad URI fails here, before Ray
        from components.model_uri import find_model_version, registry_store
        from components.serving.config import load_config

        config = load_config(args.config)
        store = registry_store(config.tracking_uri)
        config = config.model_copy(update={"tracking_uri": store.tracking_uri})
        find_model_version(args.model_uri, store.tracking_uri, config.format, store.registry_uri)
    serve_foreground(args.model_uri, port=args.port, config=config, host=args.host, check=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pipelines.kuberay.config import DEFAULT_NAMESPACE

    parser = argparse.ArgumentParser(prog="star-elastic", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    parent = sub.add_parser("parent", help="train a parent from scratch (the demo's, or on your tokenizer and data)")
    psub = parent.add_subparsers(dest="parent_command", required=True)
    train = psub.add_parser("train", help="train a parent on the 'parent.train' tokenizer, data and eval set")
    train.add_argument("--config", help="YAML with a 'parent' section (or the section itself)")
    train.add_argument("--out", help="output checkpoint folder")
    train.add_argument("--steps", type=int, help="override the number of steps")
    train.add_argument("--threads", type=int, help="override the torch CPU thread count")
    train.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or off)")
    train.set_defaults(func=_cmd_parent_train)

    example = sub.add_parser("example", help="make the inputs of a shipped example config")
    esub = example.add_subparsers(dest="example_command", required=True)
    echat = esub.add_parser("chat", help="BPE tokenizer, chat JSONL with reasoning, text rows, eval set")
    echat.add_argument("--out", default="runs/chat-example/assets", help="output folder")
    echat.add_argument("--seed", type=int, default=0, help="seed of the generated data")
    echat.set_defaults(func=_cmd_example_chat)

    rank = sub.add_parser("rank", help="importance ranking (REAP for experts) and permutation of a parent")
    rank.add_argument("--config", help="pipeline YAML (its 'rank' section) or a YAML of RankConfig fields")
    rank.add_argument("--parent", help="parent checkpoint folder or s3:// URI (RankConfig.parent_uri)")
    rank.add_argument("--out", help="output folder: permuted checkpoint, rankings.json, plot (RankConfig.output_dir)")
    rank.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a RankConfig value (repeatable)")
    rank.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or off)")
    rank.set_defaults(func=_cmd_rank)

    run = sub.add_parser("run", help="run the whole pipeline (resumes at the first stage whose inputs changed)")
    run.add_argument("config", help="pipeline YAML, e.g. pipelines/configs/demo.yaml")
    run.add_argument("--from", dest="from_stage", help="force this stage and every later one to run again")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="check every section, the parent's architecture and the URIs, print the plan; run nothing "
        "(exit 2 and one line per problem when something is wrong)",
    )
    run.add_argument("--only", action="append", metavar="STAGE", help="run just this stage (its inputs must be done)")
    run.set_defaults(func=_cmd_run)

    kfp = sub.add_parser("kfp", help="Kubeflow Pipelines")
    ksub = kfp.add_subparsers(dest="kfp_command", required=True)
    kcompile = ksub.add_parser(
        "compile", help="compile the DAG to a KFP v2 YAML (each step submits a RayJob; one parameter per config key)"
    )
    kcompile.add_argument("config", help="pipeline YAML: its values become the parameters' defaults")
    kcompile.add_argument("--out", default="pipeline.yaml", help="output YAML path (default pipeline.yaml)")
    kcompile.add_argument("--cluster", choices=["demo", "real"], default="demo", help="cluster shape for the RayJobs")
    kcompile.add_argument("--registry", default="", help="image registry prefix, e.g. ghcr.io/acme")
    kcompile.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="namespace the RayJobs are created in")
    kcompile.set_defaults(func=_cmd_kfp_compile)
    kstage = ksub.add_parser(
        "run-stage", help="run one stage by itself, as a step's RayJob does (pull upstream stages, publish its own)"
    )
    kstage.add_argument("stage", help="the stage to run; every stage upstream of it must be finished")
    source = kstage.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="pipeline YAML file")
    source.add_argument("--config-b64", help="pipeline YAML, base64-encoded (how a RayJob receives it)")
    kstage.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    kstage.add_argument("--workdir", help="change to this folder first (relative config paths resolve there)")
    kstage.add_argument("--storage-uri", help="storage root to pull upstream stages from and publish to")
    kstage.add_argument("--stages-module", help="module or .py file of the stages (default pipelines.stages)")
    kstage.add_argument("--run-key", help="groups the MLflow runs of one pipeline execution under one parent run")
    kstage.add_argument("--no-tracking", action="store_true", help="log nothing to MLflow")
    kstage.add_argument("--upstream", action="append", help="URI of a direct upstream stage (repeatable)")
    kstage.set_defaults(func=_cmd_kfp_run_stage)
    krbac = ksub.add_parser("rbac", help="print the Role + RoleBinding that let the steps manage RayJobs")
    krbac.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="namespace the RayJobs are created in")
    krbac.add_argument("--service-account", default="pipeline-runner", help="service account the steps run as")
    krbac.add_argument("--service-account-namespace", default="kubeflow", help="namespace of that service account")
    krbac.set_defaults(func=_cmd_kfp_rbac)

    from pipelines.kuberay.cli import add_kuberay_parser

    add_kuberay_parser(sub)

    serve_p = sub.add_parser("serve", help="serve every budget of one checkpoint (OpenAI-compatible, Ray Serve)")
    serve_p.add_argument("model_uri", help="nested checkpoint folder, s3://... or models:/NAME@champion")
    serve_p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    serve_p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve_p.add_argument("--config", help="serving YAML/JSON (or a pipeline YAML: its 'serve' section)")
    serve_p.set_defaults(func=_cmd_serve)

    extract = sub.add_parser(
        "extract", help="cut one budget out of a nested checkpoint, dense or FP8 / NVFP4 (zero-shot, no requantizing)"
    )
    extract.add_argument("checkpoint", help="nested checkpoint folder (export or quantize output) or s3:// prefix")
    extract.add_argument("--budget", required=True, help="budget name (see config.json 'elastic')")
    extract.add_argument("--out", required=True, help="output folder for the standalone checkpoint")
    extract.add_argument(
        "--max-shard-size",
        default=None,
        help="largest weight file before sharding with an index, as save_pretrained ('5GB', '500MB'; default 50GB)",
    )
    extract.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="dense: write in this dtype"
    )
    extract.set_defaults(func=_cmd_extract)

    from pipelines.plan_cli import add_plan_parser

    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pipelines.errors import machine_fault

    try:
        return args.func(args)
    except Exception as err:
        fault = machine_fault(err)  # a full disk, a refused permission, storage gone: one line, no traceback
        if fault is not None:
            print(f"star-elastic: error: {fault}", file=sys.stderr)
            return 1
        if not isinstance(err, ValueError | FileNotFoundError):
            raise
        for line in getattr(err, "problems", None) or [f"star-elastic: error: {err}"]:  # a ConfigError: its lines
            print(line, file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover - the console script calls main(); this serves `python -m`
    sys.exit(main())
