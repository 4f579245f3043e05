"""Where a cached decode step of ``bench_model.py``'s model goes: time per layer kind, in the step and alone.

For each batch size this times whole cached decode steps (the model as ``bench_model.py`` builds it, one
torch thread unless ``--threads``) with its :class:`~model.decode.DecodePlan`, with a timer around every
layer's step, and reports per layer kind:

* in step: the blocks' milliseconds per decode step, summed over the layers of that kind;
* alone: the same blocks each called back to back in a loop on one input (weights, state and code hot
  in the caches), summed over the layers of that kind;
* in step / alone: what running between the other layers costs that kind (its weights, states and
  operator code evicted by the layers before it).

"other" is the whole step minus its blocks: embedding, final norm, ``lm_head`` and the model's own
bookkeeping. Rounds alternate the two measures; figures are medians over ``--rounds``.

    python benchmarks/bench_decode_parts.py --batch 1 16 --json runs/bench_decode_parts.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_model import bench_config  # noqa: E402
from benchmarks.common import format_table, machine_info, save_json, set_threads  # noqa: E402
from model.cache import HybridCache, KVCache, MambaCache  # noqa: E402
from model.decode import DecodePlan  # noqa: E402
from model.hybrid import HybridLM  # noqa: E402


def _timed_steps(plan: DecodePlan, kinds: list[str], totals: dict[str, float]) -> list[Callable]:
    """Wrap every layer step of ``plan`` to add its seconds into ``totals[kind]``; returns the originals."""
    originals = list(plan.steps)

    def timed(inner: Callable, kind: str) -> Callable:
        def step(x: torch.Tensor, cache: HybridCache, index: int) -> torch.Tensor:
            start = time.perf_counter()
            out = inner(x, cache, index)
            totals[kind] += time.perf_counter() - start
            return out

        return step

    plan.steps = [timed(inner, kind) for inner, kind in zip(originals, kinds, strict=True)]
    return originals


def _alone(step: Callable, index: int, cache: HybridCache, x: torch.Tensor) -> Callable[[], None]:
    """One decode step of layer ``index`` on ``x``, repeatable: a private copy of its layer cache that every
    call reuses (the Mamba state each step returns, an attention cache rewound to the same length)."""
    layer = cache.layers[index]
    own = HybridCache([None] * len(cache.layers))
    if isinstance(layer, MambaCache):
        state = {"cache": MambaCache(layer.conv.clone(), layer.ssm.clone())}

        def run() -> None:
            own.layers[index] = state["cache"]
            step(x, own, index)
            state["cache"] = own.layers[index]

        return run
    if isinstance(layer, KVCache):
        kv = KVCache(layer.k.clone(), layer.v.clone(), layer.length, layer.pad)
        length = layer.length
        own.layers[index] = kv

        def run() -> None:
            kv.length = length
            step(x, own, index)

        return run
    return lambda: step(x, own, index)


def measure(model: HybridLM, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Per-kind milliseconds per decode step, in the step and alone, for one batch size."""
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt + args.steps), generator=g)
    kinds = [block.kind for block in model.model.layers]
    in_step: dict[str, list[float]] = defaultdict(list)
    alone: dict[str, list[float]] = defaultdict(list)
    whole: list[float] = []
    plan = DecodePlan(model)
    with torch.no_grad():
        for round_ in range(args.rounds + 1):  # round 0 warms up
            totals: dict[str, float] = defaultdict(float)
            cache = model(ids[:, : args.prompt], use_cache=True).cache
            steps = _timed_steps(plan, kinds, totals)
            start = time.perf_counter()
            for i in range(args.prompt, args.prompt + args.steps):
                plan(ids[:, i : i + 1], cache)
            elapsed = time.perf_counter() - start
            plan.steps = steps
            # each layer alone, on the input and cache state the last step left
            x = torch.randn(batch, model.config.hidden_size, generator=g)
            alone_round: dict[str, float] = defaultdict(float)
            for index, (step, kind) in enumerate(zip(steps, kinds, strict=True)):
                run = _alone(step, index, cache, x)
                for _ in range(3):
                    run()
                start_alone = time.perf_counter()
                for _ in range(args.calls):
                    run()
                alone_round[kind] += (time.perf_counter() - start_alone) / args.calls
            if round_ == 0:
                continue
            whole.append(elapsed / args.steps)
            for kind in set(kinds):
                in_step[kind].append(totals[kind] / args.steps)
                alone[kind].append(alone_round[kind])
    med = statistics.median
    rows = {
        kind: {
            "layers": kinds.count(kind),
            "in_step_ms": med(in_step[kind]) * 1e3,
            "alone_ms": med(alone[kind]) * 1e3,
        }
        for kind in dict.fromkeys(kinds)
    }
    whole_ms = med(whole) * 1e3
    return {
        "batch": batch,
        "whole_step_ms": whole_ms,
        "other_ms": whole_ms - sum(r["in_step_ms"] for r in rows.values()),
        "kinds": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--pattern", default="M*MEM-ME")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round")
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per block alone, per round")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    model = HybridLM(bench_config(args.hidden, args.pattern, args.vocab)).init_weights(args.seed).eval()
    results = [measure(model, b, args) for b in args.batch]
    print(
        f"pattern {args.pattern}, hidden {args.hidden}, {args.threads} thread(s); {args.prompt}-token prompt, "
        f"{args.steps} steps per round, medians of {args.rounds} rounds"
    )
    for r in results:
        rows = [
            [kind, k["layers"], k["in_step_ms"], k["alone_ms"], k["in_step_ms"] / k["alone_ms"]]
            for kind, k in r["kinds"].items()
        ]
        rows.append(["other", "", r["other_ms"], "", ""])
        rows.append(["whole step", "", r["whole_step_ms"], "", ""])
        print(f"\nbatch {r['batch']}:")
        print(format_table(["layer kind", "layers", "in step (ms)", "alone (ms)", "in step / alone"], rows))
    payload = {"command": " ".join(sys.argv), "machine": machine_info(args.threads), "results": results}
    if args.json is not None:
        save_json(args.json, payload)
        print(f"\nwrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
