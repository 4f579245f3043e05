"""Load on loopback: below capacity every request succeeds (and is batched); above it, clean 503s.

Capacity is the replica's: ``max_ongoing_requests`` running plus ``max_queued_requests`` waiting for a
slot; Serve sends the replica more than that, so overload is answered by the app itself with an
OpenAI-shaped JSON 503 and ``Retry-After``. The app is configured with 4 + 4: 4 concurrent clients
stay under it and a burst of 32 goes over. Counts and wall time are bounded.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.serving_app import running_app

pytestmark = pytest.mark.integration

APP = "serving-load-test"
CONFIG = {
    "api_key_env": None,
    "max_tokens_limit": 64,
    "default_max_tokens": 8,
    "think_limit": 16,
    "batch_max_size": 8,
    "batch_wait_timeout_s": 0.05,
    "max_ongoing_requests": 4,
    "max_queued_requests": 4,
    "num_cpus_per_replica": 1,
    "autoscaling": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 2},
}
# Prompts of one length (same number of steps), so concurrent requests can share a batch.
PROBLEMS = ["1+2*3", "4-1*2", "5*5+1", "9-3+3", "2*2*2", "7+0-4"]


def body(i: int, **kw) -> dict:
    msgs = [{"role": "user", "content": f"Q:{PROBLEMS[i % len(PROBLEMS)]}\n"}]  # the demo format
    return {"model": "medium", "messages": msgs, "temperature": 0, "max_tokens": 6, "reasoning_budget": 6, **kw}


@pytest.fixture(scope="module")
def base_url(serve_http, tiny_nested_checkpoint):
    with running_app(APP, tiny_nested_checkpoint, CONFIG, serve_http) as url:
        yield url


async def _client(url: str, n: int, offset: int, **kw) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return [await client.post("/v1/chat/completions", json=body(offset + i, **kw)) for i in range(n)]


async def _burst(url: str, n: int, **kw) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=body(i, **kw)) for i in range(n)))


def test_below_capacity_no_errors_and_batched(base_url):
    start = time.perf_counter()
    results = asyncio.run(asyncio.wait_for(_gather_clients(base_url, clients=4, each=3), timeout=120))
    elapsed = time.perf_counter() - start
    statuses = [r.status_code for rs in results for r in rs]
    assert statuses == [200] * 12, [r.text for rs in results for r in rs if r.status_code != 200]
    engine = httpx.get(f"{base_url}/stats", timeout=10).json()["engine"]
    assert engine["max_batch_size"] >= 2, engine  # concurrent same-length prompts were decoded together
    assert elapsed < 120


async def _gather_clients(url: str, clients: int, each: int) -> list[list[httpx.Response]]:
    return await asyncio.gather(*(_client(url, each, c * each) for c in range(clients)))


def test_above_capacity_clean_503_then_keeps_serving(base_url):
    before = httpx.get(f"{base_url}/health", timeout=10).json()
    # long enough generations that the first requests are still running when the rest arrive
    responses = asyncio.run(asyncio.wait_for(_burst(base_url, 32, max_tokens=48, reasoning_budget=16), timeout=150))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected, "no request was rejected although 32 > 4 ongoing + 4 queued"
    for r in rejected:  # OpenAI-shaped, with the delay the config names
        assert r.headers["content-type"] == "application/json" and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "overloaded", error
    assert statuses.count(200) >= 4  # those within capacity were served
    after = httpx.get(f"{base_url}/health", timeout=10).json()
    assert (after["status"], after["pid"], after["started_at"]) == ("ok", before["pid"], before["started_at"])
    again = asyncio.run(_client(base_url, 2, 0))
    assert [r.status_code for r in again] == [200, 200]


def test_client_disconnect_stops_decoding_for_it(base_url):
    """A client that goes away mid-stream frees its rows: the engine does not decode for nobody."""
    stats = lambda: httpx.get(f"{base_url}/stats", timeout=10).json()["engine"]
    with httpx.Client(base_url=base_url, timeout=60) as client:
        long = None  # a greedy request this random model answers at length (no early </think> or <eos>)
        for i in range(len(PROBLEMS)):
            req = body(i, max_tokens=64, reasoning_budget=64)
            usage = client.post("/v1/chat/completions", json=req).json()["usage"]
            if usage["completion_tokens"] >= 100:
                long = (req, usage["completion_tokens"])
                break
        if long is None:
            pytest.skip("no prompt makes this random model generate at length")
        before = stats()
        with client.stream("POST", "/v1/chat/completions", json={**long[0], "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first event arrived: the request is decoding; now hang up
    deadline = time.time() + 30
    while (now := stats())["active_groups"] or now["pending_rows"]:
        assert time.time() < deadline, now
        time.sleep(0.1)
    assert now["cancelled_rows"] == before.get("cancelled_rows", 0) + 1
    assert now["generated_tokens"] - before["generated_tokens"] < long[1]
