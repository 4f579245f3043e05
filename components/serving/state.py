"""What one replica holds, and how a validated request becomes jobs for the engine.

:class:`ServingState` is the replica: one weight copy, the decode thread, metrics, admission and
identity; it knows nothing about HTTP beyond a bounded body and the bearer key. :class:`Admission`
is the replica's backpressure (a request holds its slot until its last token is sent). A request
becomes one :class:`~components.serving.engine.Job` per (prompt, choice), indexed ``prompt * n + choice``,
as :func:`model.request_plan.plan` plans it (budgets, caps, every choice's seeds); a request's constraint
(:mod:`components.serving.constraints`) is compiled before it is admitted, and every job gets its own copy
of the grammar.

Design notes (seeds of ``n`` choices): docs/serving.md ("The replica and admission").
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from components.serving import protocol as P
from components.serving.config import ServingConfig, resolve_checkpoint
from components.serving.constraints import Constraint, ConstraintError, build_constraint, compile_constraint
from components.serving.engine import Engine, EngineStopped
from components.serving.grammar import Grammars
from components.serving.job import Job
from components.serving.loading import LoadedModel
from components.serving.metrics import ServingMetrics
from components.serving.prompts import PromptError, PromptRules, check_length
from components.serving.request_models import ChatCompletionRequest, CompletionRequest
from components.serving.tools import tool_format
from model import request_plan as rp
from model.generate import SamplingParams

log = logging.getLogger("star_elastic.serving")


class Admission:
    """At most ``ongoing`` holders at once, at most ``queued`` waiting (-1: unbounded); more -> 503."""

    def __init__(self, ongoing: int, queued: int, retry_after_s: float) -> None:
        self.ongoing, self.queued, self.retry_after_s = ongoing, queued, retry_after_s
        self.running = 0
        self.rejected = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> None:
        if self.running < self.ongoing and not self.waiting:
            self.running += 1
            return
        if 0 <= self.queued <= self.waiting:
            self.rejected += 1
            raise P.unavailable(
                f"the server is overloaded: {self.running} requests running and {self.waiting} waiting on this "
                f"replica (limits {self.ongoing} + {self.queued}); retry later",
                self.retry_after_s,
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot over: `running` already counts this request
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the slot arrived as the caller left: pass it on
                self.release()
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


@dataclass
class Prompt:
    """One prompt of a request: its ids, whether it thinks, and the text ``echo`` returns."""

    ids: list[int]
    thinks: bool
    echo_text: str


def _refusal(err: rp.PlanError) -> P.OpenAIError:
    """The HTTP error of a refused plan: an unknown ``model`` is a 404, as in the OpenAI API."""
    if err.unknown_budget:
        status = 404 if err.param == "model" else 400
        return P.OpenAIError(status, err.message, param=err.param, code="model_not_found")
    return P.OpenAIError(400, err.message, param=err.param, code="invalid_value")


class ServingState:
    """What one replica holds: the engine over one weight copy, metrics, admission, identity (pid, start time)."""

    def __init__(self, model_uri: str, config: ServingConfig) -> None:
        self.model_uri, self.config = model_uri, config
        self.api_key = config.resolved_api_key()
        self.loaded = LoadedModel.load(resolve_checkpoint(model_uri, config), config)
        self.engine = Engine(self.loaded, config).start()
        self.metrics = ServingMetrics()
        self.admission = Admission(config.max_ongoing_requests, config.max_queued_requests, config.retry_after_s)
        self.pid, self.started_at = os.getpid(), time.time()
        self.cards = self.loaded.cards
        self.limits = rp.Limits(
            {name: card.active_params for name, card in self.cards.items()}, config.allow_think_larger,
            config.max_tokens_limit, self.loaded.tokenizer.markers.think_open,
        )  # fmt: skip
        self.tool_format = tool_format(config.tool_parser)
        self.rules = PromptRules(self.loaded.tokenizer, self.tool_format)
        for effort, setting in config.reasoning_effort.items():
            if setting.think_model is not None and setting.think_model not in self.cards:
                raise ValueError(
                    f"reasoning_effort.{effort}.think_model: {setting.think_model!r} is not a served budget "
                    f"({list(self.cards)})"
                )
        self.grammars: Grammars | None = None
        self.grammar_error: str | None = None
        try:  # a tokenizer the grammar engine cannot read costs structured outputs, not the replica
            vocab = self.loaded.registry.full.config.vocab_size
            self.grammars = Grammars(
                self.loaded.tokenizer, vocab, self.loaded.tokens.answer_stop_ids, config.json_style,
                config.grammar_cache_size,
            )  # fmt: skip
        except Exception as err:
            self.grammar_error = f"{type(err).__name__}: {err}"
            log.warning("structured outputs are unavailable: the grammar engine cannot read the tokenizer (%s)", err)

    def close(self) -> None:
        self.engine.stop()

    def memory(self) -> dict[str, Any]:
        import psutil

        registry = self.loaded.registry
        plans = {n: plan for n in registry.names if (plan := registry.get(n).decode_plan()) is not None}
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in registry.full.state_dict().values()
        }
        return {
            "rss_bytes": psutil.Process().memory_info().rss,
            "weight_bytes": sum(storages.values()),  # the one weight copy (each storage counted once)
            "copied_bytes": registry.copied_bytes(),  # per budget: what building its model allocated
            "decode_copy_bytes": {  # per budget: its decode steps' weight copies (ServingConfig.decode_copy_mib)
                name: plan.copied_bytes() for name, plan in plans.items()
            },
            "decode_steps": {name: plan.compile_summary() for name, plan in plans.items()},
            "dequant_cache_bytes": self.dequantized_bytes(),  # ServingConfig.dequant_cache_mib / cache_dequantized
        }

    def dequantized_bytes(self) -> int:
        """Bytes of the dense copies quantized weights hold now, every budget's (each module once): what the
        modules found at load to keep one hold (:attr:`LoadedModel.dense_copies
        <components.serving.loading.LoadedModel.dense_copies>`), without walking the budgets' modules."""
        from model.quant import held_dense_bytes  # as loading does: a dense replica never needs the package

        return held_dense_bytes(self.loaded.dense_copies)

    # ------------------------------------------------------------------ HTTP-level checks
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.OpenAIError(
                401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_request_bytes
        too_big = P.OpenAIError(413, f"request body larger than {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():  # bounded even without (or with a lying) Content-Length
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    # ------------------------------------------------------------------ request -> jobs
    def check_budget(self, name: str, param: str) -> str:
        """``name`` if it is a served budget, else the planner's refusal (a 404 for ``model``)."""
        try:
            return rp.check_budget(name, param, self.limits)
        except rp.PlanError as err:
            raise _refusal(err) from None

    def constraint(self, req: ChatCompletionRequest | CompletionRequest) -> tuple[Constraint, Any]:
        """The request's constraint and its compiled grammar (cached; None without one); a 400 naming the field
        otherwise."""
        chat = isinstance(req, ChatCompletionRequest)
        try:
            constraint = build_constraint(
                self.tool_format, self.config.json_style, req.response_format, req.structured_outputs,
                req.tools if chat else None, req.tool_choice if chat else None,
                req.parallel_tool_calls if chat else None,
            )  # fmt: skip
            compiled = None
            if constraint.grammar is not None:
                if self.grammars is None:
                    raise ConstraintError(
                        f"{constraint.grammar.param}: structured outputs are unavailable on this replica (the grammar "
                        f"engine cannot read the checkpoint's tokenizer: {self.grammar_error})",
                        constraint.grammar.param,
                    )
                compiled = compile_constraint(self.grammars, constraint)
        except ConstraintError as err:
            raise P.OpenAIError(400, err.message, param=err.param, code="invalid_value") from None
        return constraint, compiled

    def template_kwargs(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """``chat_template_kwargs``, plus vLLM's ``reasoning_effort`` / ``enable_thinking`` when an effort is given."""
        kwargs: dict[str, Any] = {}
        if req.reasoning_effort is not None:
            kwargs = {"reasoning_effort": req.reasoning_effort, "enable_thinking": req.reasoning_effort != "none"}
        return {**kwargs, **(req.chat_template_kwargs or {})}

    def prompts(self, req: ChatCompletionRequest | CompletionRequest) -> list[Prompt]:
        """The request's prompts, checked (no control text in chat, non-empty, not too long)."""
        try:
            if isinstance(req, ChatCompletionRequest):
                tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
                messages = [m.for_template() for m in req.messages]
                ids, thinks = self.rules.chat(messages, tools or None, self.template_kwargs(req))
                prompts, params = [Prompt(ids, thinks, "")], ["messages"]
            else:
                raw = req.prompts
                params = ["prompt"] if len(raw) == 1 else [f"prompt.{i}" for i in range(len(raw))]
                prompts = [self._completion(p, param) for p, param in zip(raw, params, strict=True)]
            for p, param in zip(prompts, params, strict=True):
                check_length(p.ids, self.config.max_prompt_tokens, param)
        except PromptError as err:
            raise P.OpenAIError(400, err.message, param=err.param, code=err.code) from None
        return prompts

    def _completion(self, prompt: str | list[int], param: str) -> Prompt:
        ids, thinks = self.rules.completion(prompt, param)
        echo_text = prompt if isinstance(prompt, str) else self.loaded.tokenizer.decode(prompt)
        return Prompt(ids, thinks, echo_text)

    def _effort(self, req: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, str | None]:
        """``(think cap, think_model)`` of the request: its own fields, else its reasoning_effort's setting (whose
        thinking budget applies only when it is not larger than the answering one)."""
        cfg = self.config
        cap = req.reasoning_budget if req.reasoning_budget is not None else cfg.default_think_cap  # planner-checked
        effort = getattr(req, "reasoning_effort", None)
        if effort is None:
            return cap, req.think_model
        setting = cfg.reasoning_effort.get(effort)
        if setting is None:
            raise P.OpenAIError(
                400, f"reasoning_effort: {effort!r} is not configured on this server; configured: "
                f"{sorted(cfg.reasoning_effort)}", param="reasoning_effort", code="invalid_value",
            )  # fmt: skip
        if req.reasoning_budget is None:
            cap = None if setting.think_cap is None else min(setting.think_cap, cfg.max_tokens_limit)
        if req.think_model is not None or setting.think_model is None:
            return cap, req.think_model
        cards = self.cards
        larger = cards[setting.think_model].active_params > cards[req.model].active_params
        return cap, None if larger and not cfg.allow_think_larger else setting.think_model

    def make_jobs(self, req: ChatCompletionRequest | CompletionRequest) -> tuple[list[Job], list[Prompt]]:
        """One job per (prompt, choice) as :func:`model.request_plan.plan` plans it, sharing one event queue; the
        prompts too (for ``echo``)."""
        cfg = self.config
        cap_field = "thinking_token_budget" if req.thinking_token_budget is not None else "reasoning_budget"
        fields = rp.Fields(answer="model", think="think_model", cap=cap_field)
        self.check_budget(req.model, fields.answer)  # first: _effort reads the model's size
        cap, think_model = self._effort(req)
        constraint, compiled = self.constraint(req)
        prompts = self.prompts(req)
        count = len(prompts) * req.n
        if count > cfg.max_choices_per_request:
            raise P.OpenAIError(
                400, f"n: {len(prompts)} prompt(s) x n={req.n} = {count} sequences, more than the limit of "
                f"{cfg.max_choices_per_request} per request", param="n", code="invalid_value",
            )  # fmt: skip
        completion = isinstance(req, CompletionRequest)  # a chat prompt whose template does not think ignores them
        thinking_fields = tuple(
            name for name in ("think_model", "thinking_token_budget", "reasoning_budget")
            if completion and getattr(req, name) is not None
        )  # fmt: skip
        max_tokens = req.max_tokens if req.max_tokens is not None else cfg.default_max_tokens
        requests = [
            rp.Request(p.ids, req.model, max_tokens, p.thinks, think_model, cap, req.n, req.seed, thinking_fields)
            for p in prompts
        ]
        try:
            plans = [rp.plan(r, self.limits, fields) for r in requests]
        except rp.PlanError as err:
            raise _refusal(err) from None
        echo = bool(getattr(req, "echo", False))
        if echo and any(p.thinks for p in prompts):
            raise P.OpenAIError(
                400, "echo: not supported for a prompt that opens a thinking phase (the answer does not follow "
                "the prompt directly); send a prompt without the open marker", param="echo",
            )  # fmt: skip
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        jobs = []
        for i, choices in enumerate(plans):
            for c in choices:
                sampling = SamplingParams(
                    max_new_tokens=c.max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed
                )
                grammar = compiled.deep_copy() if compiled is not None else None  # each sequence its own state
                jobs.append(
                    Job(
                        c.prompt, c.answer_model, c.think_model, c.think_cap, c.max_tokens, sampling, req.stops,
                        req.stream, loop, events=events, index=i * req.n + c.choice, logprobs=req.logprobs_k,
                        echo=echo, grammar=grammar, constraint=constraint, seeds=c.seeds,
                    )
                )  # fmt: skip
        return jobs, prompts

    def submit(self, jobs: list[Job]) -> None:
        try:
            for job in jobs:
                self.engine.submit(job)
        except EngineStopped as err:
            for job in jobs:
                job.cancelled = True
            raise P.unavailable(
                f"the model is not serving: {err}", self.config.retry_after_s, code="unavailable"
            ) from None

    def gauges(self) -> dict[str, tuple[str, float]]:
        """Replica-level series for ``/metrics``."""
        stats = self.engine.snapshot_stats()
        mem = self.memory()
        return {
            "star_elastic_requests_running": ("Requests this replica is working on.", self.admission.running),
            "star_elastic_requests_waiting": ("Requests waiting for a slot on this replica.", self.admission.waiting),
            "star_elastic_requests_rejected_total": (
                "Requests refused with 503 because the replica was full.", self.admission.rejected,
            ),
            "star_elastic_engine_active_batches": ("Batches the decode thread is stepping.", stats["active_groups"]),
            "star_elastic_engine_pending_rows": ("Sequences waiting to be prefilled.", stats["pending_rows"]),
            "star_elastic_engine_decode_steps_total": ("Batched decode steps taken.", stats.get("decode_steps", 0)),
            "star_elastic_engine_max_batch_size": ("Largest batch decoded so far.", stats.get("max_batch_size", 0)),
            "star_elastic_engine_up": ("1 while the decode thread runs.", 1.0 if self.engine.alive else 0.0),
            "star_elastic_resident_memory_bytes": ("Resident set size of the replica process.", mem["rss_bytes"]),
            "star_elastic_weight_bytes": ("Bytes of the one weight copy every budget views.", mem["weight_bytes"]),
            **self.grammar_gauges(stats),
        }  # fmt: skip

    def grammar_stats(self) -> dict[str, Any]:
        """Grammar compiles (count, seconds, cache hits) and masks applied in the sampler, for ``/stats``."""
        stats = self.engine.snapshot_stats()
        compiled = self.grammars.stats() if self.grammars is not None else {}
        masked = {
            "masked_tokens": stats.get("grammar_masked_tokens", 0),
            "mask_s_total": stats.get("grammar_mask_s", 0),
        }
        return {"available": self.grammars is not None, "error": self.grammar_error, **compiled, **masked}

    def grammar_gauges(self, stats: dict[str, Any]) -> dict[str, tuple[str, float]]:
        g = self.grammars.stats() if self.grammars is not None else {}
        series = [
            ("compiles_total", "Grammars compiled (one per distinct schema).", g.get("compiles", 0)),
            ("compile_seconds_total", "Seconds spent compiling grammars.", g.get("compile_s_total", 0.0)),
            ("cache_hits_total", "Requests whose grammar was already compiled.", g.get("cache_hits", 0)),
            ("masked_tokens_total", "Tokens sampled under a grammar mask.", stats.get("grammar_masked_tokens", 0)),
            ("mask_seconds_total", "Seconds computing and applying grammar masks.", stats.get("grammar_mask_s", 0.0)),
        ]
        return {f"star_elastic_grammar_{name}": (text, value) for name, text, value in series}
