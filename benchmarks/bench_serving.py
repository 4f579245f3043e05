"""Serving throughput with and without batching, and the resident memory of one weight copy for all budgets.

``--part throughput``: concurrent HTTP clients against the Serve app on a local Ray, for continuous,
static and no batching side by side. ``--part memory``: the RSS of a fresh process serving every
budget against the full budget only, with the decode kernels' weight copies off (``decode_copy_mib: 0``) and at
their default bound. Target: all budgets <= 1.1 x full only with the copies off (the views of one weight copy);
the copies' memory is reported beside it. ``--part grammar``: the
cost of structured outputs: at 4 and 16 clients, all clients free against half of them asking for a
JSON schema (``response_format``), rounds alternating; reported: tokens/s of both mixes and the
grammar's own time per constrained token (mask computed and applied in the sampler, from ``/stats``).
Method: docs/benchmarks.md and docs/serving.md; figures: benchmarks/RESULTS.md.

    python benchmarks/bench_serving.py --part all --json runs/bench_serving.json
    python benchmarks/bench_serving.py --part grammar --json runs/bench_serving_grammar.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_budget_decode import DEMO, DEMO_BUDGETS, LARGE, LARGE_BUDGETS
from benchmarks.common import format_table, save_json

PROBLEMS = {
    "same": ["1+2*3", "4-1*2", "5*5+1", "9-3+3", "2*2*2", "7+0-4", "3*3-1", "8+1+1"],
    "mixed": ["1+2", "4-1*2", "5*5+1-3", "9", "2*2*2+7*1", "7+0", "3*3-1*2+4", "8+1+1"],
}
MODES = {"continuous": (16, True), "static": (16, False), "no batching": (1, False)}
"""Configuration -> (batch_max_size, merge_running_batches)."""
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": -999, "maximum": 999},
        "steps": {"type": "array", "items": {"enum": ["+", "-", "*"]}, "maxItems": 4},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "steps", "sure"],
}
"""The JSON schema half the clients of ``--part grammar`` ask for (bounded: a random model's answer ends)."""


def build_checkpoint(
    out: Path, fields: dict[str, Any], budgets: dict, vocab_from_tokenizer: bool, dtype: str = "float32"
) -> Path:
    """A random-weight nested checkpoint with ``budgets`` and the demo character tokenizer (with its chat template),
    its weights in ``dtype`` (a published checkpoint's is bfloat16)."""
    import torch

    from components.data.tokenizer import TextTokenizer, build_demo_tokenizer
    from model.config import HybridConfig
    from model.elastic import ElasticSpace, count_params
    from model.elastic.budgets import BudgetSet
    from model.elastic.export import export_nested
    from model.hybrid import HybridLM
    from model.layout import tokenizer_files

    tok = TextTokenizer(build_demo_tokenizer())
    fields = {**fields, "vocab_size": tok.vocab_size} if vocab_from_tokenizer else dict(fields)
    cfg = HybridConfig(**fields)
    space_axes: dict[str, list[int]] = {}
    for arch in budgets.values():
        for axis, size in arch.to_dict().items():
            space_axes.setdefault(axis, []).append(size)
    full_sizes = {"hidden": cfg.hidden_size, "mamba_heads": cfg.mamba_num_heads, "moe_ffn": cfg.moe_intermediate_size,
                  "shared_ffn": cfg.moe_shared_expert_intermediate_size, "mlp_ffn": cfg.intermediate_size,
                  "experts": cfg.n_routed_experts}  # fmt: skip
    space = ElasticSpace(**{a: sorted({full_sizes[a], *v}, reverse=True) for a, v in space_axes.items()})
    model = HybridLM(cfg).init_weights(0).eval().to(getattr(torch, dtype))
    full = count_params(cfg).active
    fractions = BudgetSet.of({n: round(count_params(cfg, a).active / full, 4) for n, a in budgets.items()})
    files = tokenizer_files(tok.save(out / "tokenizer"))
    return export_nested(model, budgets, fractions, space, out / "nested", extra_files=files)


# ---------------------------------------------------------------------- throughput
async def _client(url: str, n: int, offset: int, args, schema: bool = False) -> list[tuple[float, int]]:
    import httpx

    out = []
    problems = PROBLEMS[args.prompts]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i in range(n):
            body = {"model": args.model, "temperature": 0, "max_tokens": args.max_tokens,
                    "reasoning_budget": args.think, "messages": [
                        {"role": "user", "content": f"Q:{problems[(offset + i) % len(problems)]}\n"}]}  # fmt: skip
            if schema:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer",
                                                                                  "schema": ANSWER_SCHEMA}}  # fmt: skip
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            out.append((time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]))
    return out


