"""Paired whole-step decode benchmark: one served configuration under several code versions or variants.

Each SIDE is a source tree (this checkout, or a copy of an older one, e.g. ``git archive HEAD | tar -x -C
DIR``) and optionally a VARIANT of this checkout that turns one piece of decode machinery off
(:data:`VARIANTS`). Every side runs in its own worker process, with its own ``model`` package, and serves
the same budgets the way serving does: ``BudgetRegistry.from_checkpoint`` (views of one parent; an older
checkout's registry with ``nested=True``, as its server built it), each cached single-token step through
the budget model's forward. A case is (budget, batch, dtype): a fresh
``--prompt``-token prefill of ``batch`` rows, then ``--steps`` timed steps after 2 untimed ones; a round's
figure for a case is its fastest step (other processes only ever add time). Each step is timed twice: by
the wall clock and by the thread's CPU time (``time.thread_time``; with one torch thread the whole step
runs on the calling thread), which leaves out the time the step waits for a core on a shared machine.
Rounds are interleaved: in every round each case runs once on every side, one side at a time, in an order
reversed every other round, so a slow phase of the machine weighs on all sides alike.

Reported per case, side and clock: the median over rounds of the round figures (ms/step), and the ratio
side / first side taken round by round, as its median and interquartile range. The rule the decode package
follows: a piece of speed machinery stays when switching it off makes some served case at least 5% slower
(ratio >= 1.05 against the full plan). The load average is printed at the start and at the end.

    python benchmarks/bench_decode_paired.py --side before=/tmp/decode-before --side after=. \\
        --json runs/bench_decode_paired.json
    python benchmarks/bench_decode_paired.py --side plan=. --side linear=.:plain_linear --dtype float32
    python benchmarks/bench_decode_paired.py --side on=.:compiled --side argmax=.:compiled+plain_argmax --batch 1

A VARIANT may join several with ``+``. Each timed step includes the greedy pick a served step makes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO_CHECKPOINT = REPO / "runs" / "demo" / "export" / "nested"
LARGE = dict(  # bench_budget_decode.py's ~120M-parameter shape, where weights dominate a step
    vocab_size=32000, hidden_size=1024, pattern="M*EMEM-E", num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, intermediate_size=4096, mamba_num_heads=32, mamba_head_dim=64, n_groups=4, ssm_state_size=64,
    chunk_size=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
    moe_shared_expert_intermediate_size=2048,
)  # fmt: skip
LARGE_BUDGETS = {
    "full": {},
    "medium": dict(hidden=768, mamba_heads=24, moe_ffn=768, shared_ffn=1536, mlp_ffn=3072, experts=6),
    "small": dict(hidden=512, mamba_heads=16, moe_ffn=512, shared_ffn=1024, mlp_ffn=2048, experts=4),
}


# ---------------------------------------------------------------------- variants (worker side)
def _patch(name: str) -> None:
    """Switch one piece of this checkout's decode machinery off (before any model is built)."""
    import torch
    import torch.nn.functional as F

    from model.decode import budget_view, layers, plan

    if name == "reference":  # no plan at all: every step is the layers' own forward
        plan.DecodePlan.accepts = staticmethod(lambda *args, **kwargs: False)
    elif name == "plain_linear":  # projections called as modules, residual added after

        def linear(module, x, residual=None):
            out = module(x)
            return out if residual is None else residual + out

        layers.linear = plan.linear = linear
    elif name == "plain_norm":  # F.rms_norm for float32 rows too
        norm = lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)  # noqa: E731
        layers.rms_norm = plan.rms_norm = norm
    elif name.startswith("ref_"):  # one layer kind through its reference forward
        layers.STEPS[name[4:]] = layers.ReferenceStep
    elif name == "rows_major":  # the parent left (out, in) row-major: input prefixes are strided
        budget_view.store_inputs_major = lambda full: None
    elif name == "no_derived":  # the Mamba step derives A, dt_bias, D and the conv taps at every step
        call = layers.MambaStep.__call__

        def per_step(self, x, cache, index):
            p = self.params
            self.A = torch.exp(layers.cast(p["A_log"], torch.float32)).neg_()
            self.dt_bias = layers.cast(p["dt_bias"], torch.float32)
            self.D, self.conv_weight = p["D"], self.conv["weight"]  # cast / laid out inside the shared steps
            return call(self, x, cache, index)

        layers.MambaStep.__call__ = per_step
    elif name == "moe_rows_reference":  # several rows: the router and Experts as they are (no dense pass)
        layers.MoEStep.dense_rows = layers.MoEStep.rows
    elif name == "no_kernels":  # every projection through F.linear on its weight (no measured kernel copies)
        plan.prepare_decode_linears = lambda model, **kw: None
    elif name == "sdpa_attention":  # one query through F.scaled_dot_product_attention's blocked kernel

        def sdpa(q, k, v, mask):
            b, kv, g, d = q.shape
            out = F.scaled_dot_product_attention(q.reshape(b, kv * g, 1, d), k, v, attn_mask=mask, enable_gqa=g > 1)
            return out.view(b, kv, g, d)

        layers.one_query_attention = sdpa
    elif name == "bf16_fused_norm":  # bfloat16 rows through F.rms_norm (as before the float32 form)
        from model.decode import ops

        own = ops.rms_norm

        def norm(x, w, eps):
            return F.rms_norm(x, (x.shape[-1],), w, eps) if x.dtype != torch.float32 else own(x, w, eps)

        layers.rms_norm = plan.rms_norm = norm
    elif name == "compiled":  # serving's decode_compile: compiled one-row steps, kept where they measure faster
        own = budget_view.BudgetModel.decode_plan

        def compiled_plan(self, rebuild=False, max_copy_bytes=None, compiled=None):
            return own(self, rebuild, max_copy_bytes, True if compiled is None else compiled)

        budget_view.BudgetModel.decode_plan = compiled_plan
    elif name == "one_row_compiled":  # with 'compiled': batches of several rows keep the eager steps
        from model.decode.compiled import CompiledStep

        init = CompiledStep.__init__

        def one_row_only(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.several_rows = False

        CompiledStep.__init__ = one_row_only
        warm = plan.DecodePlan.warm
        plan.DecodePlan.warm = lambda self, *a, **kw: warm(self, *a, **{**kw, "rows": 0})
    elif name == "python_wrapper":  # with 'compiled': inductor's Python code calls each graph's kernels
        from model.decode import compiled

        compiled.INDUCTOR_OPTIONS = {**compiled.INDUCTOR_OPTIONS, "cpp_wrapper": False}
    elif name == "no_dot_bf16":  # with 'compiled': one-row bfloat16 projections through the generated loop
        from model.decode import dot_bf16

        os.environ[dot_bf16.SWITCH_ENV] = "0"
    elif name == "no_dot_prefetch":  # with 'compiled': the dot-product operators without their prefetch
        from model.decode import dot_bf16

        if dot_bf16.available():
            dot_bf16.set_prefetch(False)
    elif name == "no_amx":  # with 'compiled': several-rows bfloat16 projections through the library GEMMs
        from model.decode import dot_bf16

        os.environ[dot_bf16.ROWS_SWITCH_ENV] = "0"
    elif name == "no_f32_rows":  # with 'compiled': several-rows float32 projections through the library GEMMs
        from model.decode import dot_bf16

        os.environ[dot_bf16.F32_ROWS_SWITCH_ENV] = "0"
    elif name == "no_argmax_op":  # greedy picks by torch's argmax (float32 for half precision), not the operator
        from model.decode import dot_bf16

        dot_bf16.loaded = lambda: False
    elif name == "plain_argmax":  # greedy picks by argmax on the logits in their own dtype
        from model import generate

        generate.greedy_tokens = lambda logits: logits.argmax(-1)
    else:
        raise SystemExit(f"unknown variant {name!r}; known: {sorted(VARIANTS)}")


VARIANTS = {
    "reference": "no decode plan: the layers' forward for every step",
    "plain_linear": "projections called as modules; the residual added after the GEMM",
    "plain_norm": "F.rms_norm instead of the vector_norm form for float32 rows",
    "ref_mamba": "Mamba layers through their reference step",
    "ref_attention": "attention layers through their reference forward",
    "ref_moe": "MoE layers through their reference forward (no host-side routing of one token)",
    "ref_mlp": "MLP layers through their reference forward",
    "rows_major": "budget views of a parent left row-major (no store_inputs_major)",
    "no_derived": "Mamba step: A, dt_bias, D and the conv taps derived from the weights at every step",
    "moe_rows_reference": "MoE step, several rows: the router and Experts as they are (no one-pass dense routing)",
    "no_kernels": "every projection through F.linear on its own weight (no measured transposed / oneDNN copies)",
    "sdpa_attention": "one query through F.scaled_dot_product_attention instead of three GEMMs and a softmax",
    "bf16_fused_norm": "bfloat16 rows normalised by F.rms_norm instead of the float32 vector_norm form",
    "compiled": "switched ON: one-row steps through compiled steps (model/decode/compiled.py), as serving's "
    "decode_compile does (compiled and measured at the plan's first step, kept where faster)",
    "one_row_compiled": "with 'compiled': only one-row steps compiled; several rows take the eager steps",
    "python_wrapper": "with 'compiled': the graphs' kernels called from inductor's Python wrapper, not its C++ one",
    "no_dot_bf16": "with 'compiled': one-row bfloat16 projections through inductor's generated loop, not the "
    "bfloat16 dot-product operators (model/decode/dot_bf16.py)",
    "no_dot_prefetch": "with 'compiled': the bfloat16 dot-product operators without the prefetch of the rows ahead",
    "no_amx": "with 'compiled': several-rows bfloat16 projections and grouped experts through the library GEMMs, "
    "not the AMX operators (model/decode/dot_bf16.py)",
    "no_f32_rows": "with 'compiled': several-rows float32 projections through the library GEMMs and the routed "
    "experts through the dense pass over every expert, not the float32 operators (model/decode/dot_bf16.py)",
    "no_argmax_op": "greedy picks by torch's argmax (half precision cast to float32 first), not the vectorised "
    "operator (model.decode.dot_bf16.argmax_rows)",
    "plain_argmax": "greedy picks by argmax on the logits in their own dtype (no float32 cast of half precision)",
}


# ---------------------------------------------------------------------- worker
def _worker(tree: str, variant: str, args: argparse.Namespace) -> None:
    """Serve ``run`` requests (JSON lines on stdin) for the budgets of one side; answer with step seconds."""
    sys.path.insert(0, tree)
    import torch

    import model

    if not Path(model.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"worker for {tree} imported model from {model.__file__}")
    for name in filter(None, variant.split("+")):  # e.g. compiled+plain_argmax
        _patch(name)
    try:
        from model.decode.budget_view import BudgetRegistry
    except ImportError:  # an older checkout
        from model.budget_view import BudgetRegistry
    # as serving built it: an older checkout's registry laid the parent out for its budgets (nested=True)
    served = {"nested": True} if "nested" in inspect.signature(BudgetRegistry).parameters else {}
    torch.set_num_threads(args.threads)
    if args.large:  # random weights, the same in every worker
        from model.config import HybridConfig
        from model.elastic import Architecture
        from model.hybrid import HybridLM

        archs = {name: Architecture(**kw) for name, kw in LARGE_BUDGETS.items()}
        parents = {d: HybridLM(HybridConfig(**LARGE)).init_weights(0).eval().to(getattr(torch, d)) for d in args.dtype}
        registries = {d: BudgetRegistry(parent, archs, **served) for d, parent in parents.items()}
    else:
        registries = {
            d: BudgetRegistry.from_checkpoint(args.checkpoint, dtype=getattr(torch, d), **served) for d in args.dtype
        }
    vocab = registries[args.dtype[0]].full.config.vocab_size
    from model import generate

    def pick(logits: torch.Tensor) -> torch.Tensor:
        """Serving's greedy pick: this tree's own (an older one's: argmax on the logits as they are)."""
        own = getattr(generate, "greedy_tokens", None)
        return own(logits) if own is not None else logits.argmax(-1)

    print(json.dumps({"ready": True, "model": str(Path(model.__file__).parent)}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        budget = registries[req["dtype"]].get(req["budget"])
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (req["batch"], args.prompt), generator=g)
        times: dict[str, list[float]] = {"wall": [], "cpu": []}
        with torch.inference_mode():  # as serving decodes (and compiled steps are compiled)
            out = budget(ids, use_cache=True, logits_to_keep=1)
            cache, tok = out.cache, pick(out.logits[:, -1])[:, None]
            for i in range(2 + args.steps):
                wall, cpu = time.perf_counter(), time.thread_time()
                out = budget(tok, cache=cache)
                tok = pick(out.logits[:, -1])[:, None]  # the greedy pick a served step makes, timed with it
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                cache = out.cache
                if i >= 2:
                    times["wall"].append(wall)
                    times["cpu"].append(cpu)
        print(json.dumps(times), flush=True)


# ---------------------------------------------------------------------- coordinator
class Side:
    """One worker process: a tree and a variant."""

    def __init__(self, spec: str, argv: list[str]) -> None:
        name, _, where = spec.partition("=")
        tree, _, variant = where.partition(":")
        if not name or not tree:
            raise SystemExit(f"--side {spec!r}: expected NAME=TREE or NAME=TREE:VARIANT")
        unknown = [v for v in variant.split("+") if v and v not in VARIANTS]
        if unknown:
            raise SystemExit(f"--side {spec!r}: unknown variant {unknown[0]!r}; known: {sorted(VARIANTS)}")
        self.name, self.tree, self.variant = name, str(Path(tree).resolve()), variant
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", self.tree, variant, *argv]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.model = self._read()["model"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"side {self.name}: worker exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, case: dict[str, Any]) -> dict[str, list[float]]:
        """Per clock (``wall``, ``cpu``), the seconds of each timed step of ``case``."""
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def run(args: argparse.Namespace, worker_argv: list[str]) -> dict[str, Any]:
    from benchmarks.common import load_average, machine_info

    load_start = load_average()
    sides = [Side(spec, worker_argv) for spec in args.side]
    cases = [{"budget": b, "batch": n, "dtype": d} for d in args.dtype for n in args.batch for b in args.budgets]
    clocks = ("cpu", "wall")
    figures = {(i, s.name, c): [] for i in range(len(cases)) for s in sides for c in clocks}
    try:
        for round_ in range(args.rounds):
            order = sides if round_ % 2 == 0 else sides[::-1]
            for i, case in enumerate(cases):
                for side in order:
                    times = side.run(case)
                    for c in clocks:
                        figures[i, side.name, c].append(min(times[c]))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for side in sides:
            side.close()
    load_end = load_average()
    results = [
        {**case, "side": side.name, **{c: {"rounds_s": figures[i, side.name, c]} for c in clocks}}
        for i, case in enumerate(cases)
        for side in sides
    ]
    print(f"load average at start {load_start}, at end {load_end}; {args.threads} torch thread(s), "
          f"{args.rounds} rounds, fastest of {args.steps} steps per round")  # fmt: skip
    for side in sides:
        parts = [f"{v}: {VARIANTS[v]}" for v in side.variant.split("+") if v]
        note = f" (variant {'; '.join(parts)})" if parts else ""
        print(f"  {side.name}: {side.model}{note}")
    return {
        "command": " ".join(sys.argv),
        "machine": machine_info(args.threads),
        "load_average": {"start": load_start, "end": load_end},
        "sides": [{"name": s.name, "tree": s.tree, "variant": s.variant} for s in sides],
        "results": results,
    }


def report(payload: dict[str, Any], baseline: str | None = None) -> str:
    """The table of a run: per case and side, median ms/step and the paired ratio to ``baseline`` (default:
    the first side), per clock; ``>= 1.05`` in the CPU column marks a side at least 5% slower."""
    from benchmarks.common import format_table

    names = [s["name"] for s in payload["sides"]]
    base = baseline or names[0]
    if base not in names:
        raise SystemExit(f"--baseline {base!r}: not a side of this run; sides {names}")
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in payload["results"]:
        by_case.setdefault((r["budget"], r["batch"], r["dtype"]), {})[r["side"]] = r
    rows = []
    for (budget, batch, dtype), sides in by_case.items():
        for name in names:
            row = [budget, batch, dtype, name]
            for clock in ("cpu", "wall"):
                mine, ref = sides[name][clock]["rounds_s"], sides[base][clock]["rounds_s"]
                lo, mid, hi = _quartiles([a / b for a, b in zip(mine, ref, strict=True)])
                row += [f"{statistics.median(mine) * 1e3:.3f}", f"{mid:.3f} ({lo:.3f}-{hi:.3f})"]
            row.append("slower >= 5%" if name != base and float(row[5].split()[0]) >= 1.05 else "")
            rows.append(row)
    headers = ["budget", "batch", "dtype", "side", "CPU ms/step", f"CPU / {base} (IQR)", "wall ms/step",
               f"wall / {base} (IQR)", "CPU verdict"]  # fmt: skip
    return format_table(headers, rows)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", action="append", default=[], help="NAME=TREE[:VARIANT]; the first is the baseline")
    ap.add_argument("--checkpoint", type=Path, default=DEMO_CHECKPOINT, help="a nested checkpoint folder")
    ap.add_argument("--large", action="store_true", help="a random ~120M-parameter parent (LARGE) instead")
    ap.add_argument("--budgets", nargs="+", default=["full", "medium", "small"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per case and round")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None, help="print the table of a saved --json run instead")
    ap.add_argument("--baseline", default=None, help="the side ratios are taken against (default: the first)")
    ap.add_argument("--worker", nargs=2, metavar=("TREE", "VARIANT"), help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.worker:
        _worker(args.worker[0], args.worker[1], args)
        return None
    sys.path.insert(0, str(REPO))
    if args.report is not None:
        print(report(json.loads(args.report.read_text(encoding="utf-8")), args.baseline))
        return None
    if len(args.side) < 2:
        raise SystemExit("give at least two --side NAME=TREE[:VARIANT]")
    shared = ["--checkpoint", str(args.checkpoint.resolve()), "--prompt", str(args.prompt), "--steps",
              str(args.steps), "--threads", str(args.threads), "--dtype", *args.dtype]  # fmt: skip
    if args.large:
        shared.append("--large")
    payload = run(args, shared)
    print(report(payload, args.baseline))
    if args.json is not None:
        from benchmarks.common import save_json

        save_json(args.json, payload)
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
