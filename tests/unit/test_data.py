"""Unit tests of the built-in demo data: generator, tokenizer, JSONL, answers, batches."""

from __future__ import annotations

import json
import re
import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from components.data import (
    BOS,
    EOS,
    THINK_CLOSE,
    THINK_OPEN,
    CharTokenizer,
    Problem,
    ProblemConfig,
    batch_stream,
    build_tokenizer,
    check_trace,
    encode_examples,
    eval_prompts,
    extract_answer,
    format_prompt,
    format_training_text,
    generate_eval_sets,
    generate_problems,
    is_correct,
    load_jsonl,
    load_tokenizer,
    make_batch,
    pack_examples,
    save_jsonl,
)
from components.data.gym import gym_available, reasoning_gym_problems

# ---------------------------------------------------------------------------------------------
# An independent checker (does not reuse the generator's arithmetic).


def _left_to_right(expr: str, modulus: int) -> int:
    tokens = re.findall(r"\d|[+\-*]", expr)
    assert "".join(tokens) == expr, expr
    value = int(tokens[0])
    for op, x in zip(tokens[1::2], tokens[2::2], strict=True):
        value = {"+": value + int(x), "-": value - int(x), "*": value * int(x)}[op] % modulus
    return value % modulus


def _verify(problem: Problem, modulus: int = 10) -> list[int]:
    """Assert the trace and answer are right; returns the number of steps per trace line."""
    assert problem.prompt.startswith("Q:") and problem.prompt.endswith("\n")
    chain = problem.prompt[2:-1]
    assert len(chain) == 2 * problem.steps + 1
    assert problem.answer == str(_left_to_right(chain, modulus))
    widths: list[int] = []
    if not problem.reasoning:
        return widths
    assert problem.reasoning.endswith("\n")
    covered = chain[0]
    current = chain[0]
    for line in problem.reasoning[:-1].split("\n"):
        lhs, rhs = line.split("=")
        assert lhs.startswith(current), (line, problem)
        assert int(rhs) == _left_to_right(lhs, modulus), line
        covered += lhs[len(current) :]
        widths.append((len(lhs) - 1) // 2)
        current = rhs
    assert covered == chain, problem
    assert current == problem.answer
    return widths


# ---------------------------------------------------------------------------------------------
# Generator


def test_generation_is_deterministic_by_seed() -> None:
    cfg = ProblemConfig()
    assert generate_problems(200, cfg, seed=7) == generate_problems(200, cfg, seed=7)
    assert generate_problems(200, cfg, seed=7) != generate_problems(200, cfg, seed=8)
    # The first k problems do not depend on n.
    assert generate_problems(50, cfg, seed=7) == generate_problems(200, cfg, seed=7)[:50]


@pytest.mark.parametrize("modulus", [2, 7, 10])
def test_traces_and_answers_are_correct(modulus: int) -> None:
    cfg = ProblemConfig(modulus=modulus, fold_prob=0.4, direct_prob=0.1)
    problems = generate_problems(1500, cfg, seed=modulus)
    for p in problems:
        _verify(p, modulus)
        assert check_trace(p, modulus)
        assert p.source == "modarith"
        assert all(c.isdigit() and int(c) < modulus for c in p.prompt[2:-1:2])


def test_check_trace_rejects_wrong_traces() -> None:
    good = Problem("Q:7+5*3-2\n", "7+5=2\n2*3=6\n6-2=4\n", "4", 3)
    assert check_trace(good)
    assert not check_trace(Problem(good.prompt, good.reasoning, "5", 3))
    assert not check_trace(Problem(good.prompt, "7+5=2\n2*3=7\n7-2=5\n", "4", 3))  # wrong line
    assert not check_trace(Problem(good.prompt, "7+5=2\n2*3=6\n", "4", 3))  # step missing
    assert not check_trace(Problem(good.prompt, "7+5*3=6\n6-2=4", "4", 3))  # no final newline
    assert check_trace(Problem(good.prompt, "7+5*3=6\n6-2=4\n", "4", 3))
    assert check_trace(Problem(good.prompt, "", "4", 3))


def test_steps_range_is_respected() -> None:
    cfg = ProblemConfig(min_steps=2, max_steps=4)
    problems = generate_problems(600, cfg, seed=1)
    assert {p.steps for p in problems} == {2, 3, 4}
    for p in problems:
        assert len(p.prompt) == len("Q:\n") + 1 + 2 * p.steps


def test_fold_knob() -> None:
    unfolded = generate_problems(300, ProblemConfig(fold_prob=0.0, direct_prob=0.0), seed=3)
    for p in unfolded:
        assert _verify(p) == [1] * p.steps
    folded = generate_problems(300, ProblemConfig(min_steps=2, fold_prob=1.0, direct_prob=0.0), seed=3)
    all_widths = []
    for p in folded:
        widths = _verify(p)
        # Every line folds while at least two steps remain; only a lone last step stays single.
        assert all(w in (2, 3) for w in widths[:-1]) and widths[-1] in (1, 2, 3)
        if p.steps >= 2 and sum(widths[:-1]) != p.steps - 1:
            assert widths[-1] >= 2
        all_widths += widths
    assert 3 in all_widths and 2 in all_widths


def test_direct_knob() -> None:
    assert all(p.reasoning for p in generate_problems(300, ProblemConfig(direct_prob=0.0), seed=4))
    direct = generate_problems(300, ProblemConfig(direct_prob=1.0), seed=4)
    assert all(p.reasoning == "" for p in direct)
    assert all(_verify(p) == [] for p in direct)
    some = generate_problems(3000, ProblemConfig(direct_prob=0.1), seed=4)
    frac = sum(p.reasoning == "" for p in some) / len(some)
    assert 0.07 < frac < 0.13
    text = format_training_text(direct[0])
    assert THINK_OPEN + THINK_CLOSE + "A:" in text


def test_text_layout() -> None:
    p = Problem("Q:7+5*3-2\n", "7+5*3=6\n6-2=4\n", "4", 3)
    assert format_prompt(p) == "<bos>Q:7+5*3-2\n<think>"
    assert format_training_text(p) == "<bos>Q:7+5*3-2\n<think>7+5*3=6\n6-2=4\n</think>A:4<eos>"
    assert format_training_text(p).startswith(format_prompt(p))


def test_config_validation_names_fields() -> None:
    with pytest.raises(ValidationError, match="modulus"):
        ProblemConfig(modulus=11)
    with pytest.raises(ValidationError, match="modulus"):
        ProblemConfig(modulus=1)
    with pytest.raises(ValidationError, match=r"min_steps.*max_steps"):
        ProblemConfig(min_steps=5, max_steps=3)
    with pytest.raises(ValidationError, match="operators"):
        ProblemConfig(operators=["/"])
    with pytest.raises(ValidationError, match="fold_prob"):
        ProblemConfig(fold_prob=1.5)
    with pytest.raises(ValidationError, match="direct_prob"):
        ProblemConfig(direct_prob=-0.1)
    with pytest.raises(ValidationError, match="steps_max"):
        ProblemConfig(steps_max=3)  # extra fields are forbidden
    for name, field in ProblemConfig.model_fields.items():
        assert field.description, name


def test_eval_sets_are_canonical_deterministic_and_held_out() -> None:
    cfg = ProblemConfig(fold_prob=0.5, direct_prob=0.5)
    sets = generate_eval_sets([1, 3, 8], 100, seed=0, config=cfg)
    assert sets == generate_eval_sets([1, 3, 8], 100, seed=0, config=cfg)
    # A level does not depend on which other levels are requested.
    assert generate_eval_sets([3], 100, seed=0, config=cfg)[3] == sets[3]
    for level, problems in sets.items():
        assert len(problems) == 100
        for p in problems:
            assert p.steps == level  # 8 > max_steps: length generalisation is allowed
            assert _verify(p) == [1] * level
    # Held-out stream differs from the training stream at the same seed.
    assert generate_problems(50, cfg, 0, held_out=True) != generate_problems(50, cfg, 0)
    # With 6 steps the space is huge: independent streams share nothing.
    train6 = generate_problems(2000, ProblemConfig(min_steps=6), seed=0)
    eval6 = generate_eval_sets([6], 2000, seed=0)[6]
    assert not {p.prompt for p in train6} & {p.prompt for p in eval6}
    # Small levels collide by chance; exclusion makes training strictly disjoint.
    banned = eval_prompts(sets)
    train = generate_problems(3000, ProblemConfig(max_steps=3), seed=0, exclude=banned)
    assert not {p.prompt for p in train} & banned
    with pytest.raises(ValueError, match="level"):
        generate_eval_sets([0], 5, seed=0)


def test_exclude_that_covers_everything_raises() -> None:
    cfg = ProblemConfig(min_steps=1, max_steps=1, modulus=2, operators=["+"])
    everything = {f"Q:{a}+{b}\n" for a in range(2) for b in range(2)}
    with pytest.raises(ValueError, match="exclude"):
        generate_problems(1, cfg, seed=0, exclude=everything)


# ---------------------------------------------------------------------------------------------
# Tokenizer


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer()


def test_tokenizer_ids_are_pinned(tok: CharTokenizer) -> None:
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert (tok.think_open_id, tok.think_close_id) == (4, 5)
    assert tok.encode("\t\n 0A:Q~") == [6, 7, 8, 24, 41, 34, 57, 102]
    assert tok.vocab_size == 112 and tok.vocab_size % 16 == 0
    assert build_tokenizer().to_str() == build_tokenizer().to_str()


def test_special_tokens_are_single_tokens(tok: CharTokenizer) -> None:
    for text, i in [(THINK_OPEN, 4), (THINK_CLOSE, 5), (BOS, 1), (EOS, 2)]:
        assert tok.encode(text) == [i]
    ids = tok.encode("a<think>b</think>c")
    assert ids == [tok.encode("a")[0], 4, tok.encode("b")[0], 5, tok.encode("c")[0]]
    assert tok.decode(ids, skip_special=True) == "abc"
    assert tok.encode("<think") == tok.encode("<") + tok.encode("think")


def test_unknown_characters_map_to_unk(tok: CharTokenizer) -> None:
    assert tok.encode("é€\r") == [tok.unk_id] * 3
    assert tok.decode(tok.encode("aéb")) == "a<unk>b"


def test_round_trip_generated_texts(tok: CharTokenizer) -> None:
    problems = generate_problems(300, ProblemConfig(), seed=5)
    texts = [format_training_text(p) for p in problems]
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids) == text
        assert tok.encode(tok.decode(ids)) == ids
        assert ids == tok.tokenizer.encode(text, add_special_tokens=False).ids  # fast path == HF


