"""The export stage: one nested checkpoint from a distillation output folder.

``run_export(distill_output_dir, out_dir)`` reads the folder the distill stage writes
(:func:`components.distill.stage.write_output`: the student, ``router.safetensors``, ``distill.json``),
rebuilds the router, takes every budget's argmax architecture and writes the ONE nested checkpoint: the
elastic section from :func:`~model.elastic.export.nested_section`, the weights copied tensor by tensor
(:func:`~model.checkpoint.iter_tensors`), never a whole model in memory. Its reference is
:func:`~model.elastic.export.export_nested` on the loaded model (the tests compare them).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from components.distill import ckpt
from components.distill.stage import DISTILL_FILE, router_from
from components.tracking import NullTracker, Tracker
from model.config import HybridConfig
from model.elastic.budgets import BudgetSet
from model.elastic.router import RouterConfig
from model.elastic.space import ElasticSpace

_MTP_PREFIX = "mtp."  # multi-token-prediction heads: the loader skips them, so the export does too


def _file_name(key: str) -> str:
    """A stored key under the model's name (``backbone.`` read as ``model.``; experts as stored, stacked or per
    expert: the writer publishes either as one tensor per expert)."""
    return "model." + key[len("backbone.") :] if key.startswith("backbone.") else key


def _stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the loader keeps a tensor in: as stored, the MoE router's selection bias in float32."""
    return torch.float32 if dtype.is_floating_point and name.endswith("e_score_correction_bias") else dtype


def weight_entries(src: Path, model_config: HybridConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every tensor the nested checkpoint copies from ``src``, in the order
    :func:`~model.checkpoint.iter_tensors` yields them, read from the file headers only.

    Checked against ``model_config`` (names and shapes, on the meta device, per-expert tensors stacked for the
    check): a folder that is not a student as the distill stage writes it (``lm_head`` stored) raises
    :class:`~model.checkpoint.CheckpointError` naming every missing, unexpected and mis-shaped tensor.
    """
    from safetensors import safe_open

    from model.checkpoint import check_state, to_canonical, weight_files
    from model.hybrid import HybridLM
    from model.layout import DTYPE_NAMES

    dtypes = {name: dtype for dtype, name in DTYPE_NAMES.items()}

    entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for path in weight_files(src):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not iterable; this is iter_views' order
                if key.startswith(_MTP_PREFIX):
                    continue
                view = fh.get_slice(key)
                name = _file_name(key)
                entries.append((name, tuple(view.get_shape()), _stored_dtype(name, dtypes[view.get_dtype()])))
    with torch.device("meta"):
        expected = HybridLM(model_config).state_dict()
    found = to_canonical((n, torch.empty(s, dtype=d, device="meta")) for n, s, d in entries)
    check_state(expected, found, f"{src} (export streams the student as the distill stage writes it)")
    return entries


def stream_weights(
    src: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for ``entries`` out of ``src``, one tensor in memory at a time."""
    from model.checkpoint import iter_tensors

    for key, tensor in iter_tensors(src):
        if key.startswith(_MTP_PREFIX):
            continue
        name = _file_name(key)
        yield name, tensor.to(_stored_dtype(name, tensor.dtype))


def run_export(
    distill_output_dir: str | Path,
    out_dir: str | Path,
    allow_off_target: bool = False,
    tolerance: float = 0.05,
    tracker: Tracker | None = None,
    select: str = "argmax",
) -> Path:
    """Write the ONE nested checkpoint from a distillation output folder (router argmax per budget,
    or with ``select="feasible"`` the on-target architecture nearest the argmax).

    The weights are copied tensor by tensor (one tensor in memory at a time, in its stored dtype);
    no model is built. The result equals :func:`~model.elastic.export.export_nested` on the loaded
    student. Raises ``ValueError`` (from :func:`~model.elastic.export.nested_section`) naming every
    budget whose argmax architecture misses its target by more than ``tolerance``, unless
    ``allow_off_target``; a broken or altered source fails its manifest check before anything is written.
    """
    from model.atomic import publish_folder
    from model.checkpoint import CONFIG_NAME, read_config, verify_manifest, write_manifest
    from model.elastic.export import nested_section
    from model.layout import tokenizer_files, write_weights

    src = Path(distill_output_dir)
    meta_path = src / DISTILL_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{src}: no {DISTILL_FILE}; not a distillation output folder")
    meta = json.loads(meta_path.read_text())
    model_config, _ = read_config(src)
    verify_manifest(src)
    entries = weight_entries(src, model_config)
    space = ElasticSpace.model_validate(meta["space"])
    budgets = BudgetSet.model_validate({"budgets": meta["budgets"]})
    router_config = RouterConfig.model_validate(meta["router"])
    router = router_from(model_config, space, budgets, router_config, src / ckpt.ROUTER_FILE)
    section = nested_section(
        model_config, router, budgets, space, meta.get("depth_order"), allow_off_target, tolerance, select
    )
    with publish_folder(out_dir) as staging:
        write_weights(staging, entries, stream_weights(src, entries))
        model_config.to_json_file(staging / CONFIG_NAME, extra={"elastic": section})
        for name, path in tokenizer_files(src).items():
            shutil.copyfile(path, staging / name)
        write_manifest(staging)
    (tracker or NullTracker()).log_dict(section, "elastic.json")
    return Path(out_dir)
