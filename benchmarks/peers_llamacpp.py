"""llama.cpp as a peer engine: built once from the llama-cpp-python sdist, its own converter, its C API.

Everything comes from ONE source distribution, ``llama-cpp-python==VERSION`` on PyPI, fetched with
``pip download --no-binary :all:`` into a cache folder outside the repository (``$STAR_ELASTIC_CACHE/peers``,
``~/.cache/star-elastic/peers`` by default):

* the engine: the vendored ``vendor/llama.cpp`` built with CMake, CPU backend only, as shared libraries
  (``libllama.so`` and ``libggml*.so``), at the lowest CPU priority (``nice -n 19``) with two jobs, progress
  shown; a second run finds the build and only checks it (:class:`LlamaCppBuild`);
* the converter: the vendored ``convert_hf_to_gguf.py`` with its vendored ``gguf-py``, run unchanged
  (:meth:`LlamaCppBuild.convert`);
* the bindings: the sdist's ctypes module ``llama_cpp/llama_cpp.py`` pointed at that build through its own
  ``LLAMA_CPP_LIB_PATH`` switch (:class:`LlamaCppEngine`). Only that module is imported: the package's
  ``__init__`` also imports the high-level ``Llama`` class, whose dependencies (``diskcache``) the C API does
  not need, so nothing is installed anywhere.

:func:`llama_cpp_problems` says, before anything is built, what of a ``nemotron_h`` family llama.cpp cannot
take. Design and figures: docs/benchmarks.md ("Peer engines"), benchmarks/RESULTS.md.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_VERSION = "0.3.36"
NVFP4_SUPER_BLOCK = 64
"""ggml's NVFP4 block (``QK_NVFP4`` in ``ggml/src/ggml-common.h``): four 16-element ModelOpt blocks, so every
NVFP4 input width must be a multiple of 64 (the converter's ``_nvfp4_pack`` reshapes by it)."""
GGML_TYPES = {"f32": 0, "f16": 1, "bf16": 30}
"""``enum ggml_type`` values of the KV-cache types this benchmark asks for (``ggml/include/ggml.h``)."""
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)
"""CPU backend only (llama.cpp's defaults otherwise: native ISA, OpenMP); examples only for ``llama-simple``."""
TARGETS = ("llama", "llama-simple")


def cache_root() -> Path:
    """``$STAR_ELASTIC_CACHE/peers`` (the project's cache rule, :func:`components.settings.cache_dir`)."""
    from components.settings import cache_dir

    return cache_dir() / "peers"


# ---------------------------------------------------------------------- what llama.cpp can take
def llama_cpp_problems(
    config: Any, widths: Mapping[str, Mapping[str, int]], nvfp4: bool, quantized_attention: bool = False
) -> list[str]:
    """What stops llama.cpp from loading a family, one line each (empty: nothing).

    Args:
        config: the parent's :class:`~model.config.HybridConfig` (``pattern`` is read).
        widths: per budget, its input widths of the projections an NVFP4 export quantizes:
            ``hidden``, ``mamba_inner`` (Mamba heads x head dim), ``moe_ffn``, ``shared_ffn``, ``mlp_ffn``
            and, with ``quantized_attention``, ``attention`` (query heads x head dim).
        nvfp4: whether the NVFP4 export is converted too (the 64-wide blocks apply).
        quantized_attention: whether the NVFP4 preset quantizes the attention projections.
    """
    problems = []
    pattern = config.pattern
    if "E" in pattern and "-" in pattern:
        problems.append(
            f"pattern {pattern!r}: llama.cpp's nemotron_h takes no dense '-' layer beside 'E' layers (its loader "
            "builds MoE tensors for every FFN layer once the model has experts, src/models/nemotron-h.cpp, and "
            "its converter counts only 'E' layers as FFN layers then); use 'E' layers only, like Nemotron Nano"
        )
    if nvfp4:
        names = ["hidden", "mamba_inner", "moe_ffn", "shared_ffn", "mlp_ffn"]
        names += ["attention"] if quantized_attention else []
        for budget, w in widths.items():
            bad = {n: w[n] for n in names if n in w and w[n] % NVFP4_SUPER_BLOCK}
            if bad:
                problems.append(
                    f"budget {budget!r}: NVFP4 widths {bad} are not multiples of {NVFP4_SUPER_BLOCK} (ggml's NVFP4 "
                    "block); choose widths in multiples of 64 or leave nvfp4 out of --formats"
                )
    return problems


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length if one is a prefix of the
    other and they differ in length), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------- source and build
