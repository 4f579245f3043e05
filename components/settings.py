"""What the project takes from its environment: read in this module only, never written back.

The variables (read when a caller asks, into a frozen :class:`Settings` that is passed on as values):

* the MLflow store: ``MLFLOW_TRACKING_URI`` and ``MLFLOW_REGISTRY_URI``;
* the download cache: ``STAR_ELASTIC_CACHE`` (default ``~/.cache/star-elastic``), by the model layer's rule
  (:func:`model.cache_folder.cache_folder`: the model keeps a cache there too and imports nothing from here);
* S3: the endpoint (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``), the credentials
  (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``), the region
  (``AWS_DEFAULT_REGION``, else ``AWS_REGION``), the retries (``AWS_RETRY_MODE``, ``AWS_MAX_ATTEMPTS``)
  and the checksum behaviour of uploads (``AWS_REQUEST_CHECKSUM_CALCULATION``,
  ``AWS_RESPONSE_CHECKSUM_VALIDATION``).

Which MLflow store: one rule, for logging, registering and resolving ``models:/`` alike
(:func:`mlflow_store`):

1. an explicit value wins: the config's ``tracking_uri`` (the pipeline YAML, ``serve.tracking_uri``)
   or a ``--tracking-uri`` flag;
2. else ``MLFLOW_TRACKING_URI``;
3. else the caller's default: the pipeline's ``sqlite:///<runs_dir>/mlflow.db`` (commands without a
   store of their own then log nothing).

The registry is the store so chosen; ``MLFLOW_REGISTRY_URI`` names another one only when the
tracking URI itself came from the environment. Why the config wins: a config that names its store is
reproducible wherever it runs (a laptop, a RayJob whose pods carry a cluster-wide
``MLFLOW_TRACKING_URI``): it logs and registers in that store, whatever the environment says; the
environment fills in only what the config leaves open.

Every MLflow call goes through an explicit ``MlflowClient`` (:meth:`MlflowStore.client`). The few
MLflow functions that read only the process-wide URIs run inside :meth:`MlflowStore.process_wide`,
which restores those URIs, and the variables MLflow writes when they are set, on the way out.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

from pydantic import BaseModel, ConfigDict, Field

from model.cache_folder import cache_folder, default_cache_folder

if TYPE_CHECKING:
    from mlflow import MlflowClient

TRACKING_ENV = "MLFLOW_TRACKING_URI"
REGISTRY_ENV = "MLFLOW_REGISTRY_URI"
CHECKSUM_ENV = ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")
"""Variables the AWS SDKs read for the checksums of S3 requests (there is no pyarrow argument for them)."""


class S3Settings(BaseModel):
    """How to reach S3 or an S3-compatible server (None: boto3's own default chain decides)."""

    model_config = ConfigDict(frozen=True)

    endpoint_url: str | None = Field(None, description="AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL.")
    access_key_id: str | None = Field(None, repr=False, description="AWS_ACCESS_KEY_ID.")
    secret_access_key: str | None = Field(None, repr=False, description="AWS_SECRET_ACCESS_KEY.")
    session_token: str | None = Field(None, repr=False, description="AWS_SESSION_TOKEN.")
    region: str | None = Field(None, description="AWS_DEFAULT_REGION, else AWS_REGION.")
    retry_mode: str = Field("standard", description="AWS_RETRY_MODE (botocore's retry mode).")
    max_attempts: int | None = Field(None, ge=1, description="AWS_MAX_ATTEMPTS: tries of one request in all.")
    request_checksum_calculation: str | None = Field(None, description="AWS_REQUEST_CHECKSUM_CALCULATION.")
    response_checksum_validation: str | None = Field(None, description="AWS_RESPONSE_CHECKSUM_VALIDATION.")

    def checksum_env(self) -> dict[str, str]:
        """Checksum variables for processes that upload through the AWS C++ SDK (pyarrow, so Ray Train's
        checkpoints): ``when_required`` for an S3-compatible endpoint unless the environment says otherwise.

        That SDK sends checksummed ``aws-chunked`` uploads by default, which some servers (SeaweedFS, older
        MinIO / Ceph) reject or store verbatim; real AWS (no endpoint) needs nothing.
        """
        if not self.endpoint_url:
            return {}
        values = (self.request_checksum_calculation, self.response_checksum_validation)
        return {name: value or "when_required" for name, value in zip(CHECKSUM_ENV, values, strict=True)}


class Settings(BaseModel):
    """Every value the project takes from the environment."""

    model_config = ConfigDict(frozen=True)

    mlflow_tracking_uri: str | None = Field(None, description="MLFLOW_TRACKING_URI.")
    mlflow_registry_uri: str | None = Field(None, description="MLFLOW_REGISTRY_URI.")
    cache_dir: Path = Field(default_factory=default_cache_folder, description="STAR_ELASTIC_CACHE.")
    s3: S3Settings = Field(default_factory=S3Settings, description="S3 endpoint, credentials and retries.")


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name) or None
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a whole number") from None


