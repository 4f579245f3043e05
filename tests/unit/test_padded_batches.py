"""Batches of rows whose histories differ in length (left-padded KV caches) against each row decoded alone.

:func:`model.cache.concat_caches` right-aligns shorter KV histories and marks the slots before them as
padding; every decode step must give each row the logits it gets in a batch of its own, with the decode
plan, with the reference forward, and through budget views and masks. Max |difference| <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from model.cache import HybridCache, KVCache, MambaCache, canonical_strides, clone_cache, concat_caches, kv_rows
from model.config import HybridConfig
from model.decode import DecodePlan
from model.decode.budget_view import budget_model
from model.elastic import Architecture
from model.generate import RowStart, SamplingParams, decode_rows, take_row
from model.hybrid import HybridLM
from tests.conftest import TINY

ATOL = 1e-5


def _model(seed: int = 0, **overrides) -> HybridLM:
    m = HybridLM(HybridConfig(**{**TINY, **overrides})).init_weights(seed)
    with torch.no_grad():  # a selection bias that matters, so routing is not a function of the scores alone
        g = torch.Generator().manual_seed(seed + 1)
        for block in m.model.layers:
            if block.kind == "moe":
                bias = block.mixer.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.3)
    return m.eval()


def _prefill(model, prompt: list[int]) -> tuple[HybridCache, torch.Tensor]:
    out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[:, -1]


def _stepper(model, fast: bool):
    """The single-token step: the model's decode plan (fast) or its forward (a budget model's forward runs
    its plan by itself)."""
    plan = DecodePlan(model) if fast else None
    return lambda ids, cache: plan(ids, cache) if plan is not None else model(ids, cache=cache)


def _alone(model, prompt: list[int], feed: list[int], fast: bool = False) -> torch.Tensor:
    """Logits (steps, vocab) of ``prompt`` then each token of ``feed``, batch of one."""
    step = _stepper(model, fast)
    cache, first = _prefill(model, prompt)
    rows = [first[0]]
    for tok in feed:
        out = step(torch.tensor([[tok]]), cache)
        cache = out.cache
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


def _prompts(n: int, lengths: list[int], seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (length,), generator=g).tolist() for length in lengths]
    feeds = [torch.randint(0, 64, (n,), generator=g).tolist() for _ in lengths]
    return prompts, feeds


@torch.no_grad()
def _batched(model, prompts: list[list[int]], feeds: list[list[int]], fast: bool = False) -> torch.Tensor:
    """The same rows prefilled one by one, concatenated into one padded batch, fed together."""
    step = _stepper(model, fast)
    caches, firsts = zip(*(_prefill(model, p) for p in prompts), strict=True)
    cache = concat_caches(list(caches))
    steps = [torch.cat(firsts)]
    for t in range(len(feeds[0])):
        out = step(torch.tensor([[f[t]] for f in feeds]), cache)
        cache = out.cache
        steps.append(out.logits[:, -1])
    return torch.stack(steps, 1)  # (rows, steps, vocab)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("lengths", [[3, 9], [7, 2, 5], [4, 4]])
@torch.no_grad()
def test_padded_batch_decodes_every_row_as_alone(fast, lengths):
    m = _model()
    prompts, feeds = _prompts(6, lengths)
    batched = _batched(m, prompts, feeds, fast)
    for r, (p, f) in enumerate(zip(prompts, feeds, strict=True)):
        assert (batched[r] - _alone(m, p, f, fast)).abs().max().item() <= ATOL


@torch.no_grad()
def test_concat_marks_padding_and_keeps_the_inputs():
    m = _model()
    (a, _), (b, _) = _prefill(m, [1, 2, 3]), _prefill(m, [4, 5, 6, 7, 8, 9])
    before = clone_cache(a)
    merged = concat_caches([a, b])
    kv = next(c for c in merged.layers if isinstance(c, KVCache))
    assert kv.length == 6 and kv.pad.tolist() == [3, 0] and kv.row_lengths() == [3, 6]
    mask = kv.attention_mask(6)[:, 0, 0]
    assert mask.tolist() == [[False] * 3 + [True] * 3, [True] * 6]
    for x, y in zip(a.layers, before.layers, strict=True):  # inputs are copied, never written
        if isinstance(x, KVCache):
            assert torch.equal(x.k[:, :, : x.length], y.k[:, :, : y.length])
        elif isinstance(x, MambaCache):
            assert torch.equal(x.ssm, y.ssm) and torch.equal(x.conv, y.conv)
    # equal lengths: no padding at all
    same = concat_caches([clone_cache(a), clone_cache(a)])
    assert next(c for c in same.layers if isinstance(c, KVCache)).pad is None


@torch.no_grad()
def test_free_rows_of_concatenated_buffers_survive_a_kv_growth_and_refuse_longer_histories():
    """``concat_caches(rows=)``: every layer's tensors are the first rows of buffers of ``rows`` rows (free rows
    zeroed); a KV buffer that grows keeps its free rows; ``join`` refuses, changing nothing, a cache with a
    longer history or more rows than there are free, and writes a fitting one right-aligned with its padding."""
    m = _model()
    (a, _), (b, _), (long, _) = _prefill(m, [1, 2, 3, 4]), _prefill(m, [5, 6]), _prefill(m, list(range(9)))
    batch = concat_caches([clone_cache(a), clone_cache(a)], rows=3)
    assert batch.spare_rows() == 1
    kv = next(c for c in batch.layers if isinstance(c, KVCache))
    assert kv.base[0].shape[0] == 3 and not kv.base[0][2].any()
    kv.reserve(kv.k.shape[2] + 1)  # the buffer doubles: the free row stays
    assert kv.spare_rows() == 1 and kv.k.shape[2] == kv.base[0].shape[2]
    layers = list(batch.layers)
    assert not batch.join(clone_cache(long)) and batch.layers == layers  # a longer history
    assert not batch.join(concat_caches([clone_cache(b), clone_cache(b)]))  # two rows, one free
    assert batch.join(clone_cache(b)) and batch.spare_rows() == 0
    kv = next(c for c in batch.layers if isinstance(c, KVCache))
    assert kv.pad.tolist() == [0, 0, 2] and kv.row_lengths() == [4, 4, 2]
    mine = next(c for c in b.layers if isinstance(c, KVCache))
    assert torch.equal(kv.k[2, :, 2:4], mine.k[0, :, :2]) and not kv.k[2, :, :2].any()


@torch.no_grad()
def test_merging_a_padded_batch_again_and_outgrowing_the_kv_buffer():
    """Three rows merged in two rounds (the second merge pads an already padded batch), then enough steps
    to grow the preallocated KV buffer."""
    m = _model()
    prompts, feeds = _prompts(80, [2, 5, 11], seed=3)
    caches, firsts = zip(*(_prefill(m, p) for p in prompts), strict=True)
    # rows 0 and 1 decode 4 steps together before row 2 joins
    cache = concat_caches([caches[0], caches[1]])
    logits = torch.cat(firsts[:2])
    got: dict[int, list[torch.Tensor]] = {0: [logits[0]], 1: [logits[1]], 2: [firsts[2][0]]}
    for t in range(4):
        out = m(torch.tensor([[feeds[0][t]], [feeds[1][t]]]), cache=cache)
        cache = out.cache
        got[0].append(out.logits[0, -1])
        got[1].append(out.logits[1, -1])
    # row 2 (11 tokens) joins rows of 6 and 9 tokens: everyone is padded to 11
    cache = concat_caches([cache, caches[2]])
    for t in range(76):
        toks = [[feeds[0][4 + t]], [feeds[1][4 + t]], [feeds[2][t]]]
        out = m(torch.tensor(toks), cache=cache)
        cache = out.cache
        for r in range(3):
            got[r].append(out.logits[r, -1])
    kv = next(c for c in cache.layers if isinstance(c, KVCache))
    assert kv.k.shape[2] >= kv.length > 64  # the buffer grew past its first capacity
    for r in range(2):
        ref = _alone(m, prompts[r], feeds[r])
        assert (torch.stack(got[r]) - ref).abs().max().item() <= ATOL
    ref2 = _alone(m, prompts[2], feeds[2][:76])
    assert (torch.stack(got[2]) - ref2).abs().max().item() <= ATOL


@torch.no_grad()
def test_select_with_trim_and_take_row_from_a_padded_batch():
    m = _model()
    prompts, feeds = _prompts(8, [2, 10, 5], seed=5)
    caches, _ = zip(*(_prefill(m, p) for p in prompts), strict=True)
    cache = concat_caches(list(caches))
    for t in range(3):
        cache = m(torch.tensor([[f[t]] for f in feeds]), cache=cache).cache
    # the longest row leaves; the rows left share 5 slots of padding (pads 8 and 5): trim them
    lengths = next(c for c in cache.layers if isinstance(c, KVCache)).row_lengths()
    assert lengths == [5, 13, 8]
    trimmed = cache.select(torch.tensor([0, 2]), trim=5)
    kv = next(c for c in trimmed.layers if isinstance(c, KVCache))
    assert kv.length == 8 and kv.pad.tolist() == [3, 0]
    # a row taken out of the padded batch continues alone exactly like the row decoded alone throughout
    state = take_row(cache, 0, lengths[0])
    assert state.length == 5
    single = HybridCache(state.layers)
    out = m(torch.tensor([[feeds[0][3]]]), cache=single)
    ref = _alone(m, prompts[0], feeds[0][:4])[-1]
    assert (out.logits[0, -1] - ref).abs().max().item() <= ATOL
    with pytest.raises(ValueError, match="holds 5 tokens"):
        take_row(cache, 0, 6)
    with pytest.raises(ValueError, match="cuts into a row"):
        cache.select(torch.tensor([0, 1]), trim=1)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("kept", [[0], [0, 2]])
def test_trimmed_rows_get_kv_buffers_of_their_own(kv_heads, kept):
    """:func:`~model.cache.kv_rows` (what ``HybridCache.select`` keeps): the kept rows' slots from ``trim`` on, in
    a row-major buffer of their own at offset 0 (size-1 dimensions' strides too: one row, one KV head), never a
    view of the wider buffer; the trimmed cache's capacity is the rest, and it grows from there as any cache."""
    assert canonical_strides((3, 1, 6, 4)) == (24, 24, 4, 1)
    k = torch.randn(3, kv_heads, 9, 4)
    rows = torch.tensor(kept)
    got = kv_rows(k, rows, 3)
    assert torch.equal(got, k[rows][:, :, 3:])
    assert got.stride() == canonical_strides(tuple(got.shape)) and got.storage_offset() == 0
    assert got.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    assert torch.equal(kv_rows(k, rows), k[rows])
    pad = torch.tensor([3, 5, 4])
    cache = HybridCache([KVCache(k.clone(), k.clone() + 1, 8, pad), None])
    kv = cache.select(rows, trim=3).layers[0]
    assert kv.k.shape[2] == 6 and kv.length == 5 and kv.k.stride() == canonical_strides(tuple(kv.k.shape))
    assert torch.equal(kv.v, kv.k + 1)
    kv.append(torch.zeros(len(kept), kv_heads, 2, 4), torch.zeros(len(kept), kv_heads, 2, 4))
    assert kv.length == 7 and kv.k.shape[2] == 12  # full at 6 slots: doubled, the history kept
    assert torch.equal(kv.k[:, :, :5], k[rows][:, :, 3:8])


@pytest.mark.parametrize("prefer", ["view", "masked"])
@torch.no_grad()
def test_padded_batches_through_budget_views_and_masks(prefer):
    parent = _model(n_routed_experts=8)
    arch = Architecture(hidden=24, mamba_heads=2, attn_heads=2, moe_ffn=8, shared_ffn=16, mlp_ffn=32, experts=6)
    budget = budget_model(parent, arch, prefer=prefer)
    prompts, feeds = _prompts(5, [6, 2], seed=7)
    batched = _batched(budget, prompts, feeds)
    for r, (p, f) in enumerate(zip(prompts, feeds, strict=True)):
        assert (batched[r] - _alone(budget, p, f)).abs().max().item() <= ATOL


def test_concat_rejects_caches_of_different_models():
    a = _model()
    b = _model(pattern="M*E")
    with torch.no_grad():
        ca, _ = _prefill(a, [1, 2])
        cb, _ = _prefill(b, [1, 2])
    with pytest.raises(ValueError, match="numbers of layers"):
        concat_caches([ca, cb])
    with pytest.raises(ValueError, match="no cache"):
        concat_caches([])


@torch.no_grad()
def test_decode_rows_results_do_not_depend_on_batching():
    """The batched generation loop (one bucket per length) is the reference the engine's merged groups
    are compared with in the serving tests; here it must agree with rows decoded one at a time."""
    m = _model()
    prompts, _ = _prompts(1, [3, 7, 7, 4], seed=9)
    params = SamplingParams(max_new_tokens=6)
    together = decode_rows(m, [RowStart(p) for p in prompts], params)
    for p, out in zip(prompts, together, strict=True):
        assert decode_rows(m, [RowStart(p)], params)[0].tokens == out.tokens


@pytest.mark.parametrize("fast", [True, False])
@torch.no_grad()
def test_rows_leave_by_slot_and_every_row_decodes_as_alone(fast):
    """``RowGroup.keep_rows`` without padding common to the kept rows: the last rows move into the slots the
    leaving rows free (``HybridCache.fill_from_tail``), the batch goes on over a prefix of the same buffers,
    and every kept row's logits stay those of the row decoded alone; when the rows left hold padding in common
    (the one row without padding left), they are copied out in order with that padding dropped."""
    from model.generate import RowGroup

    m = _model()
    prompts, feeds = _prompts(9, [5, 3, 5, 6, 2, 5])
    groups = [RowGroup(m, [RowStart(p)]) for p in prompts]
    group = groups[0]
    for other in groups[1:]:
        group.absorb(other)
    if not fast:
        group.plan = None
    kv = next(c for c in group.cache.layers if isinstance(c, KVCache))
    buffer = kv.k.untyped_storage().data_ptr()
    alive = list(range(len(prompts)))
    got: dict[int, list[torch.Tensor]] = {r: [group.logits[j]] for j, r in enumerate(alive)}
    leave_after = {1: [1, 4], 3: [3], 6: [0]}  # step -> original rows that leave (row 3 alone has no padding)
    for t in range(len(feeds[0])):
        if t in leave_after:
            keep = [j for j, r in enumerate(alive) if r not in leave_after[t]]
            order = group.keep_rows(keep)
            assert sorted(order) == keep
            alive = [alive[j] for j in order]
            kv = next(c for c in group.cache.layers if isinstance(c, KVCache))
            if t == 1:  # no padding common to the kept rows (row 3 has none): the same buffer, cut
                assert kv.k.untyped_storage().data_ptr() == buffer and kv.k.shape[0] == len(alive)
                assert order != keep  # the last row took a freed slot
            if t == 3:  # padding common to the kept rows: copied out in order, trimmed
                assert order == keep and kv.pad is None and kv.length == group.length
        group.feed([feeds[r][t] for r in alive])
        for j, r in enumerate(alive):
            got[r].append(group.logits[j])
    for r in alive:
        want = _alone(m, prompts[r], feeds[r], fast)
        assert (torch.stack(got[r]) - want).abs().max().item() <= ATOL


@pytest.mark.parametrize("fast", [True, False])
@torch.no_grad()
def test_rows_join_by_slot_and_every_row_decodes_as_alone(fast):
    """``RowGroup.absorb`` into a batch whose buffers have free rows (made with ``rows``, or freed by a row that
    left): the joining row is written into a free row of the same buffers, the rows already there stay where
    they are, and every row's logits stay those of the row decoded alone. A joining row with a longer history
    than the batch's, or a batch without free rows, is copied with the batch into new buffers instead. The
    model's own forward (not ``fast``) returns new Mamba states, so its batches keep no free rows: every join
    copies."""
    from model.generate import RowGroup

    m = _model()
    prompts, feeds = _prompts(10, [5, 3, 4, 2, 3, 20])
    join_at = {1: 0, 2: 2, 3: 2, 4: 4, 5: 5}  # row -> step it joins at; row 5's history is the longest
    group = RowGroup(m, [RowStart(prompts[0])])
    if not fast:
        group.plan = None
    alive, fed = [0], {r: [] for r in range(len(prompts))}
    got: dict[int, list[torch.Tensor]] = {0: [group.logits[0]]}

    def where() -> list[int]:
        return [c.k.data_ptr() if isinstance(c, KVCache) else c.ssm.data_ptr() for c in group.cache.layers if c]

    for t in range(8):
        if t == 3:  # row 1 leaves by slot: its row is free again
            order = group.keep_rows([j for j, r in enumerate(alive) if r != 1])
            alive = [alive[j] for j in order]
        for r in [r for r, at in join_at.items() if at == t]:
            before = where()
            group.absorb(RowGroup(m, [RowStart(prompts[r])]), rows=4)
            # not fast: the free rows of new buffers last until the next step (row 3 joins right after row 2)
            if r in ((2, 3, 4) if fast else (3,)):
                assert where() == before, f"row {r} did not join in place"
                assert group.capacity() == 4
            else:
                assert where() != before and group.capacity() >= max(len(alive) + 1, 4), f"row {r} joined in place"
            alive.append(r)
            got[r] = [group.logits[-1]]
        tokens = [feeds[r][len(fed[r])] for r in alive]
        for r, tok in zip(alive, tokens, strict=True):
            fed[r].append(tok)
        group.feed(tokens)
        for j, r in enumerate(alive):
            got[r].append(group.logits[j])
    for r, rows in got.items():
        want = _alone(m, prompts[r], fed[r], fast)
        assert (torch.stack(rows) - want).abs().max().item() <= ATOL, r
