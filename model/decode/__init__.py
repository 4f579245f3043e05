"""Decode speed, applied to a model from outside: the layers in :mod:`model` are the reference.

* :mod:`model.decode.plan`: :class:`DecodePlan`, a model's single-token cached step in fewer operators
  (built from the model; any dtype, any device), and :func:`decode_plan`.
* :mod:`model.decode.layers`: the per-layer steps a plan runs; :mod:`model.decode.ops`: their operators.
* :mod:`model.decode.budget_view`: every budget of a nested family as views of one parent copy
  (:class:`~model.decode.budget_view.BudgetRegistry`), with :mod:`model.decode.split_linear` for grouped heads.

Every piece stays only while a paired whole-step benchmark shows it pays (``docs/decode.md``).
"""

from model.decode.plan import DecodePlan, decode_plan

__all__ = ["DecodePlan", "decode_plan"]
