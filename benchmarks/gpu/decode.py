"""Decode tokens/s per budget and batch on the device: eager (the budget's decode plan) and CUDA-graph captured.

The model: a random nemotron_h-like hybrid of about 1B parameters (:data:`LARGE`: Mamba, attention and MoE
layers, 24 experts top-2 and a shared expert; 1.03B total, 388M active) in bfloat16 on CUDA, with three
budgets (:data:`LARGE_BUDGETS`), each a view of the one parent as serving builds it
(:class:`~model.decode.budget_view.BudgetRegistry`, what :class:`components.serving.loading.LoadedModel` holds).
``--quick`` takes the demo-sized shape and budgets of ``bench_budget_decode.py`` (float32 on a CPU).

Per (budget, batch), batches 1, 16 and 64: a ``prompt``-token prefill of random ids (untimed), then greedy
single-token steps, each the budget model's forward on one token (its :class:`~model.decode.plan.DecodePlan`),
the argmax fed back: ``warmup`` untimed steps, then ``steps`` timed ones, synchronised with the device at both
ends. tokens/s = batch x steps / seconds.

``captured`` runs the same steps from the same prefill through :class:`~benchmarks.gpu.graphs.StaticStep`
(one CUDA graph replayed per step; on a CPU the static-buffer step without a graph). It passes when its greedy
tokens equal the eager ones at every step and its final decoding state (every KV slot, every Mamba state)
matches the eager one within :data:`STATE_TOLERANCE`. A capture that fails is a failed row with the exception's
first line and where the project's code raised it. Every eager row runs before any capture, so a capture that
breaks the CUDA context cannot take the eager figures with it.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.bench_budget_decode import DEMO, DEMO_BUDGETS
from benchmarks.gpu.common import Context, Options, describe, synchronize

LARGE: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=2048, pattern="MEM*EMEMEM*EMEME", num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, mamba_num_heads=64, mamba_head_dim=32, n_groups=8, ssm_state_size=128, chunk_size=128,
    n_routed_experts=24, num_experts_per_tok=2, moe_intermediate_size=1024, moe_shared_expert_intermediate_size=2048,
)  # fmt: skip
"""~1B parameters (1,034M total, 388M active): 7 Mamba, 2 attention and 7 MoE layers."""
LARGE_BUDGETS: dict[str, dict[str, int]] = {
    "full": {},
    "medium": dict(hidden=1536, mamba_heads=48, attn_heads=12, moe_ffn=768, shared_ffn=1536, experts=16),
    "small": dict(hidden=1024, mamba_heads=32, attn_heads=8, moe_ffn=512, shared_ffn=1024, experts=12),
}
BATCHES = (1, 16, 64)
STATE_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
"""Largest rel_err of the captured run's final state against the eager one (the same kernels give 0)."""


def _settings(options: Options) -> dict[str, Any]:
    """Model, budgets, dtype and step counts of this run."""
    if options.quick:
        budgets = {name: arch.model_dump(exclude_none=True) for name, arch in DEMO_BUDGETS.items()}
        fields, label, prompt, warmup, steps = DEMO, "demo", 8, 1, 4
    else:
        fields, budgets, label, prompt, warmup, steps = LARGE, LARGE_BUDGETS, "~1B", 32, 3, 32
    dtype = "bfloat16" if options.device == "cuda" else "float32"
    return dict(fields=fields, budgets=budgets, label=label, dtype=dtype, prompt=prompt, warmup=warmup, steps=steps)


def plan(options: Options) -> list[str]:
    s = _settings(options)
    cases = [(b, n) for b in s["budgets"] for n in BATCHES]
    return (
        [f"build {s['label']} {s['dtype']}"]
        + [f"eager {b} b{n}" for b, n in cases]
        + [f"captured {b} b{n}" for b, n in cases]
    )


def _build(ctx: Context, s: dict[str, Any]) -> Any:
    """The parent on the device in the run's dtype and a registry of budget views over it."""
    import torch

    from model.config import HybridConfig
    from model.decode.budget_view import BudgetRegistry
    from model.elastic import Architecture, count_params
    from model.hybrid import HybridLM

    name = f"build {s['label']} {s['dtype']}"
    start = time.perf_counter()
    config = HybridConfig(**s["fields"])
    with torch.device(ctx.device):  # allocated where it runs; init_weights draws on the CPU and copies
        full = HybridLM(config)
    full.init_weights(0)
    _as_loaded(full, getattr(torch, s["dtype"]))
    full.eval()
    archs = {n: Architecture(**kw) for n, kw in s["budgets"].items()}
    registry = BudgetRegistry(full, archs)
    synchronize(ctx.device)
    counts = {n: count_params(config, a) for n, a in archs.items()}
    figures: dict[str, Any] = {"build_s": time.perf_counter() - start, "total_params": counts["full"].total}
    figures.update({f"active_{n}": c.active for n, c in counts.items()})
    if ctx.device == "cuda":
        figures["gpu"] = torch.cuda.get_device_name()
        figures["weights_gb"] = torch.cuda.memory_allocated() / 1e9
    ctx.row(name, "pass", **figures)
    ctx.log(f"{name}: {counts['full'].total:,} parameters in {figures['build_s']:.1f} s")
    return registry


def _as_loaded(model: Any, dtype: Any) -> None:
    """Cast every tensor to the dtype loading a checkpoint in ``dtype`` gives it (the router bias stays float32),
    so that the model is the one serving would hold."""
    from model.checkpoint import loaded_dtype

    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None:
                    t.data = t.data.to(loaded_dtype(f"{prefix}.{key}", t, dtype))


