"""The project's local cache folder: ``$STAR_ELASTIC_CACHE``, else ``~/.cache/star-elastic``.

The one reading of that variable. It sits in the model layer because the model keeps a cache of its own
there (the decode kernels' measurements, :mod:`model.decode.kernels`) and ``model`` imports nothing above
it; :mod:`components.settings` builds the download cache and its ``Settings`` on the same function.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE_ENV = "STAR_ELASTIC_CACHE"


def default_cache_folder() -> Path:
    """``~/.cache/star-elastic``: the cache folder when :data:`CACHE_ENV` is unset or empty."""
    return Path.home() / ".cache" / "star-elastic"


def cache_folder(environ: Mapping[str, str] | None = None) -> Path:
    """``$STAR_ELASTIC_CACHE`` of ``environ`` (default: this process's environment), else
    :func:`default_cache_folder`; an empty value counts as unset."""
    env = os.environ if environ is None else environ
    value = env.get(CACHE_ENV)
    return Path(value) if value else default_cache_folder()
