"""Every budget of a nested family as a model whose weights are views of ONE parent copy.

:func:`budget_model` builds a :class:`BudgetModel` (a :class:`~model.hybrid.HybridLM`) whose parameters are
views of the parent's tensors: prefixes along hidden, FFN widths, experts and K/V; grouped heads (k of the
H/G heads of every group) as :mod:`model.decode.split_linear` projections over strided block views; routed
experts as strided 3-D views (:class:`StridedExperts` when (E, F) no longer flattens). The first view of a
parent re-lays its matrices out inputs-major (:func:`store_inputs_major`) so that an input-column prefix is
a contiguous row block. Small per-channel Mamba tensors (conv taps, and with several groups A_log / D /
dt_bias / the norm weight) are copied (:func:`copied_bytes`). A quantized parent, or ``prefer="masked"``,
gives the parent's own modules under the budget's hard mask instead (every budget at the parent's compute
cost), unless the registry is given the quantized budgets already sliced to their own size (``sliced``:
:func:`sliced_quantized_budgets`, each its own slice of the packed codes and block scales). A budget model's
single-token cached steps run its :class:`~model.decode.plan.DecodePlan`. :class:`BudgetRegistry` holds one
parent and every budget, largest first. Design notes: ``docs/decode.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from model.cache import HybridCache
from model.config import HybridConfig
from model.decode.plan import DecodePlan
from model.decode.split_linear import col_linear, param, row_linear
from model.elastic.arch import Architecture, LayerArch
from model.elastic.build_masks import hard_mask
from model.elastic.params import count_params
from model.elastic.slicing import extract_config, grouped_heads, head_channels, index_runs, layer_configs
from model.elastic.space import ElasticSpace
from model.hybrid import Block, CausalLMOutput, HybridLM
from model.masks import ModelMask
from model.moe import Experts, RoutingObserver, expert_loop

Mode = Literal["view", "masked", "sliced"]


def _gather(t: Tensor, index: Tensor, dim: int = 0) -> Tensor:
    """A view when ``index`` is one contiguous run, else a (small) copy."""
    r = index_runs(index)
    if len(r) == 1:
        return t.detach().narrow(dim, r[0][0], r[0][1])
    return t.detach().index_select(dim, index.to(t.device))


@torch.no_grad()
def store_transposed(weight: nn.Parameter) -> None:
    """Re-lay ``weight`` (..., out, in) out in memory as the transpose of a contiguous (..., in, out) tensor.

    The parameter object and its values stay; only the storage order of the last two dimensions changes
    (``weight.transpose(-1, -2)`` becomes contiguous), so a prefix of input columns ``weight[..., :h]`` is
    the contiguous block ``weight.transpose(-1, -2)[..., :h, :]``. A no-op when already laid out that way.
    Views taken of the old layout keep the old storage.
    """
    if weight.dim() >= 2 and not weight.transpose(-1, -2).is_contiguous():
        weight.data = weight.detach().transpose(-1, -2).contiguous().transpose(-1, -2)


def store_inputs_major(full: HybridLM) -> None:
    """:func:`store_transposed` on every plain ``nn.Linear`` weight and stacked expert weight of ``full``."""
    for module in full.modules():
        if type(module) is nn.Linear:
            store_transposed(module.weight)
        elif isinstance(module, Experts):
            store_transposed(module.up_proj)  # (E, ffn, hidden): hidden is elastic
            store_transposed(module.down_proj)  # (E, hidden, ffn): ffn is elastic


# ---------------------------------------------------------------------- per-layer views
def _view_mamba(dst: nn.Module, src: nn.Module, c: HybridConfig, la: LayerArch, h: int) -> None:
    heads = grouped_heads(c.mamba_num_heads, c.n_groups, la.mamba_heads)
    ch = head_channels(heads, c.mamba_head_dim)
    d, gn = c.mamba_d_inner, 2 * c.n_groups * c.ssm_state_size
    bc = torch.arange(gn)
    in_rows = torch.cat([ch, d + ch, 2 * d + bc, 2 * d + gn + heads])  # [z | x | B | C | dt]
    dst.in_proj = row_linear(src.in_proj, in_rows, h)
    dst.out_proj = col_linear(src.out_proj, ch, h)
    conv_ch = torch.cat([ch, d + bc])  # [x | B | C]
    dst.conv1d.weight = param(_gather(src.conv1d.weight, conv_ch))
    if src.conv1d.bias is not None:
        dst.conv1d.bias = param(_gather(src.conv1d.bias, conv_ch))
    for name in ("dt_bias", "A_log", "D"):
        setattr(dst, name, param(_gather(getattr(src, name), heads)))
    dst.norm.weight = param(_gather(src.norm.weight, ch))


def _view_attention(dst: nn.Module, src: nn.Module, c: HybridConfig, la: LayerArch, h: int) -> None:
    heads = grouped_heads(c.num_attention_heads, c.num_key_value_heads, la.attn_heads)
    ch = head_channels(heads, c.head_dim)
    dst.q_proj = row_linear(src.q_proj, ch, h)
    dst.k_proj = row_linear(src.k_proj, None, h)
    dst.v_proj = row_linear(src.v_proj, None, h)
    dst.o_proj = col_linear(src.o_proj, ch, h)


def _view_mlp(dst: nn.Module, src: nn.Module, f: int, h: int) -> None:
    dst.up_proj = row_linear(src.up_proj, torch.arange(f), h)
    dst.down_proj = col_linear(src.down_proj, torch.arange(f), h)


class StridedExperts(Experts):
    """:class:`~model.moe.Experts` over strided views ``up_proj[:E', :F', :H']`` / ``down_proj[:E', :H', :F']``.

    Used when (E, F) cannot be flattened without a copy (the expert width shrinks, or the parent's
    experts are stored inputs-major), where the parent's grouped GEMM would want packed operands. The
    path choice and the sparse and dense paths are the parent's (:meth:`Experts.forward`; they work on
    strided views); only the grouped path is replaced, by per-expert GEMMs that take strided operands.
    x: (T, hidden); idx, weights: (T, k) -> (T, hidden).
    """

    def _grouped(
        self, x: Tensor, idx: Tensor, weights: Tensor, ffn_mask: Tensor | None, observer: RoutingObserver | None
    ) -> Tensor:
        expert = lambda rows, e: self.expert(rows, e, ffn_mask)  # noqa: E731
        return expert_loop(x, idx, weights, self.num_experts, expert, observer)


def _view_moe(dst: nn.Module, src: nn.Module, la: LayerArch, h: int, config: HybridConfig) -> None:
    e, f = la.experts, la.ffn
    dst.gate.weight = param(src.gate.weight.detach()[:e, :h])
    dst.gate.e_score_correction_bias = src.gate.e_score_correction_bias[:e]
    up = src.experts.up_proj.detach()[:e, :f, :h]  # (E, F, H)
    if up.stride(0) != up.shape[1] * up.stride(1):  # (E, F) cannot be flattened without a copy
        with torch.device("meta"):
            dst.experts = StridedExperts(config)
    dst.experts.up_proj = param(up)
    dst.experts.down_proj = param(src.experts.down_proj.detach()[:e, :h, :f])  # (E, H, F)
    if src.shared_experts is not None:
        _view_mlp(dst.shared_experts, src.shared_experts, la.shared_ffn, h)


# ---------------------------------------------------------------------- the budget model
class BudgetModel(HybridLM):
    """A :class:`HybridLM` computing one budget: views of the parent (``mode="view"``), the parent's own
    modules under the budget's mask (``mode="masked"``), or a budget's own sliced tensors (``"sliced"``).
    See the module docstring."""

    def __init__(
        self,
        config: HybridConfig,
        backbone: nn.Module,
        lm_head: nn.Module,
        mode: Mode,
        kept_layers: tuple[int, ...],
        budget_mask: ModelMask | None = None,
        name: str | None = None,
    ) -> None:
        nn.Module.__init__(self)  # modules are adopted, not built: HybridLM.__init__ would allocate them
        self.config = config
        self.model = backbone
        self.lm_head = lm_head
        self.mode: Mode = mode
        self.kept_layers = kept_layers
        self.budget_mask = budget_mask
        self.name = name
        self.plan: DecodePlan | None = None

    def forward(self, input_ids: Tensor, cache: HybridCache | None = None, **options: Any) -> CausalLMOutput:
        """:meth:`HybridLM.forward` (``options``: its other arguments, by keyword) with the budget's mask applied
        for you: ``mask`` only when no budget mask is set.

        A single-token cached step without a mask runs the budget's :meth:`decode_plan`.
        """
        mask = options.pop("mask", None)
        if mask is not None and self.budget_mask is not None:
            raise ValueError(f"budget {self.name!r} already applies its own mask; pass mask=None")
        mask = mask if mask is not None else self.budget_mask
        if mask is None and DecodePlan.accepts(input_ids, cache, None, options.get("skip_logits", False)):
            return self.decode_plan()(input_ids, cache, options.get("return_hidden", False))
        return super().forward(input_ids, cache, mask=mask, **options)

    def decode_plan(
        self, rebuild: bool = False, max_copy_bytes: int | None = None, compiled: bool | None = None
    ) -> DecodePlan | None:
        """This budget's :class:`~model.decode.plan.DecodePlan` (built once), or None under a budget mask.

        ``rebuild``: build it again, after the parent's weights changed in place (a plan is built for one set
        of weights: :meth:`DecodePlan.stale <model.decode.plan.DecodePlan.stale>`). ``max_copy_bytes``: when
        it is built, the memory its weight copies may take (None: the default bound). ``compiled``: when it
        is built, with compiled one-row steps, compiled and measured at once (:meth:`DecodePlan.warm
        <model.decode.plan.DecodePlan.warm>`); None: as the plan it replaces was asked (else no)."""
        if self.budget_mask is not None:
            return None
        if self.plan is None or rebuild:
            if compiled is None:
                compiled = self.plan is not None and self.plan.compile_requested
            self.plan = DecodePlan(self, max_copy_bytes, compiled=compiled)
            self.plan.warm()
        return self.plan

    def save_pretrained(self, path: str | Path, **kwargs) -> Path:
        raise TypeError(
            "a BudgetModel shares (and may split) the parent's tensors; write a budget with "
            "model.elastic.export.extract_budget or model.elastic.slicing.extract instead"
        )


def _is_empty(mask: ModelMask) -> bool:
    """True when the mask leaves every axis full (the parent itself)."""
    return mask.hidden is None and all(
        getattr(lm, f.name) is None for lm in mask.layers for f in dataclasses.fields(lm)
    )


def _sliceable(full: HybridLM) -> bool:
    """Whether every weight a view would slice is a plain tensor of a plain module.

    Quantized modules (``QuantLinear``, ``QuantExperts``) store packed codes and block scales;
    slicing those is the quantizer's job, so such a parent is served through the mask.
    """
    linears: list[nn.Module] = [full.lm_head]
    for block in full.model.layers:
        mixer = block.mixer
        if block.kind == "mamba":
            linears += [mixer.in_proj, mixer.out_proj]
        elif block.kind == "attention":
            linears += [mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj]
        elif block.kind == "moe":
            if not isinstance(mixer.experts, Experts):
                return False
            if mixer.shared_experts is not None:
                linears += [mixer.shared_experts.up_proj, mixer.shared_experts.down_proj]
        else:
            linears += [mixer.up_proj, mixer.down_proj]
    return all(type(m) is nn.Linear for m in linears) and type(full.model.embeddings) is nn.Embedding


@torch.no_grad()
def budget_model(
    full: HybridLM,
    arch: Architecture,
    depth_order: Sequence[int] | None = None,
    space: ElasticSpace | None = None,
    prefer: Mode = "view",
    name: str | None = None,
) -> BudgetModel:
    """The budget ``arch`` of ``full`` without copying its weights (see the module docstring).

    Returns a view model unless ``prefer="masked"`` or the parent is quantized; then the masked
    parent. Raises ``ValueError`` for an invalid architecture.
    """
    if prefer not in ("view", "masked"):
        raise ValueError(f"prefer: expected 'view' or 'masked', got {prefer!r}")
    config = full.config
    res = arch.resolve(config, space, depth_order)
    if prefer == "masked" or not _sliceable(full):
        mask = hard_mask(config, arch, depth_order, full.device, space)
        kept = tuple(range(len(res.layers)))  # dropped layers stay in the stack (gated off), and in the cache
        return BudgetModel(config, full.model, full.lm_head, "masked", kept, None if _is_empty(mask) else mask, name)
    store_inputs_major(full)  # before any view of it is taken (see the module docstring)
    new_config = extract_config(config, arch, depth_order, space, allow_per_layer=True)
    per_layer = layer_configs(config, arch, depth_order, space)
    h = res.hidden
    with torch.device("meta"):
        shell = HybridLM(new_config)  # meta tensors cost nothing; every one is replaced below
        shell.model.layers = nn.ModuleList(Block(lc, la.kind) for lc, la in zip(per_layer, res.kept, strict=True))
    backbone, lm_head = shell.model, shell.lm_head
    backbone.embeddings.weight = param(full.model.embeddings.weight.detach()[:, :h])
    backbone.norm_f.weight = param(full.model.norm_f.weight.detach()[:h])
    lm_head.weight = param(full.lm_head.weight.detach()[:, :h])
    for dst_block, la, lc in zip(backbone.layers, res.kept, per_layer, strict=True):
        src_block = full.model.layers[la.index]
        dst_block.norm.weight = param(src_block.norm.weight.detach()[:h])
        if la.kind == "mamba":
            _view_mamba(dst_block.mixer, src_block.mixer, config, la, h)
        elif la.kind == "attention":
            _view_attention(dst_block.mixer, src_block.mixer, config, la, h)
        elif la.kind == "moe":
            _view_moe(dst_block.mixer, src_block.mixer, la, h, lc)
        else:
            _view_mlp(dst_block.mixer, src_block.mixer, la.ffn, h)
    left = [n for n, t in [*backbone.named_parameters(), *backbone.named_buffers()] if t.is_meta]
    if left or lm_head.weight.is_meta:  # a tensor this module forgot to slice: fail loudly
        raise RuntimeError(f"budget view left tensors unassigned: {left[:10]}")
    kept = tuple(la.index for la in res.kept)
    return BudgetModel(new_config, backbone, lm_head, "view", kept, None, name).train(False)


def _sliced(model: HybridLM, config: HybridConfig, arch: Architecture, order: Sequence[int] | None, name: str):
    """A standalone budget model (its own tensors) as a :class:`BudgetModel` of mode ``sliced``."""
    kept = tuple(la.index for la in arch.resolve(config, None, order).kept)
    return BudgetModel(model.config, model.model, model.lm_head, "sliced", kept, None, name).train(False)


def smaller_budgets(config: HybridConfig, archs: Mapping[str, Architecture], order: Sequence[int] | None) -> list[str]:
    """The budgets with fewer active parameters than the parent (the others are the parent itself)."""
    full = count_params(config).active
    return [n for n, a in archs.items() if count_params(config, a, order).active < full]


def sliced_quantized_budgets(
    folder: str | Path, names: Sequence[str], dtype: torch.dtype | None = None, cache_dequantized: bool = False
) -> dict[str, HybridLM]:
    """Each named budget of a quantized nested checkpoint at its own size: its slice of the packed codes and
    block scales (what :func:`~model.quant.nesting.extract_quantized_budget` writes), in memory. Resident
    quantized bytes grow by the budgets' own (sum of their sizes over the parent's), in exchange for a step
    that reads and dequantizes only the budget's weights."""
    from model.quant.nesting import load_quantized_budget

    return {n: load_quantized_budget(folder, n, dtype, cache_dequantized) for n in names}


