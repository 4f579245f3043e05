"""Optional source: the offline procedural generators of the ``reasoning_gym`` package.

The package is not a dependency of the project; it is imported only when this source is used, and
a clear error says how to get it (:func:`~components.data.sources.require_gym`, which the source's config
checks too). Its tasks carry no reasoning traces, so rows are chat pairs user =
question, assistant = answer (direct-answer examples; useful as prompts for evaluation too).
"""

from __future__ import annotations

from typing import Any

from components.data.reasoning import PROMPT_PREFIX, Problem, derive_seed
from components.data.sources import ChunkedReader, ReasoningGymSource, require_gym

__all__ = ["GymReader", "reasoning_gym_problems"]


def _entries(task: str, size: int, seed: int, config: dict[str, Any]) -> list[tuple[str, str]]:
    """``(question, answer)`` pairs of ``size`` problems of ``task``, deterministic by ``seed``."""
    dataset = require_gym().create_dataset(task, size=size, seed=seed, **config)
    return [(str(e["question"]).strip(), str(e["answer"]).strip()) for e in dataset]


def reasoning_gym_problems(task_name: str, n: int, seed: int, **task_config: Any) -> list[Problem]:
    """``n`` problems of the task ``task_name`` in the built-in prompt layout (``"Q:" + question + "\\n"``),
    deterministic by ``seed``; ``task_config`` goes to ``reasoning_gym.create_dataset``.

    Raises:
        ImportError: if ``reasoning_gym`` is not installed.
    """
    return [
        Problem(prompt=f"{PROMPT_PREFIX}{q}\n", reasoning="", answer=a, steps=0, source=f"reasoning_gym:{task_name}")
        for q, a in _entries(task_name, n, seed, task_config)
    ]


class GymReader(ChunkedReader[tuple[str, str]]):
    """Rows of a :class:`~components.data.sources.ReasoningGymSource`: chunk ``c`` is a dataset of
    ``CHUNK`` ``(question, answer)`` entries seeded by ``c`` (and the stream and rank)."""

    CHUNK, CACHED = 512, 16

    def __init__(self, source: ReasoningGymSource, name: str) -> None:
        require_gym()
        super().__init__(name)
        self.source = source

    def make_chunk(self, stream: int, rank: int, c: int, exclude: frozenset[str] | None) -> list[tuple[str, str]]:
        seed = derive_seed("gym", stream, rank, c) % (2**31)
        return _entries(self.source.task, self.CHUNK, seed, dict(self.source.task_config))

    def messages(self, chunk: list[tuple[str, str]], k: int, exclude: frozenset[str] | None) -> list[dict[str, Any]]:
        """Entry ``k`` as a chat pair; an excluded question is replaced by the next entry of its chunk
        (the package cannot leave questions out when it generates)."""
        for step in range(self.CHUNK):
            question, answer = chunk[(k + step) % self.CHUNK]
            if not exclude or question not in exclude:
                return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        raise ValueError(f"source {self.name!r}: exclude covers a whole chunk of {self.CHUNK} problems")
