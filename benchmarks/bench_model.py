"""Our :class:`~model.hybrid.HybridLM` against transformers' ``NemotronHForCausalLM`` (torch path, CPU).

Both models get the same config (ours -> ``to_hf_dict`` -> ``NemotronHConfig``), the same weights (our
state dict loaded strictly into the transformers model), the same inputs and the same thread count, and
are timed in one process. Measured, each as the median of ``--repeats`` runs after ``--warmup`` runs:

* prefill: tokens/s of a no-grad forward over ``batch x seq`` tokens (full logits, no cache);
* training: tokens/s of forward + cross-entropy + backward + AdamW step on ``batch x seq`` tokens;
* decode: milliseconds per cached single-token step (ours: the model's :class:`~model.decode.DecodePlan`)
  after a ``--prompt``-token prefill, at batch 1 and at ``--batch``.

Speedups (> 1: ours faster) are transformers' time / ours for the same work, taken round by round (the two
sides alternate, first one then the other) and reported as the median over rounds with its interquartile range:
other processes slow whole rounds, so a per-round ratio is steadier than the ratio of two medians.

    python benchmarks/bench_model.py --threads 2 --json runs/bench_model.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    Case,
    Timing,
    format_table,
    machine_info,
    other_cpu_load,
    paired_ratio,
    save_json,
    set_threads,
    time_interleaved,
)
from model.config import HybridConfig  # noqa: E402
from model.decode import DecodePlan  # noqa: E402
from model.hybrid import HybridLM  # noqa: E402

Forward = Callable[[Tensor], Tensor]


def bench_config(hidden: int, pattern: str, vocab: int) -> HybridConfig:
    """The benchmark model, every width derived from ``hidden`` (hidden 128: ~0.70M parameters)."""
    return HybridConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        pattern=pattern,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        intermediate_size=2 * hidden,
        mamba_num_heads=max(1, hidden // 16),
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=16,
        chunk_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=max(1, hidden // 2),
        moe_shared_expert_intermediate_size=hidden,
    )


def build_models(cfg: HybridConfig, seed: int) -> tuple[HybridLM, nn.Module]:
    """Ours with nemotron_h's init, and transformers' model holding exactly the same tensors."""
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the deprecated use_mamba_kernels note is irrelevant here
    ours = HybridLM(cfg).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a non-zero selection bias, so routing is not a function of the scores alone
        for block in ours.model.layers:
            if block.kind == "moe":
                bias = block.mixer.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = NemotronHForCausalLM(NemotronHConfig(**cfg.to_hf_dict()))
    hf.load_state_dict(ours.state_dict(), strict=True)
    return ours.eval(), hf.eval()


def forwards(ours: HybridLM, hf: nn.Module) -> dict[str, Forward]:
    """Full-logit, cache-free forwards with one signature."""
    return {
        "ours": lambda ids: ours(ids).logits,
        "transformers": lambda ids: hf(ids, use_cache=False).logits,
    }


def check_parity(ours: HybridLM, hf: nn.Module, cfg: HybridConfig, prompt: int) -> dict[str, float]:
    """Max |logit difference| on a full forward and on one cached decode step (guards against timing two
    different computations)."""
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, cfg.vocab_size, (2, prompt + 1), generator=g)
    with torch.no_grad():
        full = (ours(ids).logits - hf(ids, use_cache=False).logits).abs().max().item()
        a = ours(ids[:, :-1], use_cache=True)
        step_ours = DecodePlan(ours)(ids[:, -1:], a.cache).logits
        b = hf(ids[:, :-1], use_cache=True)
        step_hf = hf(ids[:, -1:], past_key_values=b.past_key_values, use_cache=True).logits
        step = (step_ours - step_hf).abs().max().item()
    return {"forward_max_abs_diff": full, "decode_step_max_abs_diff": step}


def decode_op_counts(ours: HybridLM, hf: nn.Module, cfg: HybridConfig, prompt: int, steps: int = 8) -> dict[str, float]:
    """ATen operator calls per batch-1 cached decode step (nested calls included, as the profiler counts
    them): a batch-1 step of a small model costs what its operators cost to dispatch."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(321)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt + steps), generator=g)
    out: dict[str, float] = {}
    with torch.no_grad():
        cache = ours(ids[:, :prompt], use_cache=True).cache
        past = hf(ids[:, :prompt], use_cache=True).past_key_values
        plan = DecodePlan(ours)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(prompt, prompt + steps):
                plan(ids[:, i : i + 1], cache)
        out["ours"] = sum(e.count for e in prof.key_averages()) / steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(prompt, prompt + steps):
                hf(ids[:, i : i + 1], past_key_values=past, use_cache=True)
        out["transformers"] = sum(e.count for e in prof.key_averages()) / steps
    return out


