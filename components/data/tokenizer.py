"""One tokenizer path for every stage: transformers' ``AutoTokenizer`` plus the ids the project needs.

:meth:`TextTokenizer.load` reads a checkpoint folder's tokenizer files with
``AutoTokenizer.from_pretrained`` and nothing else; the demo's character tokenizer is such a folder
too (:func:`build_demo_tokenizer`). Reasoning markers are configurable strings, each one token or a
sequence of tokens. Batch encoding and chat templates have fast paths, each checked against its
reference (``hf.encode``, ``hf.apply_chat_template``) when the tokenizer is built.

Design notes (markers, the demo vocabulary, the fast paths): docs/data.md ("The tokenizer").
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

try:  # the compiled-template cache behind apply_chat_template (used by the rendering fast path)
    from transformers.utils.chat_template_utils import _compile_jinja_template
except ImportError:  # another transformers layout: the reference path alone is used
    _compile_jinja_template = None

from components.data.reasoning import BOS, EOS, PAD, THINK_CLOSE, THINK_OPEN, UNK

__all__ = [
    "CONFIG_FILE",
    "DEMO_CHAT_TEMPLATE",
    "GENERATION_CONFIG_FILE",
    "TOKENIZER_FILE",
    "ReasoningMarkers",
    "TextTokenizer",
    "build_demo_tokenizer",
]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

_READS_REASONING = re.compile(r"reasoning_content|\.thinking\b|\[\s*['\"]thinking['\"]\s*\]")

DEMO_SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, THINK_OPEN, THINK_CLOSE)
#: Characters with their own id in the demo vocabulary: tab, newline, then printable ASCII.
DEMO_CHARACTERS: tuple[str, ...] = ("\t", "\n", *(chr(c) for c in range(32, 127)))
DEMO_VOCAB_MULTIPLE = 16

#: The demo chat template: ``bos_token``, then per message: system and user -> content; assistant ->
#: ``<think>`` + reasoning_content + ``</think>`` + content + ``eos_token``; the generation prompt is
#: ``<think>``. So user ``"Q:7+5*3-2\\n"`` with assistant reasoning ``"7+5=2\\n..."`` and content ``"A:4"``
#: renders to ``"<bos>Q:7+5*3-2\\n<think>7+5=2\\n...</think>A:4<eos>"`` (the demo training text).
DEMO_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is defined "
    "and message['reasoning_content'] is not none else '' -%}"
    "{{- '<think>' + reasoning + '</think>' + message['content'] + eos_token -}}"
    "{%- else -%}"
    "{{- message['content'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<think>' -}}{%- endif -%}"
)


class ReasoningMarkers(BaseModel):
    """The strings that open and close the reasoning part of an assistant turn."""

    model_config = ConfigDict(extra="forbid")

    think_open: str = Field("<think>", min_length=1, description="Opens the reasoning (a token or a string).")
    think_close: str = Field("</think>", min_length=1, description="Closes the reasoning (a token or a string).")

    @model_validator(mode="after")
    def _distinct(self) -> ReasoningMarkers:
        if self.think_open == self.think_close:
            raise ValueError(f"think_open and think_close must differ, both are {self.think_open!r}")
        return self


def _demo_vocab() -> dict[str, int]:
    tokens = list(DEMO_SPECIAL_TOKENS) + list(DEMO_CHARACTERS)
    tokens += [f"<unused_{k}>" for k in range(-len(tokens) % DEMO_VOCAB_MULTIPLE)]
    return {tok: i for i, tok in enumerate(tokens)}


def build_demo_tokenizer() -> PreTrainedTokenizerFast:
    """The demo character tokenizer with :data:`DEMO_CHAT_TEMPLATE`; the same ids on every call."""
    tok = Tokenizer(models.WordLevel(vocab=_demo_vocab(), unk_token=UNK))
    # One pre-token per character (whitespace and newline included) so WordLevel sees single chars.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Added tokens are matched in the raw text before pre-tokenization: "<think>" -> one id.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in DEMO_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[THINK_OPEN, THINK_CLOSE],
        chat_template=DEMO_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _generation_eos_ids(directory: Path) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` (an int or a list), [] when absent."""
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