_ALPHABET = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")
_TEXT = st.lists(
    st.one_of(st.text(alphabet=_ALPHABET, max_size=20), st.sampled_from([THINK_OPEN, THINK_CLOSE, BOS, EOS])),
    max_size=8,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_round_trip_arbitrary_printable(tok: CharTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.unk_id not in ids
    assert tok.decode(ids) == text
    assert tok.encode(tok.decode(ids)) == ids


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_fast_path_matches_tokenizers_on_any_text(tok: CharTokenizer, text: str) -> None:
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_tokenizer_save_load(tok: CharTokenizer, tmp_path) -> None:
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["special_token_ids"] == {
        "<pad>": 0,
        "<bos>": 1,
        "<eos>": 2,
        "<unk>": 3,
        "<think>": 4,
        "</think>": 5,
    }
    assert config["vocab_size"] == 112
    loaded = CharTokenizer.load(tmp_path)
    assert loaded.tokenizer.get_vocab() == tok.tokenizer.get_vocab()
    text = format_training_text(generate_problems(1, ProblemConfig(), seed=0)[0])
    assert loaded.encode(text) == tok.encode(text)
    assert load_tokenizer(tmp_path).to_str() == tok.tokenizer.to_str()
    config["special_token_ids"]["<bos>"] = 9
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="<bos>"):
        load_tokenizer(tmp_path)


def test_saved_tokenizer_loads_in_transformers(tok: CharTokenizer, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = format_training_text(generate_problems(1, ProblemConfig(), seed=2)[0])
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    assert hf.decode(tok.encode(text)) == text


# ---------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_round_trip(tmp_path) -> None:
    problems = generate_problems(50, ProblemConfig(), seed=9)
    path = save_jsonl(problems, tmp_path / "sub" / "data.jsonl")
    assert load_jsonl(path) == problems


def test_jsonl_lenient_parts(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    lines = [
        json.dumps({"prompt": "Q:1+1\n", "reasoning": "", "answer": "2", "extra": [1, 2]}),
        "",
        "   ",
        json.dumps({"prompt": "What is 6*7?", "answer": 42}),
    ]
    path.write_text("\n".join(lines) + "\n")
    a, b = load_jsonl(path)
    assert a == Problem("Q:1+1\n", "", "2", 0, "jsonl:x.jsonl")
    assert b.reasoning == "" and b.answer == "42"


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        ({"prompt": "Q", "reasoning": ""}, r"x\.jsonl:3: missing field 'answer'"),
        ({"prompt": 5, "answer": "1"}, r"x\.jsonl:3: field 'prompt' must be a string"),
        ({"prompt": "Q", "reasoning": ["a"], "answer": "1"}, r"x\.jsonl:3: field 'reasoning'"),
        ({"prompt": "Q", "answer": "1", "steps": "two"}, r"x\.jsonl:3: field 'steps'"),
        ([1, 2], r"x\.jsonl:3: expected a JSON object"),
        ("{not json", r"x\.jsonl:3: invalid JSON"),
    ],
)
def test_jsonl_bad_line_names_file_line_and_field(tmp_path, bad, pattern: str) -> None:
    good = json.dumps({"prompt": "Q:1\n", "reasoning": "", "answer": "1"})
    bad_line = bad if isinstance(bad, str) else json.dumps(bad)
    path = tmp_path / "x.jsonl"
    path.write_text(f"{good}\n\n{bad_line}\n")
    with pytest.raises(ValueError, match=pattern):
        load_jsonl(path)


# ---------------------------------------------------------------------------------------------
# Answers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<bos>Q:7+5\n<think>7+5=2\n</think>A:2<eos>", "2"),
        ("7+5=2\n</think>A:2<eos><pad><pad>", "2"),
        ("</think>A : 4", "4"),
        ("</think>A:  4  <eos>", "4"),
        ("</think>A:4", "4"),  # no <eos>
        ("</think>A:4<eos>A:9 junk", "4"),
        ("</think>A:4\nQ:1+1\n", "4"),
        ("</think>A:-3<eos>", "-3"),
        ("</think>A:12<think>", "12"),
        ("A:7", "7"),  # no think tags at all
        ("<think>1+1=2\nA:3 is wrong\n</think>A:5<eos>", "5"),  # A: inside the trace is ignored
        ("</think>the result is 6-2 then 8<eos>", "8"),  # no A: -> last integer after the close
        ("</think>done 6-2", "2"),  # '-' between digits is an operator, not a sign
        ("<think>3+4=7\n6*2=2\n", "2"),  # no close, no A: -> last integer of the whole text
        ("</think>A:<eos>", None),
        ("</think>A:   ", None),
        ("<think>7+5=2\n</think>no answer here", None),
        ("", None),
        ("</think>DATA: x", None),
        ("</think>A:yes", "yes"),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_extract_answer_never_raises() -> None:
    for junk in ["<", "</think", "A", "A:", ":::", "</think></think>", "\x00\n", None, 3]:
        extract_answer(junk)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pred", "answer", "ok"),
    [
        ("4", "4", True),
        (" 4 ", "4", True),
        ("04", "4", True),
        ("+4", "4", True),
        ("5", "4", False),
        (None, "4", False),
        ("a  b", "a b", True),
        ("yes", "Yes", False),
        ("", "4", False),
    ],
)
def test_is_correct(pred: str | None, answer: str, ok: bool) -> None:
    assert is_correct(pred, answer) is ok


