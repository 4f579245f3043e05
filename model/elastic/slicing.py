"""Zero-shot extraction: cut a standalone sub-model out of the (permuted) parent.

The sizes come from :meth:`Architecture.resolve`, like the masks, so "masked full model == extracted
model" compares two readings of one description. Every tensor is sliced by an index per dimension:
prefixes (``narrow``), or for grouped heads the first k heads of every group. The new model is built
on the meta device and loaded with ``strict=True, assign=True``; ``view=True`` keeps pure prefixes
as views of the parent.

Design notes (grouped heads, per-layer architectures, the config): docs/elastic.md ("Extraction").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from model.config import HybridConfig
from model.elastic.arch import Architecture, LayerArch, ResolvedArch
from model.elastic.space import ElasticSpace
from model.hybrid import Block, HybridLM

Index = int | Tensor | None
"""Per dimension: None keeps everything, an int keeps that prefix, a LongTensor gathers those rows."""

_SIZE_FIELDS = {
    "mamba": ("mamba_num_heads",),
    "attention": ("num_attention_heads",),
    "mlp": ("intermediate_size",),
    "moe": ("moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_routed_experts"),
}


# ---------------------------------------------------------------------- configs
def _layer_sizes(la: LayerArch) -> dict[str, int]:
    """Config fields (of :class:`HybridConfig`) that this layer's sizes set."""
    if la.kind == "mamba":
        return {"mamba_num_heads": la.mamba_heads}
    if la.kind == "attention":
        return {"num_attention_heads": la.attn_heads}
    if la.kind == "mlp":
        return {"intermediate_size": la.ffn}
    return {
        "moe_intermediate_size": la.ffn,
        "moe_shared_expert_intermediate_size": la.shared_ffn,
        "n_routed_experts": la.experts,
    }


def _envelope(config: HybridConfig, arch: Architecture, res: ResolvedArch, allow_per_layer: bool) -> HybridConfig:
    """One config for the kept layers: their common size per field (the largest when they differ)."""
    kept = res.kept
    if not kept:  # pragma: no cover - Architecture.depth is > 0, so one layer always stays
        raise ValueError("depth: an architecture must keep at least one layer")
    changes: dict = {"hidden_size": res.hidden, "pattern": res.pattern}
    # Fields of kinds with no kept layer take the global choice, so the config still reads sensibly.
    glob = {
        "mamba_num_heads": arch.mamba_heads,
        "num_attention_heads": arch.attn_heads,
        "intermediate_size": arch.mlp_ffn,
        "moe_intermediate_size": arch.moe_ffn,
        "moe_shared_expert_intermediate_size": arch.shared_ffn,
        "n_routed_experts": arch.experts,
    }
    for name, value in glob.items():
        if value is not None:
            changes[name] = value
    per_field: dict[str, set[int]] = {}
    for la in kept:
        for name, value in _layer_sizes(la).items():
            per_field.setdefault(name, set()).add(value)
    differing = sorted(name for name, values in per_field.items() if len(values) > 1)
    if differing and not allow_per_layer:
        raise ValueError(
            f"per-layer sizes differ on {differing}: one nemotron_h config cannot describe this architecture "
            "(use extract(), or extract_config(..., allow_per_layer=True) for the largest-size envelope)"
        )
    changes.update({name: max(values) for name, values in per_field.items()})
    passthrough = {k: v for k, v in config.passthrough.items() if k != "elastic"}
    return config.replace(passthrough=passthrough, **changes)


def extract_config(
    config: HybridConfig,
    arch: Architecture,
    depth_order: Sequence[int] | None = None,
    space: ElasticSpace | None = None,
    allow_per_layer: bool = False,
) -> HybridConfig:
    """The standalone config of the sub-model ``arch`` (pattern shortened when depth drops layers).

    Raises ValueError for an invalid architecture, and for one whose kept layers of a kind differ
    in size unless ``allow_per_layer`` (then the largest size per field is returned).
    """
    res = arch.resolve(config, space, depth_order)
    return _envelope(config, arch, res, allow_per_layer)


