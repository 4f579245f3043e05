"""Files sources (JSONL / Parquet through ``datasets``): exact ids and loss masks of chat,
prompt/response and text rows with two tokenizers, layout detection and its errors, the mixture
(weights, epochs, per-rank shards, resume), the overlong policy and ``exclude``.

Expected ids are written out by hand: the demo tokenizer maps a printable character ``c`` to
``ord(c) - 24`` ("\\n" 7, <bos> 1, <eos> 2, <think> 4, </think> 5); the ChatML BPE of
``tests/unit/data_tokenizers.py`` maps a byte to its value, "hi" to 256, <|im_start|> 258, <|im_end|> 259.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError

from components.data import (
    DataConfig,
    FilesSource,
    Row,
    TemplateError,
    TextTokenizer,
    build_demo_tokenizer,
    describe_data,
    make_data_batch,
    mixture,
    render_rows,
)
from tests.unit.data_tokenizers import DROPS_EARLIER_REASONING_TEMPLATE, chatml_bpe


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _batch(data: DataConfig, tok: TextTokenizer, **kw):
    args = dict(batch_size=1, seq_len=48, seed=0, phase="p", step=0) | kw
    return make_data_batch(data, tok, **args)


def _positions(mask_row: torch.Tensor) -> list[int]:
    return mask_row.nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def demo() -> TextTokenizer:
    return TextTokenizer(build_demo_tokenizer())


@pytest.fixture(scope="module")
def bpe() -> TextTokenizer:
    return TextTokenizer(chatml_bpe())


@pytest.fixture(autouse=True)
def _fresh_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each test reads its own files with its own Arrow cache, and no reader cached by another test."""
    monkeypatch.setenv("STAR_ELASTIC_CACHE", str(tmp_path / "cache"))
    mixture._READERS.clear()
    mixture._PLANS.clear()
    yield


# ---------------------------------------------------------------------------------------------
# Exact ids and masks, demo tokenizer

CHAT_INLINE = {
    "messages": [
        {"role": "user", "content": "Q:1+2\n"},
        {"role": "assistant", "content": "<think>1+2=3\n</think>A:3"},
    ]
}
CHAT_FIELD = {
    "messages": [
        {"role": "user", "content": "Q:1+2\n"},
        {"role": "assistant", "reasoning_content": "1+2=3\n", "content": "A:3"},
    ]
}
# <bos> Q : 1 + 2 \n <think> | 1 + 2 = 3 \n </think> A : 3 <eos>   (targets after the "|")
CHAT_IDS = [1, 57, 34, 25, 19, 26, 7, 4, 25, 19, 26, 37, 27, 7, 5, 41, 34, 27, 2]


@pytest.mark.parametrize("row", [CHAT_INLINE, CHAT_FIELD], ids=["inline", "field"])
def test_chat_row_demo(tmp_path: Path, demo: TextTokenizer, row: dict) -> None:
    data = DataConfig(sources=[{"type": "files", "paths": [str(_jsonl(tmp_path / "c.jsonl", [row]))]}])
    batch = _batch(data, demo, seq_len=24)
    assert batch.input_ids[0].tolist() == CHAT_IDS + [0] * 5
    assert _positions(batch.loss_mask[0]) == list(range(7, 18))  # position 17 predicts <eos>


def test_prompt_response_row_demo(tmp_path: Path, demo: TextTokenizer) -> None:
    path = _jsonl(tmp_path / "pr.jsonl", [{"prompt": "Hi\n", "response": "A:1"}])
    batch = _batch(DataConfig(sources=[{"type": "files", "paths": [str(path)]}]), demo, seq_len=12)
    # <bos> H i \n <think> | </think> A : 1 <eos>: the demo's generation prompt opens the reasoning, so a
    # response without reasoning gets an empty one.
    assert batch.input_ids[0].tolist() == [1, 48, 81, 7, 4, 5, 41, 34, 25, 2, 0, 0]
    assert _positions(batch.loss_mask[0]) == [4, 5, 6, 7, 8]


