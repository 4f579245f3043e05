"""Continuous batching of the serving engine: rows (one request in one phase) decoded together in groups.

Rows that start from the same cached length and feed the same number of tokens to one budget are
prefilled together as a group (no padding ever enters a Mamba state); prefilled groups of one budget
then merge into one decoding batch (:meth:`Group.absorb`), shorter KV histories left-padded and
masked. Sampling, stops, limits and grammars are per row: a row with a grammar (structured outputs, a
forced tool call; answer phase only) samples from its own logits with the tokens its grammar forbids masked,
so constrained and free rows share a batch and each samples what it would sample alone.

Design notes (stops, kept state, log-probabilities): docs/serving.md ("Continuous batching").
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from components.serving.grammar import allowed_tokens
from components.serving.job import Job
from components.serving.logprobs import LogprobEntry, prompt_logprobs, token_logprobs
from model import generate as gen  # the primitives of model.generate's batched loop


@dataclass(eq=False)
class Row:
    """One request in one phase: what to feed, where to stop, and what it has generated so far."""

    job: Job
    phase: Literal["think", "answer"]
    budget: str
    start: gen.RowStart
    max_new: int
    stop_ids: frozenset[int]
    stop: tuple[str, ...]
    seed: int | None
    keep_state: bool = False
    stop_seqs: tuple[tuple[int, ...], ...] = ()  # id sequences that end the row (the close marker)
    tokens: list[int] = field(default_factory=list)
    reason: str = "length"
    state: gen.RowState | None = None
    snapshot: gen.RowState | None = None

    def __post_init__(self) -> None:
        p = self.job.sampling
        self.greedy = p.temperature == 0
        self.params = gen.SamplingParams(temperature=p.temperature, top_p=p.top_p)
        self.gen: torch.Generator | None = None  # made on the model's device when the row joins a group
        self.want_lp = self.job.logprobs if self.phase == "answer" else None
        self.lp: list[LogprobEntry] = []
        # the grammar constrains the answer only: thinking between the markers is free
        self.matcher: Any = self.job.grammar if self.phase == "answer" else None

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.gen is None and not self.greedy:
            seed = self.seed if self.seed is not None else random.getrandbits(62)
            self.gen = torch.Generator(device=device).manual_seed(seed)
        return self.gen

    @property
    def key(self) -> tuple[str, int, int]:
        """Rows with the same key can share a batch."""
        return self.budget, self.start.state.length if self.start.state else 0, len(self.start.tokens)


class Group(gen.RowGroup):
    """Rows decoded together on one budget model: :class:`model.generate.RowGroup` (the batched loop every
    decode path shares) with per-row sampling, grammars, log-probabilities and cancellation."""

    def __init__(
        self,
        model: torch.nn.Module,
        rows: list[Row],
        snapshot_ids: frozenset[int],
        decode: Callable[..., str],
        stats: dict[str, Any] | None = None,
    ) -> None:
        self.rows, self.snapshot_ids, self.decode = rows, snapshot_ids, decode
        self.stats = stats if stats is not None else defaultdict(int)  # grammar mask counters
        device = next(model.parameters()).device
        for r in rows:
            r.generator(device)
        echo = [j for j, r in enumerate(rows) if r.job.echo and r.want_lp is not None and r.start.state is None]
        super().__init__(model, [r.start for r in rows], logits_to_keep=0 if echo else 1)  # echo: every position
        for j in echo:
            job = rows[j].job
            job.prompt_lp = prompt_logprobs(self.prefill_logits[j], rows[j].start.tokens, rows[j].want_lp)
            if job.stream:
                job.emit("prompt", job.prompt_lp)
        self.prefill_logits = None  # every position's logits: not kept past the prompt's log-probabilities

    def absorb(self, other: Group, rows: int = 0) -> None:
        """Take ``other``'s rows (same model; both about to sample): one batch, shorter histories left-padded
        (by slot where this batch's buffers have room: :meth:`model.generate.RowGroup.absorb`)."""
        super().absorb(other, rows)
        self.rows = self.rows + other.rows
        other.rows = []

    def masked_logits(self) -> dict[int, torch.Tensor]:
        """Per constrained row ``j``: its logits (1, vocab) with the tokens its grammar forbids at -inf.

        The batch's logits themselves stay the model's own (log-probabilities are taken from them); a row
        whose grammar allows nothing gets no entry and fails.
        """
        constrained = [j for j, r in enumerate(self.rows) if r.matcher is not None]
        if not constrained:
            return {}
        start = time.perf_counter()
        vocab = self.logits.shape[-1]
        allowed = allowed_tokens([self.rows[j].matcher for j in constrained], vocab).to(self.logits.device)
        idx = torch.tensor(constrained, device=self.logits.device)
        masked = self.logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))  # (constrained, vocab)
        alive = allowed.any(-1).tolist()
        self.stats["grammar_masked_tokens"] += len(constrained)
        self.stats["grammar_mask_s"] += time.perf_counter() - start
        return {j: masked[k : k + 1] for k, j in enumerate(constrained) if alive[k]}

    def step(self) -> tuple[list[Row], list[Row]]:
        """Sample one token for every row; returns (rows that got a token, rows that finished)."""
        rows, logits = self.rows, self.logits
        masked = self.masked_logits()
        greedy = gen.greedy_tokens(logits).tolist() if any(r.greedy for r in rows) else None
        stepped, finished, keep = [], [], []
        for j, row in enumerate(rows):
            if row.matcher is not None and j not in masked:  # the grammar allows no token: the row fails
                row.reason = "grammar_error"
                finished.append(row)
                continue
            own = masked.get(j, logits[j : j + 1])
            if row.greedy:
                tok = int(gen.greedy_tokens(own)) if j in masked else greedy[j]
            else:
                tok = int(gen.sample_next(own, row.params, row.gen))
            row.tokens.append(tok)
            stepped.append(row)
            if row.want_lp is not None:
                row.lp.append(token_logprobs(logits[j : j + 1], [tok], row.want_lp)[0])
            if row.matcher is not None and not row.matcher.consume_token(tok):
                row.reason = "grammar_error"
            elif row.job.cancelled:
                row.reason = "cancelled"
            else:
                why = gen.stop_reason(row.tokens, row.max_new, row.stop_ids, row.stop_seqs, row.stop, self.decode)
                if why is None:
                    keep.append(j)
                    continue
                row.reason = why
            if row.keep_state:  # the last token is not fed: the state holds everything before it
                row.state = self.take(j)
            finished.append(row)
        if len(keep) < len(rows):
            self.rows = [rows[j] for j in self.keep_rows(keep)] if keep else []
        if self.rows:
            nxt = [r.tokens[-1] for r in self.rows]
            self.feed(nxt)
            for j, (row, tok) in enumerate(zip(self.rows, nxt, strict=True)):
                if row.keep_state and tok in self.snapshot_ids:
                    row.snapshot = self.take(j, kv=False)
        return stepped, finished
