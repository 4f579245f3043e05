"""Publish a folder atomically: readers see the previous folder or the complete new one, never a part.

:func:`publish_folder` yields a staging folder, a hidden sibling of the target (same file system,
so the final rename is atomic). On a clean exit every file in it is flushed to disk (``fsync``)
and it is renamed into place; the folder it replaces is removed only after that rename. On any
exception (``KeyboardInterrupt`` included) the staging folder is removed and the previous folder
is left untouched.

POSIX cannot rename a folder onto a non-empty one, so replacing takes two renames (target aside,
staging in): between them the target is briefly absent, never half-written. A process killed
with SIGKILL mid-write leaves its hidden ``.NAME.tmp-*`` staging folder behind; the target is
still intact.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["publish_folder"]


def _fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (the names, not the files); a no-op where the file system refuses it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some network file systems reject fsync on a directory (EINVAL)
        pass
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file below ``folder`` and every folder's entries, so the rename publishes data on disk."""
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _swap_into_place(staging: Path, target: Path, aside: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is moved to ``aside`` first and restored on failure."""
    if not target.exists():
        os.replace(staging, target)
    else:
        os.replace(target, aside)
        try:
            os.replace(staging, target)
        except BaseException:
            os.replace(aside, target)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(target.parent)


@contextmanager
def publish_folder(target: str | Path) -> Iterator[Path]:
    """Yield an empty staging folder; on a clean exit it is flushed to disk and renamed to ``target``.

    Write every file of the new folder into the yielded path. ``target``'s parent folders are
    created; an existing ``target`` is replaced as a whole. Raises whatever the body or the
    renames raise, after removing the staging folder.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not tempfile.mkdtemp: mkdtemp's mode 0o700 would become the published folder's mode.
    token = uuid.uuid4().hex[:12]
    staging = target.parent / f".{target.name}.tmp-{token}"
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
        _swap_into_place(staging, target, target.parent / f".{target.name}.old-{token}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