def test_prompt_response_with_reasoning_and_system(tmp_path: Path, demo: TextTokenizer) -> None:
    row = {"system": "S\n", "prompt": "Q:1+2\n", "reasoning": "1+2=3\n", "response": "A:3"}
    path = _jsonl(tmp_path / "pr.jsonl", [row])
    batch = _batch(DataConfig(sources=[{"type": "files", "paths": [str(path)]}]), demo, seq_len=21)
    assert batch.input_ids[0].tolist() == [1, 59, 7] + CHAT_IDS[1:]  # "S\n" after <bos>
    assert _positions(batch.loss_mask[0]) == list(range(9, 20))


def test_text_row_demo(tmp_path: Path, demo: TextTokenizer) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "ab c"}])
    batch = _batch(DataConfig(sources=[{"type": "files", "paths": [str(path)]}]), demo, seq_len=8)
    assert batch.input_ids[0].tolist() == [1, 73, 74, 8, 75, 2, 0, 0]  # <bos> a b " " c <eos>
    assert _positions(batch.loss_mask[0]) == [0, 1, 2, 3, 4]  # every token after <bos>, <eos> included


def test_multi_turn_chat_trains_every_assistant_turn(demo: TextTokenizer) -> None:
    row = Row(
        "mt",
        messages=[
            {"role": "user", "content": "Q:1\n"},
            {"role": "assistant", "content": "A:1"},
            {"role": "user", "content": "Q:2\n"},
            {"role": "assistant", "content": "<think>x</think>A:2"},
        ],
    )
    (ex,) = render_rows(demo, [row])
    # <bos> Q : 1 \n <think> | </think> A : 1 <eos> | Q : 2 \n <think> | x </think> A : 2 <eos>
    assert ex.ids == [1, 57, 34, 25, 7, 4, 5, 41, 34, 25, 2, 57, 34, 26, 7, 4, 96, 5, 41, 34, 26, 2]
    assert [k for k, t in enumerate(ex.targets) if t] == [6, 7, 8, 9, 10, 16, 17, 18, 19, 20, 21]


# ---------------------------------------------------------------------------------------------
# Exact ids and masks, ChatML byte-level BPE (markers are token sequences, no bos)

# <|im_start|> u s e r \n hi <|im_end|> \n <|im_start|> a s s i s t a n t \n
_BPE_PROMPT = [258, 117, 115, 101, 114, 10, 256, 259, 10, 258, 97, 115, 115, 105, 115, 116, 97, 110, 116, 10]


def test_chat_row_bpe(tmp_path: Path, bpe: TextTokenizer) -> None:
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>2+2=4</think>4"}]}
    data = DataConfig(sources=[{"type": "files", "paths": [str(_jsonl(tmp_path / "c.jsonl", [row]))]}])
    batch = _batch(data, bpe, seq_len=42)
    # < t hi n k > 2 + 2 = 4 < / t hi n k > 4 <|im_end|> \n
    answer = [60, 116, 256, 110, 107, 62, 50, 43, 50, 61, 52, 60, 47, 116, 256, 110, 107, 62, 52, 259, 10]
    assert batch.input_ids[0].tolist() == _BPE_PROMPT + answer + [257]
    assert _positions(batch.loss_mask[0]) == list(range(19, 40))


def test_prompt_response_row_bpe(tmp_path: Path, bpe: TextTokenizer) -> None:
    path = _jsonl(tmp_path / "pr.jsonl", [{"prompt": "hi", "response": "4"}])
    batch = _batch(DataConfig(sources=[{"type": "files", "paths": [str(path)]}]), bpe, seq_len=23)
    assert batch.input_ids[0].tolist() == _BPE_PROMPT + [52, 259, 10]  # no empty reasoning: not primed
    assert _positions(batch.loss_mask[0]) == [19, 20, 21]


