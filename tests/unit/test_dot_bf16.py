"""The bfloat16 dot-product operators (:mod:`model.decode.dot_bf16`) against float64 dot products of the same
bfloat16 values, and the compiled one-row step that calls them against the eager step and against the
generated loop it replaces."""

from __future__ import annotations

import pytest
import torch

from model.cache import clone_cache
from model.decode import DecodePlan, dot_bf16, step_functions
from model.decode.budget_view import budget_model
from model.decode.compiled import CompiledStep
from model.elastic import Architecture
from tests.unit.test_decode_compiled import _ids
from tests.unit.test_decode_fast_path import _model

pytestmark = pytest.mark.skipif(
    not dot_bf16.available(), reason=f"bfloat16 dot-product operators unavailable: {dot_bf16.unavailable_reason()}"
)
# A float32 sum of n products of values ~N(0, 1) differs from float64's by a few float32 ulps of sqrt(n).
RTOL = 2e-5


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...oi,...i->...o", w.double(), x.double())


@pytest.mark.parametrize("rows, inputs", [(4096, 512), (7, 100), (33, 768), (1, 31), (5, 64)])
def test_gemv_equals_float64_dot_products_of_its_bfloat16_values(rows, inputs):
    """Row counts that do and do not fill the four-row tasks, input sizes with and without a 32-value tail."""
    g = torch.Generator().manual_seed(rows + inputs)
    w = torch.randn(rows, inputs, generator=g).to(torch.bfloat16)
    x = torch.randn(inputs, generator=g).to(torch.bfloat16)
    out = dot_bf16.gemv(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows,)
    ref = _reference(x, w)
    assert torch.allclose(out.double(), ref, rtol=0, atol=RTOL * inputs**0.5 * ref.abs().max().item() + 1e-6)


