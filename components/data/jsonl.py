"""Small JSONL helpers: records with line-numbered errors, and generated problems written as chat rows.

Training files are read by :mod:`components.data.sources` through ``datasets``; these helpers are for
writing data sets (e.g. the demo task as chat JSONL, the layout a team's own data takes) and for
reading small files where a line number in the error matters more than speed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from components.data.reasoning import Problem
from components.data.sources import problem_messages

__all__ = ["iter_jsonl", "problem_rows", "read_jsonl", "write_jsonl"]


def iter_jsonl(path: str | Path, label: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(1-based line number, object)`` for each non-empty line of a JSONL file, read lazily.

    ``label``: how errors name the file (default: ``path``), e.g. the URI it was downloaded from.

    Raises:
        ValueError: for a line that is not a JSON object, as ``"<label>:<line>: ..."``.
    """
    label = str(path) if label is None else label
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{label}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{label}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per non-empty line.

    Raises:
        ValueError: for a line that is not a JSON object, naming the file and the 1-based line.
    """
    return [obj for _, obj in iter_jsonl(path)]


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write ``records`` one JSON object per line (UTF-8, non-ASCII kept); parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def problem_rows(problems: Iterable[Problem]) -> list[dict[str, Any]]:
    """Generated problems as chat rows (``messages`` plus the reference ``answer``): the same rows the
    generator source trains on, in the layout a files source reads."""
    return [{"messages": problem_messages(p), "answer": p.answer} for p in problems]
