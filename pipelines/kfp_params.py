"""Kubeflow pipeline parameters derived from :class:`~pipelines.config.PipelineConfig`: one per top-level YAML key.

Nothing is listed by hand: the parameters are the config class's fields, in order, under their YAML
names and descriptions. ``str`` / ``int`` / ``float`` / ``bool`` fields are typed parameters, a
``str | None`` field a string ('' for null), anything else a one-line JSON string. A run's values
become the YAML mapping again (:func:`config_from_parameters`), validated like ``star-elastic run``;
the step's ``def`` is generated from the same list (:func:`step_function`).

Design notes: docs/kubernetes.md ("Pipeline parameters").
"""

from __future__ import annotations

import hashlib
import json
import linecache
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

Encoding = Literal["value", "optional", "json"]
_SCALARS: tuple[type, ...] = (str, int, float, bool)


@dataclass(frozen=True)
class ConfigParameter:
    """One pipeline parameter: a top-level field of the config class."""

    name: str  # the YAML key (the field's alias when it has one)
    field: str  # the field's name on the class
    type: type  # the kfp parameter type: str, int, float or bool
    encoding: Encoding  # "value": as is; "optional": "" is null; "json": one line of JSON
    description: str

    def encode(self, value: Any) -> Any:
        """A config value (JSON-able) -> this parameter's value."""
        if self.encoding == "json":
            return json.dumps(value, separators=(", ", ": "))
        if self.encoding == "optional":
            return "" if value is None else value
        return value

    def decode(self, value: Any) -> Any:
        """This parameter's value -> the config value (``ValueError`` naming the parameter if it is not JSON)."""
        if self.encoding == "json":
            try:
                return json.loads(value)
            except (TypeError, json.JSONDecodeError) as err:
                raise ValueError(
                    f"{self.name}: the Kubeflow parameter is not JSON ({err}); give the value as JSON, e.g. {{}}"
                ) from None
        if self.encoding == "optional":
            return None if value == "" else value
        return value


def _encoding(annotation: Any) -> tuple[type, Encoding]:
    if annotation in _SCALARS:
        return annotation, "value"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and set(typing.get_args(annotation)) == {
        str,
        type(None),
    }:
        return str, "optional"
    return str, "json"


def config_parameters(model: type[BaseModel] | None = None) -> list[ConfigParameter]:
    """The pipeline parameters of ``model`` (default :class:`~pipelines.config.PipelineConfig`), in field order."""
    if model is None:
        from pipelines.config import PipelineConfig

        model = PipelineConfig
    params = []
    for name, field in model.model_fields.items():
        kind, encoding = _encoding(field.annotation)
        note = {"value": "", "optional": " Empty: null.", "json": " As JSON."}[encoding]
        description = (field.description or name).rstrip(".") + "." + note
        params.append(ConfigParameter(field.alias or name, name, kind, encoding, description))
    return params


def parameter_defaults(cfg: BaseModel, params: Sequence[ConfigParameter] | None = None) -> dict[str, Any]:
    """Parameter name -> default from a validated config: the values its YAML set, else the fields' defaults."""
    params = config_parameters(type(cfg)) if params is None else params
    out = {}
    for p in params:
        value = getattr(cfg, p.field)
        if isinstance(value, BaseModel):  # the keys the YAML set, nothing more (see the module docstring)
            value = value.model_dump(mode="json", by_alias=True, exclude_unset=True)
        else:
            value = cfg.model_dump(mode="json", by_alias=True, include={p.field})[p.name]
        out[p.name] = p.encode(value)
    return out


def config_from_parameters(
    values: Mapping[str, Any], params: Sequence[ConfigParameter] | None = None
) -> dict[str, Any]:
    """The YAML mapping of the config from a run's parameter values (names absent from ``values`` are left out)."""
    params = config_parameters() if params is None else params
    return {p.name: p.decode(values[p.name]) for p in params if p.name in values}


# ---------------------------------------------------------------------- the step component's signature
def step_function(
    name: str,
    fixed: Sequence[tuple[str, type]],
    params: Sequence[ConfigParameter],
    optional: Sequence[str],
    target: str,
    doc: str,
) -> types.FunctionType:
    """A function ``name(<fixed>, <params>, <optional>="") -> str`` that calls ``target(**locals())``.

    ``fixed``: (name, type) of the inputs every step takes; ``optional``: string inputs that default
    to ``""``; ``target``: ``module:function`` imported in the function's body (it runs in the step's
    pod, from the source kfp embeds).
    """
    names = [n for n, _ in fixed] + [p.name for p in params] + list(optional)
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"config fields {clash} clash with the step's own inputs; rename the fields")
    args = [f"{n}: {t.__name__}" for n, t in fixed] + [f"{p.name}: {p.type.__name__}" for p in params]
    args += [f'{n}: str = ""' for n in optional]
    module, func = target.split(":")
    lines = [f"def {name}(", *(f"    {a}," for a in args), ") -> str:", f'    """{doc}"""']
    lines += [f"    from {module} import {func}", "", f"    return {func}(**locals())", ""]
    source = "\n".join(lines)
    filename = f"<generated {name} {hashlib.sha256(source.encode()).hexdigest()[:12]}>"
    namespace: dict[str, Any] = {}
    # dont_inherit: this module's postponed annotations would make kfp read the types as strings.
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)  # the source is built above from field names
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return namespace[name]