def prefill_case(fn: Forward, ids: Tensor) -> Case:
    """A no-grad forward over ``ids`` (full logits)."""

    def run() -> None:
        with torch.no_grad():
            fn(ids)

    return Case(run)


def train_case(model: nn.Module, fn: Forward, ids: Tensor, labels: Tensor) -> Case:
    """One optimiser step per call; ``model`` is a private copy (its weights change)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        logits = fn(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Case(step)


def decode_case_ours(model: HybridLM, prompt: Tensor, tokens: Tensor) -> Case:
    """``tokens.shape[1]`` cached steps of the model's decode plan, each after an untimed prefill of ``prompt``."""
    plan = DecodePlan(model)

    def setup() -> Any:
        with torch.no_grad():
            return model(prompt, use_cache=True).cache

    def run(cache: Any) -> None:
        with torch.no_grad():
            for i in range(tokens.shape[1]):
                plan(tokens[:, i : i + 1], cache)

    return Case(run, setup)


def decode_case_hf(model: nn.Module, prompt: Tensor, tokens: Tensor) -> Case:
    """Same as :func:`decode_case_ours` with transformers' own cache (``past_key_values``)."""

    def setup() -> Any:
        with torch.no_grad():
            return model(prompt, use_cache=True).past_key_values

    def run(past: Any) -> None:
        with torch.no_grad():
            for i in range(tokens.shape[1]):
                model(tokens[:, i : i + 1], past_key_values=past, use_cache=True)

    return Case(run, setup)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measure, both sides interleaved round by round (see :func:`~benchmarks.common.time_interleaved`)."""
    set_threads(args.threads)
    torch.manual_seed(args.seed)
    busy_before = other_cpu_load()
    cfg = bench_config(args.hidden, args.pattern, args.vocab)
    ours, hf = build_models(cfg, args.seed)
    parity = check_parity(ours, hf, cfg, args.prompt)
    op_counts = decode_op_counts(ours, hf, cfg, args.prompt)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    n_tok = args.batch * args.seq
    results: dict[str, dict[str, Any]] = {"ours": {}, "transformers": {}}
    timings: dict[str, dict[str, Timing]] = {"ours": {}, "transformers": {}}

    def record(key: str, measured: dict[str, Timing], value: Callable[[Timing], float]) -> None:
        for side, t in measured.items():
            timings[side][key] = t
            results[side][key] = value(t)

    fns = forwards(ours, hf)
    measured = time_interleaved({side: prefill_case(fn, inputs) for side, fn in fns.items()}, args.warmup, args.repeats)
    record("prefill_tokens_per_s", measured, lambda t: n_tok / t.median_s)

    copies = {"ours": copy.deepcopy(ours), "transformers": copy.deepcopy(hf)}
    cases = {side: train_case(m, forwards(m, m)[side], inputs, labels) for side, m in copies.items()}
    record("train_tokens_per_s", time_interleaved(cases, args.warmup, args.repeats), lambda t: n_tok / t.median_s)
    del copies, cases

    for batch in sorted({1, args.batch}):
        prompt = torch.randint(0, cfg.vocab_size, (batch, args.prompt), generator=g)
        tokens = torch.randint(0, cfg.vocab_size, (batch, args.decode_steps), generator=g)
        cases = {"ours": decode_case_ours(ours, prompt, tokens), "transformers": decode_case_hf(hf, prompt, tokens)}
        measured = time_interleaved(cases, args.warmup, args.repeats)
        record(f"decode_b{batch}_ms_per_step", measured, lambda t: 1e3 * t.median_s / args.decode_steps)

    # speedup (> 1: ours faster) = transformers' time / ours, round by round (both sides time the same work)
    speedup: dict[str, float] = {}
    speedup_iqr: dict[str, tuple[float, float]] = {}
    for key in results["ours"]:
        median, q1, q3 = paired_ratio(timings["transformers"][key], timings["ours"][key])
        speedup[key], speedup_iqr[key] = median, (q1, q3)
    machine = machine_info(args.threads)
    machine["other_cpu_load_before"] = busy_before
    machine["other_cpu_load_after"] = other_cpu_load()
    return {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": machine,
        "config": cfg.to_hf_dict(),
        "transformers": {
            "version": transformers_version(),
            "attn_implementation": getattr(hf.config, "_attn_implementation", None),
            "experts_implementation": getattr(hf.config, "_experts_implementation", None),
        },
        "parameters": ours.num_parameters(),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "parity": parity,
        "decode_b1_ops_per_step": op_counts,
        "results": results,
        "speedup": speedup,
        "speedup_iqr": speedup_iqr,
        "timings": timings,
    }


ROWS = [
    ("prefill_tokens_per_s", "prefill {batch}x{seq} (tokens/s)", 1.5),
    ("train_tokens_per_s", "training {batch}x{seq} (tokens/s)", 1.5),
    ("decode_b1_ms_per_step", "decode batch 1 (ms/step)", 3.0),
    ("decode_b{batch}_ms_per_step", "decode batch {batch} (ms/step)", 3.0),
]


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def report(out: dict[str, Any]) -> str:
    """The figures as a Markdown table under a few lines of context (machine, settings, parity, load)."""
    s = out["settings"]
    rows = []
    for key, label, target in ROWS:
        key = key.format(**s)
        ours, hf = out["results"]["ours"][key], out["results"]["transformers"][key]
        sp = out["speedup"][key]
        lo, hi = out.get("speedup_iqr", {}).get(key, (sp, sp))
        met = "yes" if sp >= target else "NO"
        rows.append([label.format(**s), ours, hf, f"{sp:.2f}x", f"{lo:.2f}-{hi:.2f}", f">= {target:g}x", met])
    table = format_table(["measure", "ours", "transformers", "speedup", "IQR", "target", "met"], rows)
    m = out["machine"]
    p = out["parity"]
    t = out["transformers"]
    head = (
        f"pattern {s['pattern']}, hidden {s['hidden']}, vocab {s['vocab']}, {out['parameters']:,} parameters; "
        f"{s['threads']} threads on {m.get('cpu_model', m['processor'])} ({m['cpu_count']} CPUs), torch {m['torch']}\n"
        f"median of {s['repeats']} after {s['warmup']} warmup; decode: {s['prompt']}-token prompt, "
        f"{s['decode_steps']} steps timed\n"
        f"parity: forward max|diff| {p['forward_max_abs_diff']:.2e}, decode step {p['decode_step_max_abs_diff']:.2e}\n"
        f"transformers {t['version']} (attention: {t['attn_implementation']}, experts: {t['experts_implementation']})"
    )
    ops = out.get("decode_b1_ops_per_step")
    if ops:
        head += (
            f"\nATen operator calls per batch-1 decode step: ours {ops['ours']:.0f}, "
            f"transformers {ops['transformers']:.0f}"
        )
    before, after = m.get("other_cpu_load_before"), m.get("other_cpu_load_after")
    if before is not None and after is not None:
        head += f"\nCPU used by other processes: {100 * before:.0f}% before the run, {100 * after:.0f}% after"
        if max(before, after) > 0.1:
            head += "  <- busy machine: figures unreliable (the sides are interleaved, so ratios suffer less)"
    return head + "\n\n" + table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both models")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size; every other width scales with it")
    ap.add_argument("--pattern", default="M*MEM-ME", help="layer pattern (M mamba, * attention, E MoE, - MLP)")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens before the timed decode steps")
    ap.add_argument("--decode-steps", type=int, default=16, help="decode steps per timed run")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per measure (medians are reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write every figure and sample here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = run(args)
    print(report(out))
    if args.json is not None:
        save_json(args.json, out)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