def test_text_row_bpe(tmp_path: Path, bpe: TextTokenizer) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "hi there"}])
    batch = _batch(DataConfig(sources=[{"type": "files", "paths": [str(path)]}]), bpe, seq_len=9)
    # No bos token: hi " " t h e r e <|im_end|>, then the pad <|endoftext|>.
    assert batch.input_ids[0].tolist() == [256, 32, 116, 104, 101, 114, 101, 259, 257]
    assert _positions(batch.loss_mask[0]) == [0, 1, 2, 3, 4, 5, 6]


def test_template_that_rewrites_earlier_turns_is_detected() -> None:
    tok = TextTokenizer(chatml_bpe(DROPS_EARLIER_REASONING_TEMPLATE))
    single = [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": "r", "content": "a"}]
    (ex,) = render_rows(tok, [Row("one", messages=single)])
    # < t hi n k > r < / t hi n k > a <|im_end|> \n
    targets = [i for i, t in zip(ex.ids, ex.targets, strict=True) if t]
    assert targets == [60, 116, 256, 110, 107, 62, 114, 60, 47, 116, 256, 110, 107, 62, 97, 259, 10]
    multi = single + [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    with pytest.raises(TemplateError, match=r"multi: the chat template is not prefix-stable at assistant turn 1"):
        render_rows(tok, [Row("multi", messages=multi)])


# ---------------------------------------------------------------------------------------------
# Parquet, layouts, errors


def test_parquet_rows_match_jsonl_rows(tmp_path: Path, demo: TextTokenizer) -> None:
    pq.write_table(pa.Table.from_pylist([CHAT_FIELD]), tmp_path / "chat.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "ab c"}]), tmp_path / "text.parquet")
    chat = _batch(DataConfig(sources=[{"type": "files", "paths": [str(tmp_path / "chat.parquet")]}]), demo, seq_len=19)
    assert chat.input_ids[0].tolist() == CHAT_IDS
    both = DataConfig(sources=[{"type": "files", "paths": [str(tmp_path / "*.parquet")]}])
    assert [f["layout"] for f in describe_data(both)[0]["files"]] == ["chat", "text"]  # detected per file
    texts = sorted(_texts(_batch(both, demo, batch_size=2, seq_len=19), demo))
    assert texts == ["Q:1+2\n1+2=3\nA:3", "ab c"]
    only_text = DataConfig(sources=[{"type": "files", "paths": [str(tmp_path / "*.parquet")], "format": "text"}])
    with pytest.raises(ValueError, match=r"chat\.parquet: format 'text' needs the field 'text'; the file has"):
        _batch(only_text, demo)


def test_layout_is_detected_per_file_and_columns_can_be_renamed(tmp_path: Path, demo: TextTokenizer) -> None:
    _jsonl(tmp_path / "a.jsonl", [{"conversations": CHAT_FIELD["messages"]}])
    data = DataConfig(sources=[{"type": "files", "paths": [str(tmp_path)], "columns": {"conversations": "messages"}}])
    assert _batch(data, demo, seq_len=19).input_ids[0].tolist() == CHAT_IDS
    info = describe_data(data, demo, n_rows=1)
    assert info[0]["files"] == [{"path": str(tmp_path / "a.jsonl"), "layout": "chat", "rows": 1}]
    assert info[0]["example_tokens"] == [19]


@pytest.mark.parametrize(
    ("rows", "fmt", "pattern"),
    [
        ([{"question": "q"}], "auto", r"bad\.jsonl: cannot tell the row layout from the fields \['question'\]"),
        ([{"prompt": "q"}], "auto", r"bad\.jsonl: prompt/response rows need the field 'response'"),
        ([{"text": "q"}], "chat", r"bad\.jsonl: format 'chat' needs the field 'messages'"),
        ([{"prompt": "q", "response": 3}], "auto", r"bad\.jsonl row 1: field 'response' must be a string"),
        ([{"messages": [{"content": "q"}]}], "auto", r"bad\.jsonl row 1: messages\[0\] has no string field 'role'"),
        ([{"messages": [{"role": "user", "content": "q"}]}], "auto", r"bad\.jsonl row 1: chat row has no assistant"),
        (
            [{"messages": [{"role": "assistant", "content": "a"}]}],
            "auto",
            r"bad\.jsonl row 1: the chat template failed on the first 0 messages .*at least one turn",
        ),
    ],
)
def test_errors_name_the_file_row_and_field(tmp_path: Path, demo: TextTokenizer, rows, fmt, pattern) -> None:
    data = DataConfig(sources=[{"type": "files", "paths": [str(_jsonl(tmp_path / "bad.jsonl", rows))], "format": fmt}])
    with pytest.raises(ValueError, match=pattern):
        _batch(data, demo)


def test_paths_that_match_nothing_are_named(tmp_path: Path, demo: TextTokenizer) -> None:
    (tmp_path / "notes.txt").write_text("x")
    for path in [str(tmp_path / "missing.jsonl"), str(tmp_path / "*.jsonl"), str(tmp_path)]:
        data = DataConfig(sources=[{"type": "files", "paths": [path], "name": "corpus"}])
        with pytest.raises(FileNotFoundError, match=rf"source 'corpus': path '{re.escape(path)}' matches no"):
            _batch(data, demo)
    with pytest.raises(ValidationError, match="paths"):
        FilesSource(paths=[])


def test_split_expression_selects_rows(tmp_path: Path, demo: TextTokenizer) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"text": f"row {k}"} for k in range(10)])
    data = DataConfig(sources=[{"type": "files", "paths": [str(path)], "split": "train[:30%]"}])
    batch = _batch(data, demo, batch_size=6)
    texts = sorted(demo.decode(r, skip_special=True) for r in batch.input_ids.tolist())
    assert texts == ["row 0", "row 0", "row 1", "row 1", "row 2", "row 2"]  # two epochs of three rows


