"""Compiled decode steps: a whole step, of one row or several, as one compiled call (CPU).

Besides reading its weights, a decode step of the eager plan pays on a CPU for the interpreter and the
dispatch of some thirty small operators per layer, for library GEMV kernels that read weights below the
machine's bandwidth on small shapes and, with several rows, for one pass over memory per operator of the
Mamba states' update. Here the step is the pure tensor functions of :mod:`model.decode.step_functions`,
compiled with ``torch.compile`` (inductor, whole graph) as one function
(:func:`~model.decode.step_functions.step`): every layer's norms, activations, conv / SSM updates, routing
and (for one row) GEMVs run as generated C++ loops, and each attention layer writes its key and value into
its KV buffer in place and attends the buffer's written slots (:func:`~model.decode.step_functions.attend`).
The history's length is data (a slot index), and the buffer's capacity, which doubles as the history grows
(:meth:`KVCache.reserve <model.cache.KVCache.reserve>`, outside the graph), is a dynamic dimension: one graph
per model shape serves every length. One call per token instead of several hundred operators.

One row (a stream decoding alone: the latency case, where dispatch weighs most) and several rows are two
graphs. In the second the row count is dynamic too (marked on every per-row argument), so one graph serves
every batch of two rows or more, with or without left padding (:class:`~model.cache.KVCache`'s ``pad``): no
batch-size buckets to compile, none to pad to. Its projections are GEMMs (each weight read once for all
rows: AMX operators for bfloat16 where the CPU has AMX, :mod:`model.decode.dot_bf16`, library GEMMs
otherwise) and its routed experts a grouped GEMM (half precision) or the dense pass (float32).

The generated GEMV streams an outputs-major contiguous matrix fastest. Weights stored otherwise, as a budget
view's are (inputs-major, runs of rows, row prefixes, strided expert stacks: :mod:`model.decode.budget_view`),
are read through outputs-major copies, made when the step is built within a memory bound
(:meth:`CompiledStep.copy_weights`), or as they are beyond it.

A step with a layer the compiled functions cannot read (a hooked or quantized projection, quantized or
observed experts, an unknown layer kind) runs eagerly as a whole. Graphs are compiled once per process and
per distinct (shapes, strides, dtypes) of their arguments, so budgets of one shape share them; inductor keeps
the generated code in ``$TORCHINDUCTOR_CACHE_DIR`` (by default under the project's cache folder), so a later
process on the same machine compiles from it. :class:`~model.decode.plan.DecodePlan` builds a
:class:`CompiledStep` when asked (``compiled=True``); :meth:`~model.decode.plan.DecodePlan.warm` compiles both
graphs and keeps each only where it measures faster than the eager steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from model.cache import HybridCache, MambaCache, canonical_strides
from model.cache_folder import cache_folder
from model.decode import dot_bf16, step_functions
from model.decode.kernels import PREPARED, Prepared, joined_weight, source_key, source_weight
from model.decode.layers import AttentionStep, MambaStep, MLPStep, MoEStep, ReferenceStep
from model.decode.ops import hooked
from model.decode.split_linear import ColSplitLinear, RowSplitLinear
from model.decode.step_functions import Projection
from model.decode.step_functions import step as step_function
from model.moe import Experts

RECOMPILE_LIMIT = 1024
"""Graphs kept for :func:`~model.decode.step_functions.step` in one process: one per model shape, dtype and
weight layout compiled (dynamo's default, 8, is fewer than a family's budgets in two dtypes; past the limit a
compiled call fails and the plan falls back to its eager steps)."""


# ---------------------------------------------------------------------- compiling
# Inductor's generated code is kept in the project's cache folder (a user's own setting wins), so that a later
# process on this machine reuses it instead of compiling again. Set on import: inductor writes its own default
# (a temporary folder) into the variable the first time anything asks for its cache folder, which a kernel
# measurement or a compiler check can do before the first compiled step.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_folder() / "inductor"))


def compiled_decode_default() -> bool:
    """Whether serving compiles its one-row decode steps unless told: yes, but ``STAR_ELASTIC_DECODE_COMPILE=0``
    says no (a test suite that starts many servers, a machine without a C++ compiler)."""
    return os.environ.get("STAR_ELASTIC_DECODE_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


INDUCTOR_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}
"""Inductor settings of the compiled step. ``cpp_wrapper``: the code that calls a graph's kernels is C++ rather
than Python, so a step costs no interpreter time between its kernels; paired against the Python wrapper on the
~115M bfloat16 family, 16-row steps ran 1.27x (full) and 1.17x (medium) faster, one-row steps showed no
consistent difference (benchmarks/RESULTS.md, "Inductor's C++ wrapper"; variant ``python_wrapper``)."""

_COMPILED: Callable[..., Any] | None = None


def compiled_step() -> Callable[..., Any]:
    """:func:`~model.decode.step_functions.step`, compiled (once per process; a graph per model shape and dtype,
    compiled on its first call; the KV buffers' capacity is the one dimension left dynamic, by the caller)."""
    global _COMPILED
    if _COMPILED is None:
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 16 * RECOMPILE_LIMIT)
        step_functions.DOT_BF16 = dot_bf16.available()
        step_functions.AMX_BF16 = dot_bf16.rows_available()
        step_functions.F32_ROWS = dot_bf16.f32_rows_available()
        _COMPILED = torch.compile(step_function, fullgraph=True, dynamic=False, options=dict(INDUCTOR_OPTIONS))
    return _COMPILED


