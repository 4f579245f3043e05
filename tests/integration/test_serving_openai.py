"""The serving API in-process (no Ray): the official ``openai`` client over the FastAPI app.

For what needs the replica's own objects or a purpose-built checkpoint: the prompt ids the engine
receives for a multi-turn chat (the checkpoint's chat template), templates that do not open or that
close the thinking, a model that emits nothing but special tokens, and overload answered with an
OpenAI-shaped JSON 503 carrying ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration

KEY = "sk-test"
SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>", "<think>", "</think>")
BASE = {"api_key": KEY, "max_tokens_limit": 64, "default_max_tokens": 8, "think_limit": 16}


def _state(folder: Path, **config):
    from components.serving.config import ServingConfig
    from components.serving.state import ServingState

    return ServingState(str(folder), ServingConfig(**{**BASE, **config}))


def _serve(state, scenario):
    """Run ``scenario(oai, http)`` against the app over an in-process transport, then stop the engine."""
    import openai

    from components.serving.api import ServingApp

    api = ServingApp(state)

    async def run():
        transport = httpx.ASGITransport(app=api.fastapi)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as http:
            oai = openai.AsyncOpenAI(base_url="http://app/v1", api_key=KEY, http_client=http, max_retries=0)
            return await scenario(oai, http)

    try:
        return asyncio.run(run())
    finally:
        api.close()


def _recording(state) -> list[list[int]]:
    """Every prompt the engine is handed, in order."""
    seen: list[list[int]] = []
    submit = state.engine.submit

    def record(job):
        seen.append(list(job.prompt))
        submit(job)

    state.engine.submit = record
    return seen


def _variant(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` changed by ``edit(folder)``, with its manifest rewritten."""
    from model.checkpoint import write_manifest

    shutil.copytree(src, dst)
    edit(dst)
    write_manifest(dst)
    return dst


@pytest.fixture(scope="module")
def uniform_checkpoint(tiny_nested_checkpoint, tmp_path_factory):
    """The tiny checkpoint with its final norm zeroed: every logit is 0, so greedy decoding emits id 0
    (``<pad>``) forever and sampling draws uniformly from the vocabulary (special tokens included)."""
    from safetensors.torch import load_file, save_file

    def zero_norm(folder: Path) -> None:
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["backbone.norm_f.weight"].zero_()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    return _variant(tiny_nested_checkpoint, tmp_path_factory.mktemp("uniform") / "ckpt", zero_norm)


# ---------------------------------------------------------------------- the chat template
def test_multi_turn_chat_with_system_message_goes_through_the_template(tiny_nested_checkpoint):
    messages = [
        {"role": "system", "content": "You are terse.\n"},
        {"role": "user", "content": "Q:1+2\n"},
        {"role": "assistant", "content": "A:3", "reasoning_content": "1+2=3\n"},
        {"role": "user", "content": "Q:3*3\n"},
    ]
    # the demo template, written out: bos, system and user contents as they are, an assistant turn as
    # <think> reasoning </think> content <eos>, and the generation prompt <think>
    rendered = "<bos>You are terse.\nQ:1+2\n<think>1+2=3\n</think>A:3<eos>Q:3*3\n<think>"
    state = _state(tiny_nested_checkpoint)
    seen = _recording(state)
    tok = state.loaded.tokenizer

    async def scenario(oai, http):
        return await oai.chat.completions.create(model="small", messages=messages, max_tokens=2, temperature=0)

    out = _serve(state, scenario)
    assert seen == [tok.encode(rendered)]
    assert seen[0] == tok.prompt_ids(messages)
    assert len(seen[0]) == len(rendered) - len("<bos><think></think><eos><think>") + 5  # one id per char, 5 specials
    assert out.usage.prompt_tokens == len(seen[0])
    assert isinstance(out.choices[0].message.reasoning_content, str)


