"""Decode steps of one nested family's budgets, dense and quantized, at several batch sizes.

The family is the one :mod:`benchmarks.bench_peers` runs in llama.cpp (``MEM*MEME`` x 3, hidden 768, 8 experts
top-2 and a shared expert, ~115M parameters, three budgets, random weights): one nested checkpoint, written
once, quantized once to FP8 and once to NVFP4 (weight-only, the default preset), each loaded as serving loads
it (:meth:`BudgetRegistry.from_checkpoint <model.decode.budget_view.BudgetRegistry.from_checkpoint>`: dense
budgets are views of one parent copy, quantized ones their own slice of the quantized tensors, dequantized
per step as serving's default ``cache_dequantized: false`` does; ``fp8-cached`` / ``nvfp4-cached``: the same
checkpoint with ``cache_dequantized: true``, each budget keeping dense copies of the weights it has used;
``f32-compiled`` / ``bf16-compiled``: with serving's ``decode_compile``, one-row steps through compiled steps
where they measure faster; ``bf16``: the same parent cast to bfloat16 and written as its own nested checkpoint).

Per format and batch size, every budget's cached decode step after a ``--prompt``-token prefill of every row:
the budgets alternate in ``--rounds`` rounds (order reversed every other round, a fresh prefill each time,
the fastest of ``--steps`` steps counts, since other processes only add time). ``speedup``: full's step
time / the budget's, taken round by round (median); ``param ratio``: full's active parameters / the
budget's; the target is ``speedup >= 0.9 x param ratio``. Used by ``bench_budget_decode.py --family``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers_family import BUDGETS, PARENT, elastic_space
from model.config import HybridConfig
from model.decode.budget_view import BudgetRegistry
from model.elastic import Architecture, count_params
from model.elastic.budgets import BudgetSet
from model.elastic.export import export_nested
from model.hybrid import HybridLM

FORMATS = ("f32", "fp8", "nvfp4")
DENSE = ("f32", "bf16")
"""Unquantized formats: the nested checkpoint written in float32, or cast to bfloat16 as a published one is."""
CACHED = "-cached"
"""Suffix of a quantized format served with ``cache_dequantized`` on (``fp8-cached``)."""
COMPILED = "-compiled"
"""Suffix of a format served with ``decode_compile`` on (``f32-compiled``): every budget's plan compiled and
measured before the timing, its compiled one-row steps kept where faster (model/decode/compiled.py)."""


def base_format(fmt: str) -> str:
    """The checkpoint a format row reads: ``f32`` for ``f32-compiled``, ``fp8`` for ``fp8-cached``."""
    return fmt.removesuffix(COMPILED).removesuffix(CACHED)


def build_family(work: Path, formats: tuple[str, ...] = FORMATS) -> dict[str, Path]:
    """``{format: nested checkpoint}``: the float32 family, its bfloat16 cast and its FP8 / NVFP4 quantizations."""
    from model.quant import quantize_checkpoint

    config = HybridConfig(**PARENT)
    archs = {name: Architecture(**kw) for name, kw in BUDGETS.items()}
    model = HybridLM(config).init_weights(0).eval()
    full = count_params(config).active
    fractions = BudgetSet.of({n: count_params(config, a).active / full for n, a in archs.items()})
    out = {"f32": export_nested(model, archs, fractions, elastic_space(config, archs), work / "nested",
                                allow_off_target=True)}  # fmt: skip
    if "bf16" in formats:
        out["bf16"] = export_nested(model.to(torch.bfloat16), archs, fractions, elastic_space(config, archs),
                                    work / "nested-bf16", allow_off_target=True)  # fmt: skip
    calib = [torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for fmt in formats:
        if fmt not in DENSE:
            start = time.perf_counter()
            out[fmt] = quantize_checkpoint(out["f32"], work / fmt, fmt, "default", calib)
            print(f"  quantized to {fmt} ({time.perf_counter() - start:.0f}s)", flush=True)
    return out


def batch_state(model: torch.nn.Module, rows: int, prompt: int, vocab: int) -> dict[str, Any]:
    """A fresh cache after a ``prompt``-token prefill of ``rows`` rows (same tokens every time), next tokens."""
    ids = torch.randint(0, vocab, (rows, prompt), generator=torch.Generator().manual_seed(0))
    res = model(ids, use_cache=True, logits_to_keep=1)
    return {"cache": res.cache, "tok": res.logits[:, -1].argmax(-1, keepdim=True)}


def fastest_step(model: torch.nn.Module, state: dict[str, Any], steps: int, warmup: int = 1) -> float:
    """Seconds of the fastest of ``steps`` decode steps continuing ``state`` (after ``warmup`` more)."""
    best = float("inf")
    for i in range(warmup + steps):
        start = time.perf_counter()
        out = model(state["tok"], cache=state["cache"])
        elapsed = time.perf_counter() - start
        state["cache"], state["tok"] = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        if i >= warmup:
            best = min(best, elapsed)
    return best


def time_budgets(registry: BudgetRegistry, rows: int, args) -> dict[str, list[float]]:
    """Per budget, the fastest step of each round (see the module docstring)."""
    names = registry.names
    out: dict[str, list[float]] = {n: [] for n in names}
    vocab = registry.full.config.vocab_size
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # round 0 warms every case up (kernel choices, allocator)
            for name in names if r % 2 == 0 else list(reversed(names)):
                model = registry.get(name)
                best = fastest_step(model, batch_state(model, rows, args.prompt, vocab), args.steps)
                if r > 0:
                    out[name].append(best)
    return out


def run_family(args, work: Path) -> list[dict[str, Any]]:
    """Rows (format, batch, budget) with step time, tokens/s, speedup over full and the parameter ratio."""
    paths = build_family(work, tuple(dict.fromkeys(base_format(f) for f in args.family_formats)))
    config = HybridConfig(**PARENT)
    archs = {name: Architecture(**kw) for name, kw in BUDGETS.items()}
    full_active = count_params(config).active
    rows = []
    for fmt in args.family_formats:
        cached = fmt.removesuffix(COMPILED).endswith(CACHED)
        registry = BudgetRegistry.from_checkpoint(paths[base_format(fmt)], cache_dequantized=cached)
        if fmt.endswith(COMPILED):
            with torch.inference_mode():
                for name in registry.names:
                    plan = registry.get(name).decode_plan(compiled=True)
                    print(f"  {fmt} {name}: {plan.compile_summary() if plan else 'no plan (masked)'}", flush=True)
        for batch in args.batches:
            start = time.perf_counter()
            steps = time_budgets(registry, batch, args)
            first = registry.names[0]
            for name in registry.names:
                active = count_params(config, archs[name]).active
                speedups = [a / b for a, b in zip(steps[first], steps[name], strict=True)]
                step = statistics.median(steps[name])
                plan = registry.get(name).plan
                compiled = plan is not None and plan.compiled is not None and batch == 1
                row = {"format": fmt, "batch": batch, "budget": name,
                       "mode": registry.get(name).mode + (" + compiled" if compiled else ""),
                       "active_params": active, "step_s": step, "tok_s": batch / step,
                       "speedup": statistics.median(speedups), "param_ratio": full_active / active,
                       "rounds_s": steps[name]}  # fmt: skip
                row["target_met"] = row["speedup"] >= 0.9 * row["param_ratio"]
                rows.append(row)
            print(f"  {fmt} batch {batch}: {time.perf_counter() - start:.0f}s", flush=True)
        del registry
    return rows


def family_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    headers = ["format", "batch", "budget", "served as", "active", "ms/step", "tok/s", "speedup", "param ratio",
               ">= 0.9x ratio"]  # fmt: skip
    body = [[r["format"], r["batch"], r["budget"], r["mode"], f"{r['active_params'] / 1e6:.1f}M",
             1e3 * r["step_s"], r["tok_s"], f"{r['speedup']:.2f}", f"{r['param_ratio']:.2f}",
             "yes" if r["target_met"] else "no"] for r in rows]  # fmt: skip
    return headers, body


__all__ = ["COMPILED", "FORMATS", "base_format", "build_family", "family_table", "run_family"]
