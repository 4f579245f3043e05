"""Artifact storage by URI: local folders by default, ``s3://bucket/prefix`` through boto3.

Stages work on local folders. ``materialize`` turns any URI into a local folder
(downloading an ``s3://`` prefix into a cache once), ``fetch_files`` fetches only the
named files of a URI (a checkpoint's ``config.json``, tokenizer files and manifest,
without its weights), ``publish`` copies a local folder to a URI. S3 settings come from the standard AWS variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) and
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for any S3-compatible server, read by
:mod:`components.settings` and passed to boto3 explicitly.

A server that stops answering is retried by botocore's ``standard`` retry mode with backoff, a bounded
number of times (``AWS_MAX_ATTEMPTS``, default :data:`S3_MAX_ATTEMPTS`; connect and read time-outs of
:data:`S3_TIMEOUT_S`); after that the transfer raises :class:`StorageUnavailable`, one line naming the
URI, the endpoint and what to do. A folder published to S3 is unpublished first (its ``manifest.json``
deleted) and its manifest uploaded last, so an upload cut off half-way is never read as complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from components.settings import S3Settings, from_environment
from components.settings import cache_dir as settings_cache_dir
from model.layout import TOKENIZER_FILES

METADATA_FILES: tuple[str, ...] = ("config.json", "manifest.json", "model.safetensors.index.json")
"""A checkpoint's files besides its weights and tokenizer that stages read before loading it."""


def is_s3(uri: str | os.PathLike) -> bool:
    return str(uri).startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3 URI: {uri!r} (expected s3://bucket/prefix)")
    return parsed.netloc, parsed.path.lstrip("/")


S3_MAX_ATTEMPTS = 4
"""Tries of one S3 request (botocore's ``standard`` mode backs off between them) unless ``AWS_MAX_ATTEMPTS`` says."""
S3_TIMEOUT_S = 20
"""Seconds to connect to the S3 endpoint, and to wait for a byte of an answer, before a try counts as failed."""


class StorageUnavailable(ConnectionError):
    """The storage endpoint stopped answering; the message names the URI, the endpoint and what to do."""


def s3_client(s3: S3Settings | None = None):
    """A boto3 S3 client for ``s3`` (default: the environment's settings, ``AWS_ENDPOINT_URL(_S3)`` for
    S3-compatible servers), with bounded retries."""
    import boto3
    from botocore.config import Config

    s3 = s3 or from_environment().s3
    retries: dict[str, Any] = {"mode": s3.retry_mode}
    if s3.max_attempts is None:
        retries["max_attempts"] = S3_MAX_ATTEMPTS
    else:  # AWS_MAX_ATTEMPTS counts every try, as botocore reads the variable
        retries["total_max_attempts"] = s3.max_attempts
    config = Config(retries=retries, connect_timeout=S3_TIMEOUT_S, read_timeout=S3_TIMEOUT_S)
    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        aws_access_key_id=s3.access_key_id,
        aws_secret_access_key=s3.secret_access_key,
        aws_session_token=s3.session_token,
        region_name=s3.region,
        config=config,
    )


