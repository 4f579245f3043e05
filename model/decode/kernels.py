"""Each projection of a decode step on the fastest GEMV its machine has, chosen by measurement.

A single-token step multiplies one row by every weight matrix. Which library call does that fastest depends
on the matrix's shape and dtype and on the machine: on a 2-core AMD EPYC (avx512_bf16), for a (49152, 768)
float32 head ``F.linear`` on the outputs-major weight took 9.7 ms, on an inputs-major copy 6.3 ms, through
oneDNN's prepacked GEMM 5.0 ms; a (128, 768) float32 projection 6 us, 6 us and 14 us; and every bfloat16
shape 30-45% less through oneDNN than through ``F.linear``. So no one rule wins everywhere: for each
distinct projection shape of a model, :func:`prepare_decode_linears` times the candidates once (cached in
memory and in a JSON file per machine) and keeps, for each projection whose winner is not its own weight,
the copy that winner reads:

* ``weight``: the module's weight as stored, ``F.linear`` (no copy);
* ``transposed``: ``F.linear`` on a copy in the other memory order (inputs-major for an outputs-major weight,
  and back);
* ``onednn``: a copy prepacked for oneDNN's blocked GEMM (``torch.ops.mkldnn._linear_pointwise``, CPU only).

Copies cost memory: at most ``max_copy_bytes`` in all, the largest time saved per byte first; the report
says what was copied. A copy remembers its source's data pointer and version counter, so a weight changed in
place (an optimiser step, ``copy_``) or replaced is never read stale: :func:`prepared_linear` drops the copy
and the projection runs on its weight. Only the decode plan's steps read the copies (:func:`model.decode.ops.
linear`); the module's own forward, its parameters and its state dict are unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache_folder import cache_folder
from model.decode.split_linear import ColSplitLinear, RowSplitLinear

CANDIDATES = ("weight", "transposed", "onednn")
MARGIN = 0.10
"""A copy is kept only when its kernel measured at least this fraction faster than the weight itself: closer
calls are noise, and a copy costs memory."""
DEFAULT_MAX_COPY_BYTES = 4 << 30
MEASUREMENT = "interleaved-median-v3"
"""How the cached times were measured (part of the cache key): times taken another way are measured again."""
PREPARED = "_decode_prepared"
"""The ``module.__dict__`` key of a projection's prepared copy (read without ``nn.Module`` attribute lookup)."""


def _mkldnn_ok(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)


def layout(weight: Tensor) -> str:
    """``"out_in"`` for a weight (out, in) stored outputs-major (rows contiguous), else ``"in_out"``."""
    return "out_in" if weight.stride(-1) == 1 else "in_out"


def machine_key() -> str:
    """What the measurements hold for: CPU model, torch version and thread count."""
    model = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | torch {torch.__version__} | {torch.get_num_threads()} threads | {MEASUREMENT}"


def default_cache_file() -> Path:
    """``decode-kernels.json`` in the project's cache folder (:func:`model.cache_folder.cache_folder`)."""
    return cache_folder() / "decode-kernels.json"


# ---------------------------------------------------------------------- a prepared projection
@dataclass
class Prepared:
    """A projection's copy for its measured kernel; ``source``: its weight's (data pointer, version)."""

    kind: str
    tensor: Tensor
    source: tuple[int, int]
    nbytes: int
    bias: Tensor | None = None
    """A split projection's biases joined (its runs' biases are views of one parent bias); None for a plain
    ``nn.Linear``, whose own bias parameter is read at every call."""

    def fresh(self, weight: Tensor) -> bool:
        return source_key(weight) == self.source


def source_key(t: Tensor) -> tuple[int, int]:
    """A tensor's (data pointer, version counter): changes when it is replaced or written in place. An
    inference tensor (made under ``torch.inference_mode``) has no version counter and cannot be written in
    place outside it; its version reads as -1."""
    return (t.data_ptr(), -1 if t.is_inference() else t._version)


