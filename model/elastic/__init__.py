"""Nested elastic sub-models of one parent: search space, architectures, masks, extraction, counts.

* :class:`ElasticSpace` - which axes shrink and their candidate sizes (:mod:`.space`).
* :class:`Architecture` - one sub-model, resolved per layer by :meth:`Architecture.resolve` (:mod:`.arch`).
* :func:`hard_mask` / :func:`soft_mask` - make the full model compute a sub-model (:mod:`.build_masks`).
* :func:`extract` / :func:`extract_config` - cut the sub-model out as a standalone model (:mod:`.slicing`).
* :func:`count_params` / :func:`expected_params` - total and active parameters (:mod:`.params`).

The invariant tying them together: for every architecture, the full model under
``hard_mask(arch)`` computes what ``extract(model, arch)`` computes, and ``count_params(arch)``
is that extracted model's parameter count.
"""

from model.elastic.arch import (
    Architecture,
    LayerArch,
    LayerOverride,
    ResolvedArch,
    check_depth_order,
    default_depth_order,
    drop_positions,
)
from model.elastic.build_masks import (
    axis_mask,
    candidate_masks,
    depth_keep_matrix,
    hard_mask,
    mask_as_dense,
    soft_mask,
)
from model.elastic.params import ParamCount, count_params, expected_params, expected_sizes
from model.elastic.slicing import extract, extract_config, layer_configs
from model.elastic.space import AXES, LAYER_AXES, ElasticSpace, allowed_sizes, full_size

__all__ = [
    "AXES",
    "LAYER_AXES",
    "Architecture",
    "ElasticSpace",
    "LayerArch",
    "LayerOverride",
    "ParamCount",
    "ResolvedArch",
    "allowed_sizes",
    "axis_mask",
    "candidate_masks",
    "check_depth_order",
    "count_params",
    "default_depth_order",
    "depth_keep_matrix",
    "drop_positions",
    "expected_params",
    "expected_sizes",
    "extract",
    "extract_config",
    "full_size",
    "hard_mask",
    "layer_configs",
    "mask_as_dense",
    "soft_mask",
]
