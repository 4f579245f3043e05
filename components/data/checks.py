"""Checks a stage runs on the driver before any worker starts: the data section against the checkpoint.

A bad path, an unknown row layout, a chat template that cannot render a row, or a tokenizer that does
not match the model fails here in seconds, naming the YAML section, instead of inside a Ray worker.
"""

from __future__ import annotations

from pathlib import Path

from components.data.mixture import describe_data
from components.data.sources import DataConfig
from components.data.tokenizer import ReasoningMarkers, TextTokenizer


def check_data(
    data: DataConfig, tokenizer_dir: str | Path, markers: ReasoningMarkers, vocab_size: int, where: str
) -> TextTokenizer:
    """Load the checkpoint's tokenizer and render the first rows of every source of ``data`` through it.

    Args:
        data: the mixture to check (files are resolved and s3:// files downloaded).
        tokenizer_dir: the checkpoint folder holding the tokenizer files.
        markers: the reasoning markers the tokenizer must contain (as tokens or token sequences).
        vocab_size: the model's embedding rows; every tokenizer id must fit.
        where: the YAML path of the section, prefixed to every error.

    Returns:
        The loaded tokenizer.
    """
    tokenizer = TextTokenizer.load(tokenizer_dir, markers)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"{where}: the tokenizer in {tokenizer_dir} has {tokenizer.vocab_size} ids but the model's vocab_size "
            f"is {vocab_size}; use the tokenizer the checkpoint was trained with"
        )
    try:
        describe_data(data, tokenizer, n_rows=2)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"{where}: {err}") from None
    return tokenizer
