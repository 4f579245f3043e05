"""Soak: the serving app under moderate load for a long time; does the replica's memory grow?

A local Ray Serve app (loopback only) over the demo-sized random checkpoint; ``--clients`` clients
send requests back to back (chat and completions, streaming and not, every budget, varying lengths)
for ``--minutes`` minutes or ``--max-requests`` requests, whichever comes first. Every ``--sample-s``
seconds the resident memory (RSS) of the model replica's process (and of the ingress) is read with
psutil. Reported: the least-squares slope of the replica's RSS in MB/min after the first sample
(warm-up), its growth from then to the end, and the KV caches' bound at this load: what the caches of
every request in flight can hold at most (per row: two Mamba states, one a snapshot for standard
budget control, plus K/V of every attention layer for the longest row). Goal: growth within that bound.

    python benchmarks/bench_soak.py                  # 20 minutes
    python benchmarks/bench_soak.py --minutes 2 --json runs/bench_soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_budget_decode import DEMO, DEMO_BUDGETS
from benchmarks.bench_serving import build_checkpoint
from benchmarks.common import format_table, save_json

PROBLEMS = ["1+2", "4-1*2", "5*5+1-3", "9", "2*2*2+7*1", "7+0", "3*3-1*2+4", "8+1+1"]
BUDGETS = list(DEMO_BUDGETS)
MB = 1024 * 1024


def kv_bound_bytes(rows: int, tokens_per_row: int, fields: dict[str, Any], dtype_bytes: int = 4) -> int:
    """Most bytes the decode caches of ``rows`` live rows of up to ``tokens_per_row`` tokens can hold.

    Attention layers: K and V of (kv_heads, head_dim) per token; Mamba layers: the conv state
    (conv_dim, kernel - 1) and the SSM state (heads, head_dim, state) per row, twice (a snapshot kept
    for standard budget control's resume).
    """
    attention = fields["pattern"].count("*")
    mamba = fields["pattern"].count("M")
    per_token = attention * 2 * fields["num_key_value_heads"] * fields["head_dim"] * dtype_bytes
    heads, head_dim, state = fields["mamba_num_heads"], fields["mamba_head_dim"], fields["ssm_state_size"]
    conv_dim = heads * head_dim + 2 * fields["n_groups"] * state
    per_row = mamba * 2 * (conv_dim * (fields.get("conv_kernel", 4) - 1) + heads * head_dim * state) * dtype_bytes
    return rows * (per_row + tokens_per_row * per_token)


def slope_mb_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of (seconds, RSS bytes) in MB per minute."""
    ts = [t / 60 for t, _ in samples]
    ys = [r / MB for _, r in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den if den else 0.0


def request(i: int, args) -> tuple[str, dict[str, Any]]:
    """The i-th request: alternating routes, streaming, budgets and lengths (bounded by the args)."""
    problem = PROBLEMS[i % len(PROBLEMS)]
    model, stream = BUDGETS[i % len(BUDGETS)], i % 4 >= 2
    think, answer = 4 + (i * 7) % args.think, 2 + (i * 5) % args.max_tokens
    if i % 3 == 2:
        body = {"model": model, "prompt": f"<bos>Q:{problem}\n<think>", "max_tokens": answer,
                "reasoning_budget": think, "temperature": 0.7, "seed": i, "stream": stream}  # fmt: skip
        return "/v1/completions", body
    msgs = [{"role": "user", "content": f"Q:{problem}\n"}]
    body = {"model": model, "messages": msgs, "max_tokens": answer, "reasoning_budget": think, "stream": stream,
            "temperature": 0.7, "seed": i}  # fmt: skip
    if i % 5 == 4:
        body["think_model"] = BUDGETS[-1]  # elastic budget control: re-prefill on the answering budget
    return "/v1/chat/completions", body


async def client(url: str, c: int, args, deadline: float, counts: dict[str, int]) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        i = c
        while time.monotonic() < deadline and counts["sent"] < args.max_requests:
            counts["sent"] += 1
            route, body = request(i, args)
            if body["stream"]:
                async with http.stream("POST", route, json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                r = await http.post(route, json=body)
            key = "ok" if r.status_code == 200 else f"status {r.status_code}"
            counts[key] = counts.get(key, 0) + 1
            i += args.clients


def ingress_pids() -> list[int]:
    import psutil

    return [
        p.pid for p in psutil.process_iter(["cmdline"]) if "StarElasticIngress" in " ".join(p.info["cmdline"] or [])
    ]


async def soak(url: str, replica_pid: int, args) -> dict[str, Any]:
    import psutil

    replica, ingress = psutil.Process(replica_pid), [psutil.Process(p) for p in ingress_pids()]
    counts: dict[str, int] = {"sent": 0}
    start = time.monotonic()
    deadline = start + args.minutes * 60
    tasks = [asyncio.create_task(client(url, c, args, deadline, counts)) for c in range(args.clients)]
    samples: list[dict[str, Any]] = []
    while True:
        t = time.monotonic() - start
        sample = {
            "t_s": round(t, 1),
            "replica_rss": replica.memory_info().rss,
            "ingress_rss": sum(p.memory_info().rss for p in ingress),
            "requests": counts.get("ok", 0),
        }
        samples.append(sample)
        print(
            f"{t:7.1f} s  replica RSS {sample['replica_rss'] / MB:8.1f} MB  "
            f"ingress RSS {sample['ingress_rss'] / MB:7.1f} MB  requests {sample['requests']}",
            flush=True,
        )
        if all(task.done() for task in tasks):
            break
        await asyncio.wait(tasks, timeout=args.sample_s)  # returns early once every client is done
    await asyncio.gather(*tasks)
    return {"samples": samples, "counts": counts, "wall_s": time.monotonic() - start}


def run(ckpt: Path, args) -> dict[str, Any]:
    import httpx
    import ray
    from ray import serve

    from components.serving.app import build_app
    from tests.conftest import free_port

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})  # loopback only
    url = f"http://127.0.0.1:{port}"
    config = {
        "api_key_env": None,
        "max_tokens_limit": 64,
        "default_max_tokens": 16,
        "think_limit": 64,
        "max_ongoing_requests": args.clients,
        "max_queued_requests": args.clients,
        "torch_threads": 1,
        "autoscaling": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 1},
    }
    try:
        serve.run(build_app({"model_uri": str(ckpt), "config": config}), name="soak", route_prefix="/")
        deadline = time.time() + 120
        while httpx.get(f"{url}/ready", timeout=10).status_code != 200:
            assert time.time() < deadline, "the app never became ready"
            time.sleep(0.5)
        pid = httpx.get(f"{url}/health", timeout=10).json()["pid"]
        return asyncio.run(soak(url, pid, args))
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="how long the load runs")
    p.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests in any case")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients, each sending back to back")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between RSS samples")
    p.add_argument("--think", type=int, default=24, help="largest reasoning_budget of a request")
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens of a request")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(Path(tmp) / "demo", DEMO, DEMO_BUDGETS, vocab_from_tokenizer=True)
        out = run(ckpt, args)
    samples = out["samples"]
    steady = [(s["t_s"], s["replica_rss"]) for s in samples[1:]]  # after the first sample: warm-up done
    growth = (steady[-1][1] - steady[0][1]) / MB if len(steady) >= 2 else 0.0
    # the longest row: a chat prompt (~20 tokens with the template) + thinking + close marker + answer
    bound = kv_bound_bytes(args.clients, 32 + args.think + 8 + args.max_tokens, DEMO) / MB
    result = {
        "args": vars(args), "load_average": load, "load_average_end": os.getloadavg(), **out,
        "replica_slope_mb_per_min": slope_mb_per_min(steady) if len(steady) >= 2 else None,
        "replica_growth_mb": growth, "kv_bound_mb": bound, "within_bound": growth <= bound,
        "ingress_slope_mb_per_min": slope_mb_per_min([(s["t_s"], s["ingress_rss"]) for s in samples[1:]])
        if len(samples) >= 3 else None,
    }  # fmt: skip
    ok = out["counts"].get("ok", 0)
    print(format_table(
        ["minutes", "requests ok", "other", "replica RSS first MB", "last MB", "slope MB/min", "growth MB",
         "KV bound MB", "within bound", "ingress slope MB/min"],
        [[round(out["wall_s"] / 60, 2), ok, {k: v for k, v in out["counts"].items() if k not in ("ok", "sent")} or "-",
          samples[0]["replica_rss"] / MB, samples[-1]["replica_rss"] / MB, result["replica_slope_mb_per_min"],
          growth, bound, "yes" if result["within_bound"] else "no", result["ingress_slope_mb_per_min"]]],
    ))  # fmt: skip
    if args.json:
        save_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