class TextTokenizer:
    """A transformers tokenizer with the ids every stage needs.

    ``encode`` adds no special tokens: chat rendering (:meth:`render_chat`) and the data renderers put
    them in explicitly, so the same text always gives the same ids.
    """

    def __init__(
        self,
        hf: PreTrainedTokenizerBase,
        markers: ReasoningMarkers | None = None,
        extra_stop_ids: Sequence[int] = (),
        source: str = "<memory>",
    ) -> None:
        self.hf = hf
        self.markers = markers or ReasoningMarkers()
        self.source = source
        if not hf.is_fast:
            raise ValueError(
                f"{source}: transformers loaded a slow (Python) tokenizer; ship a {TOKENIZER_FILE} "
                "(tokenizer.save_pretrained writes one) so offsets and batch encoding are available"
            )
        # generation_config.json of the folder this was loaded from: saved alongside (it names stop ids).
        self._generation_config: str | None = None
        if hf.eos_token_id is None:
            raise ValueError(
                f"{source}: the tokenizer has no eos token; set 'eos_token' in {CONFIG_FILE} "
                "(the token that ends an assistant turn)"
            )
        self.eos_id: int = hf.eos_token_id
        self.bos_id: int | None = hf.bos_token_id
        self.pad_id: int = hf.pad_token_id if hf.pad_token_id is not None else self.eos_id
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_id, *extra_stop_ids]))
        self.vocab_size: int = len(hf)
        self._vocab: dict[str, int] = hf.get_vocab()
        special = set(hf.all_special_ids)
        special |= {i for i, t in hf.added_tokens_decoder.items() if getattr(t, "special", False)}
        self.special_ids: frozenset[int] = frozenset(special)
        self.special_tokens: tuple[str, ...] = tuple(hf.convert_ids_to_tokens(i) for i in sorted(special))
        names = sorted((t for t in self.special_tokens if t), key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in names)) if names else None
        self.think_open_ids: tuple[int, ...] = self._marker_ids(self.markers.think_open)
        self.think_close_ids: tuple[int, ...] = self._marker_ids(self.markers.think_close)
        self.think_open_id: int | None = self.think_open_ids[0] if len(self.think_open_ids) == 1 else None
        self.think_close_id: int | None = self.think_close_ids[0] if len(self.think_close_ids) == 1 else None
        template = hf.chat_template
        if isinstance(template, dict):  # named templates: the default one is what apply_chat_template uses
            template = template.get("default")
        self.has_chat_template: bool = bool(template)
        # Whether the template places the reasoning itself (else it is folded into content); transformers
        # passes reasoning_content to templates also as `thinking` (the gpt-oss name).
        self.template_reads_reasoning: bool = bool(template) and bool(_READS_REASONING.search(template))
        self._template = template if isinstance(template, str) else None
        self._fast_encode = self._check_fast_encode()
        self._compiled = self._check_fast_render()

    def _check_fast_encode(self) -> bool:
        """Whether the Rust tokenizer alone encodes like ``hf.encode`` (checked on a probe text)."""
        probe = f" A b\n\t{self.markers.think_open}x{self.markers.think_close} é 12{''.join(self.special_tokens)}"
        backend = getattr(self.hf, "backend_tokenizer", None)
        return backend is not None and backend.encode(probe, add_special_tokens=False).ids == self.hf.encode(
            probe, add_special_tokens=False
        )

    def _check_fast_render(self) -> Any:
        """The compiled chat template when rendering with it matches ``apply_chat_template`` on a probe."""
        if self._template is None or _compile_jinja_template is None:
            return None
        try:
            compiled = _compile_jinja_template(self._template)
            probe = [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "reasoning_content": "r", "content": "a"},
                {"role": "user", "content": "v"},
            ]
            for n, gen in ((4, True), (3, False)):
                fast = self._render_compiled(compiled, probe[:n], gen)
                if fast != self._render_reference(probe[:n], gen):
                    return None
        except Exception:  # a template that rejects the probe: keep the reference path, it reports its errors
            return None
        return compiled

    def _marker_ids(self, marker: str) -> tuple[int, ...]:
        single = self._vocab.get(marker)
        if single is not None:
            return (single,)
        ids = tuple(self.encode(marker))
        if not ids:
            raise ValueError(f"{self.source}: reasoning marker {marker!r} encodes to no tokens")
        return ids

    @classmethod
    def load(cls, directory: str | Path, markers: ReasoningMarkers | None = None) -> TextTokenizer:
        """Load the tokenizer files of ``directory`` (a local folder or ``s3://`` prefix) with ``AutoTokenizer``.

        ``generation_config.json`` (when present) adds its ``eos_token_id`` values to :attr:`stop_ids`.
        """
        from components.storage import materialize

        folder = materialize(directory)
        if not (folder / TOKENIZER_FILE).is_file() and not (folder / CONFIG_FILE).is_file():
            raise FileNotFoundError(
                f"{directory}: no {TOKENIZER_FILE} or {CONFIG_FILE}; a checkpoint folder must carry its tokenizer files"
            )
        hf = AutoTokenizer.from_pretrained(str(folder))
        tok = cls(hf, markers, extra_stop_ids=_generation_eos_ids(folder), source=str(directory))
        if (folder / GENERATION_CONFIG_FILE).is_file():
            tok._generation_config = (folder / GENERATION_CONFIG_FILE).read_text()
        return tok

    # -- encoding ------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids, nothing is added."""
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` over many texts (one batched call into the Rust tokenizer)."""
        return [ids for ids, _ in self.encode_with_offsets(texts)]

    def encode_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Per text: ids (as :meth:`encode`) and each token's ``(start, end)`` character span in the text."""
        if not texts:
            return []
        if self._fast_encode:
            return [
                (e.ids, e.offsets)
                for e in self.hf.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
            ]
        enc = self.hf(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        return [
            (ids, [tuple(o) for o in offs]) for ids, offs in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        ]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; with ``skip_special`` the special tokens are dropped."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary entry ``token`` (not an encoding of a text), None when absent."""
        return self._vocab.get(token)

    def id_to_token(self, i: int) -> str | None:
        """Vocabulary entry of id ``i``, None when out of range."""
        if not 0 <= i < self.vocab_size:
            return None
        return self.hf.convert_ids_to_tokens(i)

    @property
    def bos_token(self) -> str | None:
        return self.hf.bos_token

    @property
    def eos_token(self) -> str:
        return self.hf.eos_token

    # -- chat ----------------------------------------------------------------------------------------

    def _fold(self, message: dict[str, Any]) -> dict[str, Any]:
        """``reasoning_content`` folded into ``content`` as open + reasoning + close + content."""
        reasoning = message.get("reasoning_content")
        out = {k: v for k, v in message.items() if k != "reasoning_content"}
        if reasoning is not None:
            m = self.markers
            out["content"] = f"{m.think_open}{reasoning}{m.think_close}{message.get('content') or ''}"
        return out

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The text of ``messages`` through the chat template (``apply_chat_template(tokenize=False)``).

        A message may carry ``reasoning_content``: it is passed to the template when the template reads
        that field (its text mentions ``reasoning_content`` or a message's ``thinking``), else folded into
        ``content`` as ``think_open + reasoning + think_close + content``. ``tools`` (OpenAI function
        tools) and ``template_kwargs`` (extra template variables) reach the template as
        ``apply_chat_template(tools=..., **template_kwargs)`` passes them.

        Without a chat template the rendering is a plain fallback: ``bos`` (when the tokenizer has one),
        then one line ``"{role}: {content}"`` per message, an assistant line ending with ``eos`` before
        its newline; the generation prompt is ``"assistant: "``.
        """
        if not messages:
            raise ValueError("no messages to render: a conversation needs at least one turn")
        msgs = list(messages) if self.template_reads_reasoning else [self._fold(m) for m in messages]
        if not self.has_chat_template:
            parts = [self.bos_token or ""]
            for m in msgs:
                end = self.eos_token if m["role"] == "assistant" else ""
                parts.append(f"{m['role']}: {m.get('content') or ''}{end}\n")
            if add_generation_prompt:
                parts.append("assistant: ")
            return "".join(parts)
        kwargs = dict(template_kwargs or {})
        if self._compiled is not None:
            return self._render_compiled(self._compiled, msgs, add_generation_prompt, tools, kwargs)
        return self._render_reference(msgs, add_generation_prompt, tools, kwargs)

    def _render_reference(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        return self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
        )

    def _render_compiled(
        self,
        compiled: Any,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """What ``apply_chat_template`` does for plain-string messages and dict tools: None fields dropped,
        the reasoning also passed as ``thinking``, the special tokens and extra kwargs as template variables."""
        chat = []
        for m in messages:
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        return compiled.render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.hf.special_tokens_map,
            **(kwargs or {}),
        )

    @cached_property
    def generation_opens_thinking(self) -> bool:
        """Whether the generation prompt ends with ``think_open`` (generation starts inside the reasoning)."""
        rendered = self.render_chat([{"role": "user", "content": "x"}], add_generation_prompt=True)
        return rendered.rstrip().endswith(self.markers.think_open)

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Ids of ``messages`` rendered with the generation prompt: what generation starts from."""
        return self.encode(self.render_chat(messages, True, tools, template_kwargs))

    def template_mentions(self, name: str) -> bool:
        """Whether the chat template's text mentions ``name`` (e.g. ``tool_calls``: it renders them itself)."""
        return self._template is not None and name in self._template

    def contains_special(self, text: str) -> list[str]:
        """Special-token strings found in ``text`` (user input must not smuggle control tokens), in order
        of first appearance, each once."""
        if self._special_re is None:
            return []
        return list(dict.fromkeys(self._special_re.findall(text)))

    def save(self, directory: str | Path) -> Path:
        """Write the tokenizer files into ``directory`` (``hf.save_pretrained``, plus the
        ``generation_config.json`` it was loaded with, if any); returns the folder."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(out))
        if self._generation_config is not None and not (out / GENERATION_CONFIG_FILE).exists():
            (out / GENERATION_CONFIG_FILE).write_text(self._generation_config)
        return out

    def __repr__(self) -> str:
        return f"TextTokenizer({self.source!r}, vocab_size={self.vocab_size}, chat_template={self.has_chat_template})"
