"""What every step draws, from the seed alone: the budget of a micro-batch, the router's noise, the hard-sample
coin and the learning-rate schedule.

Every rank computes the same budget and coin without communicating (each draw is keyed by seed, phase, step and
micro-batch through :func:`components.data.derive_seed`), and a resumed run draws exactly what it would have
drawn; the router's noise is per rank where the method asks for it.
"""

from __future__ import annotations

import math

import torch

from components.data import derive_seed


def draw_budget(seed: int, phase: int, step: int, probs: list[float], micro: int = 0) -> int:
    """Index (largest budget first) of the budget trained in micro-batch ``micro`` of ``step``; the same on every
    rank. Micro-batch 0 keeps the draw of a run without accumulation."""
    key = derive_seed("budget", seed, phase, step) if micro == 0 else derive_seed("budget", seed, phase, step, micro)
    g = torch.Generator().manual_seed(key)
    return int(torch.multinomial(torch.tensor(probs, dtype=torch.float64), 1, generator=g).item())


def router_generator(seed: int, phase: int, step: int, micro: int = 0, rank: int | None = None) -> torch.Generator:
    """CPU generator of the router's Gumbel noise in micro-batch ``micro`` of ``step``.

    With ``rank`` the noise is this rank's own (as in the method: every data-parallel rank draws its own
    relaxed sample of the shared budget); ``rank=None`` gives one stream shared by every rank.
    """
    if rank is not None:
        return torch.Generator().manual_seed(derive_seed("router", seed, phase, step, micro, "rank", rank))
    key = derive_seed("router", seed, phase, step) if micro == 0 else derive_seed("router", seed, phase, step, micro)
    return torch.Generator().manual_seed(key)


def draw_hard_sample(seed: int, phase: int, step: int, micro: int, prob: float) -> bool:
    """Whether micro-batch ``micro`` of ``step`` uses a hard straight-through router sample; the same on every
    rank (one coin per micro-step, like the budget)."""
    g = torch.Generator().manual_seed(derive_seed("hard", seed, phase, step, micro))
    return bool(torch.rand((), generator=g).item() < prob)


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak lr: linear warmup over ``warmup`` steps, then cosine to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))