# ---------------------------------------------------------------------------------------------
# The mixture: epochs, shards, resume, weights, overlong, exclude


def _texts(batch, tok: TextTokenizer) -> list[str]:
    return [tok.decode(r, skip_special=True) for r in batch.input_ids.tolist()]


@pytest.fixture
def rows30(tmp_path: Path) -> Path:
    return _jsonl(tmp_path / "rows.jsonl", [{"text": f"r{k:02d}"} for k in range(30)])


def test_every_row_once_per_epoch_in_a_fresh_order(rows30: Path, demo: TextTokenizer) -> None:
    data = DataConfig(sources=[{"type": "files", "paths": [str(rows30)]}])
    epoch = [_texts(_batch(data, demo, batch_size=10, step=s, seq_len=8), demo) for s in range(6)]
    first, second = sum(epoch[:3], []), sum(epoch[3:], [])
    assert sorted(first) == sorted(second) == [f"r{k:02d}" for k in range(30)]
    assert first != second


def test_ranks_read_disjoint_shards(rows30: Path, demo: TextTokenizer) -> None:
    data = DataConfig(sources=[{"type": "files", "paths": [str(rows30)]}])
    seen = [
        {
            t
            for s in range(2)
            for t in _texts(_batch(data, demo, batch_size=5, step=s, rank=r, world=3, seq_len=8), demo)
        }
        for r in range(3)
    ]
    assert [len(s) for s in seen] == [10, 10, 10]
    assert set.union(*seen) == {f"r{k:02d}" for k in range(30)}
    assert seen[1] == {f"r{k:02d}" for k in range(1, 30, 3)}  # rank 1 of 3: rows 1, 4, 7, ...


def test_resume_sees_exactly_the_same_batch(rows30: Path, tmp_path: Path, demo: TextTokenizer) -> None:
    chats = _jsonl(tmp_path / "chat.jsonl", [CHAT_FIELD] * 4)
    data = DataConfig(
        sources=[{"type": "files", "paths": [str(rows30)], "weight": 1}, {"type": "files", "paths": [str(chats)]}],
        pack=True,
    )
    kw = dict(batch_size=3, seq_len=64, seed=3, phase="distill2", step=7, rank=1, world=2)
    before = _batch(data, demo, **kw)
    mixture._READERS.clear()
    mixture._PLANS.clear()
    after = _batch(data, demo, **kw)
    assert torch.equal(before.input_ids, after.input_ids) and torch.equal(before.loss_mask, after.loss_mask)
    assert before.source_examples == after.source_examples and before.n_examples > 3


