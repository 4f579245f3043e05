"""Model configuration: the Hugging Face ``nemotron_h`` ``config.json``, validated.

One pydantic model, :class:`HybridConfig`, holds every field that changes what the network computes.
``from_hf_dict`` / ``to_hf_dict`` translate to and from the ``config.json`` transformers'
``NemotronHForCausalLM`` reads and writes: both layer-layout spellings, every spelling of infinity,
legacy field names, bookkeeping keys kept verbatim; any other key is an error that names it.

What is accepted, in full: docs/checkpoints.md ("The model config").
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

LAYER_KINDS: dict[str, str] = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
"""Pattern character -> our layer kind."""

# transformers' tagged encoding of floats JSON cannot hold (transformers >= 5 writes ``inf`` this way).
_FLOAT_TAG = "__float__"
_FLOAT_TAG_VALUES = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
HUGE_FLOAT = 1e30
"""Finite stand-in for an infinite limit in the JSON we write; read back as ``inf``."""

# transformers' current list spelling, and the legacy one still found on the Hub.
_HF_LIST_NAMES = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
_HF_LIST_TO_CHAR = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "moe": "E",
    "mlp": "-",
}

# Legacy nemotron_h field names -> current ones.
_RENAMED = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "attention_head_dim": "head_dim",  # the first Nemotron-H releases' name for head_dim
}

# Keys a nemotron_h config.json may hold that do not change what the network computes.
PASSTHROUGH_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "num_logits_to_keep",
        "use_mamba_kernels",
        "mamba_ssm_cache_dtype",
        "attention_dropout",
        "hidden_dropout",
        "rescale_prenorm_residual",
        "sliding_window",
        "max_position_embeddings",
        "num_nextn_predict_layers",
        "mtp_layers_block_type",
        "mtp_hybrid_override_pattern",
        "moe_shared_expert_overlap",
        "expand",
        "mamba_proj_bias",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "chunk_size_feed_forward",
        "quantization_config",
        "output_router_logits",
        "elastic",
        # written by some transformers releases; bookkeeping only
        "_name_or_path",
        "_attn_implementation_autoset",
        "attn_implementation",
        "generation_config",
        # in publishers' nemotron_h configs, read by no nemotron_h implementation: the architecture has no
        # rotary embedding, its RMSNorms use layer_norm_epsilon, and Mamba2's dt is per head (no dt rank)
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "norm_eps",
        "rms_norm_eps",
        "time_step_rank",
    }
)


class HybridConfig(BaseModel):
    """Everything that decides the shapes and the arithmetic of a hybrid model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0, description="Vocabulary size (rows of the embedding and lm_head).")
    hidden_size: int = Field(gt=0, description="Residual stream width d_model.")
    pattern: str = Field(
        min_length=1,
        description="One character a layer: M Mamba2, * attention, E MoE, - dense MLP.",
    )
    layer_norm_epsilon: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    residual_in_fp32: bool = Field(False, description="Keep the residual stream in float32.")
    initializer_range: float = Field(0.02, gt=0, description="Std of the normal weight initialisation.")
    # attention
    num_attention_heads: int = Field(8, gt=0, description="Query heads per attention layer.")
    num_key_value_heads: int = Field(2, gt=0, description="Key/value heads (GQA groups).")
    head_dim: int = Field(64, gt=0, description="Width of one attention head.")
    attention_bias: Literal[False] = Field(False, description="nemotron_h attention has no biases.")
    # dense MLP
    intermediate_size: int = Field(256, gt=0, description="Hidden width of dense MLP ('-') layers.")
    mlp_bias: bool = Field(False, description="Bias on MLP and expert projections.")
    mlp_hidden_act: Literal["relu2"] = Field("relu2", description="Squared ReLU, as in nemotron_h.")
    # Mamba2
    mamba_num_heads: int = Field(8, gt=0, description="SSM heads per Mamba layer.")
    mamba_head_dim: int = Field(16, gt=0, description="Width of one SSM head.")
    n_groups: int = Field(1, gt=0, description="B/C groups; heads are laid out group-major.")
    ssm_state_size: int = Field(16, gt=0, description="SSM state size N.")
    conv_kernel: int = Field(4, gt=0, description="Depthwise causal conv kernel width.")
    use_conv_bias: bool = Field(True, description="Bias on the depthwise conv.")
    use_bias: bool = Field(False, description="Bias on Mamba in_proj/out_proj (nemotron_h's use_bias).")
    mamba_hidden_act: Literal["silu"] = Field("silu", description="Activation after the conv.")
    chunk_size: int = Field(64, gt=0, description="Chunk length of the chunked SSD scan.")
    time_step_min: float = Field(1e-3, gt=0, description="Lower clamp of dt after softplus; init range low.")
    time_step_max: float = Field(0.1, gt=0, description="Upper end of the dt initialisation range.")
    time_step_floor: float = Field(1e-4, gt=0, description="Floor of the initial dt.")
    time_step_limit: tuple[float, float] = Field(
        (0.0, math.inf), description="Upper clamp of dt after softplus is time_step_limit[1]."
    )
    # MoE
    n_routed_experts: int = Field(8, gt=0, description="Routed experts per MoE layer.")
    num_experts_per_tok: int = Field(2, gt=0, description="Top-k experts per token.")
    moe_intermediate_size: int = Field(64, gt=0, description="Hidden width of each routed expert.")
    n_shared_experts: Literal[0, 1] = Field(1, description="Always-on shared expert (0 or 1).")
    moe_shared_expert_intermediate_size: int = Field(128, gt=0, description="Shared expert width.")
    routed_scaling_factor: float = Field(1.0, gt=0, description="Multiplies the routed mixture.")
    n_group: int = Field(1, gt=0, description="Expert groups for group-limited routing.")
    topk_group: int = Field(1, gt=0, description="Expert groups kept per token.")
    norm_topk_prob: bool = Field(True, description="Renormalise the selected gate scores to sum 1.")
    moe_latent_size: int | None = Field(None, description="Latent MoE projection (unsupported if set).")
    # bookkeeping carried to and from config.json unchanged
    passthrough: dict[str, Any] = Field(default_factory=dict, description="Non-computational HF keys.")

    @model_validator(mode="after")
    def _check_consistency(self) -> HybridConfig:
        problems: list[str] = []
        bad = sorted({c for c in self.pattern if c not in LAYER_KINDS})
        if bad:
            problems.append(f"pattern: unknown layer characters {bad}; use M, *, E or -")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.mamba_num_heads % self.n_groups:
            problems.append(f"mamba_num_heads ({self.mamba_num_heads}) must be divisible by n_groups ({self.n_groups})")
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.n_routed_experts % self.n_group:
            problems.append(f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group")
        if self.topk_group > self.n_group:
            problems.append(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        if self.moe_latent_size is not None:
            problems.append("moe_latent_size: latent MoE projections are not supported; remove the key")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_hidden_layers(self) -> int:
        return len(self.pattern)

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer: ``mamba``, ``attention``, ``moe`` or ``mlp``."""
        return [LAYER_KINDS[c] for c in self.pattern]

    @property
    def mamba_d_inner(self) -> int:
        """Width of the Mamba x / z streams, ``mamba_num_heads * mamba_head_dim``."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the depthwise conv: ``[x | B | C]``."""
        return self.mamba_d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_in_proj_dim(self) -> int:
        """Rows of ``in_proj``: ``[z | x | B | C | dt]``."""
        return 2 * self.mamba_d_inner + 2 * self.n_groups * self.ssm_state_size + self.mamba_num_heads

    # ------------------------------------------------------------------ HF translation
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> HybridConfig:
        """Build from a ``nemotron_h`` config dict; unknown keys raise ``ValueError`` naming them.

        Accepts what any supported transformers release or the model's publisher writes (module
        docstring): tagged floats, both layer-layout spellings, legacy names, tied embeddings.
        """
        data = decode_special_floats(dict(raw))
        if data.get("model_type", "nemotron_h") != "nemotron_h":
            raise ValueError(f"model_type: expected 'nemotron_h', got {data['model_type']!r}")
        for old, new in _RENAMED.items():
            if old in data:
                value = data.pop(old)
                data.setdefault(new, value)
        pattern = _pattern_from(data)
        n_layers = data.pop("num_hidden_layers", None)
        if n_layers is not None and n_layers != len(pattern):
            raise ValueError(f"num_hidden_layers ({n_layers}) disagrees with the layer pattern ({len(pattern)} layers)")
        # The loader materialises a tied lm_head as its own tensor (see model.checkpoint.load_state), so
        # every model built from this config owns an untied lm_head and the key is written back false.
        tied = data.pop("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise ValueError(f"tie_word_embeddings: expected true or false, got {tied!r}")
        passthrough = {k: data.pop(k) for k in list(data) if k in PASSTHROUGH_KEYS}
        if "time_step_limit" in data and data["time_step_limit"] is None:
            del data["time_step_limit"]  # null: transformers' default, (0, inf)
        if "time_step_limit" in data:
            data["time_step_limit"] = _read_limit(data["time_step_limit"])
        data.pop("n_groups_moe", None)
        try:
            return cls(pattern=pattern, passthrough=passthrough, **data)
        except ValidationError as err:
            raise ValueError(_describe(err)) from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers' ``NemotronHConfig`` reads (both layout spellings)."""
        out: dict[str, Any] = {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
            "use_mamba_kernels": False,
        }
        out.update(self.passthrough)
        fields = self.model_dump(exclude={"pattern", "passthrough"})
        limit = fields.pop("time_step_limit")
        fields["time_step_limit"] = [limit[0], limit[1] if math.isfinite(limit[1]) else HUGE_FLOAT]
        fields.pop("moe_latent_size")
        out.update(fields)
        out["hybrid_override_pattern"] = self.pattern
        out["layers_block_type"] = [_HF_LIST_NAMES[c] for c in self.pattern]
        out["num_hidden_layers"] = self.num_hidden_layers
        out["mamba_n_groups"] = self.n_groups  # read by older transformers releases
        out["expand"] = max(1, self.mamba_d_inner // self.hidden_size)
        return out

    @classmethod
    def from_json_file(cls, path: str | Path) -> HybridConfig:
        return cls.from_hf_dict(read_hf_json(path))

    def to_json_file(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        data = self.to_hf_dict()
        if extra:
            data.update(extra)
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    def replace(self, **changes: Any) -> HybridConfig:
        """A validated copy with some fields changed."""
        data = self.model_dump()
        data.update(changes)
        return HybridConfig(**data)


def decode_special_floats(obj: Any) -> Any:
    """``obj`` with every ``{"__float__": "Infinity" | "-Infinity" | "NaN"}`` replaced by the float, recursively.

    transformers >= 5 writes floats that strict JSON cannot hold as such tagged objects (e.g.
    ``"time_step_limit": [0.0, {"__float__": "Infinity"}]``); older releases wrote the bare
    ``Infinity`` token, which ``json.load`` already reads as ``inf``.
    """
    if isinstance(obj, dict):
        if set(obj) == {_FLOAT_TAG}:
            tag = obj[_FLOAT_TAG]
            if tag not in _FLOAT_TAG_VALUES:
                raise ValueError(
                    f"{{{_FLOAT_TAG!r}: {tag!r}}}: unknown float tag; expected one of {sorted(_FLOAT_TAG_VALUES)}"
                )
            return _FLOAT_TAG_VALUES[tag]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [decode_special_floats(v) for v in obj]
    return obj


def read_hf_json(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` as a dict, with transformers' tagged floats decoded (:func:`decode_special_floats`)."""
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return decode_special_floats(raw)


def _read_limit(value: Any) -> tuple[float, float]:
    """``time_step_limit`` as two floats; an upper limit >= :data:`HUGE_FLOAT` (any spelling of inf) is ``inf``."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"time_step_limit: expected [low, high], got {value!r}")
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit: expected two numbers, got {value!r}") from None
    return low, (math.inf if high >= HUGE_FLOAT else high)


def _pattern_from(data: dict[str, Any]) -> str:
    """Pop the layer layout out of ``data`` as a pattern string."""
    pattern = data.pop("hybrid_override_pattern", None)
    blocks = data.pop("layers_block_type", None)
    # transformers maps ``layer_types`` onto ``layers_block_type`` (attribute_map); some writers use it
    alias = data.pop("layer_types", None)
    if blocks is None:
        blocks = alias
    elif alias is not None and alias != blocks:
        raise ValueError(f"layer_types ({alias!r}) disagrees with layers_block_type ({blocks!r}); keep one")
    if blocks is not None:
        if not isinstance(blocks, list):
            raise ValueError("layers_block_type: expected a list of layer type names")
        unknown = sorted({b for b in blocks if b not in _HF_LIST_TO_CHAR})
        if unknown:
            raise ValueError(f"layers_block_type: unknown names {unknown}; allowed {sorted(_HF_LIST_TO_CHAR)}")
        from_list = "".join(_HF_LIST_TO_CHAR[b] for b in blocks)
        if pattern is not None and pattern != from_list:
            raise ValueError(f"hybrid_override_pattern ({pattern!r}) disagrees with layers_block_type ({from_list!r})")
        return from_list
    if pattern is None:
        raise ValueError("hybrid_override_pattern: missing (or give layers_block_type)")
    return pattern


def _describe(err: ValidationError) -> str:
    """One line per problem, each naming its field."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        msg = "unknown key (not a nemotron_h field); remove it" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{loc}: {msg}")
    return "invalid nemotron_h config: " + "; ".join(lines)
