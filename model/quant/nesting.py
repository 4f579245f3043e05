"""Nesting survives quantization: cut any budget out of ONE quantized nested checkpoint.

:func:`extract_quantized_budget` writes any budget of a quantized nested checkpoint as a standalone
quantized checkpoint, and :func:`load_quantized_budget` builds it in memory, without requantizing:
the prefix rules are those of :mod:`model.elastic.slicing` (:func:`budget_rules`), per-tensor scales
are copied and nvfp4 codes are sliced with their 16-element blocks, so extract-then-dequantize equals
dequantize-then-extract bitwise. :func:`check_nvfp4_alignment` checks the block boundaries first.

Design notes (rules, alignment, safety nets): docs/quantization.md ("Nesting under quantization").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.checkpoint import CONFIG_NAME, CheckpointError, verify_manifest, write_checkpoint
from model.config import HybridConfig
from model.elastic.arch import Architecture, ResolvedArch
from model.elastic.slicing import extract_config, grouped_heads, head_channels, index_runs
from model.hybrid import HybridLM
from model.layout import DEFAULT_MAX_SHARD_SIZE

from .checkpoint import _read_quant_config, build_quantized_model, read_quantized_tensors
from .experts import DEFAULT_CACHE_DEQUANTIZED
from .fp8 import FP8_DTYPE
from .nvfp4 import NVFP4_BLOCK_SIZE, slice_nvfp4
from .qlinear import QuantFormat, QuantPreset

__all__ = [
    "ExpertsRule",
    "LinearRule",
    "TensorRule",
    "budget_architectures",
    "budget_rules",
    "check_nvfp4_alignment",
    "extract_quantized_budget",
    "load_quantized_budget",
    "slice_quantized_state",
]

Index = int | Tensor | None
"""Per dimension: None keeps everything, an int keeps that prefix, a LongTensor gathers those entries."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_FILE_LAYER = re.compile(r"^(model|backbone)\.layers\.(\d+)\.(.*)$")
_KV_KEYS = (".k_proj.k_scale", ".v_proj.v_scale")


@dataclass(frozen=True)
class TensorRule:
    """A dense tensor ``src`` -> ``dst`` sliced by ``index`` (one entry per leading dimension)."""

    src: str
    dst: str
    index: tuple[Index, ...]


@dataclass(frozen=True)
class LinearRule:
    """A projection ``src`` -> ``dst`` (weight (out, in), bias (out,)) sliced to ``[rows, cols]``.

    ``in_axis`` / ``in_value``: the elastic axis (and the budget's value) that sets ``cols``.
    """

    src: str
    dst: str
    rows: Index
    cols: Index
    in_axis: str
    in_value: int


@dataclass(frozen=True)
class ExpertsRule:
    """Routed experts ``src`` -> ``dst``: the first ``experts``, each cut to (ffn, hidden)."""

    src: str
    dst: str
    experts: int
    ffn: int
    hidden: int


Rule = TensorRule | LinearRule | ExpertsRule


def _as_index(ix: Tensor) -> Index:
    """A gather index equal to ``0..n-1`` becomes the prefix ``n``."""
    n = ix.numel()
    return n if torch.equal(ix, torch.arange(n)) else ix


# ---------------------------------------------------------------------- budgets and rules
def budget_architectures(checkpoint_dir: str | Path) -> tuple[dict[str, Architecture], list[int] | None]:
    """``({budget: architecture}, depth_order)`` of a checkpoint; ``{"full": Architecture()}`` when not nested."""
    from model.elastic.export import read_elastic

    folder = Path(checkpoint_dir)
    raw = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    if "elastic" not in raw:
        return {"full": Architecture()}, None
    info = read_elastic(folder)
    return info.architectures, info.depth_order


