"""Unit tests of the built-in generator, chat rendering of generated problems, batch assembly and the
deterministic stream of make_data_batch (generator sources; files sources: test_data_sources.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from components.data import (
    DataConfig,
    Example,
    GeneratorSource,
    Problem,
    ProblemConfig,
    Row,
    TextTokenizer,
    assemble_batch,
    build_demo_tokenizer,
    check_trace,
    derive_seed,
    eval_prompts,
    generate_eval_sets,
    generate_problems,
    make_batch,
    make_data_batch,
    mixture,
    problem_messages,
    problem_rows,
    read_jsonl,
    render_rows,
    write_jsonl,
)
from components.data.gym import GymReader, reasoning_gym_problems
from components.data.jsonl import iter_jsonl
from components.data.sources import BoundedCache, GeneratorReader, ReasoningGymSource, gym_available

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
    tok = TextTokenizer(build_demo_tokenizer())
    assert "<think></think>A:" in tok.render_chat(problem_messages(direct[0]), add_generation_prompt=False)


def test_text_layout() -> None:
    """A generated problem through the demo chat template is exactly the historical training text
    ``<bos>`` prompt ``<think>`` trace ``</think>A:`` answer ``<eos>``, with the same ids."""
    tok = TextTokenizer(build_demo_tokenizer())
    p = Problem("Q:7+5*3-2\n", "7+5*3=6\n6-2=4\n", "4", 3)
    assert tok.render_chat(problem_messages(p), add_generation_prompt=False) == (
        "<bos>Q:7+5*3-2\n<think>7+5*3=6\n6-2=4\n</think>A:4<eos>"
    )
    assert tok.render_chat(problem_messages(p)[:1], add_generation_prompt=True) == "<bos>Q:7+5*3-2\n<think>"
    (ex,) = render_rows(tok, [Row("p", messages=problem_messages(p))])
    # <bos> Q : 7 + 5 * 3 - 2 \n <think> 7 + 5 * 3 = 6 \n 6 - 2 = 4 \n </think> A : 4 <eos>
    assert ex.ids == [1, 57, 34, 31, 19, 29, 18, 27, 21, 26, 7, 4] + [
        31,
        19,
        29,
        18,
        27,
        37,
        30,
        7,
        30,
        21,
        26,
        37,
        28,
        7,
        5,
        41,
        34,
        28,
        2,
    ]
    # Targets: everything after the generation prompt "<bos>Q:7+5*3-2\n<think>" (12 tokens).
    assert ex.targets == [False] * 12 + [True] * 19


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
# Batch assembly (demo tokenizer ids: printable c -> ord(c) - 24, "\n" 7, <bos> 1, <eos> 2, <think> 4, </think> 5)


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer(build_demo_tokenizer())


# "<bos>Q:1+2\n<think>1+2=3\n</think>A:3<eos>": 19 tokens, the generation prompt is the first 8.
_P1 = Problem("Q:1+2\n", "1+2=3\n", "3", 1)
_P1_IDS = [1, 57, 34, 25, 19, 26, 7, 4, 25, 19, 26, 37, 27, 7, 5, 41, 34, 27, 2]
# "<bos>Q:3\n<think></think>A:3<eos>": 11 tokens, the generation prompt is the first 6.
_P2 = Problem("Q:3\n", "", "3", 0)
_P2_IDS = [1, 57, 34, 27, 7, 4, 5, 41, 34, 27, 2]


def _examples(tok: TextTokenizer, *problems: Problem) -> list[Example]:
    examples = render_rows(tok, [Row(f"p{k}", messages=problem_messages(p)) for k, p in enumerate(problems)])
    for ex in examples:
        ex.source = "gen"
    return examples


def _positions(mask_row: torch.Tensor) -> list[int]:
    return mask_row.nonzero().flatten().tolist()


def test_rendered_problems_have_the_expected_ids_and_targets(tok: TextTokenizer) -> None:
    a, b = _examples(tok, _P1, _P2)
    assert a.ids == _P1_IDS and a.targets == [False] * 8 + [True] * 11
    assert b.ids == _P2_IDS and b.targets == [False] * 6 + [True] * 5


def test_one_example_per_row_hand_checked(tok: TextTokenizer) -> None:
    batch = assemble_batch(_examples(tok, _P1, _P2), batch_size=2, seq_len=24, pad_id=tok.pad_id)
    assert batch.input_ids.shape == batch.loss_mask.shape == batch.segment_ids.shape == (2, 24)
    assert batch.input_ids.dtype == torch.long and batch.loss_mask.dtype == torch.bool
    assert batch.input_ids[0].tolist() == _P1_IDS + [0] * 5
    # Position 7 holds <think> and predicts the first trace token; position 17 holds "3" and predicts <eos>.
    assert _positions(batch.loss_mask[0]) == list(range(7, 18))
    assert batch.input_ids[1].tolist() == _P2_IDS + [0] * 13
    assert _positions(batch.loss_mask[1]) == list(range(5, 10))
    assert batch.segment_ids[1].tolist() == [0] * 11 + [-1] * 13
    assert (batch.n_examples, batch.n_truncated, batch.n_dropped, batch.n_skipped) == (2, 0, 0, 0)
    assert batch.source_examples == {"gen": 2} and batch.source_tokens == {"gen": 30}
    assert batch.targets[0, 17].item() == 2 and batch.targets[0, 7].item() == 25
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.source_tokens == {"gen": 30}


def test_overlong_truncate_is_counted_and_warned(tok: TextTokenizer) -> None:
    with pytest.warns(UserWarning, match=r"1 of 2 examples are longer than seq_len=12 and were truncated"):
        batch = assemble_batch(_examples(tok, _P1, _P2), 2, 12, tok.pad_id, overlong="truncate")
    assert (batch.n_truncated, batch.n_dropped, batch.n_examples) == (1, 0, 2)
    assert batch.input_ids[0].tolist() == _P1_IDS[:12]
    assert _positions(batch.loss_mask[0]) == [7, 8, 9, 10]  # the last position has no next token
    assert _positions(batch.loss_mask[1]) == list(range(5, 10))


def test_overlong_drop_is_counted_and_warned(tok: TextTokenizer) -> None:
    with pytest.warns(UserWarning, match=r"1 of 2 examples are longer than seq_len=12 and were left out"):
        batch = assemble_batch(_examples(tok, _P1, _P2), 2, 12, tok.pad_id, overlong="drop")
    assert (batch.n_truncated, batch.n_dropped, batch.n_examples) == (0, 1, 1)
    assert batch.input_ids[0].tolist() == [0] * 12 and not batch.loss_mask[0].any()
    assert batch.input_ids[1].tolist() == _P2_IDS + [0]


def test_packing_hand_checked(tok: TextTokenizer) -> None:
    batch = assemble_batch(_examples(tok, _P1, _P2, _P1), 2, 32, tok.pad_id, pack=True)
    assert batch.input_ids[0].tolist() == _P1_IDS + _P2_IDS + [0, 0]
    # Position 18 is the first example's <eos>: predicting the next <bos> is not a target.
    assert _positions(batch.loss_mask[0]) == list(range(7, 18)) + list(range(24, 29))
    assert batch.segment_ids[0].tolist() == [0] * 19 + [1] * 11 + [-1] * 2
    assert batch.input_ids[1].tolist() == _P1_IDS + [0] * 13
    assert batch.n_examples == 3 and batch.n_skipped == 0
    # First fit: the short example goes back into the first row, which still has room.
    batch = assemble_batch(_examples(tok, _P1, _P1, _P2), 2, 32, tok.pad_id, pack=True)
    assert batch.input_ids[0].tolist() == _P1_IDS + _P2_IDS + [0, 0]
    # One row: the examples that fit nowhere are skipped and counted.
    batch = assemble_batch(_examples(tok, _P1, _P1, _P2), 1, 32, tok.pad_id, pack=True)
    assert batch.n_examples == 2 and batch.n_skipped == 1
    with pytest.raises(ValueError, match="batch_size=3"):
        assemble_batch(_examples(tok, _P1), 3, 32, tok.pad_id)


# ---------------------------------------------------------------------------------------------
# make_data_batch with generator sources


def _clear_caches() -> None:
    mixture._READERS.clear()
    mixture._PLANS.clear()


def test_stream_is_a_pure_function_of_seed_phase_step_rank(tok: TextTokenizer) -> None:
    data = DataConfig()
    kw = dict(batch_size=8, seq_len=64, seed=11, phase="distill1")
    b3 = make_data_batch(data, tok, step=3, **kw)
    _clear_caches()  # a fresh process resuming at step 3
    again = make_data_batch(data, tok, step=3, **kw)
    assert torch.equal(b3.input_ids, again.input_ids) and torch.equal(b3.loss_mask, again.loss_mask)
    for other in (
        make_data_batch(data, tok, step=4, **kw),
        make_data_batch(data, tok, **{**kw, "seed": 12}, step=3),
        make_data_batch(data, tok, **{**kw, "phase": "distill2"}, step=3),
        make_data_batch(data, tok, step=3, rank=1, world=2, **kw),
        make_data_batch(data.model_copy(update={"seed": 1}), tok, step=3, **kw),
    ):
        assert not torch.equal(other.input_ids, b3.input_ids)
    assert (b3.input_ids[:, 0] == tok.bos_id).all()
    assert b3.source_examples == {"generator": 8}


def test_make_batch_is_the_generator_only_shortcut(tok: TextTokenizer) -> None:
    cfg = ProblemConfig(max_steps=3)
    legacy = make_batch(cfg, tok, 4, 48, seed=5, index=2)
    data = DataConfig(sources=[GeneratorSource(max_steps=3)])
    direct = make_data_batch(data, tok, batch_size=4, seq_len=48, seed=5, phase="batch", step=2)
    assert torch.equal(legacy.input_ids, direct.input_ids)
    texts = [tok.decode(row, skip_special=True) for row in legacy.input_ids.tolist()]
    for text in texts:  # every row is a correct problem of at most 3 steps
        prompt, rest = text.split("\n", 1)
        assert re.fullmatch(r"Q:\d([+\-*]\d){1,3}", prompt), text
        answer = rest.rsplit("A:", 1)[1]
        assert check_trace(Problem(prompt + "\n", rest.rsplit("A:", 1)[0], answer))


def test_packed_generator_batches_fill_rows(tok: TextTokenizer) -> None:
    data = DataConfig(pack=True)
    batch = make_data_batch(data, tok, batch_size=4, seq_len=256, seed=0, phase="p", step=0)
    assert batch.input_ids.shape == (4, 256)
    assert batch.n_examples == (batch.input_ids == tok.bos_id).sum().item() > 4 * 256 // 70
    assert ((batch.input_ids == tok.pad_id).sum(dim=1) < 40).all()  # rows are nearly full
    seg, mask = batch.segment_ids, batch.loss_mask
    assert (seg[:, :-1][mask[:, :-1]] == seg[:, 1:][mask[:, :-1]]).all()  # targets stay in their example
    assert not mask[:, -1].any()
    assert batch.source_examples == {"generator": batch.n_examples}


def test_batches_respect_exclude(tok: TextTokenizer) -> None:
    cfg = dict(min_steps=1, max_steps=1, modulus=3)
    everything = sorted(f"Q:{a}{op}{b}\n" for a in range(3) for op in "+-*" for b in range(3))
    banned, allowed = set(everything[::2]), set(everything[1::2])
    data = DataConfig(sources=[GeneratorSource(**cfg)])
    batch = make_data_batch(data, tok, batch_size=32, seq_len=32, seed=0, phase="p", step=0, exclude=banned)
    prompts = {tok.decode(row, skip_special=True).split("\n")[0] + "\n" for row in batch.input_ids.tolist()}
    assert prompts <= allowed and len(prompts) > 3


def test_two_generators_mix_exactly(tok: TextTokenizer) -> None:
    data = DataConfig(
        sources=[GeneratorSource(max_steps=1, weight=7, name="easy"), GeneratorSource(min_steps=5, weight=3)]
    )
    counts = {"easy": 0, "generator": 0}
    for step in range(10):  # 10 steps of 100 slots: exactly one block of 1000
        batch = make_data_batch(data, tok, batch_size=100, seq_len=64, seed=0, phase="p", step=step)
        for name, n in batch.source_examples.items():
            counts[name] += n
    assert counts == {"easy": 700, "generator": 300}


def test_apportion_is_exact() -> None:
    assert mixture.apportion([0.7, 0.3]) == [700, 300]
    assert mixture.apportion([1, 1, 1]) == [334, 333, 333]
    assert mixture.apportion([0.0015, 0.9985]) == [2, 998]


def _slots_reference(quota: list[int], base: int, start: int, n: int) -> tuple[list[int], list[int]]:
    """Every slot from 0 in order, counting each source's earlier slots one by one."""
    pattern = [i for i, q in enumerate(quota) for _ in range(q)]
    seen = [0] * len(quota)
    labels, positions = [], []
    for t in range(start + n):
        b, k = divmod(t, sum(quota))
        label = int(np.random.default_rng(derive_seed("block", base, b)).permutation(pattern)[k])
        if t >= start:
            labels.append(label)
            positions.append(seen[label])
        seen[label] += 1
    return labels, positions


