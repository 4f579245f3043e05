"""The evaluate stage and a serving replica on the device, over a tiny nested checkpoint.

The checkpoint: random weights of the demo parent's shape with its three budgets (``full``, ``medium``,
``small``) and the demo character tokenizer, written by ``bench_serving.py``'s builder (``export_nested``, as
``tests/integration/conftest.py``'s ``build_tiny_nested_checkpoint`` does).

* ``evaluate``: :func:`components.evaluate.run_evaluate` with ``device`` set to the device (dtype ``auto``:
  bfloat16 on CUDA): standard budget control on every budget and one elastic pair (``small`` thinks, ``full``
  answers), on two built-in problems. Passes when it finishes with rows for every pair and its results say it
  ran on that device.
* ``serve``: a :class:`components.serving.state.ServingState` (the replica Ray Serve would hold: loading, the
  decode thread, admission) with ``device`` set to the device, without Ray Serve and without HTTP: a chat
  request per budget goes the way the HTTP route sends it (parse, ``make_jobs``, submit, collect, render).
  A row passes when its budget answered with at least one generated token and a finish reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.common import Context, Options, describe

BUDGETS = ("full", "medium", "small")
ELASTIC_PAIR = ("small", "full")
PROBLEM = "1+2*3"


def plan(options: Options) -> list[str]:
    d = options.device
    return [f"evaluate on {d}", f"serve load on {d}"] + [f"serve chat {b} on {d}" for b in BUDGETS]


def checkpoint(workdir: str) -> Path:
    """The tiny nested checkpoint (written once per work folder)."""
    from benchmarks.bench_budget_decode import DEMO, DEMO_BUDGETS
    from benchmarks.bench_serving import build_checkpoint

    out = Path(workdir) / "tiny-nested"
    if (out / "nested" / "config.json").exists():
        return out / "nested"
    return build_checkpoint(out, DEMO, DEMO_BUDGETS, vocab_from_tokenizer=True)


def run(ctx: Context) -> None:
    d = ctx.device
    ctx.check_time("writing the checkpoint")
    ckpt = checkpoint(ctx.options.workdir)
    ctx.check_time("evaluate")
    try:
        ctx.row(f"evaluate on {d}", **_evaluate(ctx, ckpt))
    except Exception as err:  # the serving rows still run
        ctx.row(f"evaluate on {d}", "fail", describe(err))
    ctx.check_time("loading the serving state")
    _serve(ctx, ckpt)


def _evaluate(ctx: Context, ckpt: Path) -> dict[str, Any]:
    from components.evaluate import EvalConfig, run_evaluate

    out = Path(ctx.options.workdir) / "evaluate"
    config = EvalConfig(
        checkpoint_uri=str(ckpt), levels=[1], n_per_level=2, think_caps=[0], think_limit=4, max_answer_tokens=3,
        batch_size=2, elastic_pairs=[ELASTIC_PAIR], output_dir=str(out), progress=False, device=ctx.device,
    )  # fmt: skip
    start = time.perf_counter()
    res = run_evaluate(config)
    seconds = time.perf_counter() - start
    results = json.loads(Path(res.results_json).read_text())
    ran = results["config"]
    pairs = {(r["think_budget"], r["answer_budget"]) for r in results["rows"]}
    names = [b["name"] for b in results["budgets"]]
    expected = {(b, b) for b in names} | {ELASTIC_PAIR}
    problems = []
    if ran["device"] != ctx.device:
        problems.append(f"ran on {ran['device']}, not {ctx.device}")
    if pairs != expected:
        problems.append(f"pairs {sorted(pairs)} instead of {sorted(expected)}")
    return {
        "status": "fail" if problems else "pass", "note": "; ".join(problems), "seconds": seconds,
        "device": ran["device"], "dtype": ran["dtype"], "rows": len(results["rows"]), "pairs": len(pairs),
        "accuracy_full": results["accuracy_per_budget"][names[0]]["all"],
    }  # fmt: skip


def _serve(ctx: Context, ckpt: Path) -> None:
    from components.serving.config import ServingConfig
    from components.serving.state import ServingState

    d = ctx.device
    config = ServingConfig(
        api_key_env=None, device=d, dtype="bfloat16" if d == "cuda" else "auto", think_limit=8, default_max_tokens=8
    )
    start = time.perf_counter()
    try:
        state = ServingState(str(ckpt), config)
    except Exception as err:
        ctx.row(f"serve load on {d}", "fail", describe(err))
        for b in BUDGETS:
            ctx.row(f"serve chat {b} on {d}", "fail", "the serving state did not load")
        return
    try:
        where = state.loaded.registry.full.device.type
        ok = where == d and list(state.cards) == list(BUDGETS)
        note = "" if ok else f"weights on {where}, budgets {list(state.cards)}"
        ctx.row(f"serve load on {d}", "pass" if ok else "fail", note, load_s=time.perf_counter() - start,
                weights_device=where, weight_bytes=state.memory()["weight_bytes"])  # fmt: skip
        for budget in BUDGETS:
            name = f"serve chat {budget} on {d}"
            ctx.check_time(name)
            try:
                ctx.row(name, **asyncio.run(_chat(state, budget, max(ctx.left(), 1.0))))
            except Exception as err:  # one budget's failure does not hide the others'
                ctx.row(name, "fail", describe(err))
    finally:
        state.close()


async def _chat(state: Any, budget: str, timeout_s: float) -> dict[str, Any]:
    """One chat request to ``budget``, as the HTTP route runs it; the row's status and figures."""
    from components.serving.request_models import ChatCompletionRequest, parse_request
    from components.serving.responses import Renderer, collect

    body = {"model": budget, "messages": [{"role": "user", "content": PROBLEM}], "max_tokens": 8,
            "reasoning_budget": 4}  # fmt: skip
    req = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    start = time.perf_counter()
    jobs, prompts = state.make_jobs(req)
    state.submit(jobs)
    results = await asyncio.wait_for(collect(jobs), timeout_s)
    answer = Renderer(req, jobs, prompts, lambda i: state.loaded.tokenizer.decode([i]), state.tool_format).body(results)
    seconds = time.perf_counter() - start
    choice, usage = answer.choices[0], answer.usage
    ok = answer.model == budget and choice.finish_reason is not None and usage.completion_tokens > 0
    note = "" if ok else f"model {answer.model}, finish {choice.finish_reason}, {usage.completion_tokens} tokens"
    return {
        "status": "pass" if ok else "fail", "note": note, "latency_s": seconds,
        "completion_tokens": usage.completion_tokens, "finish_reason": choice.finish_reason,
        "reasoning_tokens": usage.completion_tokens_details.reasoning_tokens,
    }  # fmt: skip
