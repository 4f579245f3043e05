"""Configuration of the serving application: one typed, documented :class:`ServingConfig`.

Unknown keys are errors (``extra="forbid"``). The Ray Serve deployment options are derived from the
same object (:meth:`ServingConfig.deployment_options`), so what the replica enforces and what Serve
routes by cannot disagree. Backpressure is the replica's own: at most ``max_ongoing_requests``
running, ``max_queued_requests`` waiting, then an OpenAI-shaped 503 with ``Retry-After``.

Design notes (proxy queue, API key, formats): docs/serving.md ("Configuration and backpressure").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from components.data.tokenizer import ReasoningMarkers
from components.serving.request_models import ReasoningEffort  # the wire format's values, mapped here
from model.decode.compiled import compiled_decode_default

DEFAULT_API_KEY_ENV = "STAR_ELASTIC_API_KEY"
DEPLOYMENT_NAME = "StarElasticServer"
"""Name of the model deployment (a RayService's Serve config, ``pipelines.kuberay.serve``, names it)."""
INGRESS_NAME = "StarElasticIngress"
"""Name of the ingress deployment in front of it (answers HTTP, probes, and 503s when replicas die)."""
APP_NAME = "star-elastic"


class AutoscalingSettings(BaseModel):
    """Ray Serve replica autoscaling (Serve scales replicas; on Kubernetes Ray scales the pods).

    Every field is passed to Serve's ``AutoscalingConfig`` under the same name. Serve averages each
    replica's ongoing requests over ``look_back_period_s`` (pushed every ``metrics_interval_s``), wants
    ``ceil(total / target_ongoing_requests)`` replicas, and moves there once that want has held for
    ``upscale_delay_s`` / ``downscale_delay_s``: a replica is added at the earliest ``upscale_delay_s``
    after load rises, and removed at the latest ``downscale_delay_s + look_back_period_s`` after it falls.
    """

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0 allows scale to zero).")
    max_replicas: int = Field(1, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at start (default: min_replicas).")
    target_ongoing_requests: float = Field(4.0, gt=0, description="Ongoing requests per replica to aim at.")
    upscale_delay_s: float = Field(10.0, ge=0, description="How long load must stay high before scaling up.")
    downscale_delay_s: float = Field(120.0, ge=0, description="How long load must stay low before scaling down.")
    downscale_to_zero_delay_s: float | None = Field(
        None, ge=0, description="With min_replicas 0: how long before the last replica goes (None: downscale_delay_s)."
    )
    look_back_period_s: float = Field(
        30.0, gt=0, description="Window over which each replica's ongoing requests are averaged before a decision."
    )
    metrics_interval_s: float = Field(
        10.0, gt=0, description="How often replicas and callers report their ongoing requests to the controller."
    )
    upscaling_factor: float | None = Field(
        None, gt=0, description="Gain on each upscaling step (1: go to the wanted count at once; <1: part way)."
    )
    downscaling_factor: float | None = Field(
        None, gt=0, description="Gain on each downscaling step (1: go to the wanted count at once; <1: part way)."
    )
    aggregation_function: Literal["mean", "max", "min"] = Field(
        "mean", description="How the samples in the look-back window are combined."
    )

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        # Serve only warns, then averages over fewer samples than one report: a window shorter than the
        # report interval would decide on a single stale sample.
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s {self.look_back_period_s:g} must be > metrics_interval_s "
                f"{self.metrics_interval_s:g}: lengthen the window or report more often"
            )
        return self

    def serve_config(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config``: every field set, the optional ones only when given."""
        return self.model_dump(exclude_none=True)


class EffortSetting(BaseModel):
    """What one ``reasoning_effort`` value of a request means: a think cap and, optionally, the budget that thinks."""

    model_config = ConfigDict(extra="forbid")

    think_cap: int | None = Field(
        None, ge=0, description="Most thinking tokens (0: answer directly; None: think_limit); clipped to "
        "max_tokens_limit.",
    )  # fmt: skip
    think_model: str | None = Field(
        None, min_length=1, description="Budget that thinks (elastic budget control); None: the requested model."
    )


def _default_efforts() -> dict[str, EffortSetting]:
    caps = {"none": 0, "minimal": 16, "low": 64, "medium": 256, "high": None, "xhigh": None, "max": None}
    return {name: EffortSetting(think_cap=cap) for name, cap in caps.items()}


class ServingConfig(BaseModel):
    """Everything the serving application needs besides the model URI."""

    model_config = ConfigDict(extra="forbid")

    # ---- access and request limits
    api_key: str | None = Field(
        None, description="Bearer token required on /v1/* routes; None: read api_key_env, and if unset, no auth."
    )
    api_key_env: str | None = Field(
        DEFAULT_API_KEY_ENV, description="Environment variable holding the API key when api_key is None."
    )
    max_request_bytes: int = Field(64 * 1024, ge=256, description="Largest accepted request body; larger -> 413.")
    max_tokens_limit: int = Field(
        1024, ge=1, description="Largest accepted max_tokens and reasoning_budget; larger -> 400."
    )
    default_max_tokens: int = Field(128, ge=1, description="Answer tokens when a request gives no max_tokens.")
    max_prompt_tokens: int = Field(2048, ge=1, description="Longest accepted prompt in tokens; longer -> 400.")

    # ---- budget control
    default_think_cap: int | None = Field(
        None, ge=0, description="Thinking tokens when a request gives no reasoning_budget; None: think_limit."
    )
    think_limit: int = Field(
        512, ge=1, description="Most thinking tokens of an uncapped thinking phase (cut like a cap if reached)."
    )
    allow_think_larger: bool = Field(
        False, description="Allow think_model to be larger (active parameters) than the answering model."
    )
    budgets: list[str] | None = Field(
        None, description="Serve only these budgets of the checkpoint (None: all). The weights are loaded once."
    )
    markers: ReasoningMarkers = Field(
        default_factory=ReasoningMarkers,
        description="Strings that open and close the model's reasoning (tokens or token sequences): they split "
        "reasoning_content from content and bound the thinking phase.",
    )
    reasoning_effort: dict[ReasoningEffort, EffortSetting] = Field(
        default_factory=_default_efforts,
        description="What each reasoning_effort of a request means (a think cap, optionally a thinking budget); "
        "an effort missing here is refused with a 400. A request's own reasoning_budget / think_model win.",
    )

    # ---- structured outputs and tools
    tool_parser: Literal["hermes", "nemotron_v2"] = Field(
        "hermes",
        description="How the model writes tool calls (its chat template's format): hermes = <tool_call>{json}"
        "</tool_call> per call; nemotron_v2 = <TOOLCALL>[{json}, ...]</TOOLCALL>.",
    )
    json_style: Literal["spaced", "compact", "flexible"] = Field(
        "spaced",
        description="Layout of constrained JSON: spaced = one line with ', ' and ': '; compact = no spaces; "
        "flexible = any whitespace (a weak model may then spend its tokens on whitespace).",
    )
    grammar_cache_size: int = Field(256, ge=1, description="Compiled grammars kept (one per distinct schema).")

    # ---- weights and compute
    format: Literal["auto", "dense", "fp8", "nvfp4", "nvfp4_w4a4"] = Field(
        "auto", description="Weights to serve: as stored (auto), or demand dense / fp8 / nvfp4 / nvfp4_w4a4."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype of dense tensors (auto: as stored)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the weights live (auto: cuda if any).")
    quantized_budgets: Literal["sliced", "masked"] = Field(
        "sliced",
        description="FP8/NVFP4 nested checkpoints: 'sliced' serves each smaller budget from its own slice of the "
        "quantized weights, computing at its own size (resident quantized bytes: the budgets' sizes summed); "
        "'masked' serves every budget as the one quantized parent under the budget's mask (no extra memory, "
        "the parent's compute cost per token).",
    )
    cache_dequantized: bool = Field(
        False,
        description="FP8/NVFP4 only: keep a dense copy of each quantized weight after first use (faster on CPU, "
        "but the resident weights are then no longer the single quantized copy).",
    )
    dequant_cache_mib: float | None = Field(
        None,
        ge=0,
        description="FP8/NVFP4 only: memory (MiB), all budgets together, for dense copies of quantized weights "
        "(largest budget first, each in layer order; a weight beyond the bound is dequantized at every step). "
        "None: as cache_dequantized says (every weight, or none).",
    )
    decode_copy_mib: float | None = Field(
        None,
        ge=0,
        description="CPU decode: memory (MiB) the budgets' decode steps may take, all budgets together, for "
        "copies of projection weights in the layout their measured fastest kernel reads (model/decode/kernels.py; "
        "on this machine class they make a budget's step up to ~1.4x faster). 0: every budget reads the one "
        "weight copy. None: up to 4 GiB per budget (STAR_ELASTIC_DECODE_COPY_MIB).",
    )
    decode_compile: bool = Field(
        default_factory=compiled_decode_default,
        description="CPU decode: each decode step, one row (a stream decoding alone) or several (a batch of any "
        "size), as one compiled call (model/decode/compiled.py; torch.compile, needs a C++ compiler), compiled "
        "at start-up and kept for a budget and row count only where it measures faster than the eager steps; "
        "its outputs-major weight copies count against decode_copy_mib. Default: on "
        "(STAR_ELASTIC_DECODE_COMPILE=0 turns the default off).",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads in the replica (None: torch's default; Ray sets it to the "
        "replica's num_cpus).",
    )
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI for models:/ URIs (None: the MLFLOW_TRACKING_URI variable)."
    )
    cache_dir: str | None = Field(None, description="Where s3:// and models:/ checkpoints are downloaded.")

    # ---- batching and backpressure
    batch_max_size: int = Field(16, ge=1, description="Most sequences decoded together in one batch (1: no batching).")
    merge_running_batches: bool = Field(
        True,
        description="Let newly prefilled requests join a batch of the same budget that is already decoding "
        "(continuous batching; shorter KV histories are left-padded and masked). False: a batch only ever "
        "holds the requests it started with.",
    )
    batch_wait_timeout_s: float = Field(
        0.01, ge=0, le=5, description="How long an idle replica waits for more requests before it starts a batch."
    )
    max_ongoing_requests: int = Field(32, ge=1, description="Requests one replica works on at once.")
    max_queued_requests: int = Field(
        64,
        ge=-1,
        description="Requests one replica holds waiting for a slot beyond that; more -> JSON 503 with Retry-After "
        "(-1: unbounded, never 503).",
    )
    retry_after_s: float = Field(
        1.0, gt=0, description="Seconds a 503 (overloaded, or the model not serving) asks the client to wait."
    )
    proxy_max_queued_requests: int = Field(
        1024,
        ge=1,
        description="Requests the ingress (and Serve's HTTP proxy before it) holds while no replica can take one "
        "(e.g. while replicas start); more -> JSON 503. Unbounded when max_queued_requests is -1.",
    )
    max_choices_per_request: int = Field(
        16, ge=1, description="Most sequences one request may ask for (n x number of prompts); more -> 400."
    )

    # ---- replicas
    num_cpus_per_replica: float = Field(1.0, ge=0, description="CPUs each replica reserves.")
    num_gpus_per_replica: float = Field(0.0, ge=0, description="GPUs each replica reserves.")
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings, description="Replica autoscaling.")

    # ---- replica health (Ray Serve only)
    health_check_period_s: float = Field(
        5.0, gt=0, description="How often Serve calls each replica's check_health; a failed check replaces it."
    )
    health_check_timeout_s: float = Field(
        60.0, gt=0, description="A check_health that has not answered after this long fails (a wedged event loop)."
    )
    stall_timeout_s: float = Field(
        120.0,
        gt=0,
        description="check_health fails when the decode thread has not finished a loop iteration for this long "
        "(a wedged decode step); longer than the slowest prefill of a full batch.",
    )
    ingress_replicas: int = Field(
        1, ge=1, description="Replicas of the ingress (no model, no CPU reserved) that answers HTTP in front of them."
    )
    replica_wait_s: float = Field(
        30.0,
        gt=0,
        description="How long the ingress waits for a model replica to take a request (e.g. while one restarts) "
        "before answering a JSON 503 with Retry-After.",
    )
    probe_timeout_s: float = Field(
        2.0, gt=0, description="/health and /ready answer 503 when no model replica answers within this."
    )

    @model_validator(mode="after")
    def _consistent(self) -> ServingConfig:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} > max_tokens_limit {self.max_tokens_limit}")
        if self.default_think_cap is not None and self.default_think_cap > self.max_tokens_limit:
            raise ValueError(f"default_think_cap {self.default_think_cap} > max_tokens_limit {self.max_tokens_limit}")
        # Serve sends at most max_ongoing_requests to a replica: a higher target could never be reached.
        if self.autoscaling.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError("autoscaling.target_ongoing_requests must be <= max_ongoing_requests")
        return self

    # ------------------------------------------------------------------ derived values
    def resolved_api_key(self) -> str | None:
        """The key requests must present, or None when the API is open."""
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or None
        return None

    def serve_max_ongoing_requests(self) -> int:
        """What Serve may send one replica: its capacity (working + waiting) plus as many again as it
        works on, so that overload reaches the replica (which answers it with a JSON 503) and the
        probes and ``/metrics`` still get through to a full replica."""
        return 2 * self.max_ongoing_requests + max(self.max_queued_requests, 0)

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments of ``Deployment.options`` for the model deployment (the replicas with weights)."""
        unbounded = self.max_queued_requests == -1
        return {
            "name": DEPLOYMENT_NAME,
            "max_ongoing_requests": self.serve_max_ongoing_requests(),
            # the ingress's queue for this deployment while no replica can take a request (e.g. one restarts)
            "max_queued_requests": -1 if unbounded else self.proxy_max_queued_requests,
            "backpressure_config": {"status_code": 503, "retry_after_s": self.retry_after_s},
            "autoscaling_config": self.autoscaling.serve_config(),
            "ray_actor_options": {"num_cpus": self.num_cpus_per_replica, "num_gpus": self.num_gpus_per_replica},
            "health_check_period_s": self.health_check_period_s,
            # The health check runs on the replica's event loop; a long decode step must not fail it.
            "health_check_timeout_s": self.health_check_timeout_s,
        }

    def ingress_options(self) -> dict[str, Any]:
        """Keyword arguments of ``Deployment.options`` for the ingress: HTTP in front of the model replicas.

        It holds no model, so it reserves no CPU and survives a model replica's death; it takes every
        request any model replica could take (``max_replicas`` times one replica's share)."""
        unbounded = self.max_queued_requests == -1
        per_ingress = -(-self.serve_max_ongoing_requests() * self.autoscaling.max_replicas // self.ingress_replicas)
        return {
            "name": INGRESS_NAME,
            "num_replicas": self.ingress_replicas,
            "max_ongoing_requests": per_ingress + 16,  # + room for probes and /metrics of a full deployment
            "max_queued_requests": -1 if unbounded else self.proxy_max_queued_requests,
            "backpressure_config": {"status_code": 503, "retry_after_s": self.retry_after_s},
            "ray_actor_options": {"num_cpus": 0},
            "health_check_period_s": self.health_check_period_s,
        }


def load_config(
    source: ServingConfig | Mapping[str, Any] | str | Path | None = None, **overrides: Any
) -> ServingConfig:
    """A :class:`ServingConfig` from an object, a dict, a YAML/JSON file path, or None (defaults).

    ``overrides`` are field values applied on top (e.g. ``max_tokens_limit=256`` from ``serve run``
    arguments, which arrive as strings and are converted by validation).
    """
    if isinstance(source, ServingConfig):
        data = source.model_dump()
    elif source is None:
        data = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        path = Path(source)
        text = path.read_text(encoding="utf-8")
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a serving config must be a mapping, got {type(data).__name__}")
        if isinstance(data.get("serve"), dict) or "elastic" in data:  # a pipeline config: take its serve section
            from components.data.inherit import Inherited

            # the pipeline's reasoning markers, unless serve sets its own (the rule every stage's section follows)
            data = Inherited.of(data, ("markers",)).fill(data.get("serve") or {}, keys=("markers",))
    data.update(overrides)
    return ServingConfig.model_validate(data)


def resolve_checkpoint(model_uri: str, config: ServingConfig) -> Path:
    """A local folder for a path, an ``s3://`` prefix or a ``models:/`` registry URI."""
    from components.storage import is_s3, materialize  # imported here: boto3 and mlflow are heavy

    if model_uri.startswith("models:/"):
        from components.model_uri import resolve_model_uri

        # fp8 / nvfp4 / dense: the registered family's version of that format (tags version.<format>)
        dst = Path(config.cache_dir) / "models" if config.cache_dir else None
        return resolve_model_uri(model_uri, config.tracking_uri, dst, fmt=config.format)
    if is_s3(model_uri):
        return materialize(model_uri, config.cache_dir)
    path = Path(model_uri)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model_uri}: not a checkpoint folder (no config.json)")
    return path
