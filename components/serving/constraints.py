"""What a request constrains its answer to: ``response_format``, vLLM's ``structured_outputs``, ``tools`` and
``tool_choice``, validated into one :class:`Constraint` (a grammar, and which tool calls to read back).

The wire models here are shared by chat completions, completions, the Responses API and the registry's
pyfunc, so every caller refuses the same mistakes with the same field names. Rules (as vLLM's server):

* ``response_format`` ``json_object`` / ``json_schema`` and ``structured_outputs`` (``json``, ``regex``,
  ``choice``, a Lark ``grammar``, ``json_object``) each give a grammar; at most one of them per request.
* ``tools`` without ``tool_choice`` means ``auto``: the answer is free and tool calls are read from it.
  ``required`` and a named function are enforced by the tool format's grammar (:mod:`components.serving.tools`)
  and cannot be combined with another grammar. ``none`` reads no calls (the tools still reach the template).
* ``parallel_tool_calls: false`` allows one call (the grammar's, or the first one read back).
* A JSON schema the grammar engine cannot enforce is a 400 naming the field (never a silent free answer).

Design notes: docs/serving.md ("Structured outputs and tool calls").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from components.serving.grammar import GrammarError, Grammars, GrammarSpec, JsonStyle
from components.serving.tools import ToolFormat, ToolSpec

__all__ = [
    "Constraint",
    "ConstraintError",
    "NamedToolChoice",
    "ResponseFormat",
    "StructuredOutputs",
    "Tool",
    "ToolChoice",
    "build_constraint",
    "compile_constraint",
]

FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


class ConstraintError(ValueError):
    """A request whose constraint is invalid; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


# ---------------------------------------------------------------------- wire models
class JsonSchemaFormat(_Strict):
    name: str | None = Field(None, pattern=FUNCTION_NAME, description="The schema's name (OpenAI requires one).")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the answer follows.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only allowed with it")
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema (object or text).")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="A Lark grammar (llguidance's syntax).")
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME, description="Letters, digits, _ . - ; at most 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments (an object).")
    strict: bool | None = Field(None, description="Accepted; required and named calls are always enforced.")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def choice_kind(value: Any) -> str:
    """The tag of a tool choice: a mode (``"auto"``, ...) or a named function (an object)."""
    return "union[named]" if isinstance(value, (dict, BaseModel)) else "union[mode]"


# tagged so that an error inside a named choice is reported at its own path (the tags are left out of it)
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("union[mode]")]
    | Annotated[NamedToolChoice, Tag("union[named]")],
    Discriminator(choice_kind),
]


# ---------------------------------------------------------------------- the constraint of a request
@dataclass(frozen=True)
class Constraint:
    """A request's constraint: ``grammar`` (None: free answer), the tools whose calls are read back from
    the answer (empty: none), the tool choice (``none``, ``auto``, ``required`` or ``named``), and whether
    several calls are allowed."""

    grammar: GrammarSpec | None = None
    tools: tuple[ToolSpec, ...] = ()
    choice: str = "none"
    parallel: bool = True

    @property
    def reads_tools(self) -> bool:
        return bool(self.tools) and self.choice != "none"


FREE = Constraint()


def _format_grammar(fmt: ResponseFormat | None, so: StructuredOutputs | None) -> GrammarSpec | None:
    if fmt is not None and fmt.type != "text" and so is not None:
        raise ConstraintError(
            "response_format: give either response_format or structured_outputs, not both", "response_format"
        )
    if fmt is not None and fmt.type == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if fmt is not None and fmt.json_schema is not None:
        return GrammarSpec.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    if so is None:
        return None
    if so.json_ is not None:
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ConstraintError(
                    f"structured_outputs.json: not valid JSON ({err})", "structured_outputs.json"
                ) from None
        if not isinstance(schema, dict):
            raise ConstraintError("structured_outputs.json: must be a JSON schema object", "structured_outputs.json")
        return GrammarSpec.json_schema(schema, "structured_outputs.json")
    if so.regex is not None:
        return GrammarSpec("regex", so.regex, "structured_outputs.regex")
    if so.choice is not None:
        return GrammarSpec("choice", json.dumps(so.choice, ensure_ascii=False), "structured_outputs.choice")
    if so.grammar is not None:
        return GrammarSpec("lark", so.grammar, "structured_outputs.grammar")
    return GrammarSpec("json_object", "", "structured_outputs.json_object")


def build_constraint(
    fmt: ToolFormat,
    style: JsonStyle,
    response_format: ResponseFormat | None = None,
    structured_outputs: StructuredOutputs | None = None,
    tools: Sequence[Tool] | None = None,
    tool_choice: ToolChoice | None = None,
    parallel_tool_calls: bool | None = None,
    tools_param: str = "tools",
) -> Constraint:
    """The :class:`Constraint` of a request's fields (module docstring for the rules).

    Raises:
        ConstraintError: naming the field at fault.
    """
    grammar = _format_grammar(response_format, structured_outputs)
    tools = list(tools or [])
    seen: dict[str, int] = {}
    for i, t in enumerate(tools):
        if t.function.name in seen:
            param = f"{tools_param}.{i}.function.name"
            raise ConstraintError(f"{param}: {t.function.name!r} is also tool {seen[t.function.name]}", param)
        seen[t.function.name] = i
    specs = tuple(
        ToolSpec(t.function.name, t.function.parameters or {"type": "object", "properties": {}}) for t in tools
    )
    parallel = parallel_tool_calls is not False
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in seen:
            raise ConstraintError(
                f"tool_choice.function.name: {name!r} is not one of the tools {sorted(seen)}",
                "tool_choice.function.name",
            )
        named = (specs[seen[name]],)
        return Constraint(_tool_grammar(fmt, named, parallel, style, grammar, tools_param), specs, "named", parallel)
    if choice == "required":
        if not tools:
            raise ConstraintError(
                "tool_choice: 'required' needs tools; send tools or another tool_choice", "tool_choice"
            )
        return Constraint(_tool_grammar(fmt, specs, parallel, style, grammar, tools_param), specs, "required", parallel)
    return Constraint(grammar, specs if choice == "auto" else (), choice, parallel)


def _tool_grammar(
    fmt: ToolFormat, tools: Sequence[ToolSpec], parallel: bool, style: JsonStyle, other: GrammarSpec | None, param: str
) -> GrammarSpec:
    if other is not None:
        raise ConstraintError(
            f"{other.param}: a forced tool call (tool_choice 'required' or a named function) is its own grammar; "
            "send one of them",
            other.param,
        )
    return GrammarSpec("lark", fmt.grammar(tools, parallel, style), param)


def compile_constraint(grammars: Grammars, constraint: Constraint) -> Any:
    """The constraint's compiled grammar (from the cache, or compiled now), so a request that cannot be
    enforced is refused before it is admitted; copy it per sequence (``deep_copy``). None: no grammar. A tool
    grammar that fails is compiled tool by tool to name the schema at fault.

    Raises:
        ConstraintError: naming the field.
    """
    spec = constraint.grammar
    if spec is None:
        return None
    try:
        return grammars.compiled(spec)
    except GrammarError as err:
        if spec.kind == "lark" and spec.param.endswith("tools"):  # a tool grammar: find the schema at fault
            for i, tool in enumerate(constraint.tools):
                param = f"{spec.param}.{i}.function.parameters"
                try:
                    grammars.compiled(GrammarSpec.json_schema(dict(tool.parameters), param))
                except GrammarError as bad:
                    raise ConstraintError(bad.message, param) from None
        raise ConstraintError(err.message, err.param) from None