class BuildSkipped(RuntimeError):
    """llama.cpp cannot be built or fetched here; the message says why."""


def _run_logged(cmd: list[str], log: Path, label: str, cwd: Path | None = None) -> None:
    """Run ``cmd``, append its output to ``log``, and print progress (``[n/N]`` or ``[ p%]`` lines) with ETA."""
    start = time.perf_counter()
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m = re.match(r"\[\s*(\d+)/(\d+)\]", line) or re.match(r"\[\s*(\d+)%\]", line)
            if m:
                done, total = (int(m.group(1)), int(m.group(2))) if m.re.groups == 2 else (int(m.group(1)), 100)
                elapsed = time.perf_counter() - start
                eta = elapsed / max(done, 1) * (total - done)
                print(f"  {label} {done}/{total}, {elapsed:.0f}s, ETA {eta:.0f}s", flush=True)
        rc = proc.wait()
    if rc:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-15:])
        raise BuildSkipped(f"{label} failed (exit {rc}); last lines of {log}:\n{tail}")


@dataclass
class LlamaCppBuild:
    """The sdist, its vendored llama.cpp and the CPU build of it, all under ``cache``."""

    cache: Path
    version: str = DEFAULT_VERSION

    @property
    def sdist(self) -> Path:
        return self.cache / f"llama_cpp_python-{self.version}"

    @property
    def source(self) -> Path:
        return self.sdist / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.cache / f"llama-cpp-{self.version}" / "build"

    @property
    def lib_dir(self) -> Path:
        return self.build_dir / "bin"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    def commit(self) -> str:
        """The vendored llama.cpp's commit ('unknown' when the sdist carries no git metadata)."""
        if not (self.source / ".git").exists():
            return "unknown"
        try:
            out = subprocess.run(["git", "-C", str(self.source), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, check=False, timeout=30)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        return out.stdout.strip() or "unknown"

    def fetch(self) -> None:
        """Download (pip) and unpack the sdist unless it is there."""
        if self.converter.is_file():
            return
        self.cache.mkdir(parents=True, exist_ok=True)
        archive = self.cache / f"llama_cpp_python-{self.version}.tar.gz"
        if not archive.is_file():
            print(f"  downloading llama-cpp-python=={self.version} (sdist) into {self.cache}", flush=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                   f"llama-cpp-python=={self.version}", "-d", str(self.cache)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode or not archive.is_file():
                raise BuildSkipped(f"cannot download the llama-cpp-python sdist: {done.stderr.strip()[-500:]}")
        with tarfile.open(archive) as tar:
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(self.cache, **kwargs)  # noqa: S202 (PyPI sdist, extracted with the data filter)

    def build(self, jobs: int = 2) -> None:
        """Configure (first time) and build the shared libraries and ``llama-simple`` at ``nice -n 19``."""
        missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
        if missing:
            raise BuildSkipped(f"{', '.join(missing)} not found; install CMake and a C++ compiler to build llama.cpp")
        self.fetch()
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        log = self.build_dir.parent / "build.log"
        self.build_dir.mkdir(parents=True, exist_ok=True)
        stamp = self.build_dir / "star-elastic-flags.json"
        if (
            not (self.build_dir / "CMakeCache.txt").is_file()
            or not stamp.is_file()
            or json.loads(stamp.read_text()) != list(CMAKE_FLAGS)
        ):
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            print(f"  configuring llama.cpp ({self.source}) in {self.build_dir}", flush=True)
            _run_logged([*nice, "cmake", "-S", str(self.source), "-B", str(self.build_dir), *generator,
                         *CMAKE_FLAGS], log, "configure")  # fmt: skip
            stamp.write_text(json.dumps(list(CMAKE_FLAGS)))
        print(f"  building {', '.join(TARGETS)} (nice -n 19, -j{jobs}; log {log})", flush=True)
        _run_logged([*nice, "cmake", "--build", str(self.build_dir), "-j", str(jobs), "--target", *TARGETS], log,
                    "build")  # fmt: skip
        if not (self.lib_dir / "libllama.so").is_file():
            raise BuildSkipped(f"the build finished but {self.lib_dir / 'libllama.so'} is missing (see {log})")

    def convert(self, model_dir: Path, out: Path, outtype: str) -> float:
        """Run the vendored ``convert_hf_to_gguf.py`` unchanged on ``model_dir``; returns its seconds.

        ``outtype``: ``f32`` / ``bf16`` (every tensor the converter keeps in float), ``auto`` (source dtype).
        The converter's own ``gguf-py`` is put first on ``PYTHONPATH`` (it also inserts it itself).
        """
        env = dict(os.environ)
        paths = [str(self.source / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        cmd = [sys.executable, str(self.converter), str(model_dir), "--outfile", str(out), "--outtype", outtype]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode or not out.is_file():
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{done.stderr.strip()[-3000:]}")
        return time.perf_counter() - start

    def run_simple(self, gguf: Path, prompt: str, n_predict: int = 16) -> str:
        """``llama-simple -m GGUF -n N PROMPT`` (greedy): its output, to show the command line works."""
        exe = self.lib_dir / "llama-simple"
        done = subprocess.run([str(exe), "-m", str(gguf), "-n", str(n_predict), prompt], capture_output=True,
                              text=True, check=False, timeout=300)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"llama-simple failed (exit {done.returncode}): {done.stderr.strip()[-1000:]}")
        return done.stdout


# ---------------------------------------------------------------------- the C API
def load_bindings(build: LlamaCppBuild) -> types.ModuleType:
    """The sdist's ctypes module ``llama_cpp.llama_cpp`` on this build's ``libllama.so`` (module docstring)."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(build.lib_dir)
    if "llama_cpp" not in sys.modules:  # a bare package: its submodules import, its __init__ does not run
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [str(build.sdist / "llama_cpp")]
        sys.modules["llama_cpp"] = pkg
    lib = importlib.import_module("llama_cpp.llama_cpp")
    if not getattr(lib, "_star_elastic_ready", False):
        lib.llama_backend_init()
        # keep llama.cpp's load-time INFO lines out of the benchmark's output; errors still show
        lib._star_elastic_log = lib.llama_log_callback(_log_errors)
        lib.llama_log_set(lib._star_elastic_log, ctypes.c_void_p())
        lib._star_elastic_ready = True
    return lib


def _log_errors(level: int, text: bytes, _user: Any) -> None:
    if level == 4:  # GGML_LOG_LEVEL_ERROR
        sys.stderr.write(text.decode("utf-8", errors="replace"))


class LlamaCppEngine:
    """One GGUF in llama.cpp, batch 1, greedy by argmax over the returned logits (ties: the lowest id).

    ``kv_type`` is the KV-cache type (``f32`` / ``f16`` / ``bf16``); flash attention is off, so the attention is
    the plain one, like ours. ``prefill`` clears the context (KV cache and Mamba states) first.
    """

    def __init__(self, lib: types.ModuleType, gguf: Path, threads: int, n_ctx: int, kv_type: str = "f32") -> None:
        self.lib = lib
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.type_k = cparams.type_v = GGML_TYPES[kv_type]
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context for {gguf}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.memory = lib.llama_get_memory(self.ctx)
        self._one = (lib.llama_token * 1)()

    def _decode(self, tokens: ctypes.Array, n: int) -> int:
        rc = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(tokens, n))
        if rc:
            raise RuntimeError(f"llama_decode returned {rc}")
        return int(self._logits().argmax())

    def _logits(self) -> np.ndarray:
        """(vocab,) float32 logits of the last fed token, a view into llama.cpp's buffer."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))

    def logits(self) -> np.ndarray:
        """A copy of the last fed token's (vocab,) logits."""
        return self._logits().copy()

    def prefill(self, prompt: Sequence[int]) -> int:
        """Clear the context, feed ``prompt``; returns the first greedy token."""
        self.lib.llama_memory_clear(self.memory, True)
        return self._decode((self.lib.llama_token * len(prompt))(*prompt), len(prompt))

    def step(self, token: int) -> int:
        """Feed one token; returns the next greedy token."""
        self._one[0] = token
        return self._decode(self._one, 1)

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


__all__ = [
    "DEFAULT_VERSION",
    "BuildSkipped",
    "LlamaCppBuild",
    "LlamaCppEngine",
    "cache_root",
    "first_divergence",
    "llama_cpp_problems",
    "load_bindings",
]