def test_weights_seventy_thirty(rows30: Path, tmp_path: Path, demo: TextTokenizer) -> None:
    chats = _jsonl(tmp_path / "chat.jsonl", [CHAT_FIELD] * 7)
    data = DataConfig(
        sources=[
            {"type": "files", "paths": [str(chats)], "weight": 0.7, "name": "traces"},
            {"type": "files", "paths": [str(rows30)], "weight": 0.3, "name": "text"},
        ]
    )
    counts = {"traces": 0, "text": 0}
    for step in range(27):  # 999 slots
        for name, n in _batch(data, demo, batch_size=37, step=step, seq_len=24).source_examples.items():
            counts[name] += n
    assert abs(counts["traces"] - 699.3) <= 1 and counts["traces"] + counts["text"] == 999


def test_mix_by_tokens(rows30: Path, tmp_path: Path, demo: TextTokenizer) -> None:
    chats = _jsonl(tmp_path / "chat.jsonl", [CHAT_FIELD] * 7)  # 19 tokens per example; text rows: 5
    sources = [
        {"type": "files", "paths": [str(chats)], "weight": 0.5, "name": "traces"},
        {"type": "files", "paths": [str(rows30)], "weight": 0.5, "name": "text"},
    ]
    tokens = {"traces": 0, "text": 0}
    examples = {"traces": 0, "text": 0}
    for step in range(10):
        batch = _batch(DataConfig(sources=sources, mix_by="tokens"), demo, batch_size=100, step=step, seq_len=24)
        for name in tokens:
            tokens[name] += batch.source_tokens[name]
            examples[name] += batch.source_examples[name]
    assert examples == {"traces": 208, "text": 792}  # 1000 * (1/19) / (1/19 + 1/5), largest remainder
    assert abs(tokens["traces"] / (tokens["traces"] + tokens["text"]) - 0.5) < 0.01


def test_overlong_policy_in_a_stream(tmp_path: Path, demo: TextTokenizer) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "x" * 20}, {"text": "y"}])
    for policy, word in [("truncate", "truncated"), ("drop", "left out")]:
        data = DataConfig(sources=[{"type": "files", "paths": [str(path)]}], overlong=policy)
        with pytest.warns(UserWarning, match=rf"2 of 4 examples are longer than seq_len=8 and were {word}"):
            batch = _batch(data, demo, batch_size=4, seq_len=8)
        assert (batch.n_truncated, batch.n_dropped) == ((2, 0) if policy == "truncate" else (0, 2))
        assert batch.n_examples == (4 if policy == "truncate" else 2)


@pytest.mark.parametrize("layout", ["prompt_response", "chat"])
def test_exclude_removes_rows_by_user_turn(tmp_path: Path, demo: TextTokenizer, layout: str) -> None:
    if layout == "chat":
        rows = [
            {"messages": [{"role": "user", "content": f"Q:{k}\n"}, {"role": "assistant", "content": "A:0"}]}
            for k in range(6)
        ]
    else:
        rows = [{"prompt": f"Q:{k}\n", "response": "A:0"} for k in range(6)]
    data = DataConfig(sources=[{"type": "files", "paths": [str(_jsonl(tmp_path / "rows.jsonl", rows))]}])
    batch = _batch(data, demo, batch_size=12, seq_len=16, exclude={"Q:1\n", "Q:4\n"})
    prompts = {t.split("\n")[0] for t in _texts(batch, demo)}
    assert prompts == {"Q:0", "Q:2", "Q:3", "Q:5"}
    with pytest.raises(ValueError, match="gets no rows"):
        _batch(data, demo, exclude={f"Q:{k}\n" for k in range(6)})