def projection(module: nn.Module) -> Projection | None:
    """What a compiled step reads for ``module``, or None when it cannot read it (a hook watches it, or it is
    not a plain or split linear, e.g. quantized). A fresh prepared copy (:mod:`model.decode.kernels`) is read
    when it is an outputs-major matrix (the order the generated GEMV streams fastest); otherwise the weight,
    or a split projection's runs, as they are."""
    kind = type(module)
    if kind is not nn.Linear and kind is not RowSplitLinear and kind is not ColSplitLinear:
        return None
    if hooked(module):
        return None
    prepared: Prepared | None = module.__dict__.get(PREPARED)
    if (
        prepared is not None
        and prepared.kind == "transposed"
        and prepared.tensor.stride(-1) == 1
        and prepared.fresh(source_weight(module))
    ):
        bias = module._parameters["bias"] if kind is nn.Linear else prepared.bias
        return ("one", [prepared.tensor], [bias])
    if kind is nn.Linear:
        return ("one", [module._parameters["weight"]], [module._parameters["bias"]])
    if kind is RowSplitLinear:
        return ("rows", [w for w, _ in module.runs], [b for _, b in module.runs])
    return ("cols", list(module.runs), [module.bias])


# ---------------------------------------------------------------------- each layer's arguments
def state_layout(conv: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor]:
    """A Mamba layer's states in the one layout the compiled steps are compiled for and return: the conv state
    (rows, conv_dim, K-1) time-major in a buffer of its own, the SSM state (rows, heads, head_dim, state)
    row-major. A prefill leaves the conv state as a view of its last K-1 inputs, whose row stride is the
    prompt's length times conv_dim; read as it is, every prompt length would be a new graph (a compile at the
    first step after each new length), so such a state is copied once (a few KB)."""
    rows, channels, taps = conv.shape
    if conv.stride() != (channels * taps, 1, channels):
        fresh = conv.new_empty((rows, taps, channels))
        conv = fresh.copy_(conv.transpose(1, 2)).transpose(1, 2)
    if ssm.stride() != canonical_strides(tuple(ssm.shape)):
        ssm = ssm.new_empty(ssm.shape).copy_(ssm)
    return conv, ssm


ProjectionOf = Callable[[nn.Module], "Projection | None"]


def mlp_args(step: MLPStep, projection: ProjectionOf) -> tuple[Any, ...] | None:
    parts = step.mixer._modules
    up, down = projection(parts["up_proj"]), projection(parts["down_proj"])
    if up is None or down is None:
        return None
    return (step.norm_params["weight"], step.eps, up, down)


