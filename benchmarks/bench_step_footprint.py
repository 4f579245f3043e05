"""Where a one-row compiled decode step's time goes between the LM head and the rest, and how much other memory
it tolerates before its weights stop coming from the cache; llama.cpp's token beside it on the same budget.

For each standalone budget checkpoint (the folders ``bench_peers.py --work`` writes: ``checkpoints/<budget>-<fmt>``)
this builds our decode plan with its compiled one-row step (as ``bench_peers.py``'s engine does), then times, in
rounds that alternate every part (``common.time_interleaved``, one untimed round first):

* ``step``: the whole one-row step (per-step median of ``--steps`` greedy steps after a prefill);
* ``head cut``: the same step with the LM head cut to its first ``--cut-rows`` rows (a second graph): what the
  layers, the norms and the step's fixed costs take without the head's weight;
* ``head alone``: the head's GEMV by itself (the generated loop of :func:`~model.decode.step_functions.gemv`,
  compiled alone with the step's inductor options), called back to back: its weight stays in the cache;
* ``+N MB``: the head-cut step followed, after every step, by a GEMV over N MB of other weights (``--extra-mb``):
  the step's time and the GEMV's GB/s show when the step's own weights and the other ones no longer fit the
  cache together;
* ``llama.cpp`` (with ``--gguf``, when the llama.cpp build of ``bench_peers.py`` exists): its token time on the
  same budget with the same extra GEMVs after every token.

    python benchmarks/bench_step_footprint.py --work /tmp/bp-full --budgets small medium --format bf16 \\
        --json runs/bench_step_footprint.json

Timings on a shared machine swing between minutes: compare parts within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_peers import OurEngine, load_ours  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Case,
    format_table,
    load_average,
    machine_info,
    save_json,
    set_threads,
    time_interleaved,
)
from model.decode import compiled as compiled_module  # noqa: E402
from model.decode.step_functions import gemv  # noqa: E402

PROMPT = list(range(10, 42))
WARMUP_ROUNDS = 1


def compiled_gemv() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The step's one-row GEMV (:func:`~model.decode.step_functions.gemv`) compiled alone, with the step's options."""
    return torch.compile(gemv, fullgraph=True, dynamic=False, options=dict(compiled_module.INDUCTOR_OPTIONS))


def per_step_ms(step: Callable[[], Any], after: Callable[[], Any] | None, steps: int) -> tuple[float, float]:
    """Median ms of ``step`` and of ``after`` (run after every step; 0 when None) over ``steps`` calls."""
    st, at = [], []
    for _ in range(steps):
        a = time.perf_counter()
        step()
        b = time.perf_counter()
        if after is not None:
            after()
        at.append(time.perf_counter() - b)
        st.append(b - a)
    return statistics.median(st) * 1e3, (statistics.median(at) * 1e3 if after is not None else 0.0)


class Ours:
    """Our engine on one budget, with the head-cut variant of its compiled step."""

    def __init__(self, folder: Path, fmt: str, cut_rows: int) -> None:
        self.engine = OurEngine(load_ours(folder, fmt).eval())
        plan = self.engine.plan
        if plan.compiled is None or not plan.compiled.one_row:
            raise SystemExit(f"{folder}: the compiled one-row step was not kept at warm-up ({plan.step_ms})")
        self.compiled, self.head = plan.compiled, plan.lm_head
        self.own_projection = self.compiled.projection
        self.cut_weight = self.head.weight.detach()[:cut_rows]
        self.token = self.engine.prefill(PROMPT)
        self.gemv = compiled_gemv()
        head = self.head.weight.detach()
        x = torch.randn(head.shape[1])
        self.head_alone = lambda: self.gemv(x, head)

    def cut(self, on: bool) -> None:
        """Step with the head cut to its first rows (a graph of its own) or whole."""

        def projection(module: torch.nn.Module) -> Any:
            return ("one", [self.cut_weight], [None]) if module is self.head else self.own_projection(module)

        self.compiled.projection = projection if on else self.own_projection

    def step(self) -> None:
        self.token = self.engine.step(self.token)

    def restart(self) -> None:
        self.token = self.engine.prefill(PROMPT)


class Peer:
    """llama.cpp on the budget's GGUF (the build ``bench_peers.py`` made)."""

    def __init__(self, gguf: Path, threads: int, kv: str) -> None:
        from benchmarks.peers_llamacpp import LlamaCppBuild, LlamaCppEngine, cache_root, load_bindings

        build = LlamaCppBuild(cache_root())
        if not build.lib_dir.exists():
            raise FileNotFoundError(f"no llama.cpp build at {build.lib_dir}: run benchmarks/bench_peers.py once")
        self.engine = LlamaCppEngine(load_bindings(build), gguf, threads, len(PROMPT) + 512, kv)
        self.token = self.engine.prefill(PROMPT)

    def step(self) -> None:
        self.token = self.engine.step(self.token)

    def restart(self) -> None:
        self.token = self.engine.prefill(PROMPT)


