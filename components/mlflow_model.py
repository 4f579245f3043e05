"""The nested checkpoint as an MLflow model: a pyfunc that answers chat and completion requests on any budget.

The registered model is a regular MLflow model (``MLmodel``, the checkpoint under ``artifacts/``,
the project code under ``code/``, built from ``mlflow_model_code.py``: no pickle). ``predict`` is
thin: the serving loader, the server's prompt rules, the server's request planner (:mod:`model.request_plan`:
checks, ``n`` choices, seeds) and the generation functions evaluation uses, so a seeded request gives the
server's tokens wherever it sits in the input. Requests are typed by :class:`GenerationRequest` (MLflow's
signature); ``temperature`` defaults to 0 so predictions are reproducible. Structured outputs and tools take
the server's arguments (``response_format``, ``tools``, ``tool_choice``, ``parallel_tool_calls``); a row with a
grammar decodes on the serving engine, whose sampler applies it.

Design notes (layout, ``model_config``, DataFrame inputs): docs/serving.md ("The registry model (MLflow pyfunc)").
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow.pyfunc
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from components.model_uri import CHECKPOINT_ARTIFACT

if TYPE_CHECKING:
    from mlflow.models.model import ModelInfo

    from components.serving.config import ServingConfig
    from components.serving.constraints import Constraint
    from components.serving.grammar import Grammars
    from components.serving.job import JobResult
    from components.serving.loading import LoadedModel
    from components.serving.prompts import PromptRules
    from components.serving.tools import ToolFormat
    from model.request_plan import ChoicePlan, Limits

_REQUIREMENTS = (
    "mlflow", "torch", "safetensors", "tokenizers", "transformers", "jinja2", "numpy", "pandas", "pydantic", "tqdm",
    "llguidance",
)  # fmt: skip
"""Distributions ``predict`` imports (pinned to the versions installed when the model is logged)."""
ROLES = ("system", "developer", "user", "assistant", "tool")


# ---------------------------------------------------------------------- requests and results
class ChatTurn(BaseModel):
    """One chat message (rendered with the others by the checkpoint's chat template)."""

    model_config = ConfigDict(extra="forbid")

    # a plain str checked below: MLflow's signature inference does not take Literal types
    role: str = Field(description=f"Who wrote it: one of {', '.join(ROLES)}.")
    content: str | None = Field(None, description="The message text (None: an assistant turn of tool calls).")
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="An assistant turn's tool calls, as the chat API returns them (arguments as JSON text)."
    )
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    @field_validator("role")
    @classmethod
    def _role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {list(ROLES)}")
        return role


