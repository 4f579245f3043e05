"""The nested checkpoint as an MLflow model: a pyfunc that answers chat and completion requests on any budget.

The registered model is a regular MLflow model (``MLmodel``, the checkpoint under ``artifacts/``,
the project code under ``code/``, built from ``mlflow_model_code.py``: no pickle). ``predict`` is
thin: the serving loader, the server's prompt rules and the generation functions evaluation uses. Requests are
typed by :class:`GenerationRequest` (MLflow's signature); ``temperature`` defaults to 0 so
predictions are reproducible.

Design notes (layout, ``model_config``, DataFrame inputs): docs/serving.md ("The registry model (MLflow pyfunc)").
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow.pyfunc
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from mlflow.models.model import ModelInfo

    from components.serving.config import ServingConfig
    from components.serving.loading import LoadedModel
    from components.serving.prompts import PromptRules

CHECKPOINT_ARTIFACT = "checkpoint"
"""Key of the nested checkpoint folder in the pyfunc's ``artifacts``."""
_REQUIREMENTS = (
    "mlflow", "torch", "safetensors", "tokenizers", "transformers", "jinja2", "numpy", "pandas", "pydantic", "tqdm",
)  # fmt: skip
"""Distributions ``predict`` imports (pinned to the versions installed when the model is logged)."""
ROLES = ("system", "developer", "user", "assistant", "tool")


# ---------------------------------------------------------------------- requests and results
class ChatTurn(BaseModel):
    """One chat message (rendered with the others by the checkpoint's chat template)."""

    model_config = ConfigDict(extra="forbid")

    # a plain str checked below: MLflow's signature inference does not take Literal types
    role: str = Field(description=f"Who wrote it: one of {', '.join(ROLES)}.")
    content: str = Field(description="The message text.")

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
    seed: int | None = Field(None, description="Sampling seed (per-row generators: independent of batching).")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerationRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages (chat) or prompt (completion)")
        return self


class GenerationResult(BaseModel):
    """One item of ``predict``'s output."""

    text: str = Field(description="The answer (special tokens and reasoning markers removed).")
    # None defaults: MLflow infers the output schema only when every optional field has one
    reasoning: str | None = Field(None, description="The kept thinking; None for a prompt without a thinking phase.")
    budget: str = Field(description="Budget that answered.")
    think_model: str | None = Field(None, description="Budget that thought (None: no thinking phase).")
    finish_reason: str = Field(description="'stop': the model ended the answer; 'length': max_tokens was reached.")
    prompt_tokens: int = Field(description="Prompt length in tokens.")
    reasoning_tokens: int = Field(description="Thinking tokens decoded (including any cut at the cap).")
    completion_tokens: int = Field(description="Every generated token, thinking included.")


# ---------------------------------------------------------------------- generation
@dataclass(frozen=True)
class _Plan:
    """What one row decodes; rows with equal ``key`` share one batched call."""

    prompt: list[int]
    budget: str
    think: str | None
    cap: int | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None

    @property
    def key(self) -> tuple[Any, ...]:
        return self.budget, self.think, self.cap, self.max_tokens, self.temperature, self.top_p, self.seed


def _plan(loaded: LoadedModel, rules: PromptRules, req: GenerationRequest, config: ServingConfig, row: int) -> _Plan:
    """What row ``row`` decodes; a request the rules refuse is a ``ValueError`` naming the row and the field."""
    from components.serving.prompts import PromptError, check_length

    def known(name: str, field: str) -> str:
        if name not in loaded.cards:
            raise ValueError(f"row {row}: {field}: unknown budget {name!r}; the model has {list(loaded.cards)}")
        return name

    budget = known(req.budget, "budget") if req.budget is not None else next(iter(loaded.cards))
    max_tokens = req.max_tokens if req.max_tokens is not None else config.default_max_tokens
    for field, value in (("max_tokens", max_tokens), ("reasoning_budget", req.reasoning_budget)):
        if value is not None and value > config.max_tokens_limit:
            raise ValueError(f"row {row}: {field}: {value} is above max_tokens_limit {config.max_tokens_limit}")
    try:
        if req.messages is not None:
            ids, thinks = rules.chat([m.model_dump() for m in req.messages])
        else:
            ids, thinks = rules.completion(req.prompt or "")
        check_length(ids, config.max_prompt_tokens, "messages" if req.messages is not None else "prompt")
    except PromptError as err:
        raise ValueError(f"row {row}: {err}") from None
    think, cap = None, None
    if thinks:
        think = known(req.think_model, "think_model") if req.think_model is not None else budget
        size_t, size_a = loaded.cards[think].active_params, loaded.cards[budget].active_params
        if size_t > size_a and not config.allow_think_larger:
            raise ValueError(
                f"row {row}: think_model: {think!r} ({size_t:,} active parameters) is larger than budget {budget!r} "
                f"({size_a:,}); elastic budget control thinks on a smaller budget"
            )
        cap = req.reasoning_budget if req.reasoning_budget is not None else config.default_think_cap
    elif req.think_model is not None or req.reasoning_budget is not None:
        raise ValueError(
            f"row {row}: think_model / reasoning_budget: this prompt has no thinking phase (a completion prompt "
            f"must end with {rules.tokenizer.markers.think_open!r} to think)"
        )
    temperature = 0.0 if req.temperature is None else req.temperature
    return _Plan(ids, budget, think, cap, max_tokens, temperature, 1.0 if req.top_p is None else req.top_p, req.seed)