@pytest.mark.parametrize(("start", "n"), [(0, 7), (995, 10), (1990, 1020)])
def test_mixture_slots_match_the_slot_by_slot_reference(start: int, n: int) -> None:
    quota = [700, 250, 50]
    labels, positions = mixture.mixture_slots(quota, base=42, start=start, n=n)
    assert (labels.tolist(), positions.tolist()) == _slots_reference(quota, 42, start, n)


def test_arguments_are_checked(tok: TextTokenizer) -> None:
    data = DataConfig()
    for bad, match in [
        (dict(batch_size=0), "batch_size"),
        (dict(seq_len=1), "seq_len"),
        (dict(rank=2, world=2), "rank"),
        (dict(step=-1), "step"),
    ]:
        kw = dict(batch_size=2, seq_len=16, seed=0, phase="p", step=0) | bad
        with pytest.raises(ValueError, match=match):
            make_data_batch(data, tok, **kw)
    with pytest.raises(ValidationError, match="resolution"):
        DataConfig(sources=[GeneratorSource(weight=1), GeneratorSource(weight=1e-4)])
    with pytest.raises(ValidationError, match="overlong"):
        DataConfig(overlong="cut")
    with pytest.raises(ValidationError, match="modulus"):
        DataConfig(sources=[{"type": "generator", "modulus": 11}])
    for name, field in DataConfig.model_fields.items():
        assert field.description, name