class GenerationRequest(BaseModel):
    """One request of ``predict``'s input: a chat (``messages``) or a completion (``prompt``)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatTurn] | None = Field(None, description="Chat messages; give this or prompt.")
    prompt: str | None = Field(
        None, description="Raw completion text (special-token strings allowed); it thinks if it ends with <think>."
    )
    budget: str | None = Field(None, description="Budget that answers (default: the largest).")
    max_tokens: int | None = Field(None, ge=1, description="Most answer tokens (default: default_max_tokens).")
    reasoning_budget: int | None = Field(
        None,
        ge=0,
        description="Most thinking tokens (0: answer at once; default: default_think_cap, else think_limit).",
    )
    think_model: str | None = Field(None, description="Budget that thinks before `budget` answers (elastic control).")
    # Optional rather than defaulted: MLflow marks a field without a None default as required in the signature
    temperature: float | None = Field(None, ge=0, le=2, description="Sampling temperature (default 0: greedy).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass (default 1).")
    seed: int | None = Field(None, description="Sampling seed: the server's tokens for this request, wherever it sits.")
    n: int | None = Field(None, ge=1, description="Choices to sample (default 1); all of them in the result's choices.")
    response_format: dict[str, Any] | None = Field(
        None, description="As the chat API: {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {...}}."
    )
    tools: list[dict[str, Any]] | None = Field(None, description="As the chat API: function tools.")
    tool_choice: str | None = Field(
        None, description="'none', 'auto' (default with tools), 'required', or the name of the function to call."
    )
    parallel_tool_calls: bool | None = Field(None, description="False: at most one tool call.")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerationRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages (chat) or prompt (completion)")
        return self


class ToolCallResult(BaseModel):
    """One tool call of a result."""

    id: str = Field(description="The call's id (what a tool message's tool_call_id answers).")
    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments, JSON text of an object.")


class GenerationChoice(BaseModel):
    """One sampled choice of a request."""

    text: str = Field(description="The answer (special tokens and reasoning markers removed).")
    # None defaults: MLflow infers the output schema only when every optional field has one
    reasoning: str | None = Field(None, description="The kept thinking; None for a prompt without a thinking phase.")
    finish_reason: str = Field(description="'stop': the model ended the answer; 'length': max_tokens was reached.")
    reasoning_tokens: int = Field(description="Thinking tokens decoded (including any cut at the cap).")
    completion_tokens: int = Field(description="Every generated token, thinking included.")
    tool_calls: list[ToolCallResult] | None = Field(
        None, description="Tool calls read from the answer (then text holds what came before them)."
    )


class GenerationResult(GenerationChoice):
    """One item of ``predict``'s output: choice 0's fields, and every choice in ``choices`` when n > 1."""

    budget: str = Field(description="Budget that answered.")
    think_model: str | None = Field(None, description="Budget that thought (None: no thinking phase).")
    prompt_tokens: int = Field(description="Prompt length in tokens.")
    choices: list[GenerationChoice] | None = Field(None, description="Every choice, in order, when n > 1.")


# ---------------------------------------------------------------------- generation
@dataclass(frozen=True)
class _Row:
    """One request: its planned choices and how they sample; choices of rows with equal ``key`` share one call."""

    choices: list[ChoicePlan]
    temperature: float
    top_p: float
    constraint: Constraint

    @property
    def key(self) -> tuple[Any, ...]:
        c = self.choices[0]
        return c.answer_model, c.think_model, c.think_cap, c.max_tokens, self.temperature, self.top_p


def _constraint(req: GenerationRequest, fmt: ToolFormat, config: ServingConfig, row: int) -> Constraint:
    """The row's constraint, validated by the server's rules (a ``ValueError`` naming the row and field)."""
    from pydantic import TypeAdapter, ValidationError

    from components.serving.constraints import ConstraintError, NamedToolChoice, ResponseFormat, Tool, build_constraint
    from components.serving.protocol import validation_error

    def invalid(field: str, err: ValidationError) -> ValueError:
        e = validation_error(err)
        return ValueError(f"row {row}: {field}{'.' if e.param else ': '}{e.message}")

    try:
        fmt_spec = ResponseFormat.model_validate(req.response_format) if req.response_format is not None else None
    except ValidationError as err:
        raise invalid("response_format", err) from None
    try:
        tools = TypeAdapter(list[Tool]).validate_python(req.tools) if req.tools is not None else None
    except ValidationError as err:
        raise invalid("tools", err) from None
    choice: Any = req.tool_choice
    if choice is not None and choice not in ("none", "auto", "required"):
        choice = NamedToolChoice(type="function", function={"name": choice})
    try:
        return build_constraint(fmt, config.json_style, fmt_spec, None, tools, choice, req.parallel_tool_calls)
    except ConstraintError as err:
        raise ValueError(f"row {row}: {err.message}") from None


def _messages(req: GenerationRequest, row: int) -> list[dict[str, Any]]:
    """The chat messages as the template takes them (tool-call arguments as objects)."""
    out = []
    for i, m in enumerate(req.messages or []):
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                fn = c.get("function") or {}
                try:
                    args = json.loads(fn["arguments"]) if isinstance(fn.get("arguments"), str) else fn["arguments"]
                    calls.append(
                        {"id": c.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}
                    )
                except (KeyError, TypeError, json.JSONDecodeError):
                    raise ValueError(
                        f"row {row}: messages.{i}.tool_calls.{j}: expected {{'id', 'type': 'function', 'function': "
                        "{'name', 'arguments' (JSON text of an object)}}"
                    ) from None
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _plan(rules: PromptRules, limits: Limits, req: GenerationRequest, config: ServingConfig, row: int,
          fmt: ToolFormat) -> _Row:  # fmt: skip
    """Row ``row``'s choices, planned by :func:`model.request_plan.plan`; a request the rules refuse is a
    ``ValueError`` naming the row and the field."""
    from components.serving.prompts import PromptError, check_length
    from model.request_plan import Fields, PlanError, Request, plan

    n, most = 1 if req.n is None else req.n, config.max_choices_per_request
    if n > most:
        raise ValueError(f"row {row}: n: {n} choices, more than max_choices_per_request {most}")
    constraint = _constraint(req, fmt, config, row)
    try:
        if req.messages is not None:
            ids, thinks = rules.chat(_messages(req, row), req.tools or None)
        else:
            ids, thinks = rules.completion(req.prompt or "")
        check_length(ids, config.max_prompt_tokens, "messages" if req.messages is not None else "prompt")
    except PromptError as err:
        raise ValueError(f"row {row}: {err}") from None
    set_fields = req.think_model is not None or req.reasoning_budget is not None  # refused if the prompt does not think
    request = Request(
        ids, req.budget if req.budget is not None else next(iter(limits.active_params)),  # default: the largest
        req.max_tokens if req.max_tokens is not None else config.default_max_tokens, thinks, req.think_model,
        req.reasoning_budget if req.reasoning_budget is not None else config.default_think_cap, n, req.seed,
        ("think_model", "reasoning_budget") if set_fields else (),
    )  # fmt: skip
    try:
        choices = plan(request, limits, Fields(answer="budget", think="think_model", cap="reasoning_budget"))
    except PlanError as err:
        raise ValueError(f"row {row}: {err}") from None
    temperature = 0.0 if req.temperature is None else req.temperature
    return _Row(choices, temperature, 1.0 if req.top_p is None else req.top_p, constraint)


def _on_engine(
    loaded: LoadedModel, config: ServingConfig, compiled: dict[int, Any], rows: dict[int, _Row]
) -> dict[int, list[JobResult]]:
    """Decode every choice of ``rows`` (row -> plan) on the serving engine, whose sampler applies each row's grammar
    (``compiled``: row -> compiled grammar, copied per choice); results per row, in choice order. The engine's events
    are read on a private event loop in a worker thread, so ``predict`` works inside a running loop too."""
    from concurrent.futures import ThreadPoolExecutor

    from components.serving.engine import Engine
    from components.serving.job import Job
    from components.serving.responses import collect
    from model.generate import SamplingParams

    order = sorted(rows)
    engine = Engine(loaded, config).start()

    async def run() -> list[JobResult]:
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        jobs = []
        for i in order:
            r = rows[i]
            for c in r.choices:
                sampling = SamplingParams(max_new_tokens=c.max_tokens, temperature=r.temperature, top_p=r.top_p)
                job = Job(c.prompt, c.answer_model, c.think_model, c.think_cap, c.max_tokens, sampling, (), False, loop,
                          events=events, index=len(jobs), grammar=compiled[i].deep_copy(), seeds=c.seeds)  # fmt: skip
                jobs.append(job)
                engine.submit(job)
        return await collect(jobs)

    try:
        with ThreadPoolExecutor(1) as pool:
            results = iter(pool.submit(asyncio.run, run()).result())
    finally:
        engine.stop()
    return {i: [next(results) for _ in rows[i].choices] for i in order}


def _decode_group(
    loaded: LoadedModel, config: ServingConfig, rules: PromptRules, fmt: ToolFormat, members: list[tuple[_Row, int]]
) -> list[GenerationChoice]:
    """One batched call over choices of equal settings (``members``: (row, choice index)), in order."""
    from model.generate import RowStart, SamplingParams, decode_rows
    from model.phases import budget_control
    from model.request_plan import decode_seeds

    row0, tokens = members[0][0], loaded.tokens
    first, plans = row0.choices[0], [r.choices[k] for r, k in members]
    prompts, seeds = [c.prompt for c in plans], [c.seeds for c in plans]
    params = SamplingParams(
        max_new_tokens=first.max_tokens, temperature=row0.temperature, top_p=row0.top_p, stop_ids=tokens.answer_stop_ids
    )
    if first.think_model is not None:  # (answer ids, how it ended, kept thinking, thinking tokens decoded) per choice
        outs = budget_control(
            loaded.registry, first.think_model, first.answer_model, tokens, prompts, first.think_cap, first.max_tokens,
            params, allow_think_larger=config.allow_think_larger, think_limit=config.think_limit, seeds=seeds,
        )  # fmt: skip
        decoded = [(o.answer_tokens, o.answer_stop, o.think_tokens, o.think_generated) for o in outs]
    else:
        model, starts = loaded.registry.get(first.answer_model), [RowStart(list(p)) for p in prompts]
        outs = decode_rows(model, starts, params, seeds=decode_seeds(seeds, "plain"))
        decoded = [(o.tokens, o.stop_reason, None, 0) for o in outs]
    out = []
    for (r, _), (ids, stop, think, generated) in zip(members, decoded, strict=True):
        answer, finish = ids[:-1] if stop == "stop_id" else ids, "length" if stop == "length" else "stop"
        reasoning = None if think is None else rules.visible_text(think)
        out.append(_choice(r, rules.visible_text(answer), reasoning, finish, generated, len(ids), fmt))
    return out


def generate(
    loaded: LoadedModel,
    requests: Sequence[GenerationRequest],
    config: ServingConfig,
    grammars: Grammars | None = None,
) -> list[GenerationResult]:
    """Answer every request (outputs in input order); choices with equal settings decode as one batch, rows with a
    grammar on the serving engine (``grammars``: compiled grammars to reuse; built when None and needed)."""
    from components.serving.grammar import GrammarError, Grammars
    from components.serving.prompts import PromptRules
    from components.serving.tools import tool_format
    from model.request_plan import Limits

    fmt = tool_format(config.tool_parser)
    rules = PromptRules(loaded.tokenizer, fmt)
    limits = Limits(
        {name: card.active_params for name, card in loaded.cards.items()}, config.allow_think_larger,
        config.max_tokens_limit, loaded.tokenizer.markers.think_open,
    )  # fmt: skip
    rows = [_plan(rules, limits, r, config, i, fmt) for i, r in enumerate(requests)]
    constrained = {i: r for i, r in enumerate(rows) if r.constraint.grammar is not None}
    if constrained and grammars is None:
        vocab = loaded.registry.full.config.vocab_size
        grammars = Grammars(loaded.tokenizer, vocab, loaded.tokens.answer_stop_ids, config.json_style)
    compiled = {}
    for i, r in constrained.items():
        try:
            compiled[i] = grammars.compiled(r.constraint.grammar)  # type: ignore[union-attr, arg-type]
        except GrammarError as err:
            raise ValueError(f"row {i}: {err.message}") from None
    done: dict[tuple[int, int], GenerationChoice] = {}
    if constrained:
        for i, results in _on_engine(loaded, config, compiled, constrained).items():
            for k, j in enumerate(results):
                done[i, k] = _choice(rows[i], j.content, j.reasoning, j.finish_reason, j.reasoning_tokens,
                                     j.answer_tokens, fmt)  # fmt: skip
    groups: dict[tuple[Any, ...], list[tuple[int, int]]] = defaultdict(list)
    for i, r in enumerate(rows):
        if i not in constrained:
            groups[r.key] += [(i, c.choice) for c in r.choices]
    for members in groups.values():
        outs = _decode_group(loaded, config, rules, fmt, [(rows[i], k) for i, k in members])
        done.update(zip(members, outs, strict=True))
    return [_result(r, [done[i, c.choice] for c in r.choices]) for i, r in enumerate(rows)]


def _choice(
    row: _Row, text: str, reasoning: str | None, finish: str, reasoning_tokens: int, answer_tokens: int,
    fmt: ToolFormat,
) -> GenerationChoice:  # fmt: skip
    """One choice; with tools (and a tool choice other than none) the answer's tool calls are read back."""
    calls = []
    if row.constraint.reads_tools:
        content, parsed = fmt.parse(text, row.constraint.parallel)
        text = content or ""
        calls = [ToolCallResult(id=c.id, name=c.name, arguments=c.arguments) for c in parsed]
        if calls and row.constraint.choice != "named" and finish != "length":
            finish = "tool_calls"
    return GenerationChoice(
        text=text, reasoning=reasoning, finish_reason=finish, reasoning_tokens=reasoning_tokens,
        completion_tokens=reasoning_tokens + answer_tokens, tool_calls=calls or None,
    )  # fmt: skip