async def _run_clients(url: str, clients: int, args, constrained: int = 0) -> dict[str, float]:
    """``clients`` concurrent clients, the first ``constrained`` of them asking for :data:`ANSWER_SCHEMA`."""
    start = time.perf_counter()
    per = await asyncio.gather(
        *(_client(url, args.requests, c * args.requests, args, c < constrained) for c in range(clients))
    )
    wall = time.perf_counter() - start
    flat = [x for p in per for x in p]
    return {"clients": clients, "requests": len(flat), "wall_s": wall, "tokens_s": sum(t for _, t in flat) / wall,
            "requests_s": len(flat) / wall, "p50_latency_s": statistics.median(lat for lat, _ in flat)}  # fmt: skip


def throughput(ckpt: Path, args) -> list[dict[str, Any]]:
    """Both configurations deployed side by side; rounds alternate between them, the best round is kept."""
    import httpx
    import ray
    from ray import serve

    from components.serving.app import build_app
    from tests.conftest import free_port

    # one replica per configuration, each reserving one logical CPU; only one configuration is busy at a time
    ray.init(num_cpus=max(2, len(MODES)), include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    modes = {m: MODES[m] for m in args.modes} if args.modes else MODES
    urls = {m: f"http://127.0.0.1:{port}/{m.replace(' ', '-')}" for m in modes}
    best: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        for mode, (size, merge) in modes.items():
            cfg = {"api_key_env": None, "batch_max_size": size, "batch_wait_timeout_s": 0.01,
                   "merge_running_batches": merge,
                   "max_ongoing_requests": 32, "max_queued_requests": 64, "torch_threads": args.threads,
                   "autoscaling": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 16}}  # fmt: skip
            app = build_app({"model_uri": str(ckpt), "config": cfg})
            serve.run(app, name=mode.replace(" ", "-"), route_prefix=f"/{mode.replace(' ', '-')}")
            while httpx.get(f"{urls[mode]}/ready", timeout=30).status_code != 200:
                time.sleep(0.5)
            asyncio.run(_run_clients(urls[mode], 1, argparse.Namespace(**{**vars(args), "requests": 2})))  # warm up
        for rnd in range(args.rounds):
            for clients in args.clients:
                for mode in modes:
                    row = asyncio.run(_run_clients(urls[mode], clients, args))
                    print(f"round {rnd} {mode:12s} clients={clients:3d} {row['tokens_s']:8.1f} tok/s "
                          f"{row['requests_s']:6.2f} req/s p50 {row['p50_latency_s']:.2f}s", flush=True)  # fmt: skip
                    key = (mode, clients)
                    if key not in best or row["tokens_s"] > best[key]["tokens_s"]:
                        best[key] = {**row, "mode": mode}
        for mode in modes:
            stats = httpx.get(f"{urls[mode]}/stats", timeout=30).json()
            engine = stats["engine"]
            steps = stats.get("decode_steps", {})
            print(f"{mode}: decode steps " + "; ".join(f"{n}: {v}" for n, v in steps.items()), flush=True)
            for clients in args.clients:
                best[(mode, clients)]["max_batch_size_seen"] = engine["max_batch_size"]
                best[(mode, clients)]["joined_running_batches"] = engine.get("joined_running_batches", 0)
    finally:
        serve.shutdown()
        ray.shutdown()
    return [best[(m, c)] for m in modes for c in args.clients]