def source_weight(module: nn.Module) -> Tensor:
    """The tensor whose (data pointer, version) tells whether a copy of ``module``'s weight is fresh: the
    weight, or a split projection's first run (every run is a view of one parent weight, and views share
    their base's version counter)."""
    if type(module) is RowSplitLinear:
        return module.runs[0][0]
    if type(module) is ColSplitLinear:
        return module.runs[0]
    return module._parameters["weight"]


def joined_weight(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """A split projection as one (out, in) outputs-major weight and its bias (copies): the runs' rows (or
    columns) side by side, in the order the split computes them."""
    if type(module) is RowSplitLinear:
        weights = [w.detach() for w, _ in module.runs]
        biases = [b.detach() for _, b in module.runs if b is not None]
        return torch.cat(weights, 0), torch.cat(biases) if biases else None
    weights = [w.detach() for w in module.runs]
    return torch.cat(weights, 1), None if module.bias is None else module.bias.detach()


def make_copy(kind: str, weight: Tensor) -> Tensor:
    """The tensor candidate ``kind`` reads for ``weight`` (out, in): a view of the other memory order, or a
    oneDNN-packed opaque tensor."""
    w = weight.detach()
    if kind == "transposed":
        return w.t().contiguous().t() if layout(w) == "out_in" else w.contiguous()
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
    raise ValueError(f"unknown kernel {kind!r}; one of {CANDIDATES}")


def run_copy(kind: str, x: Tensor, copy: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    """x: (rows, in) -> (rows, out) through the copy, plus ``residual`` (rows, out) when given."""
    if kind == "transposed":
        if residual is not None and bias is None and residual.dtype == x.dtype:
            return F.linear(x, copy, residual)  # the residual is the GEMM's addend
        out = F.linear(x, copy, bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), copy, bias, "none", [], "")
    if residual is None:
        return out
    return out.add_(residual) if residual.dtype == out.dtype else residual + out


def prepared_linear(module: nn.Module, x: Tensor, residual: Tensor | None) -> Tensor | None:
    """``module(x) (+ residual)`` through the module's prepared copy; None when it has none (or its weight
    changed since, which drops the copy)."""
    prepared: Prepared | None = module.__dict__.get(PREPARED)
    if prepared is None:
        return None
    split = type(module) is not nn.Linear
    weight = source_weight(module) if split else module._parameters["weight"]
    if not prepared.fresh(weight) or x.dtype != weight.dtype:
        del module.__dict__[PREPARED]
        return None
    bias = prepared.bias if split else module._parameters["bias"]
    return run_copy(prepared.kind, x, prepared.tensor, bias, residual)


# ---------------------------------------------------------------------- measuring
def _calls_per_batch(fn: Callable[[], object], min_s: float) -> int:
    """How many calls of ``fn`` take at least ``min_s`` (after a few warm-up calls)."""
    for _ in range(3):
        fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_s:
        fn()
        calls += 1
    return max(calls, 1)


def _interleaved_median(
    fns: dict[str, Callable[[], object]], min_s: float = 0.004, rounds: int = 7
) -> dict[str, float]:
    """Seconds per call of each function: the median of ``rounds`` batches, the functions taking turns batch
    by batch (the order rotated each round). A burst of load from another process then lands on a batch or two
    of every candidate alike instead of on all of one candidate's batches, and the median leaves it out, so it
    cannot crown the wrong kernel for good (the result is cached per machine). The median rather than the
    fastest batch: a kernel's fixed cost per call shows in a step as it does in the typical batch."""
    calls = {k: _calls_per_batch(fn, min_s) for k, fn in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            fn, n = fns[k], calls[k]
            t = time.perf_counter()
            for _ in range(n):
                fn()
            times[k].append((time.perf_counter() - t) / n)
    return {k: statistics.median(v) for k, v in times.items()}


COLD_BYTES = 64 << 20
"""A measurement cycles through distinct weights of at least this many bytes in all, so that, as in a decode
step (which reads every weight of the model once), the weights come from memory rather than from cache."""


def measure(out: int, inn: int, dtype: torch.dtype, device: torch.device, source: str) -> dict[str, float]:
    """Microseconds per batch-1 call of each candidate for a weight (out, in) stored in ``source`` order,
    cycling through enough distinct weights to leave the caches (:data:`COLD_BYTES`); the candidates are
    timed in turns (:func:`_interleaved_median`)."""
    count = max(1, min(256, -(-COLD_BYTES // (out * inn * torch.finfo(dtype).bits // 8))))
    weights = []
    for _ in range(count):
        w = torch.randn(out, inn, device=device).to(dtype)
        weights.append(w.t().contiguous().t() if source == "in_out" else w)
    x = torch.randn(1, inn, device=device).to(dtype)
    kinds = [k for k in CANDIDATES if k != "onednn" or _mkldnn_ok(device, dtype)]
    with torch.inference_mode():
        copies = {k: weights if k == "weight" else [make_copy(k, w) for w in weights] for k in kinds}

        def calls(kind: str) -> Callable[[], None]:
            def run() -> None:
                for c in copies[kind]:
                    if kind == "weight":
                        F.linear(x, c)
                    else:
                        run_copy(kind, x, c, None, None)

            return run

        best = _interleaved_median({k: calls(k) for k in kinds})
    return {k: t / count * 1e6 for k, t in best.items()}


@dataclass
class KernelTable:
    """Measured microseconds per (shape, dtype, device, source order), in memory and in ``path`` (JSON, one
    section per :func:`machine_key`)."""

    path: Path | None = None
    entries: dict[str, dict[str, float]] = field(default_factory=dict)
    loaded: bool = False

    def _load(self) -> None:
        self.loaded = True
        if self.path is None or not self.path.exists():
            return
        with contextlib.suppress(OSError, ValueError):  # an unreadable cache is measured again
            self.entries.update(json.loads(self.path.read_text()).get(machine_key(), {}))

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            data = {}
        section = data.get(machine_key(), {})
        section.update(self.entries)  # another process's measurements are kept beside ours
        self.entries.update(section)
        data[machine_key()] = section
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def times(self, weight: Tensor) -> dict[str, float]:
        """Microseconds per call of each candidate for this weight's shape, dtype, device and order."""
        out, inn = weight.shape
        return self.times_for(out, inn, weight.dtype, weight.device, layout(weight))

    def times_for(self, out: int, inn: int, dtype: torch.dtype, device: torch.device, source: str) -> dict[str, float]:
        """Microseconds per call of each candidate for a weight (out, in) stored in ``source`` order."""
        if not self.loaded:
            self._load()
        key = f"{out}x{inn} {str(dtype).removeprefix('torch.')} {device.type} {source}"
        if key not in self.entries:
            self.entries[key] = measure(out, inn, dtype, device, source)
            self._save()
        return self.entries[key]


_TABLE_LOCK = threading.Lock()
_TABLE: KernelTable | None = None


def shared_table() -> KernelTable:
    """The process's table, on :func:`default_cache_file`."""
    global _TABLE
    with _TABLE_LOCK:
        if _TABLE is None:
            _TABLE = KernelTable(default_cache_file())
        return _TABLE


# ---------------------------------------------------------------------- preparing a model
@dataclass
class PrepareReport:
    """What :func:`prepare_decode_linears` did: projections per kernel, bytes copied, seconds taken."""

    kernels: dict[str, int] = field(default_factory=dict)
    copied_bytes: int = 0
    skipped_for_memory: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        parts = ", ".join(f"{k} {n}" for k, n in sorted(self.kernels.items()))
        mib = self.copied_bytes / 2**20
        return f"decode projections: {parts}; {mib:.1f} MiB of copies ({self.seconds:.2f}s)"


def projections(model: nn.Module) -> list[nn.Module]:
    """The plain ``nn.Linear`` modules of ``model`` and its split projections (:mod:`model.decode.split_linear`,
    a budget's view of a parent projection in several runs), each once, in module order. (A hooked one is
    called as a module by the decode step and never reads its copy.)"""
    seen, out = set(), []
    for m in model.modules():
        kind = type(m)
        plain = kind is nn.Linear and m.weight.dim() == 2
        if (plain or kind in (RowSplitLinear, ColSplitLinear)) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def default_copy_bytes() -> int:
    """The bound on a model's decode weight copies when none is given: ``STAR_ELASTIC_DECODE_COPY_MIB``, or
    4 GiB."""
    env = os.environ.get("STAR_ELASTIC_DECODE_COPY_MIB")
    return int(float(env) * 2**20) if env else DEFAULT_MAX_COPY_BYTES


def _shape(module: nn.Module) -> tuple[int, int]:
    return (module.out_features, module.in_features)


def prepare_decode_linears(
    model: nn.Module, table: KernelTable | None = None, max_copy_bytes: int | None = None
) -> PrepareReport:
    """Give every projection of ``model`` its measured fastest kernel (see the module docstring).

    Idempotent: a projection with a fresh copy keeps it. ``max_copy_bytes`` (default 4 GiB, or
    ``STAR_ELASTIC_DECODE_COPY_MIB``) bounds the copies; 0 turns them off.
    """
    start = time.perf_counter()
    if max_copy_bytes is None:
        max_copy_bytes = default_copy_bytes()
    table = table or shared_table()
    report = PrepareReport()
    wanted: list[tuple[float, nn.Linear, str, int]] = []
    used = 0
    for m in projections(model) if max_copy_bytes > 0 else []:
        weight = source_weight(m)
        if weight.device.type != "cpu":  # measured for CPU kernels; CUDA's GEMV is cuBLAS's either way
            continue
        current: Prepared | None = m.__dict__.get(PREPARED)
        if current is not None and current.fresh(weight):
            used += current.nbytes
            report.kernels[current.kind] = report.kernels.get(current.kind, 0) + 1
            continue
        m.__dict__.pop(PREPARED, None)
        out_f, in_f = _shape(m)
        split = type(m) is not nn.Linear
        # A split projection runs one GEMM per run on strided views of an inputs-major parent: never faster
        # than one GEMM on the whole inputs-major matrix, whose time stands for it here.
        times = table.times_for(out_f, in_f, weight.dtype, weight.device, "in_out" if split else layout(weight))
        best = min(times, key=times.__getitem__)
        if best == "weight" or times[best] > (1 - MARGIN) * times["weight"]:
            report.kernels["weight"] = report.kernels.get("weight", 0) + 1
            continue
        nbytes = out_f * in_f * weight.element_size()
        wanted.append(((times["weight"] - times[best]) / nbytes, m, best, nbytes))
    for _, m, kind, nbytes in sorted(wanted, key=lambda t: -t[0]):
        if used + nbytes > max_copy_bytes:
            report.skipped_for_memory += 1
            report.kernels["weight"] = report.kernels.get("weight", 0) + 1
            continue
        weight, bias = source_weight(m), None
        with torch.no_grad():
            if type(m) is nn.Linear:
                copy = make_copy(kind, weight)
            else:  # the joined matrix is outputs-major: "transposed" (of the inputs-major views) is itself
                joined, bias = joined_weight(m)
                copy = joined if kind == "transposed" else make_copy(kind, joined)
        m.__dict__[PREPARED] = Prepared(kind, copy, source_key(weight), nbytes, bias)
        used += nbytes
        report.copied_bytes += nbytes
        report.kernels[kind] = report.kernels.get(kind, 0) + 1
    report.seconds = time.perf_counter() - start
    return report


def release_decode_linears(model: nn.Module) -> int:
    """Drop every prepared copy of ``model``; returns how many there were."""
    n = 0
    for m in model.modules():
        if m.__dict__.pop(PREPARED, None) is not None:
            n += 1
    return n


__all__ = [
    "CANDIDATES",
    "KernelTable",
    "PrepareReport",
    "measure",
    "prepare_decode_linears",
    "prepared_linear",
    "release_decode_linears",
    "shared_table",
]