def mamba_args(
    step: MambaStep, layer: object, projection: ProjectionOf
) -> tuple[tuple[Any, ...], tuple[Tensor, ...]] | None:
    """:func:`~model.decode.step_functions.mamba_step`'s arguments after x for this layer, and its per-row
    arguments among them (the conv and SSM states: the very tensors passed, whose row dimension a several-rows
    graph marks dynamic), or None when it cannot run compiled (no state yet, a projection it cannot read)."""
    in_p, out_p = projection(step.in_proj), projection(step.out_proj)
    if not isinstance(layer, MambaCache) or in_p is None or out_p is None:
        return None
    if step.sources() != step.key:  # a weight was replaced (moved, cast, reassigned)
        step.derive()
    shape = (tuple(step.sizes), tuple(step.xbc_sizes), step.heads, step.head_dim, step.groups, step.state)
    conv, ssm = state_layout(layer.conv, layer.ssm)
    args = (
        step.norm_params["weight"],
        step.eps,
        in_p,
        conv,
        step.conv_weight,
        step.conv["bias"],
        step.dt_bias,
        step.A,
        step.D,
        ssm,
        step.norm_weight["weight"],
        step.norm_eps,
        out_p,
        (*shape, float(step.dt_min), float(step.dt_max)),
    )
    return args, (conv, ssm)


def moe_args(
    step: MoEStep, projection: ProjectionOf, experts_of: Callable[[Experts], tuple[Tensor, Tensor]]
) -> tuple[Any, ...] | None:
    gate, experts = step.gate, step.experts
    if step.mixer.observer is not None or gate.n_group > 1 or not isinstance(experts, Experts):
        return None  # observed, grouped routing, or quantized experts
    shared = None
    if step.shared is not None:
        parts = step.shared._modules
        up, down = projection(parts["up_proj"]), projection(parts["down_proj"])
        if up is None or down is None:
            return None
        shared = (up, down)
    up, down = experts_of(experts)
    return (
        step.norm_params["weight"],
        step.eps,
        gate._parameters["weight"],
        gate._buffers["e_score_correction_bias"],
        up,
        down,
        shared,
        (gate.top_k, bool(gate.norm_topk_prob), float(gate.scaling)),
    )


@dataclass
class Segment:
    """Layers ``layers`` (indices) run by one compiled call, ending in attention layer ``attention`` (its
    query, key and value) or, when None, in the final norm and the LM head."""

    layers: list[int]
    attention: int | None


