"""Autoscaling as configured: 1 -> 2 replicas under load, back to 1 when idle, on the configured delays.

Short delays and a short look-back window keep the test short; the bounds are the configured values
plus one look-back period (and a stated slack for metric reports and the controller's loop), and each
move comes no earlier than its delay, so a window or delay that did not reach Serve fails the test.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.serving_app import running_app

pytestmark = pytest.mark.integration

APP = "serving-autoscale-test"
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 4.0,
    "look_back_period_s": 2.0,
    "metrics_interval_s": 0.5,
}
CONFIG = {
    "api_key_env": None,
    "max_tokens_limit": 64,
    "default_max_tokens": 8,
    "think_limit": 16,
    "max_ongoing_requests": 8,
    "max_queued_requests": 8,
    "num_cpus_per_replica": 0.5,
    "autoscaling": AUTOSCALING,
}
SLACK_S = 5.0  # two metric reports (0.5 s each), the controller's loop, and a busy 2-core machine
UP_BOUND_S = AUTOSCALING["upscale_delay_s"] + AUTOSCALING["look_back_period_s"] + SLACK_S
DOWN_BOUND_S = AUTOSCALING["downscale_delay_s"] + AUTOSCALING["look_back_period_s"] + SLACK_S
PROBLEMS = ["1+2*3", "4-1*2", "5*5+1", "9-3+3"]


def replicas() -> tuple[int, int]:
    """(replicas the controller wants: starting or running, replicas running) of the model deployment."""
    from ray import serve

    states = serve.status().applications[APP].deployments["StarElasticServer"].replica_states
    wanted = sum(n for state, n in states.items() if state not in ("STOPPING",))
    return wanted, states.get("RUNNING", 0)


async def load(url: str, statuses: list[int], stop: asyncio.Event, clients: int = 4) -> None:
    async def one(c: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            i = c
            while not stop.is_set():
                msgs = [{"role": "user", "content": f"Q:{PROBLEMS[i % len(PROBLEMS)]}\n"}]
                req = {"model": "medium", "messages": msgs, "temperature": 0, "max_tokens": 24, "reasoning_budget": 8}
                statuses.append((await http.post("/v1/chat/completions", json=req)).status_code)
                i += clients

    await asyncio.gather(*(one(c) for c in range(clients)))


async def wait_for(condition, bound_s: float, start: float) -> float | None:
    """Seconds from ``start`` until ``condition()`` held (polled every 0.2 s), or None past ``bound_s + 10``."""
    while time.monotonic() - start < bound_s + 10:
        if await asyncio.to_thread(condition):
            return time.monotonic() - start
        await asyncio.sleep(0.2)
    return None


async def up_then_down(url: str) -> dict:
    statuses: list[int] = []
    stop = asyncio.Event()
    loaded = time.monotonic()
    task = asyncio.create_task(load(url, statuses, stop))
    try:
        up = await wait_for(lambda: replicas()[0] == 2, UP_BOUND_S, loaded)
        both = await wait_for(lambda: replicas()[1] == 2, 60, loaded)  # the new one loaded the model
        await asyncio.sleep(2)  # both replicas under load for a moment
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    idle = time.monotonic()
    down = await wait_for(lambda: replicas()[0] == 1, DOWN_BOUND_S, idle)
    return {"up": up, "both": both, "down": down, "statuses": statuses}


@pytest.fixture(scope="module")
def base_url(serve_http, tiny_nested_checkpoint):
    with running_app(APP, tiny_nested_checkpoint, CONFIG, serve_http) as url:
        yield url


def test_one_to_two_to_one_on_the_configured_delays(base_url):
    assert replicas() == (1, 1)
    run = asyncio.run(up_then_down(base_url))
    up, both, down, statuses = run["up"], run["both"], run["down"], run["statuses"]
    assert up is not None and both is not None, run
    assert AUTOSCALING["upscale_delay_s"] - 0.5 <= up <= UP_BOUND_S, run
    assert down is not None, f"still 2 replicas {DOWN_BOUND_S + 10:.0f} s after the load stopped"
    # never before the downscale delay (the window still held load), never later than delay + window + slack
    assert AUTOSCALING["downscale_delay_s"] - 0.5 <= down <= DOWN_BOUND_S, run
    assert statuses and set(statuses) == {200}, sorted(set(statuses))  # scaling cost no request
    print(
        f"\nautoscaling: 2 replicas wanted {up:.1f} s after the load began (running at {both:.1f} s), "
        f"1 again {down:.1f} s after it stopped; {len(statuses)} requests, all 200"
    )
