"""Every checkpoint the project writes has the layout transformers' ``NemotronHForCausalLM.save_pretrained``
writes for the same config (keys, shapes, dtypes, shard files and index), and still serves, extracts and
quantizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from components.serving.loading import check_checkpoint
from model.config import HybridConfig
from model.elastic import ElasticSpace
from model.elastic.budgets import BudgetSet
from model.elastic.export import export_nested, extract_budget
from model.elastic.router import BudgetRouter, RouterConfig
from model.hybrid import HybridLM
from model.quant import load_quantized_model, quantize_checkpoint
from tests.conftest import TINY

DEMO = Path(__file__).resolve().parents[2] / "pipelines" / "assets" / "demo-parent"
BUDGETS = [{"name": "full", "fraction": 1.0}, {"name": "small", "fraction": 0.6}]


def layout(folder: Path) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """Every stored tensor: key -> (shape, dtype, file)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                s = fh.get_slice(k)
                out[k] = (tuple(s.get_shape()), s.get_dtype(), f.name)
    return out


def transformers_layout(folder: Path, out: Path, max_shard_size: str) -> Path:
    """What transformers writes for the config of ``folder`` (random weights: only the layout is compared)."""
    from transformers import AutoConfig, NemotronHForCausalLM

    hf = NemotronHForCausalLM(AutoConfig.from_pretrained(folder))
    hf.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def nested(parent: HybridLM, space: dict, out: Path) -> Path:
    space_obj, budgets = ElasticSpace.model_validate(space), BudgetSet.model_validate({"budgets": BUDGETS})
    torch.manual_seed(0)
    router = BudgetRouter(parent.config, space_obj, budgets, RouterConfig())
    return export_nested(parent, router, budgets, space_obj, out, allow_off_target=True)


@pytest.mark.parametrize(
    ("source", "space", "max_shard_size"),
    [
        ("demo", {"hidden": [64, 48], "experts": [8, 6], "moe_ffn": [32, 16], "mamba_heads": [8, 4]}, "50GB"),
        ("tiny-moe", {"hidden": [32, 16], "experts": [4, 3], "moe_ffn": [16, 8], "mamba_heads": [4, 2]}, "6KB"),
    ],
)
def test_extracted_budget_has_the_layout_transformers_writes(tmp_path, source, space, max_shard_size):
    parent = HybridLM.from_pretrained(DEMO) if source == "demo" else HybridLM(HybridConfig(**TINY)).init_weights(2)
    ckpt = nested(parent, space, tmp_path / "nested")
    for budget in ("full", "small"):
        ours = extract_budget(ckpt, budget, tmp_path / budget, max_shard_size=max_shard_size)
        theirs = transformers_layout(ours, tmp_path / f"hf-{budget}", max_shard_size)
        assert layout(ours) == layout(theirs), budget  # keys, shapes, dtypes and the file of each
        index = ours / "model.safetensors.index.json"
        assert index.exists() == (theirs / "model.safetensors.index.json").exists() == (source == "tiny-moe")
        if index.exists():  # sharded: the same index, total size and parameter count included
            assert json.loads(index.read_text()) == json.loads((theirs / index.name).read_text())
        assert any(".mixer.experts.0.up_proj.weight" in k for k in layout(ours))
        sub = HybridLM.from_pretrained(ours)  # read back: stacked as it is read
        moe = [b.mixer for b in sub.model.layers if b.kind == "moe"]
        assert moe and all(m.experts.up_proj.dim() == 3 for m in moe)


def test_nested_checkpoint_in_the_new_layout_serves_extracts_and_quantizes(tmp_path):
    parent = HybridLM(HybridConfig(**TINY)).init_weights(4)
    space = {"hidden": [32, 16], "experts": [4, 3], "moe_ffn": [16, 8], "mamba_heads": [4, 2]}
    ckpt = nested(parent, space, tmp_path / "nested")
    keys = layout(ckpt)
    assert all(k.startswith(("backbone.", "lm_head")) for k in keys)
    assert "backbone.layers.3.mixer.experts.3.down_proj.weight" in keys
    assert not [k for k in keys if k.endswith(("experts.up_proj", "experts.down_proj"))]  # no stacked tensor
    back = HybridLM.from_pretrained(ckpt)
    for name, t in parent.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    with pytest.raises(Exception, match="tokenizer"):  # the serving check reads the weights first, then the tokenizer
        check_checkpoint(ckpt)
    small = HybridLM.from_pretrained(extract_budget(ckpt, "small", tmp_path / "small"))
    assert small.config.hidden_size <= 32
    q = quantize_checkpoint(ckpt, tmp_path / "fp8", "fp8")
    assert load_quantized_model(q) is not None
