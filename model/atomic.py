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

Every published file gets the mode an ordinary ``open`` would give it (``0o666`` less the umask):
writers that go through a private temporary file (safetensors' does) would otherwise publish weights
readable by their owner alone, which another user or pod sharing the runs volume cannot load. A body
that fills the disk raises :class:`DiskFull` naming the target, the bytes it had written and the
bytes free; a caller that knows its size up front passes ``expected_bytes`` and fails before writing.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

__all__ = ["DiskFull", "publish_folder", "require_free_space"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """Not enough free space to write a folder; ``filename`` is the target, the message has the sizes."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with suppress(OSError):  # a file removed while counting
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _gb(n: int) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def require_free_space(target: str | Path, expected_bytes: int) -> None:
    """Raise :class:`DiskFull` when the file system that will hold ``target`` has under ``expected_bytes`` free."""
    target = Path(target)
    anchor = next((q for q in [target, *target.parents] if q.exists()), Path("/"))
    free = shutil.disk_usage(anchor).free
    if free < expected_bytes:
        raise DiskFull(
            errno.ENOSPC,
            f"not enough space to write {target}: needs {_gb(expected_bytes)}, {_gb(free)} free; free space there "
            "or choose another folder",
            str(target),
        )


def _is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a full disk; safetensors reports one as a plain message."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _NO_SPACE:
            return True
        if "No space left on device" in str(err) or "Disk quota exceeded" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


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
    """Flush every file below ``folder`` and every folder's entries, so the rename publishes data on disk; give
    every file the mode ``open`` would (``0o666`` less the umask)."""
    mode = 0o666 & ~_umask()
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, mode)
            fd = os.open(path, os.O_RDONLY)
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
def publish_folder(target: str | Path, expected_bytes: int | None = None) -> Iterator[Path]:
    """Yield an empty staging folder; on a clean exit it is flushed to disk and renamed to ``target``.

    Write every file of the new folder into the yielded path. ``target``'s parent folders are
    created; an existing ``target`` is replaced as a whole. Raises whatever the body or the
    renames raise, after removing the staging folder; a full disk as :class:`DiskFull`. With
    ``expected_bytes``, a file system with less free space fails before anything is written.
    """
    target = Path(target)
    if expected_bytes is not None:
        require_free_space(target.parent, expected_bytes)
    target.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not tempfile.mkdtemp: mkdtemp's mode 0o700 would become the published folder's mode.
    token = uuid.uuid4().hex[:12]
    staging = target.parent / f".{target.name}.tmp-{token}"
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
        _swap_into_place(staging, target, target.parent / f".{target.name}.old-{token}")
    except BaseException as err:
        written = _folder_bytes(staging)
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, DiskFull) or not _is_disk_full(err):
            raise
        free = shutil.disk_usage(target.parent).free
        raise DiskFull(
            errno.ENOSPC,
            f"no space left writing {target}: needs more than the {_gb(written)} written before the disk filled, "
            f"{_gb(free)} free; free space there or choose another folder (nothing was published)",
            str(target),
        ) from err
