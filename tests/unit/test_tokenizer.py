"""TextTokenizer: the demo tokenizer's pinned ids, its chat template, loading with AutoTokenizer,
markers as tokens or sequences, chat rendering and special-token detection."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from transformers import AutoTokenizer

from components.data.tokenizer import (
    DEMO_CHAT_TEMPLATE,
    ReasoningMarkers,
    TextTokenizer,
    build_demo_tokenizer,
)
from model.layout import tokenizer_files
from tests.unit.data_tokenizers import chatml_bpe

DEMO_PARENT = Path(__file__).resolve().parents[2] / "pipelines" / "assets" / "demo-parent"


@pytest.fixture(scope="module")
def demo() -> TextTokenizer:
    return TextTokenizer(build_demo_tokenizer())


@pytest.fixture(scope="module")
def bpe() -> TextTokenizer:
    return TextTokenizer(chatml_bpe())


def test_demo_ids_are_pinned(demo: TextTokenizer) -> None:
    assert (demo.pad_id, demo.bos_id, demo.eos_id) == (0, 1, 2)
    assert (demo.think_open_id, demo.think_close_id) == (4, 5)
    assert (demo.think_open_ids, demo.think_close_ids) == ((4,), (5,))
    assert demo.stop_ids == (2,)
    assert demo.encode("\t\n 0A:Q~") == [6, 7, 8, 24, 41, 34, 57, 102]
    assert demo.vocab_size == 112
    assert demo.special_ids == frozenset({0, 1, 2, 3, 4, 5})
    assert demo.special_tokens == ("<pad>", "<bos>", "<eos>", "<unk>", "<think>", "</think>")
    assert demo.token_to_id("<unused_3>") == 106 and demo.id_to_token(111) == "<unused_8>"
    assert demo.id_to_token(112) is None and demo.token_to_id("zz") is None
    assert build_demo_tokenizer().backend_tokenizer.to_str() == build_demo_tokenizer().backend_tokenizer.to_str()


def test_demo_special_tokens_are_single_tokens(demo: TextTokenizer) -> None:
    assert demo.encode("a<think>b</think>c<eos>") == [73, 4, 74, 5, 75, 2]
    assert demo.decode([73, 4, 74, 5, 75, 2], skip_special=True) == "abc"
    assert demo.encode("<think") == [36, 92, 80, 81, 86, 83]
    assert demo.encode("é€\r") == [3, 3, 3]
    assert demo.decode(demo.encode("aéb")) == "a<unk>b"


_ALPHABET = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")
_TEXT = st.lists(
    st.one_of(st.text(alphabet=_ALPHABET, max_size=20), st.sampled_from(["<think>", "</think>", "<bos>", "<eos>"])),
    max_size=8,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=_TEXT)
def test_demo_round_trip(demo: TextTokenizer, text: str) -> None:
    ids = demo.encode(text)
    assert 3 not in ids
    assert demo.decode(ids) == text
    assert demo.encode_batch([text, text]) == [ids, ids]


def test_demo_chat_template_gives_the_demo_layout(demo: TextTokenizer) -> None:
    messages = [
        {"role": "user", "content": "Q:7+5*3-2\n"},
        {"role": "assistant", "reasoning_content": "7+5*3=6\n6-2=4\n", "content": "A:4"},
    ]
    assert demo.render_chat(messages, add_generation_prompt=False) == (
        "<bos>Q:7+5*3-2\n<think>7+5*3=6\n6-2=4\n</think>A:4<eos>"
    )
    assert demo.render_chat(messages[:1], add_generation_prompt=True) == "<bos>Q:7+5*3-2\n<think>"
    assert demo.prompt_ids(messages[:1]) == [1, 57, 34, 31, 19, 29, 18, 27, 21, 26, 7, 4]
    assert demo.generation_opens_thinking
    system = [{"role": "system", "content": "S\n"}, *messages[:1]]
    assert demo.render_chat(system, add_generation_prompt=True) == "<bos>S\nQ:7+5*3-2\n<think>"


def test_shipped_demo_parent_tokenizer_is_the_demo_tokenizer(demo: TextTokenizer) -> None:
    loaded = TextTokenizer.load(DEMO_PARENT)
    assert loaded.hf.get_vocab() == demo.hf.get_vocab()
    assert loaded.hf.chat_template == DEMO_CHAT_TEMPLATE
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (0, 1, 2, 112)
    assert loaded.special_ids == demo.special_ids
    assert loaded.encode("<bos>Q:1+2\n<think>") == [1, 57, 34, 25, 19, 26, 7, 4]
    # The same folder opens in plain transformers, chat template included.
    hf = AutoTokenizer.from_pretrained(str(DEMO_PARENT))
    prompt = hf.apply_chat_template(
        [{"role": "user", "content": "Q:1+2\n"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<bos>Q:1+2\n<think>"


def test_save_load_keeps_ids_template_and_stop_ids(demo: TextTokenizer, tmp_path: Path) -> None:
    demo.save(tmp_path / "a")
    assert set(tokenizer_files(tmp_path / "a")) >= {"tokenizer.json", "tokenizer_config.json"}
    (tmp_path / "a" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = TextTokenizer.load(tmp_path / "a")
    assert loaded.stop_ids == (2, 5)
    assert loaded.encode("Q:1\n<think>") == [57, 34, 25, 7, 4]
    assert loaded.render_chat([{"role": "user", "content": "x"}], True) == "<bos>x<think>"
    loaded.save(tmp_path / "b")  # generation_config.json travels with the tokenizer
    assert TextTokenizer.load(tmp_path / "b").stop_ids == (2, 5)
    (tmp_path / "a" / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        TextTokenizer.load(tmp_path / "a")


def test_load_errors_name_the_folder_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TextTokenizer.load(tmp_path)
    no_eos = chatml_bpe()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="eos_token"):
        TextTokenizer(no_eos, source="here")


def test_markers_as_token_sequences(bpe: TextTokenizer) -> None:
    # "<think>" is not a token of this BPE: "<" "t" "hi" "n" "k" ">".
    assert bpe.think_open_id is None and bpe.think_close_id is None
    assert bpe.think_open_ids == (60, 116, 256, 110, 107, 62)
    assert bpe.think_close_ids == (60, 47, 116, 256, 110, 107, 62)
    assert (bpe.eos_id, bpe.pad_id, bpe.bos_id) == (259, 257, None)
    assert bpe.special_ids == frozenset({257, 258, 259})
    custom = TextTokenizer(chatml_bpe(), ReasoningMarkers(think_open="<|im_start|>", think_close="hi"))
    assert (custom.think_open_id, custom.think_close_id) == (258, 256)
    with pytest.raises(ValidationError, match="differ"):
        ReasoningMarkers(think_open="x", think_close="x")


def test_reasoning_is_folded_when_the_template_does_not_read_it(bpe: TextTokenizer) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning_content": "2+2=4", "content": "4"},
    ]
    assert not bpe.template_reads_reasoning and not bpe.generation_opens_thinking
    assert bpe.render_chat(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>2+2=4</think>4<|im_end|>\n"
    )
    # "<|im_start|>" "user" "\n" "hi" "<|im_end|>" "\n" "<|im_start|>" "assistant" "\n"
    assert bpe.prompt_ids(messages[:1]) == [258, 117, 115, 101, 114, 10, 256, 259, 10, 258] + [
        97,
        115,
        115,
        105,
        115,
        116,
        97,
        110,
        116,
        10,
    ]
    assert messages[1]["reasoning_content"] == "2+2=4"  # the caller's messages are not modified


def test_fallback_without_chat_template() -> None:
    tok = TextTokenizer(chatml_bpe(chat_template=None))
    assert not tok.has_chat_template
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "r", "content": "a"},
    ]
    assert tok.render_chat(messages, add_generation_prompt=False) == (
        "system: s\nuser: q\nassistant: <think>r</think>a<|im_end|>\n"
    )
    assert tok.render_chat(messages[:2], add_generation_prompt=True) == "system: s\nuser: q\nassistant: "
    demo_plain = build_demo_tokenizer()
    demo_plain.chat_template = None
    assert TextTokenizer(demo_plain).render_chat(messages[1:2], True) == "<bos>user: q\nassistant: "


def test_contains_special(demo: TextTokenizer, bpe: TextTokenizer) -> None:
    assert demo.contains_special("a </think> b <bos><think></think>") == ["</think>", "<bos>", "<think>"]
    assert demo.contains_special("<thinking> <bo s>") == []
    assert bpe.contains_special("x<|im_end|>y<|im_start|>") == ["<|im_end|>", "<|im_start|>"]
    assert bpe.contains_special("<think>") == []


# ---------------------------------------------------------------------------------------------
# Fast paths against their references

_REASONING_CHATML = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and message['reasoning_content'] is defined -%}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' -}}{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>' -}}{%- endif -%}"
)
_THINKING_CHATML = _REASONING_CHATML.replace("reasoning_content", "thinking")
_PIECES = st.sampled_from(
    ["<think>", "</think>", "<eos>", "<|im_end|>", "\n", " ", "ab", "Q:1", "é€", "\t", "hi", "{{x}}"]
)
_CONTENT = st.lists(_PIECES, max_size=4).map("".join)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _CONTENT},
    optional={"reasoning_content": st.one_of(st.none(), _CONTENT)},
)


def _tokenizers() -> list[TextTokenizer]:
    return [
        TextTokenizer(build_demo_tokenizer()),
        TextTokenizer(chatml_bpe()),
        TextTokenizer(chatml_bpe(_REASONING_CHATML)),
        TextTokenizer(chatml_bpe(_THINKING_CHATML)),
    ]


@pytest.fixture(scope="module")
def all_tokenizers() -> list[TextTokenizer]:
    return _tokenizers()


def test_fast_paths_are_on(all_tokenizers: list[TextTokenizer]) -> None:
    assert all(t._compiled is not None and t._fast_encode for t in all_tokenizers)
    assert [t.template_reads_reasoning for t in all_tokenizers] == [True, False, True, True]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(_MESSAGE, min_size=1, max_size=4), gen=st.booleans())
def test_compiled_rendering_matches_apply_chat_template(all_tokenizers, messages, gen: bool) -> None:
    for tok in all_tokenizers:
        assert tok._render_compiled(tok._compiled, messages, gen) == tok._render_reference(messages, gen)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(st.lists(_PIECES, max_size=6).map("".join), max_size=5))
def test_batch_encoding_matches_hf_encode(all_tokenizers, texts: list[str]) -> None:
    for tok in all_tokenizers:
        assert tok.encode_batch(texts) == [tok.hf.encode(t, add_special_tokens=False) for t in texts]
        for text, (ids, offsets) in zip(texts, tok.encode_with_offsets(texts), strict=True):
            assert len(offsets) == len(ids) and all(0 <= a <= b <= len(text) for a, b in offsets)


def test_reference_rendering_is_kept_when_the_probe_fails() -> None:
    template = "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{ raise_exception('no system') }}"
    template += "{%- endif -%}{{- m['content'] -}}{%- endfor -%}"
    tok = TextTokenizer(chatml_bpe(template))
    assert tok._compiled is None
    assert tok.render_chat([{"role": "user", "content": "q"}], add_generation_prompt=False) == "q"
    with pytest.raises(ValueError, match="at least one turn"):
        tok.render_chat([], add_generation_prompt=True)
