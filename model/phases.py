"""Two-phase reasoning: think (optionally capped), close the think tag, answer -- on one or two budgets.

Design choices:

* The thinking phase stops when the model emits the close marker ``</think>``: a sequence of
  token ids (one id when the tokenizer has it as a single token), detected as a suffix of the
  row's tokens; another think-stop id such as ``<eos>`` also ends it. Caps count thinking tokens,
  the tokens between the markers: a cap of T decodes at most T tokens plus the marker's first
  L-1 tokens (L = marker length), so thinking that closes on its own keeps at most T-1 tokens
  whatever L is (for L = 1: the marker's one id counts against the cap, as it always has). If no
  marker came, the thinking is cut at the LAST line break inside its first T tokens (the line
  break is kept), or at T when there is none, a trailing partial marker is dropped, and the whole
  marker is appended. Cap 0 answers directly. With no cap (``None``) the phase may run to
  ``think_limit`` tokens and is cut by the same rule if it gets there (``think_stop == "limit"``).
* Standard budget control (``think_model is answer_model``) continues from the cache: the
  thinking phase keeps each row's final cache and a snapshot of its Mamba states after its
  latest line break (a Mamba state cannot be rewound; a KV cache is truncated), so a cut row
  resumes exactly at its cut and only the close marker (plus, for a row cut at the cap, the one
  sampled-but-unfed token) is fed before the answer is decoded. No re-prefill. (With a
  multi-token marker a cut row whose extra L-1 tokens hold a line break has no usable snapshot
  and re-prefills; ``answer_start`` says so.)
* Elastic budget control (two models) re-prefills ``prompt + thinking + </think>`` on the answer
  model, as the method prescribes. ``carry_state=True`` instead hands the thinking model's
  caches (Mamba conv/SSM states, attention KV) to the answer model when their shapes agree:
  hidden size, FFN width and experts never change a cache shape (K/V and SSM states live in head
  space, and K/V heads never shrink), but different Mamba head counts or kept layers do; then
  the rows re-prefill and every result says why (``carry_note``). Carried state was computed by
  the other budget, so it is an approximation except when both models are the same budget.
* Latency: each phase is one batched call over all prompts (bucketed by length inside); a row's
  phase time is that call's wall time divided by the number of prompts, so the mean over rows
  is wall time per problem, and per-phase token counts are reported per row.
* Seeds follow :mod:`model.request_plan`'s rule: each row is one choice of a request and samples
  its two phases with that choice's :class:`~model.request_plan.ChoiceSeeds` (by default every row is
  choice 0 of a request seeded ``sampling.seed``), so a row's tokens depend neither on its position
  in the batch nor on the rows beside it, and equal what the server and the MLflow model give the
  same request. Checks of budgets and caps are the planner's too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from model.generate import (
    Decode,
    RowOutput,
    RowStart,
    RowState,
    SamplingParams,
    decode_rows,
    ends_with_any,
    rewind,
)
from model.hybrid import HybridLM
from model.request_plan import ChoiceSeeds, Fields, Limits, check_budgets, check_tokens, decode_seeds

DEFAULT_THINK_LIMIT = 512
"""Most thinking tokens decoded when no cap is given."""

ThinkStop = Literal["close", "stop", "cap", "limit", "none"]
AnswerStart = Literal["continued", "carried", "re_prefill", "prefill"]


@dataclass(frozen=True)
class PhaseTokens:
    """The token ids the two phases need, and an optional ``decode`` (ids -> text) for texts and stop strings.

    ``think_close``: the ids of the close marker ``</think>`` (an int is taken as a one-id marker).
    ``line_breaks``: ids whose text holds a newline (cap cuts). ``answer_stop_ids``: ids that end the
    answer (e.g. ``<eos>``). ``think_stop_ids``: other ids that end thinking early (e.g. ``<eos>``;
    the close marker is then appended like after a cut).
    """

    think_close: tuple[int, ...]
    line_breaks: frozenset[int]
    answer_stop_ids: tuple[int, ...] = ()
    think_stop_ids: tuple[int, ...] = ()
    decode: Decode | None = None

    def __post_init__(self) -> None:
        close = self.think_close
        close = (close,) if isinstance(close, int) else tuple(close)
        if not close or not all(isinstance(i, int) and not isinstance(i, bool) for i in close):
            raise ValueError(
                f"think_close: expected a token id or a non-empty sequence of ids, got {self.think_close!r}"
            )
        object.__setattr__(self, "think_close", close)  # frozen: normalised once here

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> PhaseTokens:
        """From a :class:`~components.data.tokenizer.TextTokenizer` (``think_close_ids``, ``stop_ids``,
        ``vocab_size``, ``decode``); line breaks found by decoding every id once (O(vocab))."""
        decode: Callable[[Sequence[int]], str] = tokenizer.decode
        hf = getattr(tokenizer, "hf", None)
        ids = range(tokenizer.vocab_size)
        if hf is not None:  # one batched call: a real vocabulary has 10^5 ids
            texts = hf.batch_decode([[i] for i in ids])
        else:
            texts = [decode([i]) for i in ids]
        breaks = frozenset(i for i, t in zip(ids, texts, strict=True) if "\n" in t)
        if not breaks:
            raise ValueError("tokenizer has no token containing a line break; cap cuts need one")
        close = tuple(tokenizer.think_close_ids)
        if not close:
            raise ValueError("tokenizer: the close marker encodes to no token; check markers.think_close")
        stops = tuple(tokenizer.stop_ids)
        return cls(close, breaks, answer_stop_ids=stops, think_stop_ids=stops, decode=decode)


@dataclass
class PhaseResult:
    """One prompt through both phases.

    ``think_tokens`` is the kept thinking (without ``</think>``); ``think_generated`` counts every
    token the thinking phase decoded (cut tokens included). ``answer_tokens`` ends with its stop id
    when one was hit. ``answer_fed``: tokens fed before the answer's first decode step (the
    re-prefill length, or what a continued row still had to feed). Texts are empty without a decode.
    """

    think_tokens: list[int]
    answer_tokens: list[int]
    think_text: str
    answer_text: str
    think_generated: int
    think_stop: ThinkStop
    answer_stop: str
    answer_start: AnswerStart
    answer_fed: int
    think_seconds: float
    answer_seconds: float
    carry_note: str | None = None

    @property
    def seconds(self) -> float:
        """Wall seconds of this request (its share of both batched phases)."""
        return self.think_seconds + self.answer_seconds


def cut_thinking(tokens: Sequence[int], cap: int, line_breaks: frozenset[int]) -> list[int]:
    """The first ``cap`` tokens cut after their last line break (kept), or all ``cap`` if none."""
    head = list(tokens[:cap])
    for j in range(len(head) - 1, -1, -1):
        if head[j] in line_breaks:
            return head[: j + 1]
    return head


def kept_thinking(out: RowOutput, cap: int, tokens: PhaseTokens, capped: bool) -> tuple[list[int], ThinkStop]:
    """The thinking a row keeps (close marker excluded) and why it ended; ``capped``: a cap (not the limit) applied.

    A row that ended on a stop id or stop sequence ending in the close marker closed on its own;
    one that ended on another stop id stopped (that id dropped); otherwise the first ``cap``
    tokens are cut at their last line break and a trailing partial marker is dropped.
    """
    close = tokens.think_close
    if out.stop_reason in ("stop_id", "stop_sequence"):
        if ends_with_any(out.tokens, (close,)):
            return out.tokens[: len(out.tokens) - len(close)], "close"
        return out.tokens[:-1], "stop"
    kept = cut_thinking(out.tokens, cap, tokens.line_breaks)
    return drop_partial_marker(kept, close), "cap" if capped else "limit"


def drop_partial_marker(kept: list[int], close: Sequence[int]) -> list[int]:
    """``kept`` without a trailing proper prefix of ``close`` (the marker is appended whole after a cut)."""
    for k in range(min(len(close) - 1, len(kept)), 0, -1):
        if kept[len(kept) - k :] == list(close[:k]):
            return kept[: len(kept) - k]
    return kept


def resume_target(prompt_len: int, generated: Sequence[int], answer_feed: Sequence[int]) -> int:
    """Most tokens a saved thinking state may have consumed and still continue ``prompt + answer_feed``.

    ``generated``: the thinking phase's tokens; ``answer_feed``: kept thinking + close marker. The
    state's tokens are ``prompt + generated[:m]``; it is usable while those are a prefix of
    ``prompt + answer_feed`` and at least one token is left to feed.
    """
    m = 0
    for a, b in zip(generated, answer_feed, strict=False):
        if a != b:
            break
        m += 1
    return prompt_len + min(m, len(answer_feed) - 1)


def resume_state(out: RowOutput, target: int) -> RowState | None:
    """The latest saved state that has consumed at most ``target`` tokens (the rest is fed again);
    ``target`` from :func:`resume_target`."""
    if out.state is not None and out.state.length <= target:
        return out.state
    if out.state is not None and out.snapshot is not None and out.snapshot.length <= target:
        return rewind(out.state, out.snapshot)
    return None


def _layout(model: HybridLM) -> tuple[tuple[int, ...], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """(kept parent layers, per layer (kind, expected conv/K shape, expected SSM/V shape)) of a model."""
    layers = []
    for block in model.model.layers:
        mixer = block.mixer
        if block.kind == "mamba":
            conv, ssm = (mixer.conv_dim, mixer.kernel - 1), (mixer.num_heads, mixer.head_dim, mixer.state_size)
            layers.append(("mamba", conv, ssm))
        elif block.kind == "attention":
            kv = (mixer.num_kv_heads, mixer.head_dim)
            layers.append(("attention", kv, kv))
        else:
            layers.append((block.kind, (), ()))
    kept = getattr(model, "kept_layers", tuple(range(len(layers))))
    return tuple(kept), layers


def carry_incompatibility(think_model: HybridLM, answer_model: HybridLM) -> str | None:
    """Why the thinking model's caches cannot feed the answer model (None when they can)."""
    kept_a, layers_a = _layout(think_model)
    kept_b, layers_b = _layout(answer_model)
    if kept_a != kept_b:
        return f"the budgets keep different layers ({list(kept_a)} vs {list(kept_b)})"
    for i, (a, b) in enumerate(zip(layers_a, layers_b, strict=True)):
        if a != b:
            what = "Mamba state shapes" if a[0] == "mamba" else "KV cache shapes"
            return f"layer {kept_a[i]}: {what} differ ({a[1:]} vs {b[1:]})"
    return None


