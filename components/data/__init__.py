"""Data for every stage: the tokenizer (transformers ``AutoTokenizer``), the ``data`` section (a
weighted mixture of JSONL / Parquet files, the built-in generator and reasoning-gym tasks), rendering
rows through the chat template with assistant-only targets, deterministic per-rank training batches,
the built-in verifiable reasoning task and answer extraction."""

from components.data.answers import extract_answer, is_correct, normalize_answer
from components.data.batches import TrainBatch, assemble_batch
from components.data.jsonl import problem_rows, read_jsonl, write_jsonl
from components.data.mixture import describe_data, make_batch, make_data_batch
from components.data.reasoning import (
    ANSWER_PREFIX,
    BOS,
    EOS,
    EVAL_SEED_OFFSET,
    PAD,
    PROMPT_PREFIX,
    THINK_CLOSE,
    THINK_OPEN,
    UNK,
    Problem,
    ProblemConfig,
    check_trace,
    derive_seed,
    eval_prompts,
    evaluate_chain,
    generate_eval_sets,
    generate_problems,
    held_out_prompts,
    iter_problems,
    parse_prompt,
)
from components.data.render import Example, Row, TemplateError, render_rows
from components.data.sources import (
    DataConfig,
    FilesSource,
    GeneratorSource,
    ReasoningGymSource,
    SourceConfig,
    problem_messages,
)
from components.data.tokenizer import DEMO_CHAT_TEMPLATE, ReasoningMarkers, TextTokenizer, build_demo_tokenizer

__all__ = [
    "ANSWER_PREFIX",
    "BOS",
    "DEMO_CHAT_TEMPLATE",
    "EOS",
    "EVAL_SEED_OFFSET",
    "PAD",
    "PROMPT_PREFIX",
    "THINK_CLOSE",
    "THINK_OPEN",
    "UNK",
    "DataConfig",
    "Example",
    "FilesSource",
    "GeneratorSource",
    "Problem",
    "ProblemConfig",
    "ReasoningGymSource",
    "ReasoningMarkers",
    "Row",
    "SourceConfig",
    "TemplateError",
    "TextTokenizer",
    "TrainBatch",
    "assemble_batch",
    "build_demo_tokenizer",
    "check_trace",
    "derive_seed",
    "describe_data",
    "eval_prompts",
    "evaluate_chain",
    "extract_answer",
    "generate_eval_sets",
    "generate_problems",
    "held_out_prompts",
    "is_correct",
    "iter_problems",
    "make_batch",
    "make_data_batch",
    "normalize_answer",
    "parse_prompt",
    "problem_messages",
    "problem_rows",
    "read_jsonl",
    "render_rows",
    "write_jsonl",
]
