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
from model.fastops import linear, rms_norm_rows
from model.masks import active_fraction
from model.norms import GatedGroupRMSNorm
from model.ssd import ssd_scan, ssd_step, ssd_step_inplace

try:  # GPU kernels for the conv; optional, same function as the torch path.
    from causal_conv1d import causal_conv1d_fn as _causal_conv1d_kernel
except ImportError:  # pragma: no cover - CPU installs never have it
    _causal_conv1d_kernel = None


_ELEMENTWISE_STATE = 4096
"""SSM state elements (batch x heads x head_dim x state) from which a decode step updates and reads the state
with elementwise kernels rather than batched matmuls (below it, one row of a small model, the matmuls are
as fast and take fewer dispatches)."""


def _cpu_chunk_size(seqlen: int, chunk_size: int) -> int:
    """Chunk length of the PyTorch scan on CPU: 16 up to 256 tokens, else 32 (never above ``chunk_size``).

    The chunked scan's result does not depend on the chunk length (up to rounding), only its cost
    does: the per-chunk (L, L) decay blocks shrink with L while the chunk-to-chunk pass grows with the
    number of chunks. Measured per scan (8 heads of 16 x 16 state, one CPU thread), chunk 16 / 32 / 64:
    16 x 64 tokens 4.7 / 7.2 / 7.7 ms, 2 x 1024 tokens 5.1 / 5.5 / 8.1 ms, 1 x 4096 tokens 15.9 / 12.4 / 20.0 ms.
    GPUs keep the configured length (it is the Triton kernel's tile).
    """
    return min(chunk_size, 16 if seqlen <= 256 else 32)


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
        self._derived_cache: tuple = ()  # weight-derived tensors of a decode step, see _derived
        self._derived_key: tuple | None = None

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
        # (b, l, conv_dim) contiguous for the scan, and the backward is elementwise (2x faster than
        # conv1d's depthwise backward for forward + backward, measured at 16 x 64 tokens).
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
        b, seq, _ = hidden.shape
        z, xbc, dt = self._split(self.in_proj(hidden))  # 1.
        if cache is not None and seq == 1:
            return self._step(z, xbc, dt, cache, head_mask)
        xbc_act, conv_state = self._conv(xbc, cache.conv if cache is not None else None)  # 2.
        x, B, C, dt, A = self._ssm_inputs(xbc_act, dt)  # 3.
        init = cache.ssm if cache is not None else None
        chunk = self.chunk_size if hidden.is_cuda else _cpu_chunk_size(seq, self.chunk_size)
        y, final = ssd_scan(x, dt, A, B, C, chunk_size=chunk, D=self.D.float(), initial_state=init)
        new_cache = None
        if use_cache or cache is not None:  # own copy of the last K-1 inputs, time-major like _step's
            conv_state = conv_state.transpose(1, 2).contiguous().transpose(1, 2)
            final = final.contiguous()
            if cache is not None and final.data_ptr() == cache.ssm.data_ptr():
                final = final.clone()  # an empty input hands the initial state back; never share it
            new_cache = MambaCache(conv_state, final, owned=True)
        return self._output(y.to(hidden.dtype), z, head_mask), new_cache

    def _step(
        self, z: Tensor, xbc: Tensor, dt: Tensor, cache: MambaCache, head_mask: Tensor | None
    ) -> tuple[Tensor, MambaCache]:
        """One decode token: z (b,1,d_inner), xbc (b,1,conv_dim), dt (b,1,H).

        The conv window is built time-major, (b, K, conv_dim): the K-term sum then runs across rows,
        which vectorises over channels (~3x faster at batch 16 than summing K contiguous values per
        channel). The new conv state is a (b, conv_dim, K-1) view of it, time-major in memory.
        """
        window = torch.cat([cache.conv.transpose(1, 2), xbc], dim=1)  # (b, K, conv_dim)
        conv = (window * self.conv1d.weight[:, 0].t().contiguous()).sum(1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        x, B, C, dt, A = self._ssm_inputs(F.silu(conv), dt[:, 0])
        ssm = cache.ssm
        if cache.owned and not torch.is_grad_enabled() and ssm.dtype == torch.float32 and ssm.is_contiguous():
            y = ssd_step_inplace(ssm, x, dt, A, B, C, D=self.D.float())
        else:
            y, ssm = ssd_step(ssm, x, dt, A, B, C, D=self.D.float())
        out = self._output(y.unsqueeze(1).to(z.dtype), z, head_mask)
        return out, MambaCache(window[:, 1:].transpose(1, 2), ssm, owned=True)

    def _derived(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor, Tensor]:
        """Tensors a decode step derives from the weights, rebuilt only when a weight changes.

        Returns ``taps_t`` (K, conv_dim), the conv weight time-major and contiguous; ``taps_c`` (conv_dim, K, 1),
        a view of it; the conv bias as ``bias`` (conv_dim,) and ``bias_c`` (conv_dim, 1, 1), or None; ``A``
        (H, 1, 1) = -exp(A_log); ``D_flat`` (d_inner,) = D repeated over each head's channels.
        The key holds every source's storage pointer (a replaced tensor) and the version counters of those
        whose values are copied (an in-place update: optimiser step, ``load_state_dict``), so a step pays
        neither the copies nor the view operators. Parameters are read from ``_parameters`` / ``_modules``:
        attribute access on a module costs a failed lookup first (about a microsecond), many times per step.
        """
        params = self._parameters
        conv = self._modules["conv1d"]
        a_log, d = params["A_log"], params["D"]
        w, bias = conv._parameters["weight"], conv._parameters["bias"]
        try:
            key = (
                w.data_ptr(),
                w._version,
                a_log.data_ptr(),
                a_log._version,
                d.data_ptr(),
                d._version,
                bias is None or bias.data_ptr(),
            )
        except RuntimeError:  # inference-mode tensors have no version counter: derive them every time
            key = None
        if key is None or key != self._derived_key:
            w = w.detach()
            c, h = self.conv_dim, self.num_heads
            self._derived_cache = (
                w[:, 0].t().contiguous(),
                w.reshape(c, -1, 1),
                None if bias is None else bias.detach(),
                None if bias is None else bias.detach().view(c, 1, 1),
                -torch.exp(a_log.detach().float()).view(h, 1, 1),
                d.detach().repeat_interleave(self.head_dim),
            )
            self._derived_key = key
        return self._derived_cache

    def decode_step(self, hidden: Tensor, cache: MambaCache, residual: Tensor) -> tuple[Tensor, MambaCache]:
        """One cached decode token without masks, as few operators as possible.

        hidden, residual: (b, hidden_size) -> (residual + out (b, hidden_size), updated cache): what
        :meth:`forward` computes for a (b, 1, hidden_size) input, up to float rounding, added onto the
        residual stream by ``out_proj``'s GEMM. States the model did not create itself, or that are not
        contiguous float32, take :meth:`_step`.
        """
        b = hidden.shape[0]
        modules = self._modules
        proj = linear(modules["in_proj"], hidden)  # (b, d_inner + conv_dim + H)
        z, xbc, dt = proj.split_with_sizes([self.d_inner, self.conv_dim, self.num_heads], -1)
        ssm = cache.ssm
        if not (cache.owned and proj.dtype == ssm.dtype == torch.float32 and ssm.is_contiguous()):
            out, new = self._step(z[:, None], xbc[:, None], dt[:, None], cache, None)
            return residual + out[:, 0], new
        taps_t, taps_c, bias, bias_c, A, D_flat = self._derived()
        c = self.conv_dim
        if b == 1:
            # Channel-major window (1, conv_dim, K): the K-tap dot product of every channel, plus its bias,
            # is one batched matmul (conv_dim batches of (1, K) @ (K, 1)) on a view of the conv weight.
            window = torch.cat([cache.conv, xbc.unsqueeze(-1)], dim=-1)
            if bias_c is None:
                conv = torch.bmm(window.view(c, 1, -1), taps_c).view(1, c)
            else:
                conv = torch.baddbmm(bias_c, window.view(c, 1, -1), taps_c).view(1, c)
            conv_state = window.narrow(2, 1, self.kernel - 1)
        else:
            # Time-major window (b, K, conv_dim): the K-term sum runs across rows, which vectorises over
            # channels (~3x faster at batch 16 than summing K contiguous values per channel).
            window = torch.cat([cache.conv.transpose(1, 2), xbc.unsqueeze(1)], dim=1)
            conv = (window * taps_t).sum(1)
            if bias is not None:
                conv += bias
            conv_state = window[:, 1:].transpose(1, 2)
        gn, h, p, g, n = self.n_groups * self.state_size, self.num_heads, self.head_dim, self.n_groups, self.state_size
        x, B, C = F.silu(conv, inplace=True).split_with_sizes([self.d_inner, gn, gn], -1)
        dt = F.softplus(dt + self._parameters["dt_bias"]).clamp_(self.dt_min, self.dt_max).view(b, h, 1, 1)
        # SSM update in place (ssd_step_inplace's arithmetic): decay, then += dt * x (outer) B per group;
        # y = state . C + D * x. The heads of a group are the rows of one (hpg * p, n) block per batch row.
        # dt and A are shaped to broadcast over (b, h, p, n) as they are: no view operators in between.
        ssm.mul_(torch.exp(dt * A))
        xdt = x.view(b, h, p, 1) * dt  # (b, h, p, 1)
        if ssm.numel() >= _ELEMENTWISE_STATE:
            # broadcast multiply-add and a last-dim dot product: batched (rows, n) x (n, 1) GEMVs of tiny
            # matrices cost 2-3x more (measured at batch 16 and on 32 heads of 64 x 64 at batch 1)
            rows = ssm.view(b, g, -1, n)
            rows.addcmul_(xdt.view(b, g, -1, 1), B.view(b, g, 1, n))
            y = torch.linalg.vecdot(rows, C.view(b, g, 1, n)).view(b, -1).addcmul_(x, D_flat)
        else:
            rows = ssm.view(b * g, -1, n)
            rows.baddbmm_(xdt.view(b * g, -1, 1), B.reshape(b * g, 1, n))
            y = torch.baddbmm(torch.mul(x, D_flat).view(b * g, -1, 1), rows, C.reshape(b * g, n, 1)).view(b, -1)
        # gated group norm (GatedGroupRMSNorm without the mask and dtype branches)
        gated = F.silu(z).mul_(y)
        norm = modules["norm"]
        weight = norm._parameters["weight"]
        if g == 1:
            gated = rms_norm_rows(gated, weight, norm.eps)
        else:
            size = norm.group_size
            gated = weight * F.rms_norm(gated.view(b, -1, size), (size,), None, norm.eps).view(b, -1)
        return linear(modules["out_proj"], gated, residual), MambaCache(conv_state, ssm, owned=True)

    def _output(self, y: Tensor, z: Tensor, head_mask: Tensor | None) -> Tensor:
        """y: (b, l, H, P) -> gated group norm -> out_proj: (b, l, hidden)."""
        fraction = None
        if head_mask is not None:
            y = y * head_mask.to(y.dtype)[:, None]
            fraction = active_fraction(head_mask, self.n_groups)  # heads are group-major, the same k per group
        y = y.reshape(*y.shape[:-2], self.d_inner)
        return self.out_proj(self.norm(y, z, fraction))