# ---------------------------------------------------------------------- the cost of grammars
def grammar_cost(ckpt: Path, args) -> list[dict[str, Any]]:
    """All clients free against half of them asking for a JSON schema, at each of ``args.grammar_clients``.

    One app (continuous batching); rounds alternate between the two mixes and the best round of each is kept.
    The grammar's time per constrained token is the server's own count (``/stats``: seconds spent computing
    and applying masks over tokens sampled under one), from the mixed rounds.
    """
    import httpx
    import ray
    from ray import serve

    from components.serving.app import build_app
    from tests.conftest import free_port

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}/grammar"
    run = argparse.Namespace(**{**vars(args), "max_tokens": args.grammar_max_tokens})
    best: dict[tuple[str, int], dict[str, Any]] = {}
    masked = {c: [0.0, 0] for c in args.grammar_clients}  # clients -> [mask seconds, masked tokens]
    try:
        cfg = {"api_key_env": None, "batch_max_size": 16, "batch_wait_timeout_s": 0.01, "max_ongoing_requests": 32,
               "max_queued_requests": 64, "torch_threads": args.threads, "max_tokens_limit": 256,
               "autoscaling": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 16}}  # fmt: skip
        serve.run(build_app({"model_uri": str(ckpt), "config": cfg}), name="grammar", route_prefix="/grammar")
        while httpx.get(f"{url}/ready", timeout=30).status_code != 200:
            time.sleep(0.5)
        warm = argparse.Namespace(**{**vars(run), "requests": 1})
        asyncio.run(_run_clients(url, 2, warm, constrained=1))  # compiles the schema once; warms both paths
        total = args.rounds * len(args.grammar_clients) * 2
        started, done = time.perf_counter(), 0
        for rnd in range(args.rounds):
            for clients in args.grammar_clients:
                for mix, constrained in (("all free", 0), ("half JSON schema", clients // 2)):
                    before = httpx.get(f"{url}/stats", timeout=30).json()["grammar"]
                    row = asyncio.run(_run_clients(url, clients, run, constrained))
                    after = httpx.get(f"{url}/stats", timeout=30).json()["grammar"]
                    if constrained:
                        masked[clients][0] += after["mask_s_total"] - before["mask_s_total"]
                        masked[clients][1] += after["masked_tokens"] - before["masked_tokens"]
                    done += 1
                    eta = (time.perf_counter() - started) / done * (total - done)
                    print(f"round {rnd} {mix:16s} clients={clients:3d} {row['tokens_s']:8.1f} tok/s "
                          f"{row['requests_s']:6.2f} req/s p50 {row['p50_latency_s']:.2f}s  ({done}/{total}, "
                          f"ETA {eta:.0f}s)", flush=True)  # fmt: skip
                    key = (mix, clients)
                    if key not in best or row["tokens_s"] > best[key]["tokens_s"]:
                        best[key] = {**row, "mix": mix, "constrained_clients": constrained}
        stats = httpx.get(f"{url}/stats", timeout=30).json()["grammar"]
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = []
    for clients in args.grammar_clients:
        free, mixed = best[("all free", clients)], best[("half JSON schema", clients)]
        seconds, tokens = masked[clients]
        for row in (free, mixed):
            rows.append({**row, "vs_free": row["tokens_s"] / free["tokens_s"],
                         "mask_us_per_token": 1e6 * seconds / tokens if tokens and row is mixed else None})  # fmt: skip
    for row in rows:
        row["compiles"], row["compile_ms_total"] = stats["compiles"], 1e3 * stats["compile_s_total"]
    return rows


# ---------------------------------------------------------------------- memory
def _rss_child(ckpt: str, budgets: str, copies: str = "default") -> None:
    """Child process: load, answer one request per served budget, print the RSS as JSON. ``copies``: the decode
    kernels' weight copies at their default bound, or ``off`` (``decode_copy_mib: 0``)."""
    import psutil

    from components.serving.config import ServingConfig
    from components.serving.job import Job
    from components.serving.state import ServingState
    from model.generate import SamplingParams

    names = None if budgets == "all" else budgets.split(",")
    copy_mib = 0 if copies == "off" else None
    state = ServingState(
        ckpt, ServingConfig(api_key_env=None, budgets=names, torch_threads=2, decode_copy_mib=copy_mib)
    )
    prompt = state.loaded.tokenizer.encode("<bos>Q:1+2*3\n<think>")

    async def one(model: str) -> None:
        job = Job(prompt, model, model, 8, 8, SamplingParams(), (), False, asyncio.get_running_loop())
        state.engine.submit(job)
        while (await job.events.get())[1] not in ("done", "error"):
            pass

    for name in state.cards:
        asyncio.run(one(name))
    mem = state.memory()
    state.close()
    print(json.dumps({"rss_bytes": psutil.Process().memory_info().rss, "weight_bytes": mem["weight_bytes"],
                      "copied_bytes": sum(mem["copied_bytes"].values()),
                      "decode_copy_bytes": sum(mem["decode_copy_bytes"].values()),
                      "budgets": list(state.cards)}))  # fmt: skip


def memory(ckpts: dict[str, Path]) -> list[dict[str, Any]]:
    """Per model and decode-copy setting: RSS serving the full budget only and every budget. The 1.1 target is
    for the budgets' views of one weight copy (copies off); the kernels' copies are reported beside it."""
    rows = []
    for name, ckpt in ckpts.items():
        for copies in ("off", "default"):
            got = {}
            for case in ("full", "all"):
                out = subprocess.run(
                    [sys.executable, __file__, "--rss-child", str(ckpt), case, copies],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                got[case] = json.loads(out.stdout.strip().splitlines()[-1])
            full, every = got["full"], got["all"]
            ratio = every["rss_bytes"] / full["rss_bytes"]
            rows.append({"model": name, "decode_copies": copies, "weight_mb": every["weight_bytes"] / 2**20,
                         "rss_full_only_mb": full["rss_bytes"] / 2**20, "rss_all_mb": every["rss_bytes"] / 2**20,
                         "ratio": ratio, "copied_kb": every["copied_bytes"] / 1024,
                         "decode_copies_full_mb": full["decode_copy_bytes"] / 2**20,
                         "decode_copies_all_mb": every["decode_copy_bytes"] / 2**20,
                         "met": ratio <= 1.1, "budgets": every["budgets"]})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["throughput", "memory", "grammar", "all"], default="all")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--model", default="full", help="budget the clients ask for")
    p.add_argument("--prompts", choices=sorted(PROBLEMS), default="mixed", help="prompts of one length or several")
    p.add_argument("--think", type=int, default=24, help="reasoning_budget of every request")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens (answer) of every request")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the replica")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per setting (the best is kept)")
    p.add_argument("--grammar-clients", type=int, nargs="+", default=[4, 16], help="clients of --part grammar")
    p.add_argument("--grammar-max-tokens", type=int, default=48, help="max_tokens of every --part grammar request")
    p.add_argument("--json", default=None)
    p.add_argument("--family", action="store_true",
                   help="throughput on bench_peers' ~115M family (vocabulary 49152, the demo tokenizer's ids) "
                        "instead of the demo-sized parent")  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=None, help="batching modes (default all)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the checkpoint's weights")
    p.add_argument("--rss-child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        _rss_child(*args.rss_child)
        return 0
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    result: dict[str, Any] = {"load_average": load, "args": {k: v for k, v in vars(args).items() if k != "rss_child"}}
    with tempfile.TemporaryDirectory() as tmp:
        if args.family:
            from benchmarks.peers_family import BUDGETS, PARENT
            from model.elastic import Architecture

            family = {n: Architecture(**kw) for n, kw in BUDGETS.items()}
            demo = build_checkpoint(Path(tmp) / "family", PARENT, family, vocab_from_tokenizer=False, dtype=args.dtype)
        else:
            demo = build_checkpoint(Path(tmp) / "demo", DEMO, DEMO_BUDGETS, vocab_from_tokenizer=True, dtype=args.dtype)
        if args.part in ("throughput", "all"):
            rows = throughput(demo, args)
            result["throughput"] = rows
            print(f"prompts: {args.prompts} ({', '.join(PROBLEMS[args.prompts])})")
            print(format_table(
                ["mode", "clients", "requests", "tokens/s", "requests/s", "p50 latency s", "max batch (any round)",
                 "joins of running batches"],
                [[r["mode"], r["clients"], r["requests"], r["tokens_s"], r["requests_s"], r["p50_latency_s"],
                  r["max_batch_size_seen"], r["joined_running_batches"]] for r in rows],
            ))  # fmt: skip
        if args.part in ("grammar", "all"):
            rows = grammar_cost(demo, args)
            result["grammar"] = rows
            print(f"JSON schema of the constrained clients: {json.dumps(ANSWER_SCHEMA)}")
            print(format_table(
                ["mix", "clients", "requests", "tokens/s", "vs all free", "p50 latency s", "grammar us / token",
                 "compiles", "compile ms"],
                [[r["mix"], r["clients"], r["requests"], r["tokens_s"], r["vs_free"], r["p50_latency_s"],
                  "" if r["mask_us_per_token"] is None else r["mask_us_per_token"], r["compiles"],
                  r["compile_ms_total"]] for r in rows],
            ))  # fmt: skip
        if args.part in ("memory", "all"):
            large = build_checkpoint(Path(tmp) / "large", LARGE, LARGE_BUDGETS, vocab_from_tokenizer=False)
            rows = memory({"demo": demo, "large": large})
            result["memory"] = rows
            print(format_table(
                ["model", "decode copies", "weights MB", "RSS full only MB", "RSS all budgets MB", "ratio",
                 "copied KB", "decode copies MB (full / all)", "<= 1.1"],
                [[r["model"], r["decode_copies"], r["weight_mb"], r["rss_full_only_mb"], r["rss_all_mb"], r["ratio"],
                  r["copied_kb"], f"{r['decode_copies_full_mb']:.1f} / {r['decode_copies_all_mb']:.1f}",
                  "yes" if r["met"] else "no"] for r in rows],
            ))  # fmt: skip
    result["load_average_end"] = os.getloadavg()
    if args.json:
        save_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
