"""Character-level tokenizer built with Hugging Face ``tokenizers`` (nothing is downloaded).

Layout of the vocabulary (fixed, so ids are the same on every build):

* ids 0-5: special tokens ``<pad>`` ``<bos>`` ``<eos>`` ``<unk>`` ``<think>`` ``</think>``; they are
  registered as added special tokens, so ``<think>`` appearing in text is ONE token;
* ids 6-7: ``"\\t"`` and ``"\\n"``;
* ids 8-102: printable ASCII ``" "`` .. ``"~"`` in code-point order;
* the rest: ``<unused_k>`` fillers up to a multiple of 16 (112) so embedding shapes are friendly.

Every other character (non-ASCII, control characters) maps to ``<unk>``. The pre-tokenizer isolates
every character and the ``Fuse`` decoder joins tokens without inserting spaces, so
``decode(encode(text)) == text`` for any text made of vocabulary characters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from components.data.reasoning import BOS, EOS, PAD, THINK_CLOSE, THINK_OPEN, UNK

SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, THINK_OPEN, THINK_CLOSE)
#: Characters with their own id: tab, newline, then printable ASCII in code-point order.
CHARACTERS: tuple[str, ...] = ("\t", "\n", *(chr(c) for c in range(32, 127)))
VOCAB_MULTIPLE = 16

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"

# The serialized form of the one-character pre-tokenizer (see build_tokenizer).
_CHAR_SPLIT = {"type": "Split", "pattern": {"Regex": r"[\s\S]"}, "behavior": "Isolated", "invert": False}


def _vocab() -> dict[str, int]:
    """Token -> id, deterministic; padded with unused fillers to a multiple of ``VOCAB_MULTIPLE``."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    n_unused = -len(tokens) % VOCAB_MULTIPLE
    tokens += [f"<unused_{k}>" for k in range(n_unused)]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> Tokenizer:
    """The character tokenizer; the same ids on every call."""
    tok = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=UNK))
    # One pre-token per character (whitespace and newline included) so WordLevel sees single chars.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Added tokens are matched in the raw text before pre-tokenization: "<think>" -> one id.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _char_level_tables(tok: Tokenizer) -> tuple[dict[str, int], re.Pattern[str]] | None:
    """Lookup tables equivalent to ``tok.encode`` when ``tok`` is a plain character tokenizer
    (no normalizer, the one-character split, WordLevel, non-stripping added tokens); else None."""
    spec = json.loads(tok.to_str())
    added = spec.get("added_tokens") or []
    if (
        spec.get("normalizer") is not None
        or spec.get("pre_tokenizer") != _CHAR_SPLIT
        or spec["model"].get("type") != "WordLevel"
        or not added
        or any(a["lstrip"] or a["rstrip"] or a["single_word"] or a["normalized"] for a in added)
    ):
        return None
    char_ids = {t: i for t, i in spec["model"]["vocab"].items() if len(t) == 1}
    # Added tokens are matched leftmost, longest first, as the Rust matcher does.
    names = sorted((a["content"] for a in added), key=len, reverse=True)
    return char_ids, re.compile("(" + "|".join(re.escape(n) for n in names) + ")")


def _special_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {}
    for t in SPECIAL_TOKENS:
        i = tok.token_to_id(t)
        if i is None:
            raise ValueError(f"tokenizer has no special token {t!r}")
        ids[t] = i
    return ids


def save_tokenizer(tok: Tokenizer, directory: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (created if needed).

    The config names the special tokens and their ids; its keys also follow the Hugging Face
    ``tokenizer_config.json`` convention so ``PreTrainedTokenizerFast`` can load the directory.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    ids = _special_ids(tok)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "additional_special_tokens": [THINK_OPEN, THINK_CLOSE],
        "clean_up_tokenization_spaces": False,
        "special_token_ids": ids,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "kind": "char",
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from ``directory``; checks the special ids against the config if present."""
    path = Path(directory)
    tok = Tokenizer.from_file(str(path / TOKENIZER_FILE))
    config_path = path / CONFIG_FILE
    if config_path.exists():
        expected = json.loads(config_path.read_text()).get("special_token_ids", {})
        actual = _special_ids(tok)
        for name, i in expected.items():
            if actual.get(name) != i:
                raise ValueError(
                    f"{config_path}: special token {name!r} has id {actual.get(name)} in {TOKENIZER_FILE}, "
                    f"config says {i}"
                )
    return tok


class CharTokenizer:
    """Thin wrapper around the ``tokenizers`` object with the ids the rest of the project needs.

    ``encode`` adds nothing (no automatic ``<bos>``): the formatting functions in
    :mod:`components.data.reasoning` put the special tokens into the text explicitly.

    For a plain character tokenizer, encoding uses lookup tables taken from the ``tokenizers``
    object (about 10x faster than its per-character regex split on short texts, which matters
    when packing thousands of examples per batch); the ids are identical (tested).
    """

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
        ids = _special_ids(self.tokenizer)
        self.pad_id = ids[PAD]
        self.bos_id = ids[BOS]
        self.eos_id = ids[EOS]
        self.unk_id = ids[UNK]
        self.think_open_id = ids[THINK_OPEN]
        self.think_close_id = ids[THINK_CLOSE]
        self.special_ids = frozenset(ids.values())
        self._fast = _char_level_tables(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        """Number of ids (embedding rows), a multiple of 16 for the built-in vocabulary."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (one per character; special-token strings become one id)."""
        if self._fast is None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        char_ids, special_re = self._fast
        ids: list[int] = []
        unk = self.unk_id
        # re.split with a capturing group alternates plain text (even) and special tokens (odd).
        for k, piece in enumerate(special_re.split(text)):
            if k % 2:
                ids.append(self.tokenizer.token_to_id(piece))
            else:
                ids.extend([char_ids.get(c, unk) for c in piece])
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` over many texts."""
        if self._fast is None:
            return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; with ``skip_special`` the special tokens are dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def save(self, directory: str | Path) -> Path:
        """Write the tokenizer files into ``directory``."""
        return save_tokenizer(self.tokenizer, directory)

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """Load a directory written by :meth:`save`."""
        return cls(load_tokenizer(directory))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
