"""One line for the machine's own faults: a full disk, a permission refused, storage that stopped answering,
a run folder another live pipeline holds.

Such a fault is not a bug to debug from a traceback: the operator needs the path or URI and what to
do. :func:`machine_fault` walks an exception and everything behind it (``__cause__`` /
``__context__``, a Ray task error's ``cause``, a failed stage's ``error``) and returns that line, or
None for any other error, which keeps its traceback.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

_FULL = {errno.ENOSPC, errno.EDQUOT}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


class RunFolderBusy(RuntimeError):
    """Another live process runs a pipeline in the same run folder (raised by the runner's folder lock)."""


def causes(err: BaseException) -> Iterator[BaseException]:
    """``err`` and every exception behind it, each once."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for attr in ("cause", "error"):  # Ray's RayTaskError.cause, the runner's StageFailed.error
            inner = getattr(e, attr, None)
            if isinstance(inner, BaseException):
                todo.append(inner)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)


def _where(e: OSError) -> str:
    return f" {e.filename}" if e.filename else ""


def machine_fault(err: BaseException) -> str | None:
    """The one line saying what failed and what to do, or None when ``err`` is not a machine fault."""
    from components.storage import StorageUnavailable
    from model.atomic import DiskFull

    for e in causes(err):
        if isinstance(getattr(e, "cause", None), BaseException):
            continue  # a Ray task error is an instance of its cause's class too; read the cause itself
        if isinstance(e, DiskFull):
            return e.strerror or str(e)
        if isinstance(e, StorageUnavailable | RunFolderBusy):
            return str(e)
        if isinstance(e, OSError) and e.errno in _FULL:
            return f"no space left on device writing{_where(e)}: free space there or choose another folder"
        if isinstance(e, OSError) and e.errno in _DENIED:
            what = "read-only file system" if e.errno == errno.EROFS else "permission denied"
            return f"{what}:{_where(e)}: make it writable by this user, or choose another folder"
    for e in causes(err):  # writers that report a full disk as a plain message (safetensors)
        if "No space left on device" in str(e):
            return "no space left on device: free space in the output folder or choose another one"
    return None
