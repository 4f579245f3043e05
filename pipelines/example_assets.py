"""Assets of the chat example: what a team brings, built here from nothing in one command.

``star-elastic example chat --out DIR`` writes, deterministically by ``--seed``: ``tokenizer/`` (a
byte-level BPE tokenizer with a ChatML-style template), ``train.jsonl`` (chat rows with reasoning),
``text.jsonl`` (plain-text rows), ``eval.jsonl`` (held-out problems answered as ``\\boxed{...}``).
The task is the built-in chained modular arithmetic, worded as a question.

Design notes (the files, tokenization): docs/stages.md ("The chat example's assets").
"""

from __future__ import annotations

import json
import random
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from components.data.reasoning import Problem, ProblemConfig, derive_seed, generate_eval_sets, iter_problems

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK_OPEN, THINK_CLOSE)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- if message['reasoning_content'] is defined and message['reasoning_content'] is not none -%}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>' -}}{%- endif -%}"
)
"""ChatML with reasoning: an assistant turn is ``<think>`` reasoning ``</think>`` answer ``<|im_end|>``;
the generation prompt opens the assistant turn and its thinking."""

SYSTEM_PROMPTS = (
    "You are a careful calculator. Think step by step.",
    "Solve the problem. Show your work, then give the final answer in a box.",
)
OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
EXAMPLE_PROBLEMS = ProblemConfig(min_steps=1, max_steps=3, fold_prob=0.0, direct_prob=0.0)
"""Chains of 1-3 steps: short enough for a parent trained in minutes, long enough that levels differ."""
EVAL_LEVELS = (1, 2, 3)
_SKIP_MODULES = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "webbrowser"})


def spaced(expr: str) -> str:
    """``"7+5*3"`` -> ``"7 + 5 * 3"``: one token per number and operator after byte-level splitting."""
    return " ".join(expr)


def question(prompt: str) -> str:
    """The user's words for a generator prompt ``"Q:7+5*3\\n"``."""
    chain = prompt.strip()[2:]
    return f"Compute {spaced(chain)} from left to right, modulo 10."


def trace(reasoning: str) -> str:
    """The generator's trace with spaces: ``"7+5=2\\n"`` -> ``" 7 + 5 = 2\\n"``.

    Each line starts with a space so that every number is the same token (``" 7"``) in the question, in
    the trace and in the result carried to the next line: copying is then a token-for-token lookup.
    """
    return "".join(" " + spaced(line) + "\n" for line in reasoning.splitlines())


def final(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


def prose(prompt: str, answer: str) -> str:
    """A worked explanation in words (a text row)."""
    chain = prompt.strip()[2:]
    value = int(chain[0])
    parts = [f"Start with {NUMBER_WORDS[value]}."]
    for i in range(1, len(chain), 2):
        op, x = chain[i], int(chain[i + 1])
        value = {"+": value + x, "-": value - x, "*": value * x}[op] % 10
        parts.append(f"Then {OP_WORDS[op]} {NUMBER_WORDS[x]} gives {NUMBER_WORDS[value]} modulo ten.")
    parts.append(f"So {spaced(chain)} modulo 10 is {answer}.")
    return " ".join(parts)


def chat_rows(n: int, seed: int, exclude: set[str]) -> Iterator[dict[str, Any]]:
    """``n`` chat rows: reasoning as a field or inline, optional system message, sometimes two turns."""
    rng = random.Random(derive_seed("chat-example-layout", seed))
    stream = iter_problems(EXAMPLE_PROBLEMS, derive_seed("chat-example", seed), exclude=exclude)
    for _ in range(n):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _turn in range(2 if rng.random() < 0.15 else 1):
            p = next(stream)
            messages.append({"role": "user", "content": question(p.prompt)})
            if rng.random() < 0.5:
                reply = {"role": "assistant", "reasoning_content": trace(p.reasoning), "content": final(p.answer)}
                messages.append(reply)
            else:
                inline = f"{THINK_OPEN}{trace(p.reasoning)}{THINK_CLOSE}{final(p.answer)}"
                messages.append({"role": "assistant", "content": inline})
        yield {"messages": messages}


def stdlib_paragraphs(limit: int) -> list[str]:
    """Up to ``limit`` paragraphs (>= 200 characters) of the standard library's module docstrings."""
    import importlib

    paragraphs: list[str] = []
    # Standard-library modules only (never whatever else is installed), minus those with side effects.
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP_MODULES)
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = importlib.import_module(name).__doc__ or ""
        except Exception:  # any module that fails to import is simply skipped
            continue
        for para in re.split(r"\n\s*\n", doc):
            text = " ".join(para.split())
            if len(text) >= 200 and text.isascii():
                paragraphs.append(text)
        if len(paragraphs) >= limit:
            break
    return paragraphs[:limit]


def text_rows(n: int, seed: int, exclude: set[str]) -> list[dict[str, str]]:
    """``n`` text rows: half worked explanations, half documentation prose."""
    stream = iter_problems(EXAMPLE_PROBLEMS, derive_seed("text-example", seed), exclude=exclude)
    rows = [{"text": prose(p.prompt, p.answer)} for p in (next(stream) for _ in range(n - n // 2))]
    rows += [{"text": t} for t in stdlib_paragraphs(n // 2)]
    random.Random(seed).shuffle(rows)
    return rows


def eval_rows(sets: dict[int, list[Problem]]) -> list[dict[str, Any]]:
    """Evaluation rows of held-out problem sets: the question, the reference answer, the level."""
    return [
        {"prompt": question(p.prompt), "answer": p.answer, "level": level}
        for level, problems in sets.items()
        for p in problems
    ]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with the example's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, THINK_OPEN, THINK_CLOSE],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_chat_example(
    out: str | Path,
    *,
    n_chat: int = 12000,
    n_text: int = 2000,
    n_eval_per_level: int = 50,
    vocab_size: int = 1280,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the example's tokenizer and data under ``out``; returns counts and paths.

    Evaluation prompts are drawn first and excluded from the training and text streams.
    """
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    sets = generate_eval_sets(list(EVAL_LEVELS), n_eval_per_level, seed, EXAMPLE_PROBLEMS)
    evals = eval_rows(sets)
    exclude = {p.prompt for problems in sets.values() for p in problems}
    chats = list(chat_rows(n_chat, seed, exclude))
    texts = text_rows(n_text, seed, exclude)
    write_jsonl(root / "train.jsonl", chats)
    write_jsonl(root / "text.jsonl", texts)
    write_jsonl(root / "eval.jsonl", evals)

    corpus = [t["text"] for t in texts] + [
        m.get("reasoning_content", "") + m["content"] for row in chats[:4000] for m in row["messages"]
    ]
    tokenizer = train_tokenizer(corpus, vocab_size)
    tok_dir = root / "tokenizer"
    tokenizer.save_pretrained(tok_dir)
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    generation = {"eos_token_id": eos_ids, "pad_token_id": tokenizer.pad_token_id, "max_new_tokens": 128}
    (tok_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return {
        "train": str(root / "train.jsonl"),
        "text": str(root / "text.jsonl"),
        "eval": str(root / "eval.jsonl"),
        "tokenizer": str(tok_dir),
        "n_chat": len(chats),
        "n_text": len(texts),
        "n_eval": len(evals),
        "vocab_size": len(tokenizer),
    }