def budget_rules(config: HybridConfig, res: ResolvedArch) -> list[Rule]:
    """Every tensor of the sub-model ``res`` of ``config``'s parent, as slicing rules (docs/quantization.md)."""
    h = res.hidden
    rules: list[Rule] = [
        TensorRule("model.embeddings.weight", "model.embeddings.weight", (None, h)),
        TensorRule("model.norm_f.weight", "model.norm_f.weight", (h,)),
        LinearRule("lm_head", "lm_head", None, h, "hidden", h),
    ]
    d_inner, gn = config.mamba_d_inner, 2 * config.n_groups * config.ssm_state_size
    for j, la in enumerate(res.kept):
        s, d = f"model.layers.{la.index}.", f"model.layers.{j}."
        rules.append(TensorRule(s + "norm.weight", d + "norm.weight", (h,)))
        s, d = s + "mixer.", d + "mixer."
        if la.kind == "mamba":
            heads = grouped_heads(config.mamba_num_heads, config.n_groups, la.mamba_heads)
            ch = head_channels(heads, config.mamba_head_dim)
            bc = torch.arange(gn)
            in_rows = _as_index(torch.cat([ch, d_inner + ch, 2 * d_inner + bc, 2 * d_inner + gn + heads]))
            conv_ch = _as_index(torch.cat([ch, d_inner + bc]))
            rules.append(LinearRule(s + "in_proj", d + "in_proj", in_rows, h, "hidden", h))
            rules += [TensorRule(s + f"conv1d.{p}", d + f"conv1d.{p}", (conv_ch,)) for p in ("weight", "bias")]
            rules += [TensorRule(s + n, d + n, (_as_index(heads),)) for n in ("dt_bias", "A_log", "D")]
            rules.append(TensorRule(s + "norm.weight", d + "norm.weight", (_as_index(ch),)))
            rules.append(LinearRule(s + "out_proj", d + "out_proj", h, _as_index(ch), "mamba_heads", la.mamba_heads))
        elif la.kind == "attention":
            heads = grouped_heads(config.num_attention_heads, config.num_key_value_heads, la.attn_heads)
            ch = _as_index(head_channels(heads, config.head_dim))
            rules.append(LinearRule(s + "q_proj", d + "q_proj", ch, h, "hidden", h))
            rules += [LinearRule(s + p, d + p, None, h, "hidden", h) for p in ("k_proj", "v_proj")]
            rules.append(LinearRule(s + "o_proj", d + "o_proj", h, ch, "attn_heads", la.attn_heads))
        elif la.kind == "mlp":
            rules.append(LinearRule(s + "up_proj", d + "up_proj", la.ffn, h, "hidden", h))
            rules.append(LinearRule(s + "down_proj", d + "down_proj", h, la.ffn, "mlp_ffn", la.ffn))
        else:
            e = la.experts
            rules.append(TensorRule(s + "gate.weight", d + "gate.weight", (e, h)))
            bias = "gate.e_score_correction_bias"
            rules.append(TensorRule(s + bias, d + bias, (e,)))
            rules.append(ExpertsRule(s + "experts", d + "experts", e, la.ffn, h))
            sh, dh, f = s + "shared_experts.", d + "shared_experts.", la.shared_ffn
            if config.n_shared_experts:
                rules.append(LinearRule(sh + "up_proj", dh + "up_proj", f, h, "hidden", h))
                rules.append(LinearRule(sh + "down_proj", dh + "down_proj", h, f, "shared_ffn", f))
    return rules


# ---------------------------------------------------------------------- NVFP4 alignment
def _runs(cols: Index, full: int) -> list[tuple[int, int]]:
    """Contiguous (start, length) runs of kept input columns."""
    if cols is None:
        return [(0, full)]
    if isinstance(cols, int):
        return [(0, cols)]
    return index_runs(cols)


def _aligned(cols: Index, full: int) -> bool:
    return all(s % NVFP4_BLOCK_SIZE == 0 and n % NVFP4_BLOCK_SIZE == 0 for s, n in _runs(cols, full))