# ---------------------------------------------------------------------------------------------
# Batches

_P1 = Problem("Q:1+2\n", "1+2=3\n", "3", 1)  # 19 tokens, context (bos + prompt) = 7
_P2 = Problem("Q:3\n", "", "3", 0)  # 11 tokens, context = 5


def _positions(mask_row: torch.Tensor) -> list[int]:
    return mask_row.nonzero().flatten().tolist()


def test_encode_examples_hand_checked(tok: CharTokenizer) -> None:
    batch = encode_examples([_P1, _P2], tok, seq_len=24)
    assert batch.input_ids.shape == batch.loss_mask.shape == (2, 24)
    assert batch.input_ids.dtype == torch.long and batch.loss_mask.dtype == torch.bool
    row0 = tok.encode(format_training_text(_P1))
    assert len(row0) == 19
    assert batch.input_ids[0].tolist() == row0 + [tok.pad_id] * 5
    # Position 6 holds "\n" and predicts <think>; position 17 holds "3" and predicts <eos>.
    assert _positions(batch.loss_mask[0]) == list(range(6, 18))
    assert batch.input_ids[0, 7].item() == tok.think_open_id
    assert _positions(batch.loss_mask[1]) == list(range(4, 10))
    assert batch.segment_ids[1].tolist() == [0] * 11 + [-1] * 13
    assert batch.n_examples == 2 and batch.n_truncated == 0
    targets = batch.targets
    assert targets[0, 17].item() == tok.eos_id and targets[0, 6].item() == tok.think_open_id


