"""Where a files source's data is: local files, folders, globs and ``s3://`` URIs.

``s3://`` objects (globs allowed in the key, or a prefix standing for a folder) are downloaded once
through boto3 (:func:`components.storage.s3_client`) into the local cache
(:func:`components.settings.cache_dir`) and read from there like local files; an object is downloaded
again only when its ETag or size changes.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from collections.abc import Sequence
from pathlib import Path

from components.settings import cache_dir as settings_cache_dir

__all__ = ["builder_for", "resolve_files"]

#: File suffix -> the ``datasets`` builder that reads it (``.gz`` compressed files too).
SUFFIX_BUILDER = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_GLOB_CHARS = re.compile(r"[*?\[]")


def _fetch_s3(pattern: str, cache_dir: str | None) -> list[Path]:
    """Download the objects matching ``pattern`` (``s3://bucket/key``, globs allowed in the key) into
    the cache (once: a file already there with the object's size and ETag is reused)."""
    from components.storage import s3_client, split_s3

    bucket, key_pattern = split_s3(pattern)
    glob_at = _GLOB_CHARS.search(key_pattern)
    prefix = key_pattern[: glob_at.start()] if glob_at else key_pattern
    client = s3_client()
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.endswith("/"):
                continue
            wanted = (
                fnmatch.fnmatchcase(key, key_pattern)
                if glob_at
                else key == prefix or key.startswith(prefix.rstrip("/") + "/")
            )
            if not wanted or Path(key).suffix.lower() not in (*SUFFIX_BUILDER, ".gz"):
                continue
            dest = settings_cache_dir(cache_dir) / "data" / bucket / key
            stamp = dest.with_name(dest.name + ".etag")
            etag = f"{obj.get('ETag', '')}:{obj['Size']}"
            if not (dest.is_file() and stamp.is_file() and stamp.read_text() == etag):
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.tmp")
                client.download_file(bucket, key, str(tmp))
                os.replace(tmp, dest)
                stamp.write_text(etag)
            out.append(dest)
    return sorted(out)


def builder_for(path: Path) -> str:
    """The ``datasets`` builder that reads ``path`` (``json`` or ``parquet``, by suffix, ``.gz`` ignored)."""
    return SUFFIX_BUILDER[[s.lower() for s in path.suffixes if s.lower() != ".gz"][-1]]


def _is_data_file(path: Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return bool(suffixes) and suffixes[-1] in SUFFIX_BUILDER


def resolve_files(paths: Sequence[str], cache_dir: str | None = None, label: str = "files") -> list[Path]:
    """Local data files of ``paths`` in a fixed order (each path's matches sorted; s3:// downloaded).

    Raises:
        FileNotFoundError: naming the source ``label`` and the path that matches no data file.
    """
    files: list[Path] = []
    for pattern in paths:
        pattern = pattern if pattern.startswith("s3://") else os.path.expanduser(pattern)
        if pattern.startswith("s3://"):
            found = _fetch_s3(pattern, cache_dir)
        elif _GLOB_CHARS.search(pattern):
            found = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        elif Path(pattern).is_dir():
            found = sorted(p for p in Path(pattern).rglob("*") if p.is_file() and _is_data_file(p))
        else:
            found = [Path(pattern)] if Path(pattern).is_file() else []
        found = [p for p in found if _is_data_file(p)]
        if not found:
            raise FileNotFoundError(
                f"source {label!r}: path {pattern!r} matches no .jsonl / .json / .parquet file (optionally .gz)"
            )
        files.extend(found)
    return list(dict.fromkeys(files))