def layer_configs(
    config: HybridConfig,
    arch: Architecture,
    depth_order: Sequence[int] | None = None,
    space: ElasticSpace | None = None,
) -> list[HybridConfig]:
    """One single-layer config per KEPT layer, with that layer's own sizes (for per-layer models)."""
    res = arch.resolve(config, space, depth_order)
    base = _envelope(config, arch, res, allow_per_layer=True)
    return [base.replace(pattern=la.char, **_layer_sizes(la)) for la in res.kept]


# ---------------------------------------------------------------------- index helpers
def _take(t: Tensor, index: Sequence[Index], view: bool) -> Tensor:
    """Slice ``t`` dimension by dimension; a copy (contiguous) unless ``view`` and only prefixes."""
    out = t.detach()
    for dim, ix in enumerate(index):
        if ix is None:
            continue
        if isinstance(ix, int):
            out = out.narrow(dim, 0, ix)
        else:
            out = out.index_select(dim, ix.to(out.device))
    return out if view else out.clone(memory_format=torch.contiguous_format)


def _as_index(ix: Tensor) -> Index:
    """A gather index that happens to be ``0..n-1`` becomes the prefix ``n`` (a view is then possible)."""
    n = ix.numel()
    return n if torch.equal(ix, torch.arange(n)) else ix


def index_runs(index: Tensor) -> list[tuple[int, int]]:
    """Maximal contiguous runs of a 1-D index as (start, length): ``[0,1,2,8,9] -> [(0,3), (8,2)]``."""
    out: list[tuple[int, int]] = []
    for i in index.tolist():
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def grouped_heads(n_heads: int, n_groups: int, keep: int) -> Tensor:
    """Indices of the first ``keep // n_groups`` heads of every group (group-major layout): (keep,)."""
    per = n_heads // n_groups
    k = keep // n_groups
    return (torch.arange(n_groups)[:, None] * per + torch.arange(k)[None, :]).reshape(-1)