def test_encode_examples_truncates_and_warns(tok: CharTokenizer) -> None:
    with pytest.warns(UserWarning, match="1 of 2 examples"):
        batch = encode_examples([_P1, _P2], tok, seq_len=12)
    assert batch.n_truncated == 1
    assert batch.input_ids[0].tolist() == tok.encode(format_training_text(_P1))[:12]
    assert _positions(batch.loss_mask[0]) == list(range(6, 11))  # last position has no next token
    assert _positions(batch.loss_mask[1]) == list(range(4, 10))


def test_pack_examples_hand_checked(tok: CharTokenizer) -> None:
    batch = pack_examples([_P1, _P2, _P1], tok, seq_len=32)
    assert batch.input_ids.shape == (2, 32)
    ids = tok.encode(format_training_text(_P1)) + tok.encode(format_training_text(_P2))
    assert batch.input_ids[0].tolist() == ids + [tok.pad_id] * 2
    # Position 18 is the first example's <eos>: predicting the next <bos> is not a target.
    assert _positions(batch.loss_mask[0]) == list(range(6, 18)) + list(range(23, 29))
    assert batch.segment_ids[0].tolist() == [0] * 19 + [1] * 11 + [-1] * 2
    assert _positions(batch.loss_mask[1]) == list(range(6, 18))
    assert batch.n_examples == 3
    assert (batch.input_ids == tok.bos_id).sum().item() == 3