def _eager(model: Any, cache: Any, tok: Any, warmup: int, steps: int, device: str) -> tuple[Any, float, bool]:
    """Greedy steps from (cache, tok): (tokens (batch, warmup + steps), seconds of the timed steps, finite)."""
    import torch

    tokens = []
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            synchronize(device)
            start = time.perf_counter()
        out = model(tok, cache=cache)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(tok)
    synchronize(device)
    seconds = time.perf_counter() - start
    return torch.cat(tokens, 1), seconds, bool(torch.isfinite(out.logits).all())


def _captured(ctx: Context, model: Any, start: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """The captured run of one case, compared with its eager run (``start``: prefill and eager results)."""
    import torch

    from benchmarks.gpu.graphs import StaticStep, compare_states, first_difference
    from model.cache import clone_cache

    warmup, steps = s["warmup"], s["steps"]
    t0 = time.perf_counter()
    step = StaticStep(model, clone_cache(start["cache"]), start["tok"], capture=ctx.device == "cuda")
    synchronize(ctx.device)
    capture_s = time.perf_counter() - t0
    tokens = []
    begin = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            synchronize(ctx.device)
            begin = time.perf_counter()
        tokens.append(step().clone())
    synchronize(ctx.device)
    seconds = time.perf_counter() - begin
    got = torch.cat(tokens, 1)
    first = first_difference(start["tokens"], got)
    diff = compare_states(start["final"], step.cache)
    tol = STATE_TOLERANCE[s["dtype"]]
    batch = got.shape[0]
    figures = {
        "tok_s": batch * steps / seconds, "eager_tok_s": start["tok_s"],
        "speedup": start["seconds"] / seconds, "capture_s": capture_s, "tokens_equal": first is None,
        "first_token_difference": first, "state_max_rel_err": diff.max_rel_err, "graph": step.graph is not None,
    }  # fmt: skip
    notes = []
    if first is not None:
        notes.append(f"greedy tokens differ from eager from step {first} of {warmup + steps}")
    if diff.max_rel_err > tol:
        notes.append(
            f"final state differs from eager (max rel err {diff.max_rel_err:.3g} > {tol:g} in layer {diff.layer}, "
            f"{diff.kind}): a graph replays the host values of its capture"
        )
    if step.graph is None:
        notes.append("no CUDA: the static-buffer step runs without a graph")
    status = "pass" if first is None and diff.max_rel_err <= tol else "fail"
    return {"status": status, "note": "; ".join(notes), **figures}


def run(ctx: Context) -> None:
    import torch

    from model.cache import clone_cache

    s = _settings(ctx.options)
    ctx.check_time("the model build")
    registry = _build(ctx, s)
    vocab = registry.full.config.vocab_size
    cases = [(b, n) for b in s["budgets"] for n in BATCHES]
    starts: dict[tuple[str, int], dict[str, Any]] = {}
    began = time.perf_counter()
    with torch.no_grad():
        for k, (budget, batch) in enumerate(cases):
            name = f"eager {budget} b{batch}"
            ctx.check_time(name)
            model = registry.get(budget)
            g = torch.Generator().manual_seed(batch)
            prompt = torch.randint(0, vocab, (batch, s["prompt"]), generator=g).to(ctx.device)
            try:
                res = model(prompt, use_cache=True, logits_to_keep=1)
                tok = res.logits[:, -1].argmax(-1, keepdim=True)
                cache = clone_cache(res.cache)
                tokens, seconds, finite = _eager(model, cache, tok, s["warmup"], s["steps"], ctx.device)
            except Exception as err:  # one budget's failure must not hide the others'
                ctx.row(name, "fail", describe(err))
                continue
            tok_s = batch * s["steps"] / seconds
            starts[(budget, batch)] = {"cache": res.cache, "tok": tok, "tokens": tokens, "final": cache,
                                       "seconds": seconds, "tok_s": tok_s}  # fmt: skip
            ctx.row(name, "pass" if finite else "fail", "" if finite else "non-finite logits", tok_s=tok_s,
                    ms_per_step=1e3 * seconds / s["steps"], steps=s["steps"])  # fmt: skip
            eta = (time.perf_counter() - began) / (k + 1) * (len(cases) - k - 1)
            ctx.log(f"{name}: {tok_s:,.0f} tok/s ({k + 1}/{len(cases)}, eager ETA {eta:.0f} s)")
        for budget, batch in cases:
            name = f"captured {budget} b{batch}"
            ctx.check_time(name)
            if (budget, batch) not in starts:
                ctx.row(name, "fail", "its eager run failed (no reference to compare with)")
                continue
            try:
                result = _captured(ctx, registry.get(budget), starts[(budget, batch)], s)
            except Exception as err:  # a step that cannot be captured: the row says why
                ctx.row(name, "fail", f"capture failed: {describe(err)}")
                _recover(ctx)
                continue
            ctx.row(name, **result)
            ctx.log(f"{name}: {result['status']} {result['tok_s']:,.0f} tok/s")


def _recover(ctx: Context) -> None:
    """After a failed capture: surface a broken device now (in the log) rather than in the next row's figures."""
    try:
        synchronize(ctx.device)
    except Exception as err:
        ctx.log(f"the device is in an error state after a failed capture: {describe(err)}")
