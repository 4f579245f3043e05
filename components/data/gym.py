"""Optional second source: the offline procedural generators of the ``reasoning_gym`` package.

The package is not a dependency of the project; it is imported only when this source is used, and
a clear error says how to get it. Its tasks carry no reasoning traces, so problems come with an
empty ``reasoning`` (direct-answer examples, or prompts for evaluation / reinforcement learning).
Caveats: the character tokenizer maps non-ASCII characters to ``<unk>``, and
:func:`~components.data.answers.extract_answer` reads single-line answers only.
"""

from __future__ import annotations

from typing import Any

from components.data.reasoning import PROMPT_PREFIX, Problem

__all__ = ["gym_available", "reasoning_gym_problems"]


def gym_available() -> bool:
    """Whether the ``reasoning_gym`` package can be imported."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        return False
    return True


def reasoning_gym_problems(task_name: str, n: int, seed: int, **task_config: Any) -> list[Problem]:
    """``n`` problems of the ``reasoning_gym`` task ``task_name`` (e.g. ``"leg_counting"``),
    deterministic by ``seed``; ``task_config`` is passed to ``reasoning_gym.create_dataset``.

    The prompt follows the built-in layout (``"Q:" + question + "\\n"``) so the same formatting,
    batching and answer extraction apply.

    Raises:
        ImportError: if ``reasoning_gym`` is not installed.
    """
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            "the reasoning_gym source needs the optional package 'reasoning-gym' "
            "(pip install reasoning-gym); the built-in modular arithmetic task needs nothing extra"
        ) from e
    dataset = reasoning_gym.create_dataset(task_name, size=n, seed=seed, **task_config)
    problems = []
    for entry in dataset:
        question = str(entry["question"]).strip()
        problems.append(
            Problem(
                prompt=f"{PROMPT_PREFIX}{question}\n",
                reasoning="",
                answer=str(entry["answer"]).strip(),
                steps=0,
                source=f"reasoning_gym:{task_name}",
            )
        )
    return problems