def check_nvfp4_alignment(
    config: HybridConfig,
    archs: Mapping[str, Architecture],
    depth_order: Sequence[int] | None,
    preset: QuantPreset,
) -> None:
    """Raise ``ValueError`` unless every budget keeps whole NVFP4 blocks of every quantized input.

    One line per (budget, axis, value), naming the first layer affected and the kept column runs.
    """
    problems: dict[tuple[str, str, int], str] = {}
    for name, arch in archs.items():
        res = arch.resolve(config, None, depth_order)
        for rule in budget_rules(config, res):
            checks: list[tuple[str, str, int, Index, int]] = []
            if isinstance(rule, LinearRule) and preset.should_quantize(rule.src):
                full = _full_in(config, rule.src)
                checks.append((rule.src, rule.in_axis, rule.in_value, rule.cols, full))
            elif isinstance(rule, ExpertsRule) and preset.should_quantize(rule.src + ".up_proj"):
                checks.append((rule.src + ".*.up_proj", "hidden", rule.hidden, rule.hidden, config.hidden_size))
                checks.append((rule.src + ".*.down_proj", "moe_ffn", rule.ffn, rule.ffn, config.moe_intermediate_size))
            for layer, axis, value, cols, full in checks:
                key = (name, axis, value)
                if key in problems or _aligned(cols, full):
                    continue
                runs = _runs(cols, full)
                width = sum(n for _, n in runs)
                problems[key] = (
                    f"budget {name!r}: {axis}={value} keeps {width} input columns of {layer} in runs "
                    f"(start, length) {runs[:4]}{' ...' if len(runs) > 4 else ''}, "
                    f"not whole {NVFP4_BLOCK_SIZE}-element blocks"
                )
    if problems:
        raise ValueError(
            "NVFP4 cannot nest these budgets: every elastic width along an input dimension must be a multiple of "
            f"{NVFP4_BLOCK_SIZE} (per group for grouped heads; ElasticSpace(nvfp4_aligned=True) checks the "
            "candidates when the space is configured): " + "; ".join(problems.values())
        )


