"""Evaluation sets of the evaluate stage: JSONL files (local or ``s3://``) and the built-in held-out levels.

A JSONL row holds the question (``prompt`` or ``messages``), the reference ``answer`` and optionally
a group field (one accuracy row per value); field names are configurable (:class:`EvalSetConfig`).
Every item becomes a chat rendered by the tokenizer's chat template, the built-in levels included.

Design notes (row labels): docs/data.md ("Evaluation sets").
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from components.data.answers import AnswerFormat
from components.data.jsonl import iter_jsonl
from components.data.reasoning import generate_eval_sets
from components.settings import cache_dir as settings_cache_dir

__all__ = [
    "EvalItem",
    "EvalSetConfig",
    "builtin_items",
    "fetch_file",
    "load_eval_set",
    "thinking_prompt",
]

_ROLES = ("system", "user", "assistant", "tool")


class EvalSetConfig(BaseModel):
    """One JSONL evaluation set (module docstring for the row layout)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="JSONL file: a local path or s3://bucket/key.")
    name: str | None = Field(None, description="Label in the accuracy table (default: the file stem).")
    prompt_field: str = Field("prompt", description="Field with the question as a string (one user message).")
    messages_field: str = Field("messages", description="Field with the question as a chat list (wins over prompt).")
    answer_field: str = Field("answer", description="Field with the reference answer (string or number).")
    group_by: str | None = Field(
        None, description="Field to group the accuracy table by (e.g. level, category); null: one row for the set."
    )
    system_prompt: str | None = Field(
        None, description="A system message put before every question that has none (null: none)."
    )
    answer_format: AnswerFormat | None = Field(
        None, description="How to read answers of this set (null: the stage's answer_format)."
    )
    limit: int | None = Field(None, ge=1, description="Use only the first N rows (null: all).")

    @model_validator(mode="after")
    def _fields(self) -> EvalSetConfig:
        names = {"prompt_field": self.prompt_field, "messages_field": self.messages_field}
        names["answer_field"] = self.answer_field
        if self.group_by is not None:
            names["group_by"] = self.group_by
        if len(set(names.values())) != len(names):
            raise ValueError(f"eval set {self.path}: field names must differ, got {names}")
        return self

    @property
    def label(self) -> str:
        return self.name or Path(self.path.rstrip("/")).stem


@dataclass(frozen=True)
class EvalItem:
    """One question: the chat to render, the reference answer, its table label and how to read answers."""

    messages: tuple[dict[str, Any], ...]
    answer: str
    label: str
    answer_format: AnswerFormat


# ---------------------------------------------------------------------- files
def fetch_file(uri: str, cache_dir: str | Path | None = None) -> Path:
    """A local copy of ``uri``: a local path as is, an ``s3://`` object downloaded (fresh every call)."""
    from components.storage import is_s3, s3_client, split_s3

    if not is_s3(uri):
        path = Path(uri)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        return path
    bucket, key = split_s3(uri)
    if not key or key.endswith("/"):
        raise ValueError(f"{uri}: expected an s3://bucket/key of one file")
    folder = settings_cache_dir(cache_dir) / "s3-files"
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix="-" + Path(key).name)
    os.close(fd)
    try:
        s3_client().download_file(bucket, key, tmp)
    except Exception as err:  # boto3 raises several types; the message is what matters here
        Path(tmp).unlink(missing_ok=True)
        raise FileNotFoundError(f"{uri}: cannot download ({type(err).__name__}: {err})") from None
    return Path(tmp)