def run_budget(name: str, folder: Path, gguf: Path | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    ours = Ours(folder, args.format, args.cut_rows)
    ours.cut(True)
    ours.step()  # compile the head-cut graph before any timing
    ours.cut(False)
    ours.head_alone()
    peer = None
    if gguf is not None:
        try:
            peer = Peer(gguf, args.threads, "bf16" if args.format == "bf16" else "f32")
        except FileNotFoundError as e:
            print(f"  llama.cpp skipped: {e}", flush=True)
    hidden = ours.head.weight.shape[1]
    extra = {mb: torch.randn(max(1, int(mb * 1e6 / (2 * hidden))), hidden).to(torch.bfloat16) for mb in args.extra_mb}
    gemv_fn = ours.gemv
    xs = torch.randn(hidden)
    for w in extra.values():
        gemv_fn(xs, w)

    # Each part runs ``args.steps`` steps per round and records its per-step medians (the step's, and the extra
    # GEMV's after it); time_interleaved alternates the parts round by round.
    times: dict[str, list[tuple[float, float]]] = {}

    def part(label: str, step: Callable[[], Any], after: Callable[[], Any] | None, restart: Callable[[], Any]) -> Case:
        times[label] = []
        return Case(fn=lambda _: times[label].append(per_step_ms(step, after, args.steps)), setup=restart)

    def ours_restart(cut: bool) -> Callable[[], bool]:
        def restart() -> bool:
            ours.cut(cut)
            ours.restart()
            return True  # a value, so that time_interleaved passes it on (and keeps the restart untimed)

        return restart

    cases = {
        "step": part("step", ours.step, None, ours_restart(False)),
        "head cut": part("head cut", ours.step, None, ours_restart(True)),
        "head alone": part("head alone", ours.head_alone, None, lambda: True),
    }
    for mb, w in extra.items():
        label = f"head cut +{mb:g} MB"
        cases[label] = part(label, ours.step, lambda w=w: gemv_fn(xs, w), ours_restart(True))
    if peer is not None:

        def peer_restart() -> bool:
            peer.restart()
            return True

        for mb in [0.0, *extra]:
            label = "llama.cpp" if mb == 0 else f"llama.cpp +{mb:g} MB"
            after = None if mb == 0 else (lambda w=extra[mb]: gemv_fn(xs, w))
            cases[label] = part(label, peer.step, after, peer_restart)
    time_interleaved(cases, warmup=WARMUP_ROUNDS, repeats=args.rounds)
    times = {k: v[WARMUP_ROUNDS:] for k, v in times.items()}
    rows = []
    for k, v in times.items():
        ms = statistics.median(t[0] for t in v)
        other_ms = statistics.median(t[1] for t in v)
        mb = next((m for m in extra if k.endswith(f"+{m:g} MB")), 0.0)
        rows.append(
            {
                "budget": name,
                "part": k,
                "ms": ms,
                "extra_gemv_ms": other_ms if mb else None,
                "extra_gemv_gbs": extra[mb].nbytes / other_ms / 1e6 if mb else None,
                "head_mb": ours.head.weight.nbytes / 1e6,
            }
        )
    if peer is not None:
        peer.engine.close()
    ours.cut(False)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="bench_peers.py's --work folder")
    p.add_argument("--budgets", nargs="+", default=["small", "medium", "full"])
    p.add_argument("--format", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=64, help="steps per part and round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--cut-rows", type=int, default=1024, help="rows of the LM head kept in the head-cut step")
    p.add_argument("--extra-mb", type=float, nargs="*", default=[8.0, 25.0, 50.0])
    p.add_argument("--no-peer", action="store_true", help="leave llama.cpp out")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    load_start = load_average()
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for budget in args.budgets:
            folder = args.work / "checkpoints" / f"{budget}-{args.format}"
            gguf = None if args.no_peer else args.work / "gguf" / f"{budget}-{args.format}.gguf"
            if not folder.exists():
                raise SystemExit(f"{folder}: no such checkpoint (run benchmarks/bench_peers.py --work {args.work})")
            print(f"{budget} {args.format} ...", flush=True)
            rows += run_budget(budget, folder, gguf if gguf is not None and gguf.exists() else None, args)
    load_end = load_average()
    table = format_table(
        ["budget", "part", "ms", "extra GEMV ms", "extra GEMV GB/s"],
        [
            [
                r["budget"],
                r["part"],
                f"{r['ms']:.2f}",
                "" if r["extra_gemv_ms"] is None else f"{r['extra_gemv_ms']:.2f}",
                "" if r["extra_gemv_gbs"] is None else f"{r['extra_gemv_gbs']:.1f}",
            ]
            for r in rows
        ],
    )
    print(table)
    start, end = (f"{v[0]:.2f}" if v else "?" for v in (load_start, load_end))
    print(f"load average {start} at the start, {end} at the end")
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        payload = {"rows": rows, "args": settings, "machine": machine_info(args.threads)}
        save_json(args.json, {**payload, "load_start": load_start, "load_end": load_end})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