# ---------------------------------------------------------------------- memory accounting
def _storages(module: nn.Module) -> dict[int, int]:
    """Storage data pointer -> storage bytes, over parameters and buffers."""
    out: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        s = t.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def copied_bytes(budget: nn.Module, full: nn.Module) -> int:
    """Bytes of ``budget``'s tensors that live outside ``full``'s storages (what building it allocated)."""
    own = _storages(full)
    return sum(n for ptr, n in _storages(budget).items() if ptr not in own)


# ---------------------------------------------------------------------- registry
class BudgetRegistry:
    """One parent in memory and a :class:`BudgetModel` per budget, largest (by active params) first.

    ``get(name)`` returns the budget's model; unknown names raise ``ValueError`` listing the valid ones.
    """

    def __init__(
        self,
        full: HybridLM,
        budgets: Mapping[str, Architecture],
        depth_order: Sequence[int] | None = None,
        prefer: Mode = "view",
        sliced: Mapping[str, HybridLM] | None = None,
    ) -> None:
        """``sliced``: budgets already cut to their own size (quantized slices of the parent), served as they
        are instead of as views or masks of ``full``."""
        if not budgets:
            raise ValueError("a budget registry needs at least one budget")
        self.full = full.eval()
        self.depth_order = list(depth_order) if depth_order is not None else None
        sized = []
        for n, a in budgets.items():
            try:
                active = count_params(full.config, a, self.depth_order).active
            except ValueError as err:
                raise ValueError(f"budget {n!r}: {err}") from None
            sized.append((n, a, active))
        sized.sort(key=lambda t: -t[2])  # stable: equal sizes keep the given order
        self.architectures = {n: a for n, a, _ in sized}
        self.active_params = {n: p for n, _, p in sized}
        own = dict(sliced or {})
        self._models = {
            n: _sliced(own[n], full.config, a, self.depth_order, n)
            if n in own
            else budget_model(full, a, self.depth_order, prefer=prefer, name=n)
            for n, a, _ in sized
        }

    @property
    def names(self) -> list[str]:
        """Budget names, largest first."""
        return list(self._models)

    def check(self, name: str, field: str = "budget") -> str:
        """``name`` if it is a budget, else ``ValueError`` naming ``field`` and the valid budgets."""
        if name not in self._models:
            raise ValueError(f"{field}: unknown budget {name!r}; valid budgets {self.names}")
        return name

    def get(self, name: str) -> BudgetModel:
        return self._models[self.check(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def copied_bytes(self) -> dict[str, int]:
        """Per budget, bytes allocated beyond the parent's weights."""
        return {n: copied_bytes(m, self.full) for n, m in self._models.items()}

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        quantized_budgets: Literal["sliced", "masked"] = "sliced",
        cache_dequantized: bool = False,
    ) -> BudgetRegistry:
        """Load a checkpoint folder once; budgets from its ``elastic`` section, or one budget ``"full"``.

        A quantized (FP8 / NVFP4) nested checkpoint serves its smaller budgets ``sliced`` (each its own slice
        of the quantized weights, computing at its own size) or ``masked`` (the one quantized parent under
        each budget's mask, at the parent's compute cost and no extra memory)."""
        from model.checkpoint import inspect_checkpoint
        from model.elastic.export import read_elastic

        folder = Path(path)
        info = inspect_checkpoint(folder, verify=False)  # the loaders below check the manifest themselves
        quantized = info.quantized
        if quantized:
            from model.quant import load_quantized_model

            full = load_quantized_model(folder, dtype=dtype, cache_dequantized=cache_dequantized)
        else:
            full = HybridLM.from_pretrained(folder, dtype=dtype)
        if device is not None:
            full = full.to(device)
        if not info.elastic:
            return cls(full, {"full": Architecture()})
        elastic = read_elastic(folder)
        sliced = None
        if quantized and quantized_budgets == "sliced":
            smaller = smaller_budgets(full.config, elastic.architectures, elastic.depth_order)
            sliced = sliced_quantized_budgets(folder, smaller, dtype, cache_dequantized)
            if device is not None:
                sliced = {n: m.to(device) for n, m in sliced.items()}
        return cls(full, elastic.architectures, elastic.depth_order, sliced=sliced)