def head_channels(heads: Tensor, head_dim: int) -> Tensor:
    """Channel indices of the given heads: (len(heads) * head_dim,)."""
    return (heads[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


# ---------------------------------------------------------------------- per-module slicing
def _linear(lin: nn.Linear, rows: Index, cols: Index, view: bool, prefix: str) -> dict[str, Tensor]:
    """weight (out, in) -> [rows, cols]; bias (out,) -> [rows]."""
    out = {f"{prefix}.weight": _take(lin.weight, [rows, cols], view)}
    if lin.bias is not None:
        out[f"{prefix}.bias"] = _take(lin.bias, [rows], view)
    return out


def _slice_mamba(mixer: nn.Module, config: HybridConfig, la: LayerArch, h: int, view: bool) -> dict[str, Tensor]:
    heads = grouped_heads(config.mamba_num_heads, config.n_groups, la.mamba_heads)
    ch = head_channels(heads, config.mamba_head_dim)  # kept channels of z, x, y and the gated norm
    d_inner, gn = config.mamba_d_inner, 2 * config.n_groups * config.ssm_state_size
    bc = torch.arange(gn)
    # in_proj rows [z | x | B | C | dt]; conv channels [x | B | C]
    in_rows = _as_index(torch.cat([ch, d_inner + ch, 2 * d_inner + bc, 2 * d_inner + gn + heads]))
    conv_ch = _as_index(torch.cat([ch, d_inner + bc]))
    head_ix, ch_ix = _as_index(heads), _as_index(ch)
    out = _linear(mixer.in_proj, in_rows, h, view, "in_proj")
    out["conv1d.weight"] = _take(mixer.conv1d.weight, [conv_ch], view)  # (conv_dim, 1, K)
    if mixer.conv1d.bias is not None:
        out["conv1d.bias"] = _take(mixer.conv1d.bias, [conv_ch], view)
    for name in ("dt_bias", "A_log", "D"):
        out[name] = _take(getattr(mixer, name), [head_ix], view)
    out["norm.weight"] = _take(mixer.norm.weight, [ch_ix], view)
    out.update(_linear(mixer.out_proj, h, ch_ix, view, "out_proj"))
    return out


def _slice_attention(mixer: nn.Module, config: HybridConfig, la: LayerArch, h: int, view: bool) -> dict[str, Tensor]:
    heads = grouped_heads(config.num_attention_heads, config.num_key_value_heads, la.attn_heads)
    ch = _as_index(head_channels(heads, config.head_dim))
    out = _linear(mixer.q_proj, ch, h, view, "q_proj")
    out.update(_linear(mixer.k_proj, None, h, view, "k_proj"))
    out.update(_linear(mixer.v_proj, None, h, view, "v_proj"))
    out.update(_linear(mixer.o_proj, h, ch, view, "o_proj"))
    return out


def _slice_mlp(mlp: nn.Module, f: int, h: int, view: bool, prefix: str) -> dict[str, Tensor]:
    out = _linear(mlp.up_proj, f, h, view, f"{prefix}up_proj")
    out.update(_linear(mlp.down_proj, h, f, view, f"{prefix}down_proj"))
    return out


def _slice_moe(mixer: nn.Module, la: LayerArch, h: int, view: bool) -> dict[str, Tensor]:
    e, f = la.experts, la.ffn
    out = {
        "gate.weight": _take(mixer.gate.weight, [e, h], view),
        "gate.e_score_correction_bias": _take(mixer.gate.e_score_correction_bias, [e], view),
        "experts.up_proj": _take(mixer.experts.up_proj, [e, f, h], view),  # (E, F, H)
        "experts.down_proj": _take(mixer.experts.down_proj, [e, h, f], view),  # (E, H, F)
    }
    if mixer.shared_experts is not None:
        out.update(_slice_mlp(mixer.shared_experts, la.shared_ffn, h, view, "shared_experts."))
    return out


def _slice_block(block: Block, config: HybridConfig, la: LayerArch, h: int, view: bool) -> dict[str, Tensor]:
    """State dict of one block (keys relative to the block)."""
    out = {"norm.weight": _take(block.norm.weight, [h], view)}
    if la.kind == "mamba":
        mixer = _slice_mamba(block.mixer, config, la, h, view)
    elif la.kind == "attention":
        mixer = _slice_attention(block.mixer, config, la, h, view)
    elif la.kind == "moe":
        mixer = _slice_moe(block.mixer, la, h, view)
    else:
        mixer = _slice_mlp(block.mixer, la.ffn, h, view, "")
    out.update({f"mixer.{k}": v for k, v in mixer.items()})
    return out


# ---------------------------------------------------------------------- public API
@torch.no_grad()
def extract(
    model: HybridLM,
    arch: Architecture,
    depth_order: Sequence[int] | None = None,
    view: bool = False,
    space: ElasticSpace | None = None,
) -> HybridLM:
    """A standalone :class:`HybridLM` computing what ``model`` computes under ``hard_mask(arch)``.

    Tensors keep the parent's dtype and device. ``view=True`` shares storage with the parent
    where a slice is a pure prefix (see the module docstring).
    """
    config = model.config
    res = arch.resolve(config, space, depth_order)
    new_config = _envelope(config, arch, res, allow_per_layer=True)
    h = res.hidden
    with torch.device("meta"):
        new = HybridLM(new_config)
        # Each block from its own sizes: identical to the envelope unless the architecture is per-layer.
        new.model.layers = nn.ModuleList(
            Block(new_config.replace(pattern=la.char, **_layer_sizes(la)), la.kind) for la in res.kept
        )
    state: dict[str, Tensor] = {
        "model.embeddings.weight": _take(model.model.embeddings.weight, [None, h], view),
        "model.norm_f.weight": _take(model.model.norm_f.weight, [h], view),
        "lm_head.weight": _take(model.lm_head.weight, [None, h], view),
    }
    for j, la in enumerate(res.kept):
        block_state = _slice_block(model.model.layers[la.index], config, la, h, view)
        state.update({f"model.layers.{j}.{k}": v for k, v in block_state.items()})
    new.load_state_dict(state, strict=True, assign=True)  # requires_grad stays the module's (True)
    return new.train(model.training)