_FIELDS = Fields(max_tokens="answer_max_tokens")
"""This module's names of a request's fields, in the planner's errors."""


def _check(think_cap: int | None, answer_max_tokens: int, think_limit: int, prompts: Sequence[Sequence[int]]) -> None:
    check_tokens(answer_max_tokens, think_cap, Limits({}), _FIELDS)
    if think_limit < 1:
        raise ValueError(f"think_limit: expected >= 1, got {think_limit}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def think_then_answer(
    think_model: HybridLM,
    answer_model: HybridLM,
    tokens: PhaseTokens,
    prompts: Sequence[Sequence[int]],
    think_cap: int | None,
    answer_max_tokens: int,
    sampling: SamplingParams | None = None,
    carry_state: bool = False,
    think_limit: int = DEFAULT_THINK_LIMIT,
    seeds: Sequence[ChoiceSeeds] | None = None,
) -> list[PhaseResult]:
    """Think on ``think_model`` (at most ``think_cap`` tokens), then answer on ``answer_model``.

    ``prompts`` are token ids ending where thinking starts (after the open marker ``<think>``). ``sampling``
    gives temperature / top-p (its ``stop_ids`` and ``stop`` strings apply to the answer; its
    ``max_new_tokens`` is ignored). ``seeds``: each row's phase seeds (a :func:`model.request_plan.plan`
    choice's); by default every row is choice 0 of a request seeded ``sampling.seed``. See the module
    docstring for caps, continuation and carry.
    """
    _check(think_cap, answer_max_tokens, think_limit, prompts)
    sampling = sampling or SamplingParams()
    n = len(prompts)
    if n == 0:
        return []
    if seeds is None:
        seeds = [ChoiceSeeds.of(sampling.seed)] * n
    elif len(seeds) != n:
        raise ValueError(f"seeds: got {len(seeds)} for {n} prompts")
    same = think_model is answer_model
    keep = same or carry_state
    cap = think_limit if think_cap is None else think_cap
    think_seeds, answer_seeds = decode_seeds(seeds, "think"), decode_seeds(seeds, "answer")

    # ---- phase 1: thinking
    outs: list[RowOutput] | None = None
    think_wall = 0.0
    if cap > 0:
        params = replace(
            sampling,
            max_new_tokens=cap + len(tokens.think_close) - 1,  # the marker's first L-1 ids do not count
            stop_ids=tokens.think_stop_ids,
            stop_sequences=(tokens.think_close,),
            stop=(),
        )
        starts = [RowStart(list(p)) for p in prompts]
        outs, think_wall = _timed(
            lambda: decode_rows(
                think_model,
                starts,
                params,
                decode=tokens.decode,
                seeds=think_seeds,
                keep_state=keep,
                snapshot_ids=sorted(tokens.line_breaks) if keep else (),
            ),
            answer_model.device,
        )

    # ---- between the phases: what the answer phase starts from
    note = None
    if outs is not None and not same and carry_state:
        note = carry_incompatibility(think_model, answer_model)
    kept_rows: list[tuple[list[int], ThinkStop]] = []
    answer_starts: list[RowStart] = []
    modes: list[AnswerStart] = []
    for i, p in enumerate(prompts):
        kept, stop = kept_thinking(outs[i], cap, tokens, think_cap is not None) if outs is not None else ([], "none")
        kept_rows.append((kept, stop))
        seq = [*p, *kept, *tokens.think_close]
        state = None
        if outs is not None and (same or (carry_state and note is None)):
            state = resume_state(outs[i], resume_target(len(p), outs[i].tokens, seq[len(p) :]))
        if state is not None:
            answer_starts.append(RowStart(seq[state.length :], state))
            modes.append("continued" if same else "carried")
        else:
            answer_starts.append(RowStart(seq))
            modes.append("prefill" if outs is None else "re_prefill")

    # ---- phase 2: answering
    params = replace(
        sampling,
        max_new_tokens=answer_max_tokens,
        stop_ids=(*tokens.answer_stop_ids, *sampling.stop_ids),
    )
    answers, answer_wall = _timed(
        lambda: decode_rows(answer_model, answer_starts, params, decode=tokens.decode, seeds=answer_seeds),
        answer_model.device,
    )
    decode = tokens.decode
    results = []
    for i in range(n):
        kept, stop = kept_rows[i]
        ans = answers[i]
        results.append(
            PhaseResult(
                think_tokens=kept,
                answer_tokens=ans.tokens,
                think_text=decode(kept) if decode else "",
                answer_text=decode(ans.tokens) if decode else "",
                think_generated=len(outs[i].tokens) if outs is not None else 0,
                think_stop=stop,
                answer_stop=ans.stop_reason,
                answer_start=modes[i],
                answer_fed=len(answer_starts[i].tokens),
                think_seconds=think_wall / n,
                answer_seconds=answer_wall / n,
                carry_note=(f"carry_state fell back to re-prefill: {note}" if note else None),
            )
        )
    return results