@pytest.mark.parametrize(
    ("generation_prompt", "appended", "thinks"),
    [("", ["<think>"], True), ("<think>\n", [], True), ("<think></think>", [], False)],
)
def test_templates_that_do_not_open_or_that_close_the_thinking(
    tiny_nested_checkpoint, tmp_path, generation_prompt, appended, thinks
):
    """No open marker in the generation prompt: it is appended (budget control applies to every reasoning
    model); open marker then whitespace: thinks as is; the template closed the thinking: answer only."""

    def retemplate(folder: Path) -> None:
        path = folder / "chat_template.jinja"
        text = path.read_text()
        assert text.endswith("{{- '<think>' -}}{%- endif -%}")  # the demo template's generation prompt
        path.write_text(
            text.replace("{{- '<think>' -}}{%- endif -%}", f"{{{{- {generation_prompt!r} -}}}}{{%- endif -%}}")
        )

    folder = _variant(tiny_nested_checkpoint, tmp_path / "ckpt", retemplate)
    state = _state(folder)
    seen = _recording(state)
    tok = state.loaded.tokenizer
    messages = [{"role": "user", "content": "Q:1+2\n"}]

    async def scenario(oai, http):
        return await oai.chat.completions.create(model="small", messages=messages, max_tokens=2, temperature=0)

    out = _serve(state, scenario)
    assert seen == [tok.encode("<bos>Q:1+2\n" + generation_prompt) + [tok.token_to_id(t) for t in appended]]
    assert (out.choices[0].message.reasoning_content is not None) == thinks
    assert out.model_extra["budget_control"]["think_model"] == ("small" if thinks else None)


# ---------------------------------------------------------------------- special tokens
def test_special_tokens_never_reach_the_client(uniform_checkpoint):
    state = _state(uniform_checkpoint)

    async def scenario(oai, http):
        greedy = await oai.completions.create(
            model="full", prompt="<bos>Q:1\n", max_tokens=8, temperature=0, logprobs=0
        )
        sampled = await oai.chat.completions.create(
            model="medium", messages=[{"role": "user", "content": "Q:1\n"}], max_tokens=40, temperature=1.0,
            seed=1, n=3, logprobs=True, extra_body={"reasoning_budget": 40},
        )  # fmt: skip
        streamed = await oai.completions.create(
            model="small", prompt=["<bos>Q:1\n", "<bos>Q:2\n"], max_tokens=40, temperature=1.0, seed=2, stream=True
        )
        chunks = [c async for c in streamed]
        return greedy, sampled, chunks

    greedy, sampled, chunks = _serve(state, scenario)
    # every logit is 0: greedy picks id 0, <pad>, eight times; the text shows none of it
    assert greedy.choices[0].logprobs.tokens == ["<pad>"] * 8 and greedy.choices[0].text == ""
    raw = [e.token for c in sampled.choices for e in c.logprobs.content]
    assert sum(t in SPECIAL for t in raw) >= 3  # uniform sampling drew special tokens (fixed seed)
    for c in sampled.choices:
        for text in (c.message.content, c.message.reasoning_content):
            assert not any(t in text for t in SPECIAL), text
        assert c.message.content == "".join(e.token for e in c.logprobs.content if e.token not in SPECIAL)
    streamed = "".join(c.text for chunk in chunks for c in chunk.choices)
    assert streamed and not any(t in streamed for t in SPECIAL)


