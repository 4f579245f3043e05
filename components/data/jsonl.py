"""JSONL source of reasoning problems: one JSON object per line.

Each object needs ``prompt`` and ``answer`` strings and may carry a ``reasoning`` string (the trace
inside the think tags; empty or absent for direct answers). Optional ``steps`` (int) and ``source``
(str) are kept when present; any other field is ignored, so richer datasets load as they are.
Integer answers (``"answer": 42``) are accepted and stored as text. Texts are kept verbatim: the
layout conventions of the built-in task (prompt and trace lines ending in ``"\\n"``) are not forced.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from components.data.reasoning import Problem

__all__ = ["load_jsonl", "save_jsonl"]


def _field(obj: dict, name: str, where: str, *, required: bool, default: str = "") -> str:
    """String field ``name`` of ``obj``; ``where`` is ``"file:line"`` for the error message."""
    if name not in obj:
        if required:
            raise ValueError(f"{where}: missing field {name!r}")
        return default
    value = obj[name]
    if name == "answer" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def load_jsonl(path: str | Path) -> list[Problem]:
    """Problems from a JSONL file; empty lines are skipped.

    Raises:
        ValueError: for a line that is not a JSON object or lacks / mistypes a field; the message
            names the file, the 1-based line number and the field.
    """
    path = Path(path)
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            steps = obj.get("steps", 0)
            if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
                raise ValueError(f"{where}: field 'steps' must be a non-negative integer, got {steps!r}")
            problems.append(
                Problem(
                    prompt=_field(obj, "prompt", where, required=True),
                    reasoning=_field(obj, "reasoning", where, required=False),
                    answer=_field(obj, "answer", where, required=True),
                    steps=steps,
                    source=_field(obj, "source", where, required=False, default=f"jsonl:{path.name}"),
                )
            )
    return problems


def save_jsonl(problems: Iterable[Problem], path: str | Path) -> Path:
    """Write ``problems`` one JSON object per line (all five fields); parents are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in problems:
            record = {
                "prompt": p.prompt,
                "reasoning": p.reasoning,
                "answer": p.answer,
                "steps": p.steps,
                "source": p.source,
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