def budget_control(
    registry: Any,
    think_budget: str,
    answer_budget: str,
    tokens: PhaseTokens,
    prompts: Sequence[Sequence[int]],
    think_cap: int | None,
    answer_max_tokens: int,
    sampling: SamplingParams | None = None,
    carry_state: bool = False,
    allow_think_larger: bool = False,
    think_limit: int = DEFAULT_THINK_LIMIT,
    seeds: Sequence[ChoiceSeeds] | None = None,
) -> list[PhaseResult]:
    """:func:`think_then_answer` by budget name on a :class:`~model.decode.budget_view.BudgetRegistry`.

    ``think_budget == answer_budget`` is standard budget control; otherwise elastic. Raises a
    ``ValueError`` (:class:`~model.request_plan.PlanError`) naming the field for an unknown budget or a
    bad cap, and for a thinking budget larger (by active parameters) than the answering one unless
    ``allow_think_larger``. ``seeds``: as :func:`think_then_answer`.
    """
    check_budgets(think_budget, answer_budget, Limits(registry.active_params, allow_think_larger), _FIELDS)
    _check(think_cap, answer_max_tokens, think_limit, prompts)
    think_model = registry.get(think_budget)
    answer_model = think_model if think_budget == answer_budget else registry.get(answer_budget)
    return think_then_answer(
        think_model, answer_model, tokens, prompts, think_cap, answer_max_tokens, sampling, carry_state, think_limit,
        seeds,
    )  # fmt: skip