def _result(row: _Row, choices: list[GenerationChoice]) -> GenerationResult:
    """A request's result: choice 0's fields, every choice when there are several."""
    first = row.choices[0]
    return GenerationResult(
        **dict(choices[0]), budget=first.answer_model, think_model=first.think_model, prompt_tokens=len(first.prompt),
        choices=choices if len(choices) > 1 else None,
    )  # fmt: skip


class StarElasticModel(mlflow.pyfunc.PythonModel):
    """The pyfunc: loads the checkpoint artifact once, answers :class:`GenerationRequest` rows on any budget."""

    def load_context(self, context: Any) -> None:

        from components.serving.config import ServingConfig
        from components.serving.loading import LoadedModel

        self.config = ServingConfig.model_validate(dict(context.model_config or {}))
        self.loaded = LoadedModel.load(context.artifacts[CHECKPOINT_ARTIFACT], self.config)  # sets torch_threads
        self.grammars: Grammars | None = None  # compiled grammars, kept across predict calls
        try:
            from components.serving.grammar import Grammars

            loaded, vocab = self.loaded, self.loaded.registry.full.config.vocab_size
            self.grammars = Grammars(loaded.tokenizer, vocab, loaded.tokens.answer_stop_ids, self.config.json_style)
        except Exception:  # a tokenizer the grammar engine cannot read: generate() says so for rows that need one
            self.grammars = None

    def predict(
        self, context: Any, model_input: list[GenerationRequest], params: dict[str, Any] | None = None
    ) -> list[GenerationResult]:
        """Requests (validated by MLflow against the type hint) -> one result per request, in order."""
        return generate(self.loaded, model_input, self.config, self.grammars)


