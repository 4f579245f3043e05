"""Mamba2 mixer (nemotron_h layout): in_proj -> [z | x | B | C | dt], causal conv, SSD scan, gated norm.

Steps, numbered as in the forward pass:
1. ``in_proj`` splits into z (d_inner), xBC (d_inner + 2*G*N) and dt (H).
2. Depthwise causal conv (kernel K, with bias) and SiLU over xBC.
3. ``dt = clamp(softplus(dt + dt_bias))``, ``A = -exp(A_log)``; the SSD scan gives y, plus ``D * x``.
4. Gated group RMSNorm of ``y * silu(z)`` (group size d_inner / G), then ``out_proj``.

Heads are group-major: group g owns heads ``g*H/G .. (g+1)*H/G - 1``. :meth:`Mamba2Mixer.forward`
runs the chunked scan over a sequence; :meth:`Mamba2Mixer.step` the same steps for one cached token
(the recurrence advanced by :func:`~model.ssd.ssd_step`, the one step every decode path uses).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import MambaCache
from model.config import HybridConfig
from model.masks import active_fraction
from model.norms import GatedGroupRMSNorm
from model.ssd import ssd_scan, ssd_step

try:  # GPU kernels for the conv; optional, same function as the torch path.
    from causal_conv1d import causal_conv1d_fn as _causal_conv1d_kernel
except ImportError:  # pragma: no cover - CPU installs never have it
    _causal_conv1d_kernel = None


def _cpu_chunk_size(seqlen: int, chunk_size: int) -> int:
    """Chunk length of the PyTorch scan on CPU: 16 up to 256 tokens, else 32 (never above ``chunk_size``).

    The chunked scan's result does not depend on the chunk length (up to rounding), only its cost
    does: the per-chunk (L, L) decay blocks shrink with L while the chunk-to-chunk pass grows with the
    number of chunks; short chunks win on a CPU until the number of chunks dominates.
    GPUs keep the configured length (it is the Triton kernel's tile).
    """
    return min(chunk_size, 16 if seqlen <= 256 else 32)


def conv_step(state: Tensor, xbc: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The causal depthwise conv at one new position (no activation); shared by every decode path.

    state: (b, conv_dim, K-1) the previous K-1 inputs, any layout; xbc: (b, conv_dim) the new input;
    weight: (conv_dim, 1, K); bias: (conv_dim,) or None. Returns the conv output (b, conv_dim) and the new
    state (b, conv_dim, K-1), a view of the window, time-major in memory like the forward's. The window is
    built time-major, (b, K, conv_dim): the K-term sum then runs across rows and vectorises over channels.
    """
    window = torch.cat([state.transpose(1, 2), xbc.unsqueeze(1)], dim=1)  # (b, K, conv_dim)
    taps = weight.squeeze(1).t().contiguous()  # (K, conv_dim): a contiguous operand keeps the product vectorised
    out = (window * taps).sum(1)
    if bias is not None:
        out += bias
    return out, window[:, 1:].transpose(1, 2)


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

    def _conv(self, xbc: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """Causal depthwise conv + SiLU over time.

        xbc: (b, l, conv_dim) conv inputs; prev: (b, conv_dim, K-1) the inputs before them (None: zeros).
        Returns the activated output (b, l, conv_dim), contiguous, and the last K-1 inputs
        (b, conv_dim, K-1), a view, for the decoding cache.
        """
        K, seq = self.kernel, xbc.shape[1]
        if prev is None:
            hist = F.pad(xbc, (0, 0, K - 1, 0))  # (b, K-1+l, conv_dim)
        else:
            hist = torch.cat([prev.transpose(1, 2), xbc], dim=1)
        state = hist[:, seq:].transpose(1, 2)
        if _causal_conv1d_kernel is not None and xbc.is_cuda and prev is None:
            out = _causal_conv1d_kernel(
                xbc.transpose(1, 2).contiguous(), self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu"
            )
            return out.transpose(1, 2), state
        # K shifted multiply-adds in time-major layout rather than F.conv1d: same sums, the output comes out
        # (b, l, conv_dim) contiguous for the scan, and the backward is elementwise (cheaper than conv1d's
        # depthwise backward).
        w = self.conv1d.weight[:, 0].t()  # (K, conv_dim)
        bias = self.conv1d.bias
        out = hist[:, :seq] * w[0] if bias is None else torch.addcmul(bias, hist[:, :seq], w[0])
        for k in range(1, K):
            out = torch.addcmul(out, hist[:, k : k + seq], w[k])
        return F.silu(out), state

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
        if cache is not None and hidden.shape[1] == 1:
            out, new_cache = self.step(hidden[:, 0], cache, head_mask)
            return out[:, None], new_cache
        seq = hidden.shape[1]
        z, xbc, dt = self._split(self.in_proj(hidden))  # 1.
        xbc_act, conv_state = self._conv(xbc, cache.conv if cache is not None else None)  # 2.
        x, B, C, dt, A = self._ssm_inputs(xbc_act, dt)  # 3.
        init = cache.ssm if cache is not None else None
        chunk = self.chunk_size if hidden.is_cuda else _cpu_chunk_size(seq, self.chunk_size)
        y, final = ssd_scan(x, dt, A, B, C, chunk_size=chunk, D=self.D.float(), initial_state=init)
        new_cache = None
        if use_cache or cache is not None:  # an own copy of the last K-1 inputs, time-major
            conv_state = conv_state.transpose(1, 2).contiguous().transpose(1, 2)
            new_cache = MambaCache(conv_state, final.contiguous())
        return self._output(y.to(hidden.dtype), z, head_mask), new_cache  # 4.

    def step(self, hidden: Tensor, cache: MambaCache, head_mask: Tensor | None = None) -> tuple[Tensor, MambaCache]:
        """One decode token: hidden (b, hidden_size) -> (output (b, hidden_size), updated cache).

        The forward's steps 1-4 for a single position, through the two single-step functions every decode
        path shares: :func:`conv_step` (the K-tap dot product of each channel's window) and
        :func:`~model.ssd.ssd_step`. The cache passed in is not modified.
        """
        z, xbc, dt = self._split(self.in_proj(hidden))  # 1.
        conv, conv_state = conv_step(cache.conv, xbc, self.conv1d.weight, self.conv1d.bias)  # 2.
        x, B, C, dt, A = self._ssm_inputs(F.silu(conv), dt)  # 3.
        y, ssm = ssd_step(cache.ssm, x, dt, A, B, C, D=self.D)
        out = self._output(y.to(hidden.dtype), z, head_mask)  # 4.
        return out, MambaCache(conv_state, ssm)

    def _output(self, y: Tensor, z: Tensor, head_mask: Tensor | None) -> Tensor:
        """y: (b, l, H, P) -> gated group norm -> out_proj: (b, l, hidden)."""
        fraction = None
        if head_mask is not None:
            y = y * head_mask.to(y.dtype)[:, None]
            fraction = active_fraction(head_mask, self.n_groups)  # heads are group-major, the same k per group
        y = y.reshape(*y.shape[:-2], self.d_inner)
        return self.out_proj(self.norm(y, z, fraction))