# ---------------------------------------------------------------------------------------------
# JSONL helpers


def test_problem_rows_round_trip_through_jsonl(tmp_path) -> None:
    problems = generate_problems(5, ProblemConfig(), seed=9)
    path = write_jsonl(problem_rows(problems), tmp_path / "sub" / "rows.jsonl")
    rows = read_jsonl(path)
    assert rows[0]["messages"] == problem_messages(problems[0]) and rows[0]["answer"] == problems[0].answer
    path.write_text(path.read_text() + "\n[1]\n")
    with pytest.raises(ValueError, match=r"rows\.jsonl:7: expected a JSON object"):
        read_jsonl(path)


def test_iter_jsonl_numbers_lines_and_names_the_source(tmp_path) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"b": [2]}\n{bad\n')
    lines = iter_jsonl(path, label="s3://bucket/set.jsonl")
    assert next(lines) == (1, {"a": 1}) and next(lines) == (4, {"b": [2]})  # blank lines skipped, still counted
    with pytest.raises(ValueError, match=r"^s3://bucket/set\.jsonl:5: invalid JSON \("):
        next(lines)


# ---------------------------------------------------------------------------------------------
# Readers of procedural sources


def test_bounded_cache_drops_the_least_recently_used() -> None:
    made: list[str] = []

    def make(key: str):
        return lambda: made.append(key) or key.upper()

    cache: BoundedCache[str] = BoundedCache(2)
    assert [cache.get(k, make(k)) for k in ("a", "b", "a", "c", "a", "b")] == ["A", "B", "A", "C", "A", "B"]
    # "a" was used again before "c" came, so "b" went first; "b" is made again
    assert made == ["a", "b", "c", "b"] and len(cache) == 2


def test_generator_reader_positions_are_chunk_items() -> None:
    source = GeneratorSource(min_steps=1, max_steps=3)
    reader = GeneratorReader(source, "gen")
    rows = reader.rows([0, 5, 256 + 3], stream=7, rank=1, world=4, exclude=None)
    assert [r.origin for r in rows] == ["gen:0", "gen:5", "gen:259"]
    chunk0 = generate_problems(256, source.problem_config(), derive_seed("chunk", 7, 1, 0))
    chunk1 = generate_problems(256, source.problem_config(), derive_seed("chunk", 7, 1, 1))
    assert [r.messages for r in rows] == [problem_messages(p) for p in (chunk0[0], chunk0[5], chunk1[3])]


class _FakeGym:
    """Stands in for the optional ``reasoning_gym`` package: dataset entries name their seed and index."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def create_dataset(self, task: str, size: int, seed: int, **config) -> list[dict[str, str]]:
        self.calls.append((task, size, seed))
        return [{"question": f" {task} {seed} {i} ", "answer": f" {i * config.get('scale', 1)} "} for i in range(size)]


def test_gym_reader_chunks_and_exclude(monkeypatch) -> None:
    import sys

    gym = _FakeGym()
    monkeypatch.setitem(sys.modules, "reasoning_gym", gym)
    reader = GymReader(ReasoningGymSource(task="legs", task_config={"scale": 10}), "g")
    seed0 = derive_seed("gym", 0, 0, 0) % (2**31)
    seed1 = derive_seed("gym", 0, 0, 1) % (2**31)
    rows = reader.rows([0, 1, 512 + 2, 3], stream=0, rank=0, world=1, exclude=None)
    assert [r.origin for r in rows] == ["g:0", "g:1", "g:514", "g:3"]
    assert [r.messages[0]["content"] for r in rows] == [f"legs {seed0} 0", f"legs {seed0} 1", f"legs {seed1} 2",
                                                        f"legs {seed0} 3"]  # fmt: skip
    assert rows[2].messages[1] == {"role": "assistant", "content": "20"}
    assert gym.calls == [("legs", 512, seed0), ("legs", 512, seed1)]  # one dataset per chunk, then cached
    # an excluded question is replaced by the next entry of its chunk (wrapping around)
    exclude = frozenset({f"legs {seed0} 1", f"legs {seed0} 2", f"legs {seed0} 511"})
    rows = reader.rows([1, 511], stream=0, rank=0, world=1, exclude=exclude)
    assert [r.messages[0]["content"] for r in rows] == [f"legs {seed0} 3", f"legs {seed0} 0"]
    everything = frozenset(f"legs {seed0} {i}" for i in range(512))
    with pytest.raises(ValueError, match="source 'g': exclude covers a whole chunk of 512 problems"):
        reader.rows([0], stream=0, rank=0, world=1, exclude=everything)


# ---------------------------------------------------------------------------------------------
# Optional reasoning_gym source


def test_gym_source_reports_missing_package() -> None:
    if gym_available():
        pytest.skip("reasoning_gym is installed")
    with pytest.raises(ImportError, match="reasoning-gym"):
        reasoning_gym_problems("leg_counting", 2, seed=0)
    with pytest.raises(ValidationError, match="reasoning-gym"):
        DataConfig(sources=[{"type": "reasoning_gym", "task": "leg_counting"}])


@pytest.mark.skipif(not gym_available(), reason="reasoning_gym is not installed")
def test_gym_source_rows(tok: TextTokenizer) -> None:
    problems = reasoning_gym_problems("leg_counting", 5, seed=0)
    assert len(problems) == 5 and problems == reasoning_gym_problems("leg_counting", 5, seed=0)
    data = DataConfig(sources=[{"type": "reasoning_gym", "task": "leg_counting"}])
    batch = make_data_batch(data, tok, batch_size=2, seq_len=512, seed=0, phase="p", step=0)
    assert batch.source_examples == {"reasoning_gym:leg_counting": 2}
