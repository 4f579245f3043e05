"""Instructions per cached decode step, ours against transformers' ``NemotronHForCausalLM``, under callgrind.

Wall-clock ratios on a shared 2-core machine move by +-10% from run to run (``bench_model.py`` reports
their interquartile range); instruction counts do not. This runs one child process under
``valgrind --tool=callgrind`` with instrumentation off until the models are built and warmed up, then
counts the instructions of ``--steps`` cached decode steps of each model separately (the child waits at
each phase boundary while this process zeroes and dumps callgrind's counters with ``callgrind_control``).
Same config, weights and inputs as ``bench_model.py``, one torch thread.

Instructions are a proxy for time, exact for the per-operator overhead that dominates a small model's
decode step (Python, dispatch, tensor bookkeeping), loose for the matrix products: under valgrind MKL
takes a different code path than on the bare CPU. Each batch size costs about two minutes (valgrind
runs the imports too).

    python benchmarks/bench_decode_instructions.py --batch 1 16 --json runs/bench_decode_instructions.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, save_json  # noqa: E402

PHASES = ("ours", "transformers")


def _child(args: argparse.Namespace) -> None:
    """Inside valgrind: build both models, warm up, then one phase per model, each between two handshakes."""
    import torch

    from benchmarks.bench_model import bench_config, build_models
    from model.decode import DecodePlan

    torch.set_num_threads(1)
    folder = Path(args.dir)
    cfg = bench_config(args.hidden, args.pattern, args.vocab)
    ours, hf = build_models(cfg, 0)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch[0], args.prompt), generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch[0], args.steps + 4), generator=g)

    def handshake(name: str) -> None:
        (folder / name).touch()
        while not (folder / f"{name}.ack").exists():
            time.sleep(0.05)

    plan = DecodePlan(ours)  # our decode step
    with torch.no_grad():
        cache = ours(prompt, use_cache=True).cache
        past = hf(prompt, use_cache=True).past_key_values
        for i in range(4):  # warm: first calls load code and grow nothing later
            plan(tokens[:, i : i + 1], cache)
            hf(tokens[:, i : i + 1], past_key_values=past, use_cache=True)
        steps = range(4, 4 + args.steps)
        handshake("start_ours")
        for i in steps:
            plan(tokens[:, i : i + 1], cache)
        handshake("start_transformers")
        for i in steps:
            hf(tokens[:, i : i + 1], past_key_values=past, use_cache=True)
        handshake("end")


def _summary(dump: Path) -> int:
    """Total instructions of one callgrind dump (its ``summary:`` line)."""
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"{dump}: no summary line")


def count(batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Instructions per decode step of both models at ``batch`` rows."""
    folder = Path(tempfile.mkdtemp(prefix="decode-instr-"))
    out = folder / "cg.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable,
           __file__, "--child", "--dir", str(folder), "--batch", str(batch), "--steps", str(args.steps),
           "--hidden", str(args.hidden), "--pattern", args.pattern, "--vocab", str(args.vocab),
           "--prompt", str(args.prompt)]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)

    def control(*flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, str(proc.pid)], check=True, capture_output=True)

    def wait_for(name: str) -> None:
        while not (folder / name).exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the callgrind child exited early: {proc.stderr.read()[-2000:]}")
            time.sleep(0.2)

    try:
        wait_for("start_ours")
        control("-i", "on")
        control("-z")
        (folder / "start_ours.ack").touch()
        wait_for("start_transformers")
        control("-d", "ours")
        control("-z")
        (folder / "start_transformers.ack").touch()
        wait_for("end")
        control("-d", "transformers")
        (folder / "end.ack").touch()
        proc.wait(timeout=600)
        dumps = sorted(folder.glob("cg.out.*"), key=lambda p: int(p.suffix[1:]))
        if len(dumps) < 2:
            raise RuntimeError(f"expected two callgrind dumps in {folder}, found {[d.name for d in dumps]}")
        per_step = {name: _summary(d) / args.steps for name, d in zip(PHASES, dumps, strict=False)}
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
    return {"batch": batch, **{f"{k}_per_step": v for k, v in per_step.items()},
            "ratio": per_step["transformers"] / per_step["ours"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=8, help="decode steps counted per model")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--pattern", default="M*MEM-ME")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"needs {' and '.join(missing)} (Debian package valgrind): apt-get install valgrind", file=sys.stderr)
        return 2
    rows = []
    for batch in args.batch:
        start = time.perf_counter()
        rows.append(count(batch, args))
        print(f"batch {batch}: counted in {time.perf_counter() - start:.0f} s", flush=True)
    print(f"pattern {args.pattern}, hidden {args.hidden}, vocab {args.vocab}; {args.prompt}-token prompt, "
          f"{args.steps} decode steps per model, 1 thread, callgrind")  # fmt: skip
    print(format_table(
        ["batch", "ours (M instructions / step)", "transformers", "transformers / ours"],
        [[r["batch"], r["ours_per_step"] / 1e6, r["transformers_per_step"] / 1e6, r["ratio"]] for r in rows],
    ))  # fmt: skip
    if args.json:
        save_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("child", "dir")}, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