def test_gemv_reads_a_row_block_of_a_wider_matrix_through_its_row_stride():
    """A budget's run of a parent's rows and columns: a view whose rows are further apart than its width."""
    parent = torch.randn(96, 200).to(torch.bfloat16)
    w = parent[10:50, 8:136]
    x = torch.randn(128).to(torch.bfloat16)
    assert w.stride() == (200, 1)
    ref = _reference(x, w)
    assert torch.allclose(dot_bf16.gemv(x, w).double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_the_prefetch_of_the_rows_ahead_changes_no_result():
    """With and without the prefetch, bit for bit (it only asks for memory early), on a matrix, a row block of a
    wider one and an expert stack; the switch returns the previous setting."""
    g = torch.Generator().manual_seed(2)
    parent = torch.randn(300, 700, generator=g).to(torch.bfloat16)
    stack = torch.randn(4, 37, 96, generator=g).to(torch.bfloat16)
    x, xs, idx = parent[0, :640].clone(), torch.randn(2, 96, generator=g).to(torch.bfloat16), torch.tensor([3, 1])
    cases = [lambda: dot_bf16.gemv(x, parent[:, :640]), lambda: dot_bf16.gemv(x, parent[13:290, 50:690]),
             lambda: dot_bf16.gemv_gather(xs, stack, idx)]  # fmt: skip
    assert dot_bf16.set_prefetch(True) is True  # on by default
    with_prefetch = [f() for f in cases]
    try:
        assert dot_bf16.set_prefetch(False) is True
        without = [f() for f in cases]
    finally:
        assert dot_bf16.set_prefetch(True) is False
    assert all(torch.equal(a, b) for a, b in zip(with_prefetch, without, strict=True))


def test_gemv_gather_takes_each_rows_expert_and_broadcasts_one_row():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 96, 200, generator=g).to(torch.bfloat16)
    idx = torch.tensor([5, 0, 7])
    x = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    for rows in (x, x[:1].expand(3, -1)):  # three rows, and one row for every expert (row stride 0)
        out = dot_bf16.gemv_gather(rows, w, idx)
        ref = _reference(rows, w[idx])
        assert out.shape == (3, 96)
        assert torch.allclose(out.double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_bad_operands_get_errors_that_name_the_problem():
    w = torch.randn(8, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        torch.ops.star_elastic.gemv_bf16(torch.randn(64), w)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        dot_bf16.gemv(torch.randn(64), w.t().contiguous().t())
    with pytest.raises(RuntimeError, match="has 32 inputs"):
        dot_bf16.gemv(torch.randn(32), w)
    with pytest.raises(RuntimeError, match="out of range"):
        dot_bf16.gemv_gather(torch.randn(2, 64), torch.randn(3, 8, 64).to(torch.bfloat16), torch.tensor([0, 3]))


def test_the_switch_leaves_the_generated_loop_and_says_why(monkeypatch):
    monkeypatch.setenv(dot_bf16.SWITCH_ENV, "0")
    monkeypatch.setattr(dot_bf16, "_state", {})
    assert not dot_bf16.available()
    assert dot_bf16.unavailable_reason() == f"switched off ({dot_bf16.SWITCH_ENV}=0)"


def _called_operators(plan: DecodePlan, tok: torch.Tensor, cache) -> set[str]:
    """Names of the star_elastic operators one step of ``plan`` called."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        plan(tok, cache)
    return {e.key for e in prof.key_averages() if e.key.startswith("star_elastic::")}


@pytest.mark.parametrize("view", [False, True])
@torch.no_grad()
def test_a_compiled_bfloat16_step_calls_the_operators_and_holds_to_the_eager_steps_rounding(view, monkeypatch):
    """The whole model (every projection contiguous: all take the operators, the experts through the gather) and
    a budget view (contiguous copies of its split / prefix projections take them); each step's
    logits against the eager step's from the same state, and against the same compiled step with the operators
    switched off (the generated loop: the reference the operators replace)."""
    model = _model({}).to(torch.bfloat16)
    if view:
        model = budget_model(model, Architecture(hidden=24, mamba_heads=2, moe_ffn=8, experts=3))
    plan = DecodePlan(model, compiled=True)
    plan.warm(rows=0)
    plan.compiled = plan.compiled or CompiledStep(plan.steps, plan.norm_f, plan.lm_head, 1 << 30)  # even if slower
    assert step_functions.DOT_BF16
    eager = DecodePlan(model)
    ids = _ids(12, seed=5)
    out = model(ids[:, :8], use_cache=True)
    for t in range(8, 12):  # each step from the same state: rounding differences do not accumulate
        tok = ids[:, t : t + 1]
        called = _called_operators(plan, tok, clone_cache(out.cache))
        assert "star_elastic::gemv_bf16" in called
        assert view or "star_elastic::gemv_bf16_gather" in called  # the whole model's experts are contiguous
        fast = plan(tok, clone_cache(out.cache)).logits.float()
        monkeypatch.setattr(step_functions, "DOT_BF16", False)
        assert not _called_operators(plan, tok, clone_cache(out.cache))
        loop = plan(tok, clone_cache(out.cache)).logits.float()
        monkeypatch.setattr(step_functions, "DOT_BF16", True)
        ref = eager(tok, clone_cache(out.cache)).logits.float()
        assert (fast - ref).abs().max().item() <= 2e-2
        assert (fast - loop).abs().max().item() <= 2e-2
        out = model(tok, cache=out.cache)


# ---------------------------------------------------------------------- several rows (AMX tiles)
def _both_paths(run):
    """``run()`` with AMX tiles (where this CPU and kernel allow them) and with the dot-product loop."""
    previous = dot_bf16.set_amx(True)
    try:
        tiles = run()
        dot_bf16.set_amx(False)
        loop = run()
    finally:
        dot_bf16.set_amx(previous)
    return tiles, loop


def _close(out: torch.Tensor, ref: torch.Tensor, inputs: int) -> bool:
    return torch.allclose(out.double(), ref, rtol=0, atol=RTOL * inputs**0.5 * ref.abs().max().item() + 1e-6)


@pytest.mark.parametrize(
    "rows, out, inputs",
    [(2, 64, 512), (16, 1288, 768), (5, 70, 96), (17, 40, 128), (40, 96, 64), (3, 7, 33), (4, 100, 100)],
)
def test_gemm_equals_float64_dot_products_of_its_bfloat16_values(rows, out, inputs):
    """Blocks of 32 weight rows (AMX tiles) and the rows past the last block (dot products), inputs that are a
    multiple of 32 and not (dot products only), one and several 16-row tiles of x; with the tiles and without."""
    g = torch.Generator().manual_seed(rows * out + inputs)
    w = torch.randn(out, inputs, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, inputs, generator=g).to(torch.bfloat16)
    ref = x.double() @ w.double().t()
    for got in _both_paths(lambda: dot_bf16.gemm(x, w)):
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        assert _close(got, ref, inputs)


def test_gemm_reads_a_row_block_of_a_wider_matrix_and_rows_of_a_wider_x():
    g = torch.Generator().manual_seed(3)
    parent = torch.randn(300, 1024, generator=g).to(torch.bfloat16)
    w = parent[10:210, 64:576]  # rows 1024 apart, 512 wide
    x = torch.randn(9, 700, generator=g).to(torch.bfloat16)[:, 100:612]
    ref = x.double() @ w.double().t()
    for got in _both_paths(lambda: dot_bf16.gemm(x, w)):
        assert _close(got, ref, 512)


def test_gemm_grouped_takes_each_experts_rows_by_their_offsets():
    """Rows sorted by expert with cumulative offsets (``F.grouped_mm``'s): an expert with no rows, one with more
    than a 16-row tile, rows past the last offset (zeros); a strided stack (a budget's slice of the experts)."""
    g = torch.Generator().manual_seed(4)
    parent = torch.randn(5, 120, 200, generator=g).to(torch.bfloat16)
    for w in (parent[:4, :96, :128].contiguous(), parent[1:5, 8:104, 36:164]):
        counts = [7, 0, 19, 3]
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        x = torch.randn(31, 128, generator=g).to(torch.bfloat16)
        ref = torch.zeros(31, 96, dtype=torch.float64)
        start = 0
        for e, c in enumerate(counts):
            ref[start : start + c] = x[start : start + c].double() @ w[e].double().t()
            start += c
        for got in _both_paths(lambda x=x, w=w, offs=offs: dot_bf16.gemm_grouped(x, w, offs)):
            assert got.shape == (31, 96) and _close(got, ref, 128)
            assert torch.equal(got[start:], torch.zeros(31 - start, 96))


def test_bad_groups_get_errors_that_name_the_problem():
    w = torch.randn(3, 32, 64).to(torch.bfloat16)
    x = torch.randn(6, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="offs must rise"):
        dot_bf16.gemm_grouped(x, w, torch.tensor([4, 2, 6], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="offs must be int32"):
        dot_bf16.gemm_grouped(x, w, torch.tensor([2, 4, 6]))
    with pytest.raises(RuntimeError, match="must be \\(rows, in\\)"):
        dot_bf16.gemm(x[0], w[0])


def _several_rows_against_references(
    model, flag: str, operators: set[str], seeds: tuple[int, int], tol: float, monkeypatch
) -> None:
    """Three rows through the several-rows graph of ``model``: the step calls ``operators`` (profiler events) with
    ``step_functions.<flag>`` on and none of them with it off, and its logits hold (within ``tol``) to the eager
    steps and to the same graph with the flag off (the reference the operators replace). Then five rows run
    the same graph under ``fail_on_recompile`` (the row count stays dynamic through the operators' shapes)."""
    plan = DecodePlan(model, compiled=True)
    plan.compiled.one_row = False  # several rows only
    eager = DecodePlan(model)
    ids = _ids(12, seed=seeds[0], rows=3)
    out = model(ids[:, :8], use_cache=True)
    for t in range(8, 11):
        tok = ids[:, t : t + 1]
        called = _called_operators(plan, tok, clone_cache(out.cache))
        assert getattr(step_functions, flag)
        assert operators <= called
        fast = plan(tok, clone_cache(out.cache)).logits.float()
        monkeypatch.setattr(step_functions, flag, False)
        assert not _called_operators(plan, tok, clone_cache(out.cache)) & operators
        library = plan(tok, clone_cache(out.cache)).logits.float()
        monkeypatch.setattr(step_functions, flag, True)
        ref = eager(tok, clone_cache(out.cache)).logits.float()
        assert (fast - ref).abs().max().item() <= tol
        assert (fast - library).abs().max().item() <= tol
        out = model(tok, cache=out.cache)
    ids = _ids(10, seed=seeds[1], rows=5)
    out = model(ids[:, :8], use_cache=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        fast = plan(ids[:, 8:9], clone_cache(out.cache)).logits.float()
    assert (fast - eager(ids[:, 8:9], clone_cache(out.cache)).logits.float()).abs().max().item() <= tol


@torch.no_grad()
def test_a_compiled_bfloat16_step_of_several_rows_calls_the_amx_operators(monkeypatch):
    """Projections and grouped experts on the AMX operators (where this machine has AMX tiles), against the eager
    steps' rounding and the library GEMMs."""
    if not dot_bf16.rows_available():
        pytest.skip(f"AMX operators unavailable: {dot_bf16.rows_unavailable_reason()}")
    operators = {"star_elastic::gemm_bf16", "star_elastic::gemm_bf16_grouped"}
    _several_rows_against_references(_model({}).to(torch.bfloat16), "AMX_BF16", operators, (11, 12), 2e-2, monkeypatch)


def test_the_amx_switch_says_why_it_is_off(monkeypatch):
    monkeypatch.setenv(dot_bf16.ROWS_SWITCH_ENV, "0")
    assert not dot_bf16.rows_available()
    assert dot_bf16.rows_unavailable_reason() == f"switched off ({dot_bf16.ROWS_SWITCH_ENV}=0)"


# ---------------------------------------------------------------------- several rows, float32
@pytest.mark.parametrize("rows, out, inputs", [(2, 64, 512), (16, 1288, 768), (5, 70, 96), (17, 41, 100), (40, 9, 17)])
def test_gemm_f32_equals_float64_dot_products(rows, out, inputs):
    """Four-row weight blocks and their tails, four-row x blocks and their tails, inputs with and without a
    16-value tail, one and several 16-row groups of x."""
    g = torch.Generator().manual_seed(rows * out + inputs)
    w = torch.randn(out, inputs, generator=g)
    x = torch.randn(rows, inputs, generator=g)
    got = dot_bf16.gemm_f32(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    assert _close(got, x.double() @ w.double().t(), inputs)


def test_gemm_f32_rows_do_not_depend_on_the_rows_beside_them():
    """Each output is one sum in a fixed order: a row computed alone, or among 3 or 21 others, is the same bits
    (a batch's row decodes as it would alone)."""
    g = torch.Generator().manual_seed(8)
    parent = torch.randn(200, 1024, generator=g)
    w = parent[:130, 64:704]  # a budget's view: rows 1024 apart
    x = torch.randn(22, 640, generator=g)
    full = dot_bf16.gemm_f32(x, w)
    assert _close(full, x.double() @ w.double().t(), 640)
    for rows in (x[5:6], x[3:7], x[1:22]):
        start = int((rows.data_ptr() - x.data_ptr()) // (4 * 640))
        assert torch.equal(dot_bf16.gemm_f32(rows, w), full[start : start + rows.shape[0]])


def test_gemm_f32_grouped_takes_each_experts_rows_by_their_offsets():
    g = torch.Generator().manual_seed(9)
    parent = torch.randn(5, 120, 200, generator=g)
    for w in (parent[:4, :96, :128].contiguous(), parent[1:5, 8:104, 36:164]):
        counts = [7, 0, 19, 3]
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        x = torch.randn(31, 128, generator=g)
        ref = torch.zeros(31, 96, dtype=torch.float64)
        start = 0
        for e, c in enumerate(counts):
            ref[start : start + c] = x[start : start + c].double() @ w[e].double().t()
            start += c
        got = dot_bf16.gemm_f32_grouped(x, w, offs)
        assert got.shape == (31, 96) and _close(got, ref, 128)
        assert torch.equal(got[start:], torch.zeros(31 - start, 96))
    with pytest.raises(RuntimeError, match="must be float32"):
        torch.ops.star_elastic.gemm_f32(x, w[0].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="offs must rise"):
        dot_bf16.gemm_f32_grouped(x, w, torch.tensor([4, 2, 6, 8], dtype=torch.int32))


@torch.no_grad()
def test_a_compiled_float32_step_of_several_rows_calls_the_float32_operators(monkeypatch):
    """Float32 projections and grouped routed experts on the float32 operators, against the eager steps and the
    same graph on the library GEMMs and the dense pass over every expert."""
    operators = {"star_elastic::gemm_f32", "star_elastic::gemm_f32_grouped"}
    _several_rows_against_references(_model({}), "F32_ROWS", operators, (13, 14), 1e-4, monkeypatch)


def test_the_float32_switch_says_why_it_is_off(monkeypatch):
    monkeypatch.setenv(dot_bf16.F32_ROWS_SWITCH_ENV, "0")
    assert not dot_bf16.f32_rows_available()
    assert dot_bf16.f32_rows_unavailable_reason() == f"switched off ({dot_bf16.F32_ROWS_SWITCH_ENV}=0)"


# ---------------------------------------------------------------------- the greedy pick
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_picks_what_torch_argmax_picks(dtype):
    """Random rows with and without a 16-value tail, ties (the first), rows of -inf, NaNs (the first NaN, as
    torch.argmax), +inf, rows of a wider tensor; and greedy_tokens takes it once the operators are loaded."""
    from model.generate import greedy_tokens

    g = torch.Generator().manual_seed(7)
    cases = [torch.randn(rows, n, generator=g) for rows, n in ((1, 49152), (16, 4099), (3, 7), (2, 1))]
    cases.append(torch.randint(0, 3, (4, 1000), generator=g).float())  # many ties
    cases.append(torch.full((2, 40), float("-inf")))
    special = torch.randn(3, 100, generator=g)
    special[1, 37] = special[1, 80] = float("nan")
    special[2, 5] = float("inf")
    cases.append(special)
    cases.append(torch.randn(5, 300, generator=g)[:, 50:250])  # rows 300 apart
    assert dot_bf16.loaded()
    for logits in cases:
        logits = logits.to(dtype)
        assert torch.equal(dot_bf16.argmax_rows(logits), logits.argmax(-1))
        assert torch.equal(greedy_tokens(logits[:, None]), logits.argmax(-1)[:, None])  # (rows, 1, vocab)
