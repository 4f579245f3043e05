"""Structured outputs: grammars over the tokenizer (llguidance), compiled once per schema, applied as token masks.

A :class:`GrammarSpec` is what a request constrains its answer to (a JSON schema, any JSON object, a
regular expression, a choice of strings, or a Lark grammar such as a tool-call format). :class:`Grammars`
compiles each spec once (an LRU cache keyed by the spec's text) into a matcher over the checkpoint's
tokenizer and hands every sequence its own copy; compile time, cache hits and mask time are counted
for ``/stats`` and ``/metrics``. :func:`allowed_tokens` turns the matchers of a batch's constrained rows
into one boolean mask, which the sampler applies to those rows only (:mod:`components.serving.batch`).

Why llguidance (measured against xgrammar, docs/serving.md "Structured outputs and tool calls"): no
dependency (xgrammar pulls triton and a TVM runtime, useless on CPU), it refuses JSON-schema keywords it
does not implement instead of silently not enforcing them, Lark grammars embed JSON schemas (a tool-call
format is one line), and its per-token cost is of the same order.

Design notes: docs/serving.md ("Structured outputs and tool calls").
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    import llguidance

    from components.data.tokenizer import TextTokenizer

__all__ = [
    "GrammarError",
    "GrammarSpec",
    "Grammars",
    "allowed_reference",
    "allowed_tokens",
    "closed_schema",
    "json_options",
    "lark_literal",
]

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
JsonStyle = Literal["spaced", "compact", "flexible"]


class GrammarError(ValueError):
    """A grammar that does not compile; ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class GrammarSpec:
    """What one request constrains its answer to.

    ``source``: the JSON schema as JSON text (key order kept: it is the order properties are generated
    in), the regular expression, the choices as a JSON list, or the Lark grammar. ``param``: the request
    field it came from, for errors. Specs with equal ``(kind, source)`` share one compiled grammar.
    """

    kind: GrammarKind
    source: str
    param: str

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str) -> GrammarSpec:
        """The spec of a JSON schema, its objects closed (:func:`closed_schema`)."""
        return cls("json_schema", json.dumps(closed_schema(schema), separators=(",", ":"), ensure_ascii=False), param)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "additionalItems", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing about others closed
    (``additionalProperties: false``), as xgrammar's strict mode, vLLM's default, enforces: a model must
    not invent properties the schema does not name (with a weak model they would never end). A schema
    that allows other properties explicitly keeps them. Returns a new schema; ``schema`` is unchanged."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = [closed_schema(x) for x in out[key]] if isinstance(out[key], list) else closed_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(x) for x in out[key]]
    others = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not any(k in out for k in others):
        out["additionalProperties"] = False
    return out


def json_options(style: JsonStyle) -> dict[str, Any]:
    """llguidance's JSON layout options: ``spaced`` is ``json.dumps``' layout on one line (``", "``,
    ``": "``), ``compact`` has no space at all, ``flexible`` allows any JSON whitespace (a weak model can
    then spend its tokens on whitespace)."""
    if style == "flexible":
        return {"whitespace_flexible": True}
    sep = (", ", ": ") if style == "spaced" else (",", ":")
    return {"whitespace_flexible": False, "item_separator": sep[0], "key_separator": sep[1]}


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON string escaping, which Lark's literals accept)."""
    return json.dumps(text, ensure_ascii=False)


# ---------------------------------------------------------------------- the tokenizer as llguidance sees it
def _byte_table(tokenizer: TextTokenizer, n_vocab: int) -> list[bytes]:
    """Every id's bytes, for tokenizers whose decoder llguidance cannot read (e.g. the demo's character
    ``WordLevel``). Special tokens get llguidance's special prefix ``0xFF`` so no grammar text produces them."""
    hf = tokenizer.hf
    out = []
    for i in range(n_vocab):
        if i >= tokenizer.vocab_size or i in tokenizer.special_ids:
            name = hf.convert_ids_to_tokens(i) if i < tokenizer.vocab_size else f"<id_{i}>"
            out.append(b"\xff" + (name or f"<id_{i}>").encode())
        else:
            out.append(hf.decode([i]).encode("utf-8"))
    return out


class _Wrapped:
    """What ``llguidance.TokenizerWrapper`` reads: ids' bytes, eos / bos, special ids, an encoder."""

    def __init__(self, tokenizer: TextTokenizer, n_vocab: int, eos: Sequence[int]) -> None:
        self.tokens = _byte_table(tokenizer, n_vocab)
        self.eos_token_id, self.bos_token_id = eos[0], tokenizer.bos_id
        self.special_token_ids = sorted(i for i in tokenizer.special_ids if i < n_vocab)
        self._encode = tokenizer.encode

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text.decode("utf-8", errors="replace"))


