"""The export stage streams the nested checkpoint tensor by tensor; the in-memory export is its reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from components.distill.export import run_export
from components.distill.stage import DISTILL_FILE
from model.checkpoint import CheckpointError, save_model, verify_manifest
from model.config import HybridConfig
from model.elastic import ElasticSpace
from model.elastic.budgets import BudgetSet
from model.elastic.export import export_nested, read_elastic
from model.elastic.router import BudgetRouter, RouterConfig
from model.hybrid import HybridLM
from tests.conftest import TINY

SPACE = {"hidden": [32, 24, 16], "mamba_heads": [4, 2], "moe_ffn": [16, 8], "experts": [4, 3]}
BUDGETS = [{"name": "full", "fraction": 1.0}, {"name": "small", "fraction": 0.6}]


def build_distill_output(
    folder: Path,
    vocab_size: int = TINY["vocab_size"],
    dtype: torch.dtype = torch.float32,
    extra_files: dict[str, Path] | None = None,
    seed: int = 0,
    expert_layout: str = "per_expert",
) -> Path:
    """A distillation output folder as the distill stage writes it, without training: a random student
    (``model.safetensors`` in ``dtype``, the router bias in float32), a random router and ``distill.json``."""
    cfg = HybridConfig(**{**TINY, "vocab_size": vocab_size})
    student = HybridLM(cfg).init_weights(seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in student.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g))
    student = student.to(dtype)
    for module in student.modules():  # as the consolidation writes it: the selection bias stays float32
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.float()
    save_model(student, folder, expert_layout=expert_layout, extra_files=extra_files)
    space, budgets = ElasticSpace.model_validate(SPACE), BudgetSet.model_validate({"budgets": BUDGETS})
    torch.manual_seed(seed + 2)
    router = BudgetRouter(cfg, space, budgets, RouterConfig())
    save_file({k: v.contiguous() for k, v in router.state_dict().items()}, str(folder / "router.safetensors"))
    meta = {"space": space.model_dump(mode="json"), "budgets": BUDGETS, "router": RouterConfig().model_dump()}
    meta["depth_order"] = None
    (folder / DISTILL_FILE).write_text(json.dumps(meta))
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open is not iterable


def _reference(src: Path, out: Path, select: str = "argmax") -> Path:
    """The in-memory export of the same folder: load the student, rebuild the router, export_nested."""
    from components.distill.stage import router_from

    meta = json.loads((src / DISTILL_FILE).read_text())
    model = HybridLM.from_pretrained(src)
    space = ElasticSpace.model_validate(meta["space"])
    budgets = BudgetSet.model_validate({"budgets": meta["budgets"]})
    router = router_from(
        model.config, space, budgets, RouterConfig.model_validate(meta["router"]), src / "router.safetensors"
    )
    tok = {n: src / n for n in ("tokenizer.json",) if (src / n).exists()}
    return export_nested(model, router, budgets, space, out, extra_files=tok, allow_off_target=True, select=select)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_export_equals_the_in_memory_export(tmp_path, dtype, monkeypatch):
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"version": "1.0"}')
    src = build_distill_output(tmp_path / "student", dtype=dtype, extra_files={"tokenizer.json": tok})
    reference = _reference(src, tmp_path / "reference")

    import model.checkpoint as checkpoint
    import model.hybrid as hybrid

    def no_load(*args, **kwargs):
        raise AssertionError("the export loaded a whole model")

    for module in (checkpoint, hybrid):  # every whole-model load reads its tensors through load_state
        monkeypatch.setattr(module, "load_state", no_load)
    streamed = run_export(src, tmp_path / "streamed", allow_off_target=True)

    assert (streamed / "config.json").read_text() == (reference / "config.json").read_text()
    want, got = _tensors(reference), _tensors(streamed)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    bias = [n for n in got if n.endswith("e_score_correction_bias")]
    assert bias and all(got[n].dtype == torch.float32 for n in bias)
    other = [n for n in got if n.endswith("lm_head.weight")]
    assert other and got[other[0]].dtype == dtype
    assert (streamed / "tokenizer.json").read_text() == '{"version": "1.0"}'
    verify_manifest(streamed)
    assert read_elastic(streamed).names == ["full", "small"]


def test_feasible_selection_streams_the_same_section(tmp_path):
    src = build_distill_output(tmp_path / "student", seed=3)
    reference = _reference(src, tmp_path / "reference", select="feasible")
    streamed = run_export(src, tmp_path / "streamed", allow_off_target=True, select="feasible")
    assert json.loads((streamed / "config.json").read_text()) == json.loads((reference / "config.json").read_text())


def test_stream_takes_either_expert_layout_and_refuses_what_it_cannot_copy(tmp_path):
    per_expert = run_export(build_distill_output(tmp_path / "per-expert"), tmp_path / "a", allow_off_target=True)
    stacked_src = build_distill_output(tmp_path / "stacked", expert_layout="stacked")
    stacked = run_export(stacked_src, tmp_path / "b", allow_off_target=True)
    a, b = _tensors(per_expert), _tensors(stacked)
    assert a.keys() == b.keys() and any(".mixer.experts.0.up_proj.weight" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    broken = build_distill_output(tmp_path / "broken")
    (broken / "manifest.json").unlink()
    tensors = _tensors(broken)
    del tensors["backbone.norm_f.weight"]
    tensors["backbone.layers.3.mixer.bogus"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"(?s)missing tensors .*norm_f.*unexpected tensors.*bogus"):
        run_export(broken, tmp_path / "out", allow_off_target=True)
    del tensors["backbone.layers.3.mixer.experts.1.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.\*\.up_proj\.weight: expert indices \[0, 2, 3\]"):
        run_export(broken, tmp_path / "out", allow_off_target=True)
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="no distill.json"):
        run_export(tmp_path / "nowhere", tmp_path / "out")
    good = build_distill_output(tmp_path / "student")
    weights = good / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(CheckpointError, match="SHA-256"):
        run_export(good, tmp_path / "out", allow_off_target=True)
    assert not (tmp_path / "out").exists()