def _messages(row: dict[str, Any], cfg: EvalSetConfig, where: str) -> tuple[dict[str, Any], ...]:
    if cfg.messages_field in row:
        chat = row[cfg.messages_field]
        if not isinstance(chat, list) or not chat:
            raise ValueError(f"{where}: field {cfg.messages_field!r} must be a non-empty list of messages")
        out = []
        for k, m in enumerate(chat):
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content", ""), str):
                raise ValueError(
                    f"{where}: {cfg.messages_field}[{k}] must be {{'role': one of {list(_ROLES)}, 'content': str}}"
                )
            out.append(dict(m))
        while out and out[-1]["role"] == "assistant":  # a trailing assistant turn is the answer, not the question
            out.pop()
        if not out:
            raise ValueError(f"{where}: field {cfg.messages_field!r} holds no message before the assistant turn")
    elif cfg.prompt_field in row:
        prompt = row[cfg.prompt_field]
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: field {cfg.prompt_field!r} must be a string, got {type(prompt).__name__}")
        out = [{"role": "user", "content": prompt}]
    else:
        raise ValueError(f"{where}: missing field {cfg.prompt_field!r} (a string) or {cfg.messages_field!r} (a chat)")
    if cfg.system_prompt is not None and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": cfg.system_prompt})
    return tuple(out)


def _scalar(row: dict[str, Any], name: str, where: str) -> str:
    if name not in row:
        raise ValueError(f"{where}: missing field {name!r}")
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: field {name!r} must be a string or a number, got {type(value).__name__}")
    return str(value)


def _group_key(value: str) -> tuple[int, float, str]:
    """Numbers first, in numeric order, then texts: levels 2 < 10."""
    try:
        return 0, float(value), value
    except ValueError:
        return 1, 0.0, value


def load_eval_set(
    cfg: EvalSetConfig, fmt: AnswerFormat, prefix: bool = True, index: int = 0
) -> dict[str, list[EvalItem]]:
    """Label -> items of one JSONL set (groups sorted, numbers numerically). ``prefix``: label groups
    ``name/value`` (False with a single source). ``index``: the set's position, for error messages.

    Raises:
        ValueError: naming ``eval_sets[index]``, the file, the 1-based line and the field at fault.
    """
    try:
        path = fetch_file(cfg.path)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"eval_sets[{index}].path: {err}") from None
    fmt = cfg.answer_format or fmt
    groups: dict[str, list[EvalItem]] = {}
    n = 0
    for lineno, row in iter_jsonl(path, label=f"eval_sets[{index}] {cfg.path}"):
        where = f"eval_sets[{index}] {cfg.path}:{lineno}"
        messages = _messages(row, cfg, where)
        answer = _scalar(row, cfg.answer_field, where)
        if cfg.group_by is None:
            label = cfg.label
        else:
            value = _scalar(row, cfg.group_by, where)
            label = f"{cfg.label}/{value}" if prefix else value
        groups.setdefault(label, []).append(EvalItem(messages, answer, label, fmt))
        n += 1
        if n == cfg.limit:  # stop before reading the next line
            break
    if not n:
        raise ValueError(f"eval_sets[{index}]: {cfg.path} holds no rows")
    if cfg.group_by is None:
        return groups
    strip = len(cfg.label) + 1 if prefix else 0
    return {k: groups[k] for k in sorted(groups, key=lambda k: _group_key(k[strip:]))}


def builtin_items(levels: list[int], n_per_level: int, seed: int, fmt: AnswerFormat) -> dict[str, list[EvalItem]]:
    """The built-in generator's held-out levels as items: label ``"<level>"``, the prompt as one user message."""
    out = {}
    for level, problems in generate_eval_sets(levels, n_per_level, seed).items():
        label = str(level)
        out[label] = [EvalItem(({"role": "user", "content": p.prompt},), p.answer, label, fmt) for p in problems]
    return out


# ---------------------------------------------------------------------- prompts
def thinking_prompt(
    tokenizer: Any, messages: tuple[dict[str, Any], ...] | list[dict[str, Any]], open_think: bool = True
) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template with the generation prompt, ending
    where thinking starts.

    Budget control decodes the thinking first, so the prompt must end after the open marker. Many
    reasoning templates end their generation prompt with it (the demo's: ``<think>``); when one does
    not and ``open_think`` is set, the marker is appended (the model is made to think, as a
    ``reasoning_budget`` request would).
    """
    chat = [dict(m) for m in messages]
    if not open_think:
        return list(tokenizer.prompt_ids(chat))
    rendered = tokenizer.render_chat(chat, add_generation_prompt=True)
    opener = tokenizer.markers.think_open
    if rendered.rstrip().endswith(opener):
        return list(tokenizer.prompt_ids(chat))
    return list(tokenizer.encode(rendered + opener))