def ll_tokenizer(tokenizer: TextTokenizer, n_vocab: int, eos: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` over the model's ``n_vocab`` logits, ``eos`` ending a grammar.

    Byte-level and SentencePiece tokenizers are read by llguidance itself from the Rust tokenizer; any
    other (llguidance raises ``ValueError`` on its decoder) gets every id's bytes from ``decode``.
    """
    import llguidance
    import llguidance.hf

    eos = list(eos) or [tokenizer.eos_id]
    try:
        return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=n_vocab, eos_token=eos)
    except ValueError:
        wrapped = llguidance.TokenizerWrapper(_Wrapped(tokenizer, n_vocab, eos))
        return llguidance.LLTokenizer(wrapped, n_vocab=n_vocab, eos_token=eos)


# ---------------------------------------------------------------------- compiling, cached
class Grammars:
    """Grammars compiled once per spec over one tokenizer; :meth:`matcher` gives each sequence its own copy.

    Compiling builds llguidance's parser and lexer (milliseconds; more for large schemas); a copy of a
    compiled matcher costs microseconds. At most ``capacity`` grammars are kept (least recently used
    first out). Thread-safe: requests compile on the event loop, the decode thread only uses copies.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        n_vocab: int,
        eos: Sequence[int],
        style: JsonStyle = "spaced",
        capacity: int = 256,
    ) -> None:
        start = time.perf_counter()
        self.tokenizer, self.n_vocab, self.style, self.capacity = tokenizer, n_vocab, style, capacity
        self.ll = ll_tokenizer(tokenizer, n_vocab, eos)
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {
            "tokenizer_setup_s": time.perf_counter() - start,
            "compiles": 0,
            "compile_s_total": 0.0,
            "compile_s_max": 0.0,
            "cache_hits": 0,
            "compile_errors": 0,
        }

    def text(self, spec: GrammarSpec) -> str:
        """llguidance's grammar for ``spec`` (JSON layout from ``style``; a schema's own ``x-guidance`` wins)."""
        import llguidance

        opts = json_options(self.style)
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=opts)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=opts)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            lark = "start: " + " | ".join(lark_literal(c) for c in json.loads(spec.source))
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.LLMatcher.grammar_from_lark(spec.source)

    def compiled(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The compiled matcher of ``spec`` (from the cache, or compiled now and cached).

        Raises:
            GrammarError: the grammar does not compile (naming ``spec.param`` and llguidance's reason).
        """
        import llguidance

        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self.counters["cache_hits"] += 1
                return hit
        start = time.perf_counter()
        try:
            matcher = llguidance.LLMatcher(self.ll, self.text(spec), log_level=0)
            error = matcher.get_error() if matcher.is_error() else None
        except ValueError as err:  # a schema that is not a JSON object
            error = str(err)
        seconds = time.perf_counter() - start
        with self._lock:
            if error is not None:
                self.counters["compile_errors"] += 1
                raise GrammarError(f"{spec.param}: cannot be enforced: {error.strip()}", spec.param)
            self.counters["compiles"] += 1
            self.counters["compile_s_total"] += seconds
            self.counters["compile_s_max"] = max(self.counters["compile_s_max"], seconds)
            self._cache[spec.key] = matcher
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher of ``spec`` for one sequence (a copy of the compiled one)."""
        return self.compiled(spec).deep_copy()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self.counters, "cached": len(self._cache)}


# ---------------------------------------------------------------------- masks
def allowed_tokens(matchers: Sequence[llguidance.LLMatcher], n_vocab: int) -> torch.Tensor:
    """Which tokens each matcher allows next: (len(matchers), n_vocab) bool, on the CPU.

    llguidance writes a bitmask (bit ``t % 32`` of int32 word ``t // 32`` is token ``t``); viewed as
    little-endian bytes and unpacked least-significant bit first, bit ``k`` of the flat array is token
    ``k``. Reference: :func:`allowed_reference`.
    """
    import llguidance.numpy as ln

    bits = ln.allocate_token_bitmask(len(matchers), n_vocab)  # (rows, ceil(n_vocab / 32)) int32
    for j, m in enumerate(matchers):
        ln.fill_next_token_bitmask(m, bits, j)
    words = bits.astype("<i4", copy=False).view(np.uint8)  # (rows, 4 * words), little-endian byte order
    flat = np.unpackbits(words, axis=1, bitorder="little")[:, :n_vocab]
    return torch.from_numpy(flat.astype(bool))


def allowed_reference(matcher: llguidance.LLMatcher, n_vocab: int, eos: Sequence[int]) -> torch.Tensor:
    """The slow reference of :func:`allowed_tokens` for one matcher: (n_vocab,) bool, token by token (a token
    is allowed when the matcher would consume it; an ``eos`` id when the grammar is complete)."""
    done = matcher.is_accepting()
    return torch.tensor([done if t in eos else matcher.validate_tokens([t]) == 1 for t in range(n_vocab)])