def _full_in(config: HybridConfig, name: str) -> int:
    """Full input width of the projection ``name`` in the parent."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "out_proj":
        return config.mamba_d_inner
    if leaf == "o_proj":
        return config.num_attention_heads * config.head_dim
    if leaf == "down_proj":
        return config.moe_shared_expert_intermediate_size if "shared_experts" in name else config.intermediate_size
    return config.hidden_size


# ---------------------------------------------------------------------- slicing tensors
def _take(t: Tensor, index: Sequence[Index]) -> Tensor:
    """Slice ``t`` dimension by dimension into a new contiguous tensor (fp8 gathered through uint8)."""
    fp8 = t.dtype == FP8_DTYPE
    out = t.view(torch.uint8) if fp8 else t
    for dim, ix in enumerate(index):
        if ix is None:
            continue
        out = out.narrow(dim, 0, ix) if isinstance(ix, int) else out.index_select(dim, ix.to(out.device))
    out = out.clone(memory_format=torch.contiguous_format)
    return out.view(FP8_DTYPE) if fp8 else out


def _slice_nvfp4_weight(packed: Tensor, scales: Tensor, rows: Index, cols: Index, what: str) -> tuple[Tensor, Tensor]:
    """NVFP4 codes (out, in/2) and block scales (out, in/16) cut to ``[rows, cols]`` (whole blocks)."""
    if not _aligned(cols, packed.shape[-1] * 2):
        raise ValueError(f"{what}: kept input columns {_runs(cols, packed.shape[-1] * 2)} split NVFP4 blocks")
    if isinstance(cols, Tensor):  # several runs (grouped heads): whole bytes and whole blocks
        packed = packed.index_select(-1, cols[0::2] // 2)
        scales = scales.view(torch.uint8).index_select(-1, cols[0::NVFP4_BLOCK_SIZE] // NVFP4_BLOCK_SIZE)
        scales = scales.view(FP8_DTYPE)
        cols = None
    packed, scales = slice_nvfp4(packed, scales, rows, cols)
    return packed.contiguous().clone(), scales.view(torch.uint8).clone().view(FP8_DTYPE)


def _slice_linear(
    tensors: Mapping[str, Tensor], src: str, dst: str, rows: Index, cols: Index, fmt: QuantFormat
) -> dict[str, Tensor]:
    """One projection, quantized (``src.weight_scale`` present) or dense, with its scales and bias."""
    out: dict[str, Tensor] = {}
    w = tensors[f"{src}.weight"]
    if f"{src}.weight_scale" not in tensors:
        out[f"{dst}.weight"] = _take(w, [rows, cols])
    elif fmt == "fp8":
        out[f"{dst}.weight"] = _take(w, [rows, cols])
        out[f"{dst}.weight_scale"] = tensors[f"{src}.weight_scale"].clone()  # per tensor: untouched
    else:
        packed, scales = _slice_nvfp4_weight(w, tensors[f"{src}.weight_scale"], rows, cols, src)
        out[f"{dst}.weight"], out[f"{dst}.weight_scale"] = packed, scales
        out[f"{dst}.weight_scale_2"] = tensors[f"{src}.weight_scale_2"].clone()  # global: untouched
    if f"{src}.input_scale" in tensors:
        out[f"{dst}.input_scale"] = tensors[f"{src}.input_scale"].clone()  # per tensor: untouched
    if f"{src}.bias" in tensors:
        out[f"{dst}.bias"] = _take(tensors[f"{src}.bias"], [rows])
    return out


def slice_quantized_state(
    tensors: Mapping[str, Tensor], config: HybridConfig, res: ResolvedArch, fmt: QuantFormat
) -> dict[str, Tensor]:
    """The quantized (file-keyed) state of the sub-model ``res``, cut from the parent's ``tensors``."""
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for rule in budget_rules(config, res):
        if isinstance(rule, TensorRule):
            if rule.src in tensors:  # optional tensors (conv bias) may be absent
                out[rule.dst] = _take(tensors[rule.src], rule.index)
                used.add(rule.src)
        elif isinstance(rule, LinearRule):
            part = _slice_linear(tensors, rule.src, rule.dst, rule.rows, rule.cols, fmt)
            used.update(rule.src + k[len(rule.dst) :] for k in part)
            out.update(part)
        elif f"{rule.src}.0.up_proj.weight" in tensors:  # per-expert (quantized) layout
            for j in range(rule.experts):
                s, d = f"{rule.src}.{j}.", f"{rule.dst}.{j}."
                out.update(_slice_linear(tensors, s + "up_proj", d + "up_proj", rule.ffn, rule.hidden, fmt))
                out.update(_slice_linear(tensors, s + "down_proj", d + "down_proj", rule.hidden, rule.ffn, fmt))
            used.update(k for k in tensors if k.startswith(rule.src + "."))  # experts >= e' are dropped
        else:  # dense stacked experts (a custom preset that keeps them in high precision)
            e, f, h = rule.experts, rule.ffn, rule.hidden
            out[f"{rule.dst}.up_proj"] = _take(tensors[f"{rule.src}.up_proj"], [e, f, h])  # (E, F, H)
            out[f"{rule.dst}.down_proj"] = _take(tensors[f"{rule.src}.down_proj"], [e, h, f])  # (E, H, F)
            used.update({f"{rule.src}.up_proj", f"{rule.src}.down_proj"})
    new_index = {la.index: j for j, la in enumerate(res.kept)}
    for k in tensors:  # FP8 KV-cache scales (per attention layer): kept layers renumbered, copied whole
        m = _LAYER.match(k)
        if k.endswith(_KV_KEYS) and m and int(m.group(1)) in new_index:
            out[f"model.layers.{new_index[int(m.group(1))]}.{m.group(2)}"] = tensors[k].clone()
            used.add(k)
    dropped = {la.index for la in res.layers if not la.keep}
    left = [k for k in tensors if k not in used and not ((m := _LAYER.match(k)) and int(m.group(1)) in dropped)]
    if left:  # a tensor no rule covers: refuse rather than write an incomplete model
        raise CheckpointError(f"tensors not covered by the nesting rules: {sorted(left)[:20]}")
    return out


def logical_param_count(tensors: Mapping[str, Tensor]) -> int:
    """Parameters the tensors stand for (nvfp4 bytes hold two; scales and the selection bias are not parameters)."""
    n = 0
    for k, v in tensors.items():
        base, _, leaf = k.rpartition(".")
        if leaf in ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale") or k.endswith(
            "e_score_correction_bias"
        ):
            continue
        packed = leaf == "weight" and v.dtype == torch.uint8 and f"{base}.weight_scale_2" in tensors
        n += v.numel() * (2 if packed else 1)
    return n