class CompiledStep:
    """A decode plan's step, one row or several, as one compiled call (:func:`~model.decode.step_functions.step`):
    the runs of layers between attention layers (its segments), each attention layer's cache write and
    attention between them, as the eager steps do them. Built by :class:`~model.decode.plan.DecodePlan` from
    its eager steps, which it reads (their modules, their derived tensors) and falls back to."""

    def __init__(
        self, steps: list[ReferenceStep], norm_f: nn.Module, lm_head: nn.Module, max_copy_bytes: int = 0
    ) -> None:
        """``max_copy_bytes``: what the outputs-major copies of weights stored otherwise (:meth:`copy_weights`)
        may take."""
        self.steps, self.norm_f, self.lm_head = steps, norm_f, lm_head
        self.segments: list[Segment] = []
        current: list[int] = []
        for i, step in enumerate(steps):
            if type(step) is AttentionStep:
                self.segments.append(Segment(current, i))
                current = []
            else:
                current.append(i)
        self.segments.append(Segment(current, None))
        self.covered = all(type(s) in (MambaStep, MoEStep, MLPStep, AttentionStep) for s in steps)
        self.one_row = True  # which steps run compiled: one row, several rows (DecodePlan.warm decides)
        self.several_rows = True
        self._zeros: dict[tuple[int, torch.device, int], Tensor] = {}
        self.copies: dict[int, Prepared] = {}
        self.expert_copies: dict[int, tuple[Tensor, Tensor, tuple[int, ...]]] = {}
        self.copied_bytes = self.copy_weights(max_copy_bytes)

    def weights(self) -> tuple[list[nn.Module], list[Experts]]:
        """The projections and the routed experts the compiled step reads, in layer order, the head last."""
        linears: list[nn.Module] = []
        experts: list[Experts] = []
        for step in self.steps:
            if type(step) is MambaStep:
                linears += [step.in_proj, step.out_proj]
            elif type(step) is AttentionStep:
                linears += [step.q_proj, step.k_proj, step.v_proj, step.o_proj]
            elif type(step) is MoEStep:
                if isinstance(step.experts, Experts):
                    experts.append(step.experts)
                if step.shared is not None:
                    linears += [step.shared._modules["up_proj"], step.shared._modules["down_proj"]]
            elif type(step) is MLPStep:
                linears += [step.mixer._modules["up_proj"], step.mixer._modules["down_proj"]]
        return linears + [self.lm_head], experts

    @torch.no_grad()
    def copy_weights(self, max_copy_bytes: int) -> int:
        """Give the weights the generated GEMV would stream poorly an outputs-major contiguous copy, in layer
        order while ``max_copy_bytes`` lasts; returns the bytes copied.

        The loops stream a contiguous outputs-major matrix at the machine's bandwidth; a budget view's weights
        are other shapes of memory: inputs-major (a view's parent is re-laid so for the multi-row GEMMs),
        several runs of rows (grouped heads), a prefix of every row (a narrower hidden size), strided expert
        stacks. A copy is checked against its source's data pointer and version counter at every step (a
        changed weight is never read through a stale copy: the copy is dropped)."""
        used = 0
        linears, experts = self.weights()
        for m in linears:
            p = projection(m)
            if p is None or (p[0] == "one" and p[1][0].is_contiguous()):
                continue
            weight = source_weight(m)
            nbytes = m.out_features * m.in_features * weight.element_size()
            if used + nbytes > max_copy_bytes:
                continue
            if type(m) is nn.Linear:
                copy, bias = weight.detach().contiguous(), None
            else:
                joined, bias = joined_weight(m)
                copy = joined.contiguous()
            self.copies[id(m)] = Prepared("rows", copy, source_key(weight), nbytes, bias)
            used += nbytes
        for e in experts:
            up, down = e._parameters["up_proj"], e._parameters["down_proj"]
            nbytes = (up.numel() + down.numel()) * up.element_size()
            if (up.is_contiguous() and down.is_contiguous()) or used + nbytes > max_copy_bytes:
                continue
            self.expert_copies[id(e)] = (
                up.detach().contiguous(),
                down.detach().contiguous(),
                source_key(up) + source_key(down),
            )
            used += nbytes
        return used

    def projection(self, module: nn.Module) -> Projection | None:
        """:func:`projection`, reading the module's outputs-major copy when it has a fresh one."""
        copy = self.copies.get(id(module))
        if copy is not None:
            if copy.fresh(source_weight(module)) and not hooked(module):
                bias = module._parameters["bias"] if type(module) is nn.Linear else copy.bias
                return ("one", [copy.tensor], [bias])
            del self.copies[id(module)]
        return projection(module)

    def experts(self, experts: Experts) -> tuple[Tensor, Tensor]:
        """The routed experts' (up (E, F, H), down (E, H, F)) stacks: their fresh contiguous copies, or
        the parameters."""
        up, down = experts._parameters["up_proj"], experts._parameters["down_proj"]
        copy = self.expert_copies.get(id(experts))
        if copy is not None:
            if copy[2] == source_key(up) + source_key(down):
                return copy[0], copy[1]
            del self.expert_copies[id(experts)]
        return up, down

    def layer_args(
        self, cache: HybridCache, segment: Segment
    ) -> tuple[list[tuple[str, tuple[Any, ...]]], list[Tensor]] | None:
        """Each layer's (kind, arguments) for :func:`segment` and the per-row tensors among them (the Mamba
        states), or None when one cannot run compiled now."""
        out: list[tuple[str, tuple[Any, ...]]] = []
        per_row: list[Tensor] = []
        for i in segment.layers:
            step = self.steps[i]
            kind = type(step)
            if kind is MambaStep:
                built, name = mamba_args(step, cache.layers[i], self.projection), "mamba"
                if built is None:
                    return None
                args, states = built
                per_row += states
            elif kind is MoEStep:
                args, name = moe_args(step, self.projection, self.experts), "moe"
            else:
                args, name = mlp_args(step, self.projection), "mlp"
            if args is None:
                return None
            out.append((name, args))
        return out, per_row

    def arguments(
        self, x: Tensor, cache: HybridCache
    ) -> list[tuple[list[tuple[str, tuple[Any, ...]]], Any, list[Tensor]]] | None:
        """Every segment's (layer arguments for :func:`~model.decode.step_functions.segment`, then its attention
        layer's q, k, v, o projections, or the LM head's projection for the last segment, then the per-row
        tensors among its layer arguments: :meth:`layer_args`), or None when this step cannot run compiled: a row
        count it is switched off for (:attr:`one_row`, :attr:`several_rows`), a layer kind or a projection it
        cannot read (a hook watches it, quantized), an attention cache not started (no prefill)."""
        if not self.covered or not (self.one_row if x.shape[0] == 1 else self.several_rows):
            return None
        plan = []
        for seg in self.segments:
            if seg.attention is not None:
                layer = cache.layers[seg.attention]
                step = self.steps[seg.attention]
                ps = [self.projection(m) for m in (step.q_proj, step.k_proj, step.v_proj, step.o_proj)]
                if layer is None or layer.length == 0 or any(p is None for p in ps):
                    return None
            else:
                ps = self.projection(self.lm_head)
                if ps is None:
                    return None
            built = self.layer_args(cache, seg)
            if built is None:
                return None
            layers, per_row = built
            plan.append((layers, ps, per_row))
        return plan

    def runs(self, x: Tensor, cache: HybridCache) -> bool:
        """Whether a step on this embedded token x (rows, hidden) and this cache runs compiled."""
        return self.arguments(x, cache) is not None

    def no_pad(self, rows: int, device: torch.device, layer: int) -> Tensor:
        """(rows,) zeros: the padding of rows that have none (one graph for padded and unpadded batches); one
        tensor per attention layer, as a padded cache has (a graph guards on which arguments are one tensor:
        zeros shared by the layers would make the graph for padded batches another one)."""
        key = (rows, device, layer)
        zeros = self._zeros.get(key)
        if zeros is None:
            zeros = self._zeros[key] = torch.zeros(rows, dtype=torch.long, device=device)
        return zeros

    def __call__(self, x: Tensor, cache: HybridCache) -> tuple[Tensor, Tensor] | None:
        """x: (rows, hidden) embedded tokens -> (normed final hidden (rows, hidden), logits (rows, vocab)),
        advancing ``cache``; None (nothing done) when the step cannot run compiled (:meth:`arguments`).

        One row and several rows are separate graphs; in the latter the row count is a dynamic dimension
        (marked on every per-row argument), so one graph serves every batch of two rows or more."""
        plan = self.arguments(x, cache)
        if plan is None:
            return None
        rows = x.shape[0]
        mark = torch._dynamo.maybe_mark_dynamic
        if rows > 1:
            mark(x, 0)
        segments, attentions, kv_layers = [], [], []
        for seg, (layers, ps, per_row) in zip(self.segments, plan, strict=True):
            if rows > 1:  # the Mamba states
                for t in per_row:
                    mark(t, 0)
            if seg.attention is None:
                segments.append((layers, ("head", (self.norm_f._parameters["weight"], self.norm_f.eps, ps))))
                continue
            step, layer = self.steps[seg.attention], cache.layers[seg.attention]
            segments.append((layers, ("attention", (step.norm_params["weight"], step.eps, *ps[:3]))))
            layer.reserve(layer.length + 1)  # a full buffer doubles here, outside the graph
            # The capacity grows with the history: a dynamic dimension, so one graph serves every length.
            mark(layer.k, 2)
            mark(layer.v, 2)
            pad = layer.pad if layer.pad is not None else self.no_pad(rows, layer.k.device, seg.attention)
            if rows > 1:
                for t in (layer.k, layer.v, pad):
                    mark(t, 0)
            pos = torch.full((1,), layer.length, dtype=torch.long, device=layer.k.device)
            attentions.append((layer.k, layer.v, pos, pad, (step.kv, step.heads, step.d), ps[3]))
            kv_layers.append(layer)
        _, (h, logits) = compiled_step()(x, segments, attentions)
        for seg, (_, _, per_row) in zip(self.segments, plan, strict=True):  # states updated in place
            mambas = [i for i in seg.layers if type(self.steps[i]) is MambaStep]
            for i, conv, ssm in zip(mambas, per_row[0::2], per_row[1::2], strict=True):
                layer = cache.layers[i]
                if layer.conv is not conv or layer.ssm is not ssm:  # laid out anew by state_layout
                    cache.layers[i] = MambaCache(conv, ssm)
        for layer in kv_layers:
            layer.length += 1
        return h, logits


__all__ = [
    "CompiledStep",
    "compiled_decode_default",
    "compiled_step",
    "projection",
    "state_layout",
]
