"""Mamba2 mixer (nemotron_h layout): in_proj -> [z | x | B | C | dt], causal conv, SSD scan, gated norm.

Steps, numbered as in the forward pass:
1. ``in_proj`` splits into z (d_inner), xBC (d_inner + 2*G*N) and dt (H).
2. Depthwise causal conv (kernel K, with bias) and SiLU over xBC.
3. ``dt = clamp(softplus(dt + dt_bias))``, ``A = -exp(A_log)``; the SSD scan gives y, plus ``D * x``.
4. Gated group RMSNorm of ``y * silu(z)`` (group size d_inner / G), then ``out_proj``.

Heads are group-major: group g owns heads ``g*H/G .. (g+1)*H/G - 1``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import MambaCache
from model.config import HybridConfig
from model.norms import GatedGroupRMSNorm
from model.ssd import ssd_scan, ssd_step

try:  # GPU kernels for the conv; optional, same function as the torch path.
    from causal_conv1d import causal_conv1d_fn as _causal_conv1d_kernel
except ImportError:  # pragma: no cover - CPU installs never have it
    _causal_conv1d_kernel = None


class Mamba2Mixer(nn.Module):
    """One Mamba2 mixer. Input and output: (batch, seq, hidden)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = config
        self.hidden_size = c.hidden_size
        self.num_heads = c.mamba_num_heads
        self.head_dim = c.mamba_head_dim
        self.n_groups = c.n_groups
        self.state_size = c.ssm_state_size
        self.d_inner = c.mamba_d_inner
        self.conv_dim = c.mamba_conv_dim
        self.kernel = c.conv_kernel
        self.chunk_size = c.chunk_size
        self.dt_min = c.time_step_min
        self.dt_max = c.time_step_limit[1]
        self.in_proj = nn.Linear(c.hidden_size, c.mamba_in_proj_dim, bias=c.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.conv_kernel, groups=self.conv_dim, bias=c.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedGroupRMSNorm(self.d_inner, self.d_inner // self.n_groups, eps=c.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.d_inner, c.hidden_size, bias=c.use_bias)

    def reset_parameters(self, config: HybridConfig, generator: torch.Generator | None = None) -> None:
        """nemotron_h initialisation of dt_bias (inverse softplus of log-uniform dt)."""
        dt = torch.exp(
            torch.rand(self.num_heads, generator=generator)
            * (math.log(config.time_step_max) - math.log(config.time_step_min))
            + math.log(config.time_step_min)
        ).clamp(min=config.time_step_floor)
        with torch.no_grad():
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _split(self, proj: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return proj.split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)

    def _ssm_inputs(self, xbc: Tensor, dt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Split the activated conv output and discretise dt. Shapes: (b, l, ...) -> x (b,l,H,P), B/C (b,l,G,N)."""
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.d_inner, gn, gn], dim=-1)
        lead = x.shape[:-1]
        x = x.reshape(*lead, self.num_heads, self.head_dim)
        B = B.reshape(*lead, self.n_groups, self.state_size)
        C = C.reshape(*lead, self.n_groups, self.state_size)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        A = -torch.exp(self.A_log.float())
        return x, B, C, dt, A

    def _conv(self, xbc: Tensor, prev: Tensor | None) -> Tensor:
        """Causal depthwise conv + SiLU. xbc: (b, l, conv_dim); prev: (b, conv_dim, K-1) or None."""
        xt = xbc.transpose(1, 2)
        if _causal_conv1d_kernel is not None and xt.is_cuda and prev is None:
            out = _causal_conv1d_kernel(
                xt.contiguous(), self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu"
            )
            return out.transpose(1, 2)
        left = prev if prev is not None else xt.new_zeros(xt.shape[0], self.conv_dim, self.kernel - 1)
        out = F.conv1d(torch.cat([left, xt], dim=-1), self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        return F.silu(out).transpose(1, 2)

    def forward(
        self,
        hidden: Tensor,
        cache: MambaCache | None = None,
        use_cache: bool = False,
        head_mask: Tensor | None = None,
    ) -> tuple[Tensor, MambaCache | None]:
        """hidden: (batch, seq, hidden_size). ``head_mask`` (H,) zeroes/weights whole heads.

        Returns (output (batch, seq, hidden_size), the updated cache or None).
        """
        b, seq, _ = hidden.shape
        z, xbc, dt = self._split(self.in_proj(hidden))  # 1.
        if cache is not None and seq == 1:
            return self._step(z, xbc, dt, cache, head_mask)
        prev_conv = cache.conv if cache is not None else None
        xbc_act = self._conv(xbc, prev_conv)  # 2.
        x, B, C, dt, A = self._ssm_inputs(xbc_act, dt)  # 3.
        init = cache.ssm if cache is not None else None
        y, final = ssd_scan(x, dt, A, B, C, chunk_size=self.chunk_size, D=self.D.float(), initial_state=init)
        new_cache = None
        if use_cache or cache is not None:
            xt = xbc.transpose(1, 2)
            hist = xt if prev_conv is None else torch.cat([prev_conv, xt], dim=-1)
            conv_state = hist[..., -(self.kernel - 1) :]
            if conv_state.shape[-1] < self.kernel - 1:
                conv_state = F.pad(conv_state, (self.kernel - 1 - conv_state.shape[-1], 0))
            new_cache = MambaCache(conv_state.contiguous(), final)
        return self._output(y.to(hidden.dtype), z, head_mask), new_cache

    def _step(
        self, z: Tensor, xbc: Tensor, dt: Tensor, cache: MambaCache, head_mask: Tensor | None
    ) -> tuple[Tensor, MambaCache]:
        """One decode token: z (b,1,d_inner), xbc (b,1,conv_dim), dt (b,1,H)."""
        window = torch.cat([cache.conv, xbc.transpose(1, 2)], dim=-1)  # (b, conv_dim, K)
        conv = (window * self.conv1d.weight.squeeze(1)).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        x, B, C, dt, A = self._ssm_inputs(F.silu(conv), dt[:, 0])
        y, ssm = ssd_step(cache.ssm, x, dt, A, B, C, D=self.D.float())
        out = self._output(y.unsqueeze(1).to(z.dtype), z, head_mask)
        return out, MambaCache(window[..., 1:], ssm)

    def _output(self, y: Tensor, z: Tensor, head_mask: Tensor | None) -> Tensor:
        """y: (b, l, H, P) -> gated group norm -> out_proj: (b, l, hidden)."""
        fraction = None
        if head_mask is not None:
            y = y * head_mask.to(y.dtype)[:, None]
            fraction = head_mask.float().mean()
        y = y.reshape(*y.shape[:-2], self.d_inner)
        return self.out_proj(self.norm(y, z, fraction))