def generate(
    loaded: LoadedModel, requests: Sequence[GenerationRequest], config: ServingConfig
) -> list[GenerationResult]:
    """Answer every request (outputs in input order); rows with equal settings decode as one batch."""
    from components.serving.prompts import PromptRules
    from model.generate import RowStart, SamplingParams, decode_rows
    from model.phases import budget_control

    rules = PromptRules(loaded.tokenizer)
    plans = [_plan(loaded, rules, r, config, i) for i, r in enumerate(requests)]
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, p in enumerate(plans):
        groups[p.key].append(i)
    tokens = loaded.tokens
    results: list[GenerationResult | None] = [None] * len(plans)
    for rows in groups.values():
        first = plans[rows[0]]
        prompts = [plans[i].prompt for i in rows]
        sampling = SamplingParams(
            max_new_tokens=first.max_tokens, temperature=first.temperature, top_p=first.top_p, seed=first.seed
        )
        if first.think is not None:
            outs = budget_control(
                loaded.registry, first.think, first.budget, tokens, prompts, first.cap, first.max_tokens, sampling,
                allow_think_larger=config.allow_think_larger, think_limit=config.think_limit,
            )  # fmt: skip
            for i, r in zip(rows, outs, strict=True):
                answer = r.answer_tokens[:-1] if r.answer_stop == "stop_id" else r.answer_tokens
                results[i] = GenerationResult(
                    text=rules.visible_text(answer),
                    reasoning=rules.visible_text(r.think_tokens),
                    budget=first.budget,
                    think_model=first.think,
                    finish_reason="length" if r.answer_stop == "length" else "stop",
                    prompt_tokens=len(plans[i].prompt),
                    reasoning_tokens=r.think_generated,
                    completion_tokens=r.think_generated + len(r.answer_tokens),
                )
        else:
            params = SamplingParams(
                max_new_tokens=first.max_tokens, temperature=first.temperature, top_p=first.top_p,
                seed=first.seed, stop_ids=tokens.answer_stop_ids,
            )  # fmt: skip
            outs = decode_rows(loaded.registry.get(first.budget), [RowStart(list(p)) for p in prompts], params)
            for i, o in zip(rows, outs, strict=True):
                answer = o.tokens[:-1] if o.stop_reason == "stop_id" else o.tokens
                results[i] = GenerationResult(
                    text=rules.visible_text(answer),
                    reasoning=None,
                    budget=first.budget,
                    think_model=None,
                    finish_reason="length" if o.stop_reason == "length" else "stop",
                    prompt_tokens=len(plans[i].prompt),
                    reasoning_tokens=0,
                    completion_tokens=len(o.tokens),
                )
    return [r for r in results if r is not None]


class StarElasticModel(mlflow.pyfunc.PythonModel):
    """The pyfunc: loads the checkpoint artifact once, answers :class:`GenerationRequest` rows on any budget."""

    def load_context(self, context: Any) -> None:
        import torch

        from components.serving.config import ServingConfig
        from components.serving.loading import LoadedModel

        self.config = ServingConfig.model_validate(dict(context.model_config or {}))
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        self.loaded = LoadedModel.load(context.artifacts[CHECKPOINT_ARTIFACT], self.config)

    def predict(
        self, context: Any, model_input: list[GenerationRequest], params: dict[str, Any] | None = None
    ) -> list[GenerationResult]:
        """Requests (validated by MLflow against the type hint) -> one result per request, in order."""
        return generate(self.loaded, model_input, self.config)


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
) -> ModelInfo:
    """Log ``checkpoint`` as a pyfunc model of run ``run_id`` (an MLflow 3 logged model linked to the run).

    The model is created for the given run explicitly (no active-run state), so the stage's run stays
    open. MLflow runs the model on its input example once while logging (a check that it loads and
    answers). Returns the :class:`~mlflow.models.model.ModelInfo` (``model_uri``: ``models:/<model_id>``).
    """
    import mlflow
    from mlflow.entities import LoggedModelOutput

    folder = Path(checkpoint)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint_uri: {folder} is not a checkpoint folder (no config.json)")
    mlflow.set_tracking_uri(tracking_uri)
    logged = mlflow.initialize_logged_model(
        name=name, source_run_id=run_id, experiment_id=experiment_id, tags=dict(tags or {}), model_type="llm"
    )
    info = mlflow.pyfunc.log_model(
        name=name,
        python_model=str(Path(__file__).with_name("mlflow_model_code.py")),  # the signature: predict's type hints
        artifacts={CHECKPOINT_ARTIFACT: str(folder)},
        code_paths=code_paths(),
        input_example=input_example(folder),
        pip_requirements=pip_requirements(),
        metadata={"checkpoint": folder.name},
        model_id=logged.model_id,
    )
    mlflow.MlflowClient(tracking_uri).log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    return info


def checkpoint_folder(model_dir: str | Path) -> Path:
    """The nested checkpoint inside a downloaded pyfunc model folder (``model_dir`` itself for a bare checkpoint)."""
    from mlflow.models import Model

    model_dir = Path(model_dir)
    if not (model_dir / "MLmodel").is_file():
        if (model_dir / "config.json").is_file():  # a bare checkpoint folder
            return model_dir
        raise FileNotFoundError(f"{model_dir}: neither an MLflow model (no MLmodel) nor a checkpoint (no config.json)")
    flavor = Model.load(model_dir).flavors.get("python_function", {})
    artifact = (flavor.get("artifacts") or {}).get(CHECKPOINT_ARTIFACT)
    if not artifact:
        raise FileNotFoundError(f"{model_dir}: the MLflow model has no {CHECKPOINT_ARTIFACT!r} artifact")
    return model_dir / artifact["path"]
