"""What a section inherits from the pipeline's top level: the data mixture and the reasoning markers.

One rule, for every stage's config (:mod:`pipelines.sections`) and for the serving config read from a
pipeline YAML (:func:`components.serving.config.load_config`): a section that sets neither ``data``
nor ``markers`` takes the top-level one; a section's own value is never merged with it. A calibration
(rank, quantize) packs the inherited rows, as padding would dilute its statistics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from components.data.sources import DataConfig
from components.data.tokenizer import ReasoningMarkers

KEYS = ("data", "markers")


class Inherited(BaseModel):
    """The pipeline's top-level ``data`` and ``markers`` (None: the top level sets none)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    data: DataConfig | None = Field(None, description="The top-level data mixture.")
    markers: ReasoningMarkers | None = Field(None, description="The top-level reasoning markers.")

    @classmethod
    def of(cls, top: Mapping[str, Any], keys: tuple[str, ...] = KEYS) -> Inherited:
        """From a pipeline YAML's top-level mapping, validating only ``keys`` (errors at ``data...`` /
        ``markers...``, their YAML paths)."""
        return cls.model_validate({k: top[k] for k in keys if top.get(k) is not None})

    def fill(
        self, section: Mapping[str, Any], *, calibration: bool = False, keys: tuple[str, ...] = KEYS
    ) -> dict[str, Any]:
        """``section`` (a mapping of the keys it sets) with ``keys`` filled in where it sets none of its own."""
        out = dict(section)
        if "data" in keys and self.data is not None and "data" not in out:
            data = self.data.model_copy(update={"pack": True}) if calibration else self.data
            out["data"] = data.model_dump(mode="json")
        if "markers" in keys and self.markers is not None and "markers" not in out:
            out["markers"] = self.markers.model_dump()
        return out
