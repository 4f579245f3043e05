"""The hybrid Mamba2 / attention / MoE causal language model (nemotron_h layout).

``HybridLM.model.layers[i]`` is ``x = x + mixer(RMSNorm(x))`` with the mixer chosen
by the pattern character; then ``model.norm_f`` and an untied ``lm_head``.
Parameter names equal transformers' ``NemotronHForCausalLM`` state dict, so
checkpoints move between the two without renaming (see :mod:`model.checkpoint`).

Every forward optionally takes a :class:`~model.masks.ModelMask`: the full model
then computes the nested sub-model the masks describe (exactly, for hard masks).
This is the reference computation; :mod:`model.decode` computes its cached single-token
steps with fewer operators, from outside (this module does not import it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from model.attention import Attention
from model.cache import HybridCache, empty_cache
from model.checkpoint import CheckpointInfo, check_state, load_state, read_config, save_model
from model.config import HybridConfig
from model.mamba import Mamba2Mixer
from model.masks import LayerMask, ModelMask, NormFraction, active_fraction
from model.mlp import MLP
from model.moe import MoE
from model.norms import RMSNorm


@dataclass
class CausalLMOutput:
    """``logits`` (batch, seq, vocab), None when skipped; ``cache`` when decoding; ``hidden`` (batch, seq, hidden)
    if asked."""

    logits: Tensor | None
    cache: HybridCache | None = None
    hidden: Tensor | None = None


_FULL_LAYER = LayerMask()
"""No masks (every field None); shared, never modified."""


class Block(nn.Module):
    """Pre-norm residual block around one mixer."""

    def __init__(self, config: HybridConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        if kind == "mamba":
            self.mixer: nn.Module = Mamba2Mixer(config)
        elif kind == "attention":
            self.mixer = Attention(config)
        elif kind == "moe":
            self.mixer = MoE(config)
        elif kind == "mlp":
            self.mixer = MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        else:  # pragma: no cover - the config validator rejects other kinds
            raise ValueError(f"unknown layer kind {kind!r}")

    def forward(
        self,
        x: Tensor,
        cache: HybridCache | None,
        index: int,
        use_cache: bool,
        hidden_mask: Tensor | None,
        hidden_fraction: NormFraction | None,
        lmask: LayerMask | None,
    ) -> Tensor:
        """x: (batch, seq, hidden) -> same."""
        h = self.norm(x.to(self.norm.weight.dtype), hidden_fraction)
        lm = lmask if lmask is not None else _FULL_LAYER
        if self.kind in ("mamba", "attention"):
            head_mask = lm.mamba_heads if self.kind == "mamba" else lm.attn_heads
            layer_cache = cache[index] if cache is not None else None
            h, new = self.mixer(h, layer_cache, use_cache or cache is not None, head_mask)
            if cache is not None:
                cache[index] = new
        elif self.kind == "moe":
            h = self.mixer(h, lm.experts, lm.ffn, lm.shared_ffn)
        else:
            h = self.mixer(h, lm.ffn)
        if hidden_mask is not None:
            h = h * hidden_mask.to(h.dtype)
        if lm.keep is not None:
            h = h * lm.keep.to(h.dtype)
        return x + h.to(x.dtype)


class Backbone(nn.Module):
    """Embeddings, blocks and the final norm (``model.`` in the nemotron_h state dict)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, kind) for kind in config.layer_kinds)
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class HybridLM(nn.Module):
    """Causal LM. ``forward(input_ids)`` -> :class:`CausalLMOutput` with ``logits`` (batch, seq, vocab)."""

    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward (``torch.utils.checkpoint``, non-reentrant) instead
    of keeping them: a training forward then holds one (batch, seq, hidden) input per block plus one block's
    intermediates. Same gradients; one extra block forward per block in the backward. Set per instance."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # ------------------------------------------------------------------ construction
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> HybridLM:
        """nemotron_h's initialisation, deterministic by ``seed``."""
        g = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * std)
            elif isinstance(module, nn.Conv1d):
                bound = 1.0 / math.sqrt(module.weight.shape[-1])
                module.weight.copy_((torch.rand(module.weight.shape, generator=g) * 2 - 1) * bound)
                if module.bias is not None:
                    module.bias.copy_((torch.rand(module.bias.shape, generator=g) * 2 - 1) * bound)
        for block in self.model.layers:
            mixer = block.mixer
            if isinstance(mixer, Mamba2Mixer):
                mixer.reset_parameters(self.config, g)
                mixer.A_log.copy_(torch.log(torch.arange(1, mixer.num_heads + 1, dtype=torch.float32)))
                mixer.D.fill_(1.0)
                # GPT-2 style residual scaling of the output projection
                w = mixer.out_proj.weight
                bound = 1.0 / math.sqrt(w.shape[1])
                w.copy_((torch.rand(w.shape, generator=g) * 2 - 1) * bound / math.sqrt(len(self.model.layers)))
            elif isinstance(mixer, MoE):
                mixer.experts.up_proj.copy_(torch.randn(mixer.experts.up_proj.shape, generator=g) * std)
                mixer.experts.down_proj.copy_(torch.randn(mixer.experts.down_proj.shape, generator=g) * std)
                # the router weight is a bare parameter (not nn.Linear): without this every score is 0.5
                mixer.gate.weight.copy_(torch.randn(mixer.gate.weight.shape, generator=g) * std)
                mixer.gate.e_score_correction_bias.zero_()
        return self

    @staticmethod
    def from_pretrained(path: str | Path, dtype: torch.dtype | None = None) -> HybridLM:
        """Load a nemotron_h checkpoint folder (safetensors + config.json); all-or-nothing.

        ``dtype=None`` keeps every tensor in its stored dtype (bf16 files give a bf16 model); a ``dtype``
        converts floating tensors as they are read (the router's bias stays float32). The model is built on
        the meta device and takes the loaded tensors as they are, so each is held once (see
        :func:`model.checkpoint.load_state` for the layouts accepted and the checks).
        """
        folder = Path(path)
        config, _ = read_config(folder)
        with torch.device("meta"):  # shapes only: every tensor is assigned from the files below
            model = HybridLM(config)
        model.load_state_dict(load_state(folder, model.state_dict(), dtype), strict=True, assign=True)
        return model.eval()

    @staticmethod
    def check_checkpoint(info: CheckpointInfo) -> int:
        """Raise :class:`~model.checkpoint.CheckpointError` naming every missing, unexpected or mis-shaped
        tensor of the dense checkpoint ``info`` describes (its headers against its config); returns its
        parameter count. No weight is read."""
        with torch.device("meta"):  # shapes only: the meta device allocates nothing
            model = HybridLM(info.config)
        check_state(model.state_dict(), info.dense_state(), str(info.folder))
        return model.num_parameters()

    def save_pretrained(self, path: str | Path, **kwargs) -> Path:
        """Write safetensors + config.json atomically. See :func:`model.checkpoint.save_model`."""
        return save_model(self, path, **kwargs)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        cache: HybridCache | None = None,
        use_cache: bool = False,
        mask: ModelMask | None = None,
        logits_to_keep: int = 0,
        return_hidden: bool = False,
        skip_logits: bool = False,
    ) -> CausalLMOutput:
        """input_ids: (batch, seq) long.

        ``use_cache=True`` (or passing ``cache``) returns the updated :class:`HybridCache`;
        ``logits_to_keep=n`` computes logits for the last n positions only (0: all);
        ``skip_logits=True`` returns the final hidden states and no logits (for a loss that applies
        ``lm_head`` itself, chunk by chunk: :mod:`model.elastic.kd_chunked`).
        """
        if use_cache and cache is None:
            cache = empty_cache(len(self.model.layers))
        x = self.model.embeddings(input_ids)
        hidden_mask = mask.hidden if mask is not None else None
        fraction = active_fraction(hidden_mask)
        if hidden_mask is not None:
            x = x * hidden_mask.to(x.dtype)
        if self.config.residual_in_fp32:
            x = x.float()
        recompute = self.gradient_checkpointing and torch.is_grad_enabled() and cache is None
        for i, block in enumerate(self.model.layers):
            lmask = mask.layer(i) if mask is not None else None
            if recompute:  # non-reentrant: gradients also reach the mask tensors inside lmask
                x = checkpoint(block, x, None, i, False, hidden_mask, fraction, lmask, use_reentrant=False)
            else:
                x = block(x, cache, i, use_cache, hidden_mask, fraction, lmask)
        if cache is not None:
            cache.seen_tokens += input_ids.shape[1]
        h = self.model.norm_f(x.to(self.model.norm_f.weight.dtype), fraction)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = None if skip_logits else self.lm_head(h)
        return CausalLMOutput(logits=logits, cache=cache, hidden=h if return_hidden or skip_logits else None)

    # ------------------------------------------------------------------ bookkeeping
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device
