"""Everything that needs a GPU, checked in one command: a table of pass / fail rows with their figures.

Sections (one module each under ``benchmarks/gpu/``; their docstrings say what each row measures):

1. ``kernels``: ``ssd_scan`` through mamba-ssm's ``mamba_chunk_scan_combined`` against the reference scan, and
   the ``causal_conv1d`` path of the Mamba mixer against its PyTorch path, in float32 and bfloat16: max relative
   error and kernel vs reference time.
2. ``decode``: a ~1B-parameter random nemotron_h-like model in bfloat16, three budgets as serving builds them:
   tokens/s at batch 1, 16 and 64, eager (the decode plan) and captured (the same step replayed as a CUDA
   graph, which must give the same greedy tokens and state; a capture that fails says why).
3. ``distill``: one ZeRO-3 distillation step on NCCL in one process (world size 1): step time and peak memory.
4. ``serve``: the evaluate stage and a serving replica (``ServingState``, no Ray Serve) answering one chat
   request per budget, both on the device.

Each section has its own time limit (its share of ``--budget-s``; time a section leaves unused goes to the
next) and its own error handling: a failure is a row that says why, never the end of the run. On CUDA every
section runs in a child process of its own (``--no-isolate``: all in this process). Exit status 1 when any row
failed, errored or timed out.

On a GPU machine, after ``pip install -c constraints.txt -e '.[gpu]'``::

    python benchmarks/gpu_check.py --json gpu_check.json

On a CPU (the smoke run the unit tests use; tiny configs, gloo instead of NCCL, kernels skipped)::

    python benchmarks/gpu_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, machine_info, save_json  # noqa: E402
from benchmarks.gpu.common import FAILED, Options, Row  # noqa: E402
from benchmarks.gpu.runner import SECTIONS, run_sections  # noqa: E402

PACKAGES = ("torch", "mamba-ssm", "causal-conv1d", "triton", "deepspeed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny configs and few steps (the CPU smoke run)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for all sections together")
    p.add_argument("--sections", nargs="+", choices=[s.name for s in SECTIONS], default=None, help="default: all")
    p.add_argument("--json", type=Path, default=None, help="also write every row and its figures here")
    p.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (default: a temporary folder)")
    p.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=None,
        help="each section in its own process (default: on CUDA)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False); use --device cpu")
    if args.budget_s <= 0:
        p.error(f"--budget-s: must be positive, got {args.budget_s}")
    if args.isolate is None:
        args.isolate = args.device == "cuda"
    return args


def versions() -> dict[str, str | None]:
    """Installed versions of the packages the figures depend on (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table: section, check, status, figures (``name value``), note."""
    body = [
        [r.section, r.check, r.status, ", ".join(f"{k} {_cell(v)}" for k, v in r.figures.items()), r.note] for r in rows
    ]
    return format_table(["section", "check", "status", "figures", "note"], body)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    sections = [s for s in SECTIONS if args.sections is None or s.name in args.sections]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    options = Options(device=args.device, quick=args.quick, workdir=str(workdir))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    found = versions()
    print(f"gpu_check on {gpu or 'cpu'}; " + ", ".join(f"{k} {v or 'missing'}" for k, v in found.items()), flush=True)

    def log(message: str) -> None:
        print(f"[gpu_check] {message}", file=sys.stderr, flush=True)

    start = time.monotonic()
    try:
        rows = run_sections(sections, options, args.budget_s, args.isolate, log)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    total = time.monotonic() - start
    failed = [r for r in rows if r.status in FAILED]
    print(table(rows))
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "error", "timeout", "skip")}
    print(f"{len(rows)} checks in {total:.0f} s: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n), flush=True)
    if args.json:
        save_json(args.json, {
            "device": args.device, "gpu": gpu, "versions": found, "machine": machine_info(torch.get_num_threads()),
            "args": {k: str(v) for k, v in vars(args).items()}, "total_s": total, "passed": not failed,
            "rows": [r.to_dict() for r in rows],
        })  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
