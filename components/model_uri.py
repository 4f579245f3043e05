"""``models:/`` URIs: the store they resolve in, the registered version they name, the checkpoint they download.

``models:/NAME@alias`` and ``models:/NAME/VERSION`` resolve in the store :mod:`components.settings`
picks: an explicit ``tracking_uri`` (``serve.tracking_uri``), else ``MLFLOW_TRACKING_URI``, else the
pipeline's own store (``sqlite:///runs/mlflow.db``), which must exist: resolution never creates a store.
A version's family (its ``format`` and ``version.<format>`` tags, written by :mod:`components.register`)
gives the sibling of another format; the download is the pyfunc model of :mod:`components.mlflow_model`,
whose checkpoint artifact :func:`checkpoint_folder` finds.

Serving, the CLI and the register stage read these rules from here; the register stage writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from components.settings import MlflowStore, mlflow_store

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

BASE_FORMAT = "dense"
"""Format name of the nested checkpoint as exported (quantized ones are named by the quantize stage)."""
CHECKPOINT_ARTIFACT = "checkpoint"
"""Key of the nested checkpoint folder in the registered pyfunc's ``artifacts``."""


def registry_store(tracking_uri: str | None = None, runs_dir: str | Path = "runs") -> MlflowStore:
    """The store ``models:/`` URIs resolve in: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else the
    pipeline's default store ``sqlite:///<runs_dir>/mlflow.db`` (absolute), which must exist (MLflow would
    otherwise create an empty database wherever the process runs)."""
    store = mlflow_store(tracking_uri)
    if store is not None:
        return store
    db = Path(runs_dir).resolve() / "mlflow.db"
    if not db.is_file():
        raise FileNotFoundError(
            f"no MLflow tracking store for models:/ URIs: MLFLOW_TRACKING_URI is unset and the pipeline's store {db} "
            "does not exist (run the pipeline here first, or set MLFLOW_TRACKING_URI or serve.tracking_uri)"
        )
    uri = f"sqlite:///{db}"
    return MlflowStore(tracking_uri=uri, registry_uri=uri, source="default")


def registry_tracking_uri(tracking_uri: str | None = None, runs_dir: str | Path = "runs") -> str:
    """The tracking URI of :func:`registry_store`."""
    return registry_store(tracking_uri, runs_dir).tracking_uri


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/NAME@ALIAS`` -> (NAME, ALIAS, None); ``models:/NAME/VERSION`` -> (NAME, None, VERSION)."""
    rest = uri.removeprefix("models:/")
    if not uri.startswith("models:/") or not rest:
        raise ValueError(f"{uri!r}: not a models:/NAME@ALIAS or models:/NAME/VERSION URI")
    if "@" in rest:
        name, _, alias = rest.partition("@")
        if name and alias and "/" not in alias:
            return name, alias, None
    elif rest.count("/") == 1:
        name, _, version = rest.partition("/")
        if name and (version.isdigit() or version == "latest"):
            return name, None, version
    raise ValueError(f"{uri!r}: not a models:/NAME@ALIAS or models:/NAME/VERSION URI")


def find_model_version(uri: str, tracking_uri: str, fmt: str = "auto", registry_uri: str | None = None) -> ModelVersion:
    """The registered version ``uri`` names, or its sibling holding ``fmt`` weights; one-line errors.
    ``registry_uri``: the registry of that store (default: the tracking store itself)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    name, alias, version = parse_models_uri(uri)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)
    try:
        model = client.get_registered_model(name)
    except MlflowException:
        known = [m.name for m in client.search_registered_models(max_results=20)]
        raise ValueError(f"{uri}: no registered model {name!r} at {tracking_uri}; it has {known}") from None
    if alias is not None:
        if alias not in model.aliases:
            raise ValueError(
                f"{uri}: registered model {name!r} has no alias {alias!r} (aliases: {model.aliases or 'none'}); "
                "the promotion gate may have rejected every version (see each version's 'promotion' tag)"
            )
        version = model.aliases[alias]
    elif version == "latest":
        numbers = [int(v.version) for v in client.search_model_versions(f"name = '{name}'")]
        if not numbers:
            raise ValueError(f"{uri}: registered model {name!r} has no versions yet")
        version = str(max(numbers))
    try:
        mv = client.get_model_version(name, version)
    except MlflowException:
        raise ValueError(f"{uri}: registered model {name!r} has no version {version}") from None
    have = mv.tags.get("format", BASE_FORMAT)
    if fmt in ("auto", have):
        return mv
    sibling = mv.tags.get(f"version.{fmt}")
    if sibling is None:
        raise ValueError(
            f"{uri}: version {mv.version} has no {fmt} sibling; its family has formats "
            f"{mv.tags.get('formats', have)} (serve.format)"
        )
    return client.get_model_version(name, sibling)


def resolve_model_uri(uri: str, tracking_uri: str | None, dst: str | Path | None = None, fmt: str = "auto") -> Path:
    """``models:/NAME@alias`` or ``models:/NAME/VERSION`` -> the local nested checkpoint folder of that version.

    ``fmt`` other than ``auto`` takes the family's version holding that format (``fp8``, ``nvfp4``,
    ``dense``). The model is downloaded under ``dst`` (``<dst>/<NAME>-v<VERSION>``; default: a temporary
    folder) and the checkpoint folder inside it returned.
    """
    import mlflow

    store = registry_store(tracking_uri)
    mv = find_model_version(uri, store.tracking_uri, fmt, store.registry_uri)
    target = None
    if dst is not None:
        target = Path(dst) / f"{mv.name}-v{mv.version}"
        target.mkdir(parents=True, exist_ok=True)
    # MLflow's models:/ artifact repository finds the version through the process-wide registry, whatever
    # registry_uri says: that registry is this store's for the download
    with store.process_wide():
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{mv.name}/{mv.version}",
            dst_path=str(target) if target else None,
            tracking_uri=store.tracking_uri,
            registry_uri=store.registry_uri,
        )
    return checkpoint_folder(local)


def checkpoint_folder(model_dir: str | Path) -> Path:
    """The nested checkpoint inside a downloaded pyfunc model folder (``model_dir`` itself for a bare checkpoint)."""
    from mlflow.models import Model

    model_dir = Path(model_dir)
    if not (model_dir / "MLmodel").is_file():
        if (model_dir / "config.json").is_file():  # a bare checkpoint folder
            return model_dir
        raise FileNotFoundError(f"{model_dir}: neither an MLflow model (no MLmodel) nor a checkpoint (no config.json)")
    flavor = Model.load(model_dir).flavors.get("python_function", {})
    artifact = (flavor.get("artifacts") or {}).get(CHECKPOINT_ARTIFACT)
    if not artifact:
        raise FileNotFoundError(f"{model_dir}: the MLflow model has no {CHECKPOINT_ARTIFACT!r} artifact")
    return model_dir / artifact["path"]