def test_template_failure_names_the_row() -> None:
    template = "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{ raise_exception('no system role') }}"
    template += "{%- endif -%}{{- m['content'] -}}{%- endfor -%}"
    tok = TextTokenizer(chatml_bpe(template))
    row = Row("f.jsonl row 3", messages=[{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}])
    with pytest.raises(
        ValueError, match=r"f\.jsonl row 3: the chat template failed on the first 2 messages .*no system"
    ):
        render_rows(tok, [row])


# ---------------------------------------------------------------------------------------------
# Streaming files sources


def _stream_texts(data: DataConfig, tok: TextTokenizer, steps: range, **kw) -> list[str]:
    return [t for s in steps for t in _texts(_batch(data, tok, step=s, seq_len=8, **kw), tok)]


@pytest.mark.parametrize("n_files", [1, 3])
def test_streaming_epochs_and_disjoint_ranks(tmp_path: Path, demo: TextTokenizer, n_files: int) -> None:
    for f in range(n_files):  # 30 rows in all
        _jsonl(tmp_path / f"part-{f}.jsonl", [{"text": f"r{k:02d}"} for k in range(f, 30, n_files)])
    source = {"type": "files", "paths": [str(tmp_path / "*.jsonl")], "streaming": True, "shuffle_buffer": 4}
    data = DataConfig(sources=[source])
    first, second = (
        _stream_texts(data, demo, range(3), batch_size=10),
        _stream_texts(data, demo, range(3, 6), batch_size=10),
    )
    assert sorted(first) == sorted(second) == [f"r{k:02d}" for k in range(30)]
    assert first != second and first != sorted(first)  # shuffled, differently per epoch
    # 3 ranks: by files when there are 3 files, by row position (every rank reads everything) with 1.
    seen = [set(_stream_texts(data, demo, range(2), batch_size=5, rank=r, world=3)) for r in range(3)]
    assert [len(s) for s in seen] == [10, 10, 10] and set.union(*seen) == {f"r{k:02d}" for k in range(30)}


def test_streaming_resume_and_restart_are_exact(tmp_path: Path, demo: TextTokenizer) -> None:
    _jsonl(tmp_path / "rows.jsonl", [{"text": f"r{k:02d}"} for k in range(30)])
    data = DataConfig(sources=[{"type": "files", "paths": [str(tmp_path / "rows.jsonl")], "streaming": True}])
    sequential = [_texts(_batch(data, demo, batch_size=7, step=s, seq_len=8), demo) for s in range(10)]
    mixture._READERS.clear()
    mixture._PLANS.clear()
    assert _texts(_batch(data, demo, batch_size=7, step=9, seq_len=8), demo) == sequential[9]  # fresh process at step 9
    assert _texts(_batch(data, demo, batch_size=7, step=2, seq_len=8), demo) == sequential[2]  # going back replays
    info = describe_data(data)
    assert info[0]["files"] == [{"path": str(tmp_path / "rows.jsonl"), "layout": "text"}]
    assert not (tmp_path / "cache" / "datasets").exists() or not any((tmp_path / "cache" / "datasets").rglob("*.arrow"))


def test_streaming_exclude_and_errors(tmp_path: Path, demo: TextTokenizer) -> None:
    rows = [{"prompt": f"Q:{k}\n", "response": "A:0"} for k in range(6)]
    path = str(_jsonl(tmp_path / "pr.jsonl", rows))
    data = DataConfig(sources=[{"type": "files", "paths": [path], "streaming": True}])
    texts = _texts(_batch(data, demo, batch_size=12, seq_len=16, exclude={"Q:1\n", "Q:4\n"}), demo)
    assert {t.split("\n")[0] for t in texts} == {"Q:0", "Q:2", "Q:3", "Q:5"}
    with pytest.raises(ValueError, match="gets no rows"):
        _batch(data, demo, exclude={f"Q:{k}\n" for k in range(6)})
    sliced = DataConfig(sources=[{"type": "files", "paths": [path], "streaming": True, "split": "train[:50%]"}])
    with pytest.raises(ValueError, match="streaming: false"):
        _batch(sliced, demo)