# ---------------------------------------------------------------------- public API
def _budget_state(
    quant_dir: Path, budget_name: str
) -> tuple[HybridConfig, dict[str, Tensor], dict[str, Any], str, ResolvedArch]:
    """Shared by extraction and loading: (standalone config, sliced tensors, quantization_config, format, arch)."""
    from model.elastic.export import read_elastic

    qc, fmt = _read_quant_config(quant_dir)
    verify_manifest(quant_dir)
    info = read_elastic(quant_dir)
    budget = info.budget(budget_name)
    try:
        new_config = extract_config(info.config, budget.architecture, info.depth_order)
    except ValueError as err:
        raise ValueError(f"budget {budget_name!r} cannot be written as a standalone checkpoint: {err}") from None
    res = budget.architecture.resolve(info.config, None, info.depth_order)
    state = slice_quantized_state(read_quantized_tensors(quant_dir), info.config, res, fmt)
    got = logical_param_count(state)
    if got != budget.total_params:
        raise CheckpointError(
            f"{quant_dir}: budget {budget_name!r} extracts to {got} parameters but its config entry records "
            f"{budget.total_params} (edited config or different weights?)"
        )
    return new_config, state, qc, fmt, res


def _renumber_ignore(ignore: Sequence[str], res: ResolvedArch) -> list[str]:
    """Module names of the parent -> of the sub-model (dropped layers vanish, kept ones are renumbered)."""
    new_index = {la.index: j for j, la in enumerate(res.kept)}
    out = []
    for name in ignore:
        m = _FILE_LAYER.match(name)
        if m is None:
            out.append(name)
        elif int(m.group(2)) in new_index:
            out.append(f"{m.group(1)}.layers.{new_index[int(m.group(2))]}.{m.group(3)}")
    return out


def extract_quantized_budget(
    quant_dir: str | Path, budget_name: str, out_dir: str | Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> Path:
    """Write ``budget_name`` of a quantized nested checkpoint as a standalone quantized checkpoint (sharded
    with an index above ``max_shard_size``, as ``save_pretrained`` shards).

    The result has the budget's plain ``nemotron_h`` config (no ``elastic`` section), the same
    ``quantization_config`` (module names renumbered when depth drops layers), the tokenizer files,
    and a manifest; it loads with :func:`~model.quant.checkpoint.load_quantized_model` and computes
    what the quantized nested model computes under the budget's hard mask.
    """
    from model.layout import tokenizer_files

    from .checkpoint import HF_QUANT_CONFIG
    from .modelopt import hf_quant_config, quantization_config_of

    src = Path(quant_dir)
    new_config, state, qc, fmt, res = _budget_state(src, budget_name)
    kv = "FP8" if isinstance(qc.get("kv_cache_scheme"), dict) else qc.get("kv_cache_scheme")
    hf = hf_quant_config(fmt, _renumber_ignore(qc.get("ignore") or [], res), kv)
    if (src / HF_QUANT_CONFIG).is_file():  # keep the producer the source records
        hf["producer"] = json.loads((src / HF_QUANT_CONFIG).read_text(encoding="utf-8")).get("producer", hf["producer"])
    return write_checkpoint(
        out_dir,
        state,
        new_config,
        metadata={"quant_algo": hf["quantization"]["quant_algo"]},
        extra_config={"quantization_config": quantization_config_of(hf)},
        extra_files=tokenizer_files(src),
        extra_json={HF_QUANT_CONFIG: hf},
        max_shard_size=max_shard_size,
    )


def load_quantized_budget(
    quant_dir: str | Path,
    budget_name: str,
    dtype: torch.dtype | None = None,
    cache_dequantized: bool = DEFAULT_CACHE_DEQUANTIZED,
) -> HybridLM:
    """The standalone quantized model of ``budget_name``, cut from the nested quantized checkpoint in memory."""
    src = Path(quant_dir)
    new_config, state, _, fmt, _ = _budget_state(src, budget_name)
    return build_quantized_model(new_config, state, fmt, dtype, cache_dequantized, f"{src} [{budget_name}]")