@contextmanager
def unreachable_as_one_line(uri: str, action: str) -> Iterator[None]:
    """Turn botocore's connection failures (after its retries) into :class:`StorageUnavailable` for ``uri``."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import ReadTimeoutError

    try:
        yield
    except (BotoConnectionError, ReadTimeoutError, S3UploadFailedError) as err:
        if isinstance(err, S3UploadFailedError) and not _is_connection_failure(err):
            raise
        s3 = from_environment().s3
        attempts, endpoint = s3.max_attempts or S3_MAX_ATTEMPTS, s3.endpoint_url or "(AWS default)"
        raise StorageUnavailable(
            f"{action} {uri}: the S3 endpoint {endpoint} did not answer after {attempts} tries "
            f"({type(err).__name__}); check that it is up and AWS_ENDPOINT_URL, then re-run (nothing was published)"
        ) from err


def _is_connection_failure(err: BaseException) -> bool:
    text = str(err)
    return any(k in text for k in ("Could not connect", "Connection was closed", "Read timeout", "Connect timeout"))


def publish(local_dir: str | Path, uri: str) -> str:
    """Copy the folder ``local_dir`` to ``uri`` (a local path or ``s3://``). Returns ``uri``."""
    src = Path(local_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"cannot publish {src}: not a folder")
    if not is_s3(uri):
        dst = Path(uri)
        if dst.resolve() != src.resolve():
            tmp = dst.parent / f".{dst.name}.publish-tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp)
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(tmp, dst)
        return str(dst)
    bucket, prefix = split_s3(uri)
    client = s3_client()
    # unpublish (delete the old manifest), upload everything but the manifest, then the manifest: a reader
    # that sees a manifest sees all of its files, and an upload cut off half-way leaves no manifest
    files = sorted(p for p in src.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.name == "manifest.json")

    def key(relative: str) -> str:
        return f"{prefix.rstrip('/')}/{relative}" if prefix else relative

    with unreachable_as_one_line(uri, "publishing"):
        if any(p.name == "manifest.json" for p in files):
            client.delete_object(Bucket=bucket, Key=key("manifest.json"))
        for path in files:
            client.upload_file(str(path), bucket, key(path.relative_to(src).as_posix()))
    return uri


def _cache_folder(uri: str | Path, cache_dir: str | Path | None) -> Path:
    """Where :func:`materialize` downloads the ``s3://`` prefix ``uri``."""
    return settings_cache_dir(cache_dir) / "s3" / hashlib.sha256(str(uri).encode()).hexdigest()[:16]


def materialize(uri: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A local folder holding the contents of ``uri`` (s3 prefixes are downloaded once into ``cache_dir``)."""
    if not is_s3(uri):
        path = Path(uri)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        return path
    bucket, prefix = split_s3(str(uri))
    local = _cache_folder(uri, cache_dir)
    marker = local / ".complete"
    if marker.exists():
        return local
    client = s3_client()
    tmp = local.parent / f".{local.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    paginator = client.get_paginator("list_objects_v2")
    n = 0
    base = prefix.rstrip("/") + "/" if prefix else ""
    with unreachable_as_one_line(str(uri), "downloading"):
        for page in paginator.paginate(Bucket=bucket, Prefix=base):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(base) :]
                if not rel:
                    continue
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, obj["Key"], str(dest))
                n += 1
    if n == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileNotFoundError(f"{uri}: no objects under this prefix")
    (tmp / ".complete").write_text("ok")
    shutil.rmtree(local, ignore_errors=True)
    os.replace(tmp, local)
    return local


def fetch_files(uri: str | Path, names: Iterable[str], cache_dir: str | Path | None = None) -> Path:
    """A local folder holding the files ``names`` (paths relative to ``uri``) that exist under ``uri``; nothing else.

    For reading a checkpoint's metadata (``config.json``, tokenizer files, ``manifest.json``) without
    downloading its weights (tens of GB at real scale). A local ``uri`` is returned as is. For an
    ``s3://`` prefix already downloaded whole by :func:`materialize`, that folder is returned; otherwise
    each named object is downloaded again on every call (small files: a re-published prefix is never read
    stale) into its own cache folder, and a name with no object is left out (the caller checks for the
    files it requires). Raises ``FileNotFoundError`` when none of ``names`` exists under ``uri``.
    """
    names = sorted(set(names))
    bad = [n for n in names if not n or n.startswith("/") or ".." in Path(n).parts]
    if bad:
        raise ValueError(f"fetch_files: names must be relative paths inside the prefix, got {bad}")
    if not is_s3(uri):
        return materialize(uri)
    full = _cache_folder(uri, cache_dir)
    if (full / ".complete").exists():
        return full
    from botocore.exceptions import ClientError

    bucket, prefix = split_s3(str(uri))
    base = prefix.rstrip("/") + "/" if prefix else ""
    local = full.parent / f"{full.name}.files"
    local.mkdir(parents=True, exist_ok=True)
    client = s3_client()
    found = 0
    for name in names:
        dest = local / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{os.getpid()}.tmp"
        try:
            client.download_file(bucket, base + name, str(tmp))
        except ClientError as err:
            tmp.unlink(missing_ok=True)
            if err.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey"):
                raise
            dest.unlink(missing_ok=True)  # gone from the prefix since an earlier call
            continue
        os.replace(tmp, dest)  # atomic: a concurrent reader sees the old file or the new one
        found += 1
    if found == 0:
        raise FileNotFoundError(f"{uri}: none of {names} exists under this prefix")
    return local


def fetch_metadata(uri: str | Path, cache_dir: str | Path | None = None) -> Path:
    """:func:`fetch_files` of a checkpoint's metadata: ``config.json``, ``manifest.json``, the shard index and the
    tokenizer files (:data:`~model.layout.TOKENIZER_FILES`), never a weight file. Enough for
    :func:`~model.checkpoint.read_config` and :meth:`~components.data.tokenizer.TextTokenizer.load`."""
    return fetch_files(uri, (*METADATA_FILES, *TOKENIZER_FILES), cache_dir)


def check_reachable(uri: str) -> None:
    """Fail fast (before any stage runs) if ``uri`` cannot be written: local parent missing or bucket absent."""
    if is_s3(uri):
        bucket, _ = split_s3(uri)
        try:
            s3_client().head_bucket(Bucket=bucket)
        except Exception as err:  # boto3 raises several types; the message is what matters here
            raise ValueError(f"{uri}: bucket {bucket!r} is not reachable ({type(err).__name__}: {err})") from None
        return
    p = Path(uri)
    anchor = next((q for q in [p, *p.parents] if q.exists()), None)
    if anchor is None or not os.access(anchor, os.W_OK):
        raise ValueError(f"{uri}: not writable (nearest existing folder: {anchor})")
