"""Log-probabilities: computed from logits (the engine) and shown in the two OpenAI layouts (the API).

Design choices:

* A log-probability is the model's own: log-softmax of the logits, before temperature and top-p
  (what vLLM returns by default). :func:`token_logprobs` scores given tokens and lists the top-k
  alternatives best first; :func:`prompt_logprobs` scores a prompt from its prefill logits (the
  first token has nothing before it: its entry is None, as in vLLM's ``echo``).
* Completions use the legacy layout (parallel lists ``tokens`` / ``token_logprobs`` /
  ``top_logprobs`` / ``text_offset``; each ``top_logprobs`` dict holds the token itself plus its
  top-k, so up to k + 1 keys, as the OpenAI API defines it). Chat uses ``content`` entries with
  ``token``, ``logprob``, ``bytes`` and a ``top_logprobs`` list. Log-probabilities are clamped at
  -9999 so that -inf never reaches JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from components.serving.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

FLOOR = -9999.0

LogprobEntry = tuple[int, float | None, list[tuple[int, float]]]
"""One token: (id, its log-probability or None for a first prompt token, top-k (id, logprob) best first)."""


def token_logprobs(logits: torch.Tensor, next_ids: Sequence[int], k: int) -> list[LogprobEntry]:
    """Log-probabilities of ``next_ids`` under ``logits`` and the top-``k`` alternatives.

    logits: (n, vocab), row i scoring the token that follows position i; next_ids: n ids.
    Returns n entries ``(id, logprob, [(alt id, alt logprob), ...])`` with alternatives best first.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # (n, vocab)
    idx = torch.tensor(list(next_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, idx[:, None])[:, 0].tolist()
    if k:
        values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in chosen]
    return [(int(t), c, top) for t, c, top in zip(idx.tolist(), chosen, tops, strict=True)]


def prompt_logprobs(logits: torch.Tensor, ids: Sequence[int], k: int) -> list[LogprobEntry]:
    """The prompt's entries: the first token has none (nothing precedes it), token i is scored by logits[i-1].

    logits: (len(ids), vocab), the prefill's logits at every prompt position.
    """
    return [(int(ids[0]), None, []), *token_logprobs(logits[:-1], ids[1:], k)] if ids else []


TokenText = Callable[[int], str]
"""Token id -> its text, as the logprobs fields show it."""


def completion_logprobs(entries: Sequence[LogprobEntry], text: TokenText, start_offset: int = 0) -> CompletionLogprobs:
    """Legacy-completions log-probabilities of ``entries`` = ``(token id, logprob or None, top-k)``.

    Each ``top_logprobs`` dict holds the token's own log-probability and its top-k alternatives
    (up to k + 1 keys, as the OpenAI API defines it); None where the logprob is None (the first
    prompt token). ``text_offset`` counts characters from ``start_offset``.
    """
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = start_offset
    for tok, lp, top in entries:
        s = text(tok)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        out.token_logprobs.append(None if lp is None else max(lp, FLOOR))
        if lp is None:
            out.top_logprobs.append(None)
        else:
            alts = {s: max(lp, FLOOR)}
            for i, v in top:
                alts.setdefault(text(i), max(v, FLOOR))
            out.top_logprobs.append(alts)
    return out


def chat_logprobs(entries: Sequence[LogprobEntry], text: TokenText) -> ChoiceLogprobs:
    """Chat log-probabilities of ``entries`` = ``(token id, logprob, top-k alternatives)``."""

    def item(tok: int, lp: float) -> TopLogprob:
        s = text(tok)
        return TopLogprob(token=s, logprob=max(lp, FLOOR), bytes=list(s.encode("utf-8")))

    content = []
    for tok, lp, top in entries:
        head = item(tok, lp)
        content.append(TokenLogprob(**head.model_dump(), top_logprobs=[item(i, v) for i, v in top]))
    return ChoiceLogprobs(content=content)
