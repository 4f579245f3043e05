"""A model replica killed (SIGKILL) under concurrent clients: what the clients and the probes see.

Six clients (three streaming, three not) send requests back to back; the replica process is killed
with SIGKILL while requests are in flight. Every request that fails must fail as a client expects:
a JSON 503 with ``Retry-After`` (or, once a stream has started, a complete terminal SSE error event),
within a stated bound; ``/health`` must say 503 while no replica is up, and answer promptly; a new
replica must answer within a stated time. A wedged decode thread must fail the replica's health check.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.integration.serving_app import running_app

pytestmark = pytest.mark.integration

APP = "serving-faults-test"
CONFIG = {
    "api_key_env": None,
    "max_tokens_limit": 64,
    "default_max_tokens": 8,
    "think_limit": 16,
    "batch_wait_timeout_s": 0.02,
    "max_ongoing_requests": 8,
    "max_queued_requests": 8,
    "num_cpus_per_replica": 0.5,
    "retry_after_s": 1,
    "health_check_period_s": 1,
    "health_check_timeout_s": 10,
    "replica_wait_s": 3,
    "probe_timeout_s": 1,
    "autoscaling": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 4},
}
REQUEST_BOUND_S = 20.0  # replica_wait_s (3) + the longest generation under this load on 2 busy cores, with margin
PROBE_BOUND_S = 4.0  # probe_timeout_s (1) + HTTP and scheduling slack
RECOVERY_BOUND_S = 60.0  # health check period (1) + a new replica process loading the model on 2 cores
PROBLEMS = ["1+2*3", "4-1*2", "5*5+1", "9-3+3", "2*2*2", "7+0-4"]


def body(i: int, stream: bool) -> dict:
    msgs = [{"role": "user", "content": f"Q:{PROBLEMS[i % len(PROBLEMS)]}\n"}]
    return {"model": "medium", "messages": msgs, "temperature": 0, "max_tokens": 48, "reasoning_budget": 16,
            "stream": stream}  # fmt: skip


@dataclass
class Outcome:
    stream: bool
    start: float
    end: float
    status: int
    retry_after: str | None = None
    error: dict | None = None  # the OpenAI error object of a 503 or of a stream's terminal event
    done: bool = False  # a stream that ended with [DONE]


async def one_request(http: httpx.AsyncClient, i: int, stream: bool) -> Outcome:
    start = time.monotonic()
    if not stream:
        r = await http.post("/v1/chat/completions", json=body(i, False))
        out = Outcome(False, start, time.monotonic(), r.status_code, r.headers.get("retry-after"))
        if r.status_code != 200:
            assert r.headers["content-type"] == "application/json", (r.status_code, r.text)
            out.error = r.json()["error"]
        return out
    async with http.stream("POST", "/v1/chat/completions", json=body(i, True)) as r:
        if r.status_code != 200:
            await r.aread()
            assert r.headers["content-type"] == "application/json", (r.status_code, r.text)
            return Outcome(
                True, start, time.monotonic(), r.status_code, r.headers.get("retry-after"), r.json()["error"]
            )
        events = [line[len("data: ") :] async for line in r.aiter_lines() if line.startswith("data: ")]
    out = Outcome(True, start, time.monotonic(), 200)
    assert events, "a stream without a single event"
    if events[-1] == "[DONE]":
        out.done = True
    else:  # the terminal event must be a complete JSON error object
        out.error = json.loads(events[-1])["error"]
    return out


async def client(url: str, c: int, stream: bool, outcomes: list[Outcome], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_BOUND_S + 30) as http:
        i = c
        while not stop.is_set():
            out = await one_request(http, i, stream)
            outcomes.append(out)
            i += 6
            if out.status != 200 or out.error:
                await asyncio.sleep(0.2)  # as a client honouring Retry-After would, but shorter: keep the test short


async def prober(url: str, probes: list[tuple[float, int, float, int | None]], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=PROBE_BOUND_S + 10) as http:
        while not stop.is_set():
            t = time.monotonic()
            r = await http.get("/health")
            probes.append((t, r.status_code, time.monotonic() - t, r.json().get("pid")))
            await asyncio.sleep(0.25)


async def kill_under_load(url: str) -> dict:
    outcomes: list[Outcome] = []
    probes: list[tuple[float, int, float, int | None]] = []
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client(url, c, stream=c % 2 == 1, outcomes=outcomes, stop=stop)) for c in range(6)]
    tasks.append(asyncio.create_task(prober(url, probes, stop)))
    try:
        deadline = time.monotonic() + 60
        while sum(o.status == 200 and not o.error for o in outcomes) < 6:  # every client is under way
            assert time.monotonic() < deadline, outcomes
            await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            old_pid = (await http.get("/health")).json()["pid"]
            await asyncio.sleep(0.3)  # requests are in flight: they were sent back to back
            killed = time.monotonic()
            os.kill(old_pid, signal.SIGKILL)
            recovered = None
            while time.monotonic() - killed < RECOVERY_BOUND_S:
                r = await http.get("/health")
                if r.status_code == 200 and r.json()["pid"] != old_pid:
                    recovered = time.monotonic()
                    break
                await asyncio.sleep(0.2)
        await asyncio.sleep(2.0)  # a little traffic on the new replica
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_BOUND_S + 30)
    return {"outcomes": outcomes, "probes": probes, "killed": killed, "recovered": recovered, "old_pid": old_pid}


@pytest.fixture(scope="module")
def base_url(serve_http, tiny_nested_checkpoint):
    with running_app(APP, tiny_nested_checkpoint, CONFIG, serve_http) as url:
        yield url


def test_replica_killed_under_load_costs_clients_clean_503s_only(base_url):
    run = asyncio.run(kill_under_load(base_url))
    outcomes, probes, killed, recovered = run["outcomes"], run["probes"], run["killed"], run["recovered"]
    assert recovered is not None, f"no new replica answered within {RECOVERY_BOUND_S} s of the kill"
    failed = [o for o in outcomes if o.status != 200 or o.error]
    assert failed, "no request was in flight when the replica died: the test exercised nothing"
    for o in outcomes:
        assert o.status in (200, 503), o
        assert o.end - o.start <= REQUEST_BOUND_S, o  # nobody waited without bound
        if o.status == 503:  # before a response started: a JSON 503 asking to retry
            assert o.retry_after == "1", o
            assert set(o.error) == {"message", "type", "param", "code"}, o
            assert o.error["code"] in ("replica_unavailable", "overloaded"), o
        elif o.error is not None:  # a stream cut by the death ends with a complete error event
            assert o.stream and o.error["code"] == "replica_unavailable", o
        else:
            assert o.done or not o.stream, o
    assert all(o.start >= killed - REQUEST_BOUND_S for o in failed)  # failures belong to the kill, not before it
    # the probes answered promptly throughout, said 503 in the gap, and never vouched for the dead process
    assert all(elapsed <= PROBE_BOUND_S for _, _, elapsed, _ in probes), max(p[2] for p in probes)
    gap = [status for t, status, _, _ in probes if killed < t < recovered]
    assert 503 in gap, probes
    assert not [p for p in probes if p[0] > killed + 0.5 and p[1] == 200 and p[3] == run["old_pid"]], probes
    served_after = [o for o in outcomes if o.start > recovered and o.status == 200 and not o.error]
    assert served_after, "nothing was served by the new replica"
    print(
        f"\nkill -9 under 6 clients: {len(failed)} of {len(outcomes)} requests failed cleanly "
        f"({sum(o.status == 503 for o in failed)} JSON 503, {sum(o.status == 200 for o in failed)} stream error "
        "events), new replica "
        f"answering after {recovered - killed:.1f} s, longest request {max(o.end - o.start for o in outcomes):.1f} s, "
        f"{gap.count(503)} of {len(gap)} probes in the gap said 503"
    )


def test_a_wedged_decode_thread_fails_the_health_check(tiny_nested_checkpoint, monkeypatch):
    """The replica's check_health (what Serve calls) fails once a decode step hangs past stall_timeout_s."""
    from components.serving.batch import Group
    from components.serving.deployments import StarElasticServer

    release, entered = threading.Event(), threading.Event()
    step = Group.step

    def hanging_step(self):  # a decode step that never returns, as a wedged kernel or a deadlock would
        entered.set()
        release.wait(60)
        return step(self)

    replica = StarElasticServer.func_or_class(str(tiny_nested_checkpoint), {**CONFIG, "stall_timeout_s": 1.0})
    try:
        replica.check_health()  # healthy while it idles: the idle loop beats
        time.sleep(1.5)
        replica.check_health()
        monkeypatch.setattr(Group, "step", hanging_step)

        async def submit() -> None:
            state = replica.api.state
            from components.serving.request_models import ChatCompletionRequest, parse_request

            req = parse_request(ChatCompletionRequest, json.dumps(body(0, False)).encode())
            jobs, _ = state.make_jobs(req)
            state.submit(jobs)
            assert await asyncio.to_thread(entered.wait, 30)
            await asyncio.sleep(1.5)
            with pytest.raises(RuntimeError, match="no progress"):
                replica.check_health()
            assert "no progress" in replica.probe()["error"]

        asyncio.run(submit())
    finally:
        release.set()
        replica.api.close()