def test_make_batch_and_stream_are_deterministic_and_resumable(tok: CharTokenizer) -> None:
    cfg = ProblemConfig()
    b3 = make_batch(cfg, tok, batch_size=8, seq_len=64, seed=11, index=3)
    assert torch.equal(b3.input_ids, make_batch(cfg, tok, 8, 64, 11, 3).input_ids)
    assert not torch.equal(b3.input_ids, make_batch(cfg, tok, 8, 64, 11, 4).input_ids)
    assert not torch.equal(b3.input_ids, make_batch(cfg, tok, 8, 64, 12, 3).input_ids)
    stream = batch_stream(cfg, tok, batch_size=8, seq_len=64, seed=11)
    first = [next(stream) for _ in range(5)]
    assert torch.equal(first[3].input_ids, b3.input_ids)
    resumed = batch_stream(cfg, tok, 8, 64, seed=11).skip(3)
    assert torch.equal(next(resumed).input_ids, b3.input_ids)
    assert torch.equal(next(batch_stream(cfg, tok, 8, 64, 11, start=4)).input_ids, first[4].input_ids)
    assert (b3.input_ids[:, 0] == tok.bos_id).all()


def test_packed_batches_fill_rows(tok: CharTokenizer) -> None:
    cfg = ProblemConfig()
    batch = make_batch(cfg, tok, batch_size=4, seq_len=256, seed=0, index=0, pack=True)
    assert batch.input_ids.shape == (4, 256)
    assert batch.n_examples == (batch.input_ids == tok.bos_id).sum().item() > 4 * 256 // 70
    # Unused tail of each row is shorter than one example.
    assert ((batch.input_ids == tok.pad_id).sum(dim=1) < 70).all()
    again = next(batch_stream(cfg, tok, 4, 256, seed=0, pack=True))
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.loss_mask, batch.loss_mask)
    # Every masked position predicts a token of the same example.
    seg = batch.segment_ids
    assert (seg[:, :-1][batch.loss_mask[:, :-1]] == seg[:, 1:][batch.loss_mask[:, :-1]]).all()
    assert not batch.loss_mask[:, -1].any()


def test_batches_respect_exclude(tok: CharTokenizer) -> None:
    cfg = ProblemConfig(min_steps=1, max_steps=1, modulus=3)
    everything = sorted(f"Q:{a}{op}{b}\n" for a in range(3) for op in "+-*" for b in range(3))
    banned, allowed = set(everything[::2]), set(everything[1::2])
    batch = make_batch(cfg, tok, 16, 32, seed=0, index=0, exclude=banned)
    texts = [tok.decode(row, skip_special=True) for row in batch.input_ids.tolist()]
    assert all(t.split("\n")[0] + "\n" in allowed for t in texts)


# ---------------------------------------------------------------------------------------------
# Optional reasoning_gym source


def test_gym_source_reports_missing_package() -> None:
    if gym_available():
        pytest.skip("reasoning_gym is installed")
    with pytest.raises(ImportError, match="reasoning-gym"):
        reasoning_gym_problems("leg_counting", 2, seed=0)


@pytest.mark.skipif(not gym_available(), reason="reasoning_gym is not installed")
def test_gym_source_problems() -> None:
    problems = reasoning_gym_problems("leg_counting", 5, seed=0)
    assert len(problems) == 5 and problems == reasoning_gym_problems("leg_counting", 5, seed=0)
    for p in problems:
        assert p.prompt.startswith("Q:") and p.prompt.endswith("\n") and p.answer
        assert extract_answer(f"</think>A:{p.answer}<eos>") == p.answer