# ---------------------------------------------------------------------- overload
def test_overload_is_an_openai_json_503_with_retry_after(uniform_checkpoint):
    """One slot, no queue: of two simultaneous requests one runs, the other gets a 503 at once."""
    import openai

    state = _state(
        uniform_checkpoint, max_ongoing_requests=1, max_queued_requests=0, retry_after_s=2,
        autoscaling={"target_ongoing_requests": 1},
    )  # fmt: skip
    long = {"model": "full", "messages": [{"role": "user", "content": "Q:1\n"}], "temperature": 0,
            "max_tokens": 64, "extra_body": {"reasoning_budget": 64}}  # fmt: skip

    async def scenario(oai, http):
        both = await asyncio.gather(*(oai.chat.completions.create(**long) for _ in range(2)), return_exceptions=True)
        after = await oai.chat.completions.create(**{**long, "max_tokens": 1})  # the slot is free again
        raw = await http.post("/v1/completions", json={"model": "full", "prompt": "a", "max_tokens": 1},
                              headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        metrics = (await http.get("/metrics")).text
        return both, after, raw, metrics

    both, after, raw, metrics = _serve(state, scenario)
    errors = [r for r in both if isinstance(r, Exception)]
    assert len(errors) == 1, both  # one ran, one was refused
    err = errors[0]
    assert isinstance(err, openai.APIStatusError) and err.status_code == 503
    assert err.response.headers["retry-after"] == "2"
    assert err.response.headers["content-type"] == "application/json"
    body = err.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert (body["type"], body["code"]) == ("server_error", "overloaded") and "overloaded" in body["message"]
    assert after.choices[0].finish_reason in ("length", "stop") and raw.status_code == 200
    assert "star_elastic_requests_rejected_total 1" in metrics
    assert 'star_elastic_requests_total{budget="full",route="chat",status="503"} 1' in metrics


# ---------------------------------------------------------------------- failures and shutdown
def test_a_handler_bug_is_a_500_and_the_app_keeps_serving(tiny_nested_checkpoint):
    """A failure injected into one request (not the client's fault) is an OpenAI-shaped 500, counted in
    the metrics; the admission slot is given back and the next request is answered."""
    state = _state(
        tiny_nested_checkpoint, max_ongoing_requests=1, max_queued_requests=0,
        autoscaling={"target_ongoing_requests": 1},
    )  # fmt: skip
    make_jobs = state.make_jobs
    failures = iter([RuntimeError("injected")])

    def fail_once(req):
        err = next(failures, None)
        if err is not None:
            raise err
        return make_jobs(req)

    state.make_jobs = fail_once
    body = {"model": "small", "messages": [{"role": "user", "content": "Q:1\n"}], "max_tokens": 2, "temperature": 0}

    async def scenario(oai, http):
        auth = {"Authorization": f"Bearer {KEY}"}
        broken = await http.post("/v1/chat/completions", json=body, headers=auth)
        fine = await http.post("/v1/chat/completions", json=body, headers=auth)
        return broken, fine, (await http.get("/metrics")).text

    broken, fine, metrics = _serve(state, scenario)
    assert broken.status_code == 500
    assert broken.json()["error"] == {
        "message": "internal error: RuntimeError", "type": "server_error", "param": None, "code": None,
    }  # fmt: skip
    assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert 'star_elastic_requests_total{budget="small",route="chat",status="500"} 1' in metrics
    assert state.admission.running == 0


def test_the_app_lifespan_stops_the_engine(tiny_nested_checkpoint):
    """Shutdown is explicit: the ASGI server's lifespan end (uvicorn, or Serve stopping a replica) calls
    ``ServingApp.close``, after which the probes and requests answer 503."""
    from components.serving.api import ServingApp

    api = ServingApp(_state(tiny_nested_checkpoint))
    app = api.fastapi
    body = {"model": "small", "prompt": "a", "max_tokens": 1}

    async def run():
        async with app.router.lifespan_context(app):
            assert api.state.engine.alive
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            auth = {"Authorization": f"Bearer {KEY}"}
            return (
                await http.get("/health"),
                await http.get("/ready"),
                await http.post("/v1/completions", json=body, headers=auth),
            )

    try:
        health, ready, refused = asyncio.run(run())
    finally:
        api.close()  # a second close is harmless
    assert not api.state.engine.alive
    assert (health.status_code, health.json()["status"]) == (503, "unhealthy")
    assert (ready.status_code, ready.json()["ready"]) == (503, False)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
