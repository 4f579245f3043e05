"""Run every benchmark in sequence with its default settings (``make bench``).

Each script prints its own table and ratios; figures worth keeping go into
``benchmarks/RESULTS.md`` together with the command that produced them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = [
    "bench_model.py",
    "bench_decode_instructions.py",  # needs valgrind (Debian package); exits 2 with a message without it
    "bench_elastic_step.py",
    "bench_budget_decode.py",
    "bench_quant_decode.py",
    "bench_peers.py",  # builds llama.cpp once into $STAR_ELASTIC_CACHE/peers; skipped with a reason without CMake
    "bench_serving.py",
    "bench_reap.py",
    "bench_zero_memory.py",
    "bench_kd_memory.py",
    "bench_baselines.py",  # runs the demo and demo-long pipelines first where they are missing
]
ARGS = {"bench_baselines.py": ["--run-missing"]}
"""Flags a script needs under ``make bench``."""


def main() -> int:
    failed = []
    for name in SCRIPTS:
        path = HERE / name
        if not path.exists():
            print(f"== {name}: missing, skipped", flush=True)
            continue
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(path), *ARGS.get(name, [])], cwd=HERE.parent)
        print(f"== {name}: exit {rc} after {time.perf_counter() - start:.0f}s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
