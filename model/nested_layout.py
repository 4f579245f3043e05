"""A nested memory layout of the Mamba projections, for a parent serving several head budgets.

A budget keeping k of the H/G heads of every group keeps G separate runs of ``in_proj``'s z, x and dt
rows and of ``out_proj``'s columns. Read as views of the parent's group-major layout, those runs are
short strided pieces, and one-row GEMVs over them stream slower than over one block (a ~120M-parameter
parent's medium budget: 2.20 ms per step in its Mamba ``in_proj`` calls as group-major views, 1.74 ms on
a contiguous copy, 1.88 ms nested; ``benchmarks/bench_budget_decode.py --projections``). Re-laying both
projections out TIER BY TIER fixes that without a copy per budget: the heads every budget keeps come
first (the first k_1 heads of every group, group-major), then the heads only larger budgets keep, one
tier per budget size. Every budget's rows are then one prefix of the storage:

* ``in_proj`` (:class:`TieredRows`): one GEMV over the storage prefix, then one gather of its outputs
  into the mixer's ``[z | x | B | C | dt]`` group-major order (none for the smallest budget, whose
  single tier is already in that order);
* ``out_proj`` (:class:`TieredCols`): one gather of the input channels into tier order, then one GEMV
  over the storage prefix (again none for the smallest budget).

:func:`nest_mamba_projections` re-lays a parent in place: its Mamba ``in_proj`` / ``out_proj`` become
these modules over the new storage (the parent computes exactly what it did, one weight copy, the old
layout freed), and :func:`tiered_view` gives a budget's modules as views of it. The parent is then for
inference through :mod:`model.budget_view` only: its Mamba projections have no ``weight`` in the
``nn.Linear`` sense, so slicing, permuting or saving it fails loudly instead of reading permuted rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from model.config import HybridConfig
from model.elastic.slicing import grouped_heads, head_channels
from model.tiered_linear import TieredCols, TieredRows


def _tier_heads(config: HybridConfig, tiers: list[int]) -> list[Tensor]:
    """Per tier, its heads in group-major order: tier t holds heads j in [k_{t-1}, k_t) of every group."""
    per = config.mamba_num_heads // config.n_groups
    out, lo = [], 0
    for k in tiers:
        j = torch.arange(lo, k)
        out.append((torch.arange(config.n_groups)[:, None] * per + j[None, :]).reshape(-1))
        lo = k
    return out


def _storage_order(config: HybridConfig, tiers: list[int]) -> tuple[Tensor, Tensor]:
    """Original ``in_proj`` row and ``out_proj`` column of every storage position, tier by tier.

    in_proj rows: tier 1 is ``[z | x | B | C | dt]`` of its heads (B and C whole), later tiers
    ``[z | x | dt]`` of theirs; out_proj columns: the channels of each tier's heads.
    """
    d, gn, p = config.mamba_d_inner, 2 * config.n_groups * config.ssm_state_size, config.mamba_head_dim
    rows, cols = [], []
    for t, heads in enumerate(_tier_heads(config, tiers)):
        ch = head_channels(heads, p)
        parts = [ch, d + ch] + ([2 * d + torch.arange(gn)] if t == 0 else []) + [2 * d + gn + heads]
        rows.append(torch.cat(parts))
        cols.append(ch)
    return torch.cat(rows), torch.cat(cols)


def _order_or_none(order: Tensor) -> Tensor | None:
    """``order``, or None when it is the identity (then no gather is needed)."""
    return None if torch.equal(order, torch.arange(order.numel())) else order


def _on(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)


def _positions(index: Tensor, size: int) -> Tensor:
    """(size,) map from a value of ``index`` to its position in ``index`` (other entries undefined)."""
    pos = torch.empty(size, dtype=torch.long)
    pos[index] = torch.arange(index.numel())
    return pos


def _prefix_view(layer: nn.Module, rows: int, cols: int, bias_len: int, kept: int, order: Tensor | None,
                 share: bool) -> nn.Module:  # fmt: skip
    """A layer of ``layer``'s kind (TieredRows / TieredCols) over ``weight_t[:rows, :cols]``, the bias prefix
    ``[:bias_len]``, and ``order`` with the first ``kept`` storage indices (``share``: the layer's own order
    and index, the same tensors)."""
    index = layer.storage_rows if type(layer) is TieredRows else layer.storage_cols
    bias = layer.bias.detach()[:bias_len] if layer.bias is not None else None
    if share:
        order = layer.order
    else:
        order, index = _on(order, index.device), index[:kept]
    return type(layer)(layer.weight_t.detach()[:rows, :cols], bias, order, index)


NEST_MIN_BYTES = 1 << 20
"""``in_proj`` bytes from which :func:`nest_mamba_projections` re-lays a layer out. Below about a megabyte
(the L2 cache here) a decode step is operator overhead, and the two gathers the layout adds to the full
budget are not paid back: on the demo parent (84 KB per ``in_proj``) the nested full budget ran 0.98x as
fast as group-major, medium and small 1.07x / 1.14x (``benchmarks/bench_budget_decode.py --skip-large
--nest-min-bytes 0``). The threshold keeps the full budget, which serves most traffic, on its own path
there; on a 19 MB ``in_proj`` the layout speeds every budget but full, which it leaves as fast."""


@torch.no_grad()
def nest_mamba_projections(
    mixer: nn.Module, config: HybridConfig, heads_per_group: Iterable[int], min_bytes: int | None = None
) -> bool:
    """Re-lay one Mamba mixer's ``in_proj`` / ``out_proj`` tier by tier, in place (see the module docstring).

    ``heads_per_group``: the kept heads per group of every budget that keeps this layer. Returns False (and
    changes nothing) when no budget keeps fewer heads than the layer has, when ``in_proj`` holds fewer than
    ``min_bytes`` (default :data:`NEST_MIN_BYTES`) or when the projections are not plain ``nn.Linear``
    layers (quantized ones); the parent computes exactly as before either way.
    """
    per = config.mamba_num_heads // config.n_groups
    tiers = sorted({int(k) for k in heads_per_group} | {per})
    if len(tiers) == 1 or type(mixer.in_proj) is not nn.Linear or type(mixer.out_proj) is not nn.Linear:
        return False
    weight = mixer.in_proj.weight
    if weight.numel() * weight.element_size() < (NEST_MIN_BYTES if min_bytes is None else min_bytes):
        return False
    if tiers[0] < 1 or tiers[-1] > per:
        raise ValueError(f"heads per group {tiers} must lie in 1..{per}")
    rows, cols = _storage_order(config, tiers)
    w_in, b_in = mixer.in_proj.weight.detach(), mixer.in_proj.bias
    # one copy each, written straight in the new (inputs-major) layout: (hidden, total) and (d_inner, hidden)
    storage_in = w_in.t().index_select(1, rows.to(w_in.device))
    bias_in = b_in.detach().index_select(0, rows.to(w_in.device)) if b_in is not None else None
    w_out, b_out = mixer.out_proj.weight.detach(), mixer.out_proj.bias
    storage_out = w_out.t().index_select(0, cols.to(w_out.device))
    device = w_in.device
    order_in, order_out = _order_or_none(_positions(rows, rows.numel())), _order_or_none(cols)
    mixer.in_proj = TieredRows(storage_in, bias_in, _on(order_in, device), rows.to(device))
    bias_out = b_out.detach() if b_out is not None else None
    mixer.out_proj = TieredCols(storage_out, bias_out, _on(order_out, device), cols.to(device))
    return True


def tiered_view(src: nn.Module, config: HybridConfig, keep: int, hidden: int) -> tuple[TieredRows, TieredCols]:
    """A budget's ``in_proj`` / ``out_proj`` as views of a nested mixer ``src``: ``keep`` heads in all (a tier
    of the layout), the first ``hidden`` input / output channels. Orders as :func:`model.budget_view`'s
    group-major views expect: in_proj rows ``[z | x | B | C | dt]`` of the kept heads, out_proj inputs the
    kept heads' channels."""
    d, gn, p = config.mamba_d_inner, 2 * config.n_groups * config.ssm_state_size, config.mamba_head_dim
    heads = grouped_heads(config.mamba_num_heads, config.n_groups, keep)
    ch = head_channels(heads, p)
    want_rows = torch.cat([ch, d + ch, 2 * d + torch.arange(gn), 2 * d + gn + heads])
    rows_in, cols_out = src.in_proj.storage_rows.cpu(), src.out_proj.storage_cols.cpu()
    n_in, n_out = want_rows.numel(), ch.numel()
    if not (torch.equal(rows_in[:n_in].sort().values, want_rows.sort().values)):
        raise ValueError(f"{keep} Mamba heads ({keep // config.n_groups} per group) are not a tier of this nested "
                         "layout; build the registry with every budget that will be served")  # fmt: skip
    order_in = _order_or_none(_positions(rows_in[:n_in], config.mamba_in_proj_dim)[want_rows])
    order_out = _order_or_none(_positions(ch, d)[cols_out[:n_out]])
    every_head = n_in == rows_in.numel()  # the parent's own orders then (shared, no new bytes)
    in_proj = _prefix_view(src.in_proj, hidden, n_in, n_in, n_in, order_in, every_head)
    out_proj = _prefix_view(src.out_proj, n_out, hidden, hidden, n_out, order_out, every_head)
    return in_proj, out_proj


__all__ = ["NEST_MIN_BYTES", "nest_mamba_projections", "tiered_view"]