def from_environment(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings ``environ`` (default: this process's environment) gives; empty variables count as unset."""
    env = os.environ if environ is None else environ

    def get(*names: str) -> str | None:
        return next((env[n] for n in names if env.get(n)), None)

    s3 = S3Settings(
        endpoint_url=get("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        access_key_id=get("AWS_ACCESS_KEY_ID"),
        secret_access_key=get("AWS_SECRET_ACCESS_KEY"),
        session_token=get("AWS_SESSION_TOKEN"),
        region=get("AWS_DEFAULT_REGION", "AWS_REGION"),
        retry_mode=get("AWS_RETRY_MODE") or "standard",
        max_attempts=_int(env, "AWS_MAX_ATTEMPTS"),
        request_checksum_calculation=get(CHECKSUM_ENV[0]),
        response_checksum_validation=get(CHECKSUM_ENV[1]),
    )
    return Settings(
        mlflow_tracking_uri=get(TRACKING_ENV),
        mlflow_registry_uri=get(REGISTRY_ENV),
        cache_dir=cache_folder(env),
        s3=s3,
    )


def cache_dir(explicit: str | Path | None = None) -> Path:
    """The local download cache: ``explicit`` (a config's ``cache_dir``), else ``$STAR_ELASTIC_CACHE``, else
    ``~/.cache/star-elastic``."""
    return Path(explicit) if explicit else from_environment().cache_dir


# ---------------------------------------------------------------------- the MLflow store
_PROCESS_WIDE = threading.RLock()  # re-entered by a register inside a scoped body


class MlflowStore(BaseModel):
    """The MLflow store one run logs to and registers in, and where that choice came from."""

    model_config = ConfigDict(frozen=True)

    tracking_uri: str = Field(description="Where runs, params, metrics and artifacts are logged.")
    registry_uri: str = Field(description="Where model versions and aliases live (usually the same store).")
    source: Literal["config", "environment", "default", "given"] = Field(
        "given", description="Which rule chose it ('given': chosen elsewhere, e.g. by the driver of this worker)."
    )

    @classmethod
    def of(cls, tracking_uri: str, registry_uri: str | None = None) -> MlflowStore:
        """A store chosen already (``registry_uri`` None: the tracking store itself)."""
        return cls(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)

    def client(self) -> MlflowClient:
        """A client bound to this store; it never consults the process-wide URIs."""
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)

    @contextmanager
    def process_wide(self) -> Iterator[None]:
        """Make this store MLflow's process-wide one for the body, then restore what was there.

        Only for MLflow functions that take no client or URI (``mlflow.pyfunc.log_model``), or that look the
        store up process-wide behind a client (the SQL registry's ``create_model_version`` of a
        ``models:/<model_id>`` source). MLflow's setters
        also write ``MLFLOW_TRACKING_URI`` / ``MLFLOW_REGISTRY_URI`` into the environment (for subprocesses);
        both variables are put back as they were. Bodies run one at a time in a process.
        """
        import mlflow
        from mlflow.tracking._model_registry import utils as registry_state
        from mlflow.tracking._tracking_service import utils as tracking_state

        with _PROCESS_WIDE:
            saved_env = {name: os.environ.get(name) for name in (TRACKING_ENV, REGISTRY_ENV)}
            saved = (tracking_state._tracking_uri, registry_state._registry_uri)
            try:
                mlflow.set_tracking_uri(self.tracking_uri)
                mlflow.set_registry_uri(self.registry_uri)
                yield
            finally:
                mlflow.set_tracking_uri(saved[0])
                registry_state._registry_uri = saved[1]  # its setter cannot unset
                for name, value in saved_env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value


@overload
def mlflow_store(explicit: str | None, default: str, settings: Settings | None = None) -> MlflowStore: ...
@overload
def mlflow_store(
    explicit: str | None, default: None = None, settings: Settings | None = None
) -> MlflowStore | None: ...
def mlflow_store(
    explicit: str | None,
    default: str | None = None,
    settings: Settings | None = None,
) -> MlflowStore | None:
    """The store by the module's rule: ``explicit``, else ``MLFLOW_TRACKING_URI``, else ``default``; None when
    none of them names one (tracking off). ``settings``: the environment to apply (default: this process's)."""
    env = settings or from_environment()
    if explicit:
        return MlflowStore(tracking_uri=explicit, registry_uri=explicit, source="config")
    if env.mlflow_tracking_uri:
        registry = env.mlflow_registry_uri or env.mlflow_tracking_uri
        return MlflowStore(tracking_uri=env.mlflow_tracking_uri, registry_uri=registry, source="environment")
    if default:
        return MlflowStore(tracking_uri=default, registry_uri=default, source="default")
    return None