# ---------------------------------------------------------------------- logging
def input_example(checkpoint: str | Path) -> list[dict[str, Any]]:
    """A chat request that thinks briefly on the smallest budget of ``checkpoint`` (logged with the model)."""
    from model.elastic.export import read_elastic

    raw = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    names = read_elastic(checkpoint).names if "elastic" in raw else ["full"]  # a plain checkpoint serves as "full"
    question = {"role": "user", "content": "7+5*3-2"}
    return [{"messages": [question], "budget": names[-1], "max_tokens": 8, "reasoning_budget": 16}]


def pip_requirements() -> list[str]:
    """Pinned requirements of ``predict`` (local version labels such as ``+cpu`` dropped: pip cannot pin them)."""
    return [f"{name}=={metadata.version(name).split('+')[0]}" for name in _REQUIREMENTS]


def code_paths() -> list[str]:
    """The project packages the pyfunc imports (copied into the model's ``code/`` folder)."""
    import components
    import model

    return [str(Path(components.__file__).parent), str(Path(model.__file__).parent)]


def log_nested_model(
    checkpoint: str | Path,
    *,
    tracking_uri: str,
    run_id: str,
    experiment_id: str,
    name: str = "model",
    tags: Mapping[str, str] | None = None,
    registry_uri: str | None = None,
) -> ModelInfo:
    """Log ``checkpoint`` as a pyfunc model of run ``run_id`` (an MLflow 3 logged model linked to the run) in
    the store ``tracking_uri`` / ``registry_uri`` (default: the tracking store).

    The model is created for the given run explicitly (no active-run state), so the stage's run stays
    open. MLflow runs the model on its input example once while logging (a check that it loads and
    answers). Returns the :class:`~mlflow.models.model.ModelInfo` (``model_uri``: ``models:/<model_id>``).
    """
    import mlflow
    from mlflow.entities import LoggedModelOutput

    from components.settings import MlflowStore

    folder = Path(checkpoint)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint_uri: {folder} is not a checkpoint folder (no config.json)")
    store = MlflowStore.of(tracking_uri, registry_uri)
    with store.process_wide():  # these two take no client or URI: only the process-wide store, for them alone
        logged = mlflow.initialize_logged_model(
            name=name, source_run_id=run_id, experiment_id=experiment_id, tags=dict(tags or {}), model_type="llm"
        )
        info = mlflow.pyfunc.log_model(
            name=name,
            python_model=str(Path(__file__).with_name("mlflow_model_code.py")),  # the signature: predict's hints
            artifacts={CHECKPOINT_ARTIFACT: str(folder)},
            code_paths=code_paths(),
            input_example=input_example(folder),
            pip_requirements=pip_requirements(),
            metadata={"checkpoint": folder.name},
            model_id=logged.model_id,
        )
    store.client().log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    return info
