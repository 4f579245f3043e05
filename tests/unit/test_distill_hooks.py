"""The distillation worker's hooks: the per-step callback a config names (the fault tests' way into the loop)
and the host-heap settings a CPU worker applies to itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from components.distill.config import DistillConfig, preflight, resolve_step_callback
from tests.integration import distill_faults

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, **changes) -> DistillConfig:
    base = dict(teacher_uri=str(tmp_path / "parent"), output_dir=str(tmp_path / "out"), space={"hidden": [32, 16]},
                budgets=[{"name": "full", "fraction": 1.0}])  # fmt: skip
    return DistillConfig(**{**base, **changes})


def test_step_callback_names_an_importable_function(tmp_path):
    assert resolve_step_callback(None) is None
    assert resolve_step_callback(distill_faults.CALLBACK) is distill_faults.exit_last_rank_once
    with pytest.raises(ValueError, match="step_callback='tests.integration.distill_faults:nope'"):
        resolve_step_callback("tests.integration.distill_faults:nope")
    with pytest.raises(ValueError, match="step_callback='no_such_module_here:f'.*importable"):
        resolve_step_callback("no_such_module_here:f")
    with pytest.raises(ValueError, match="not callable"):
        resolve_step_callback("tests.integration.distill_faults:FAIL_AT_STEP")
    with pytest.raises(ValueError, match="step_callback"):
        _config(tmp_path, step_callback="tests.integration.distill_faults.exit_last_rank_once")  # no ':'
    # the driver's preflight refuses a callback the workers could not import, before anything else
    with pytest.raises(ValueError, match="no_such_module_here"):
        preflight(_config(tmp_path, step_callback="no_such_module_here:f"))
    # a callback does not change what is trained: the run key (and so the resumed run) stays the same
    assert _config(tmp_path).run_key() == _config(tmp_path, step_callback=distill_faults.CALLBACK).run_key()


def test_the_fault_callback_kills_the_last_rank_once(tmp_path):
    """In a child process: nothing happens on other steps or ranks; at the step on the last rank the process
    exits with status 1 and leaves its marker; called again (the restarted worker) it returns."""
    script = textwrap.dedent(f"""
        from components.distill.config import DistillConfig
        from tests.integration.distill_faults import FAIL_AT_STEP, exit_last_rank_once
        cfg = DistillConfig.model_validate_json({_config(tmp_path).model_dump_json()!r})
        exit_last_rank_once(cfg, FAIL_AT_STEP - 1, 1, 2)
        exit_last_rank_once(cfg, FAIL_AT_STEP, 0, 2)
        print("alive", flush=True)
        exit_last_rank_once(cfg, FAIL_AT_STEP, 1, 2)
        print("survived", flush=True)
    """)
    run = lambda: subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)  # noqa: E731
    first = run()
    assert first.returncode == 1 and "alive" in first.stdout and "survived" not in first.stdout, first.stderr
    assert (tmp_path / "out" / ".exit_last_rank_once.marker").read_text() == "rank 1 exited at step 4\n"
    second = run()
    assert second.returncode == 0 and "survived" in second.stdout, second.stderr


# ---------------------------------------------------------------------- the host heap
def test_heap_policy_by_stage_and_device():
    from components.distill.heap import HostHeapConfig, policy_for

    assert policy_for(None, 3, use_gpu=False) == HostHeapConfig(mmap_threshold=131072)  # ZeRO-3 on CPU: pinned
    assert policy_for(None, 0, use_gpu=False) is None and policy_for(None, 2, use_gpu=False) is None
    assert policy_for(None, 3, use_gpu=True) is None  # the CUDA caching allocator holds a GPU run's tensors
    given = HostHeapConfig(mmap_threshold=1 << 20)
    assert policy_for(given, 0, use_gpu=False) is given and policy_for(given, 3, use_gpu=True) is None
    assert policy_for(HostHeapConfig(), 3, use_gpu=False) == HostHeapConfig()  # {}: glibc as it is


def test_worker_settings_follow_the_device(tmp_path):
    from components.distill import worker as W
    from model.config import HybridConfig
    from tests.conftest import TINY

    model = HybridConfig(**TINY)

    def zero(**changes) -> dict:
        return W.deepspeed_config(_config(tmp_path, zero_stage=3, **changes), 2, model)["zero_optimization"]

    assert zero()["stage3_allgather_sequential"] is True  # CPU: each parameter straight into its buffer
    assert zero(use_gpu=True)["stage3_allgather_sequential"] is False  # GPU: DeepSpeed's coalesced gathers
    assert zero(zero3_gathers="coalesced")["stage3_allgather_sequential"] is False
    assert zero(use_gpu=True, zero3_gathers="per_parameter")["stage3_allgather_sequential"] is True
    assert W.configure_host_memory(_config(tmp_path, zero_stage=3, use_gpu=True)) == {}  # nothing set on a GPU
    assert W.configure_host_memory(_config(tmp_path, zero_stage=1)) == {}  # below ZeRO-3: glibc as it is


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt / mallinfo2")
@pytest.mark.parametrize("pinned", [False, True])
def test_pinned_threshold_returns_freed_blocks_that_glibc_would_keep(pinned):
    """In a child process (mallopt is process-wide): after a 16 MB block is freed, glibc raises its threshold and
    serves a 1 MB block from the heap; with the threshold pinned at 128 KB the 1 MB block gets its own mapping."""
    script = textwrap.dedent(f"""
        import ctypes
        from components.distill import heap
        if {pinned}:
            assert heap.apply(heap.HostHeapConfig(mmap_threshold=131072)) == {{"mmap_threshold": True}}
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free(libc.malloc(16 << 20))  # a large block freed: glibc's dynamic threshold rises to 16 MB
        before = heap.mallinfo()["hblkhd"]
        block = libc.malloc(1 << 20)
        print(heap.mallinfo()["hblkhd"] - before)
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    mapped = int(run.stdout.split()[-1])
    assert mapped >= (1 << 20) if pinned else mapped == 0


def test_memory_peaks_report_the_largest_rank_above_its_baseline(tmp_path):
    """Two gloo ranks in child processes: rank 1 writes 400 MB after its baseline, rank 0 100 MB. Both get rank 1's
    peak (the MAX all-reduce): about the 400 MB it wrote, not wildly more."""
    script = textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from components.distill import heap
        from components.distill import worker as W
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
        baseline = heap.restart_resident_peak()
        block = torch.ones((100 + 300 * rank) * 1_000_000 // 4)  # written: every page resident
        peaks = W.memory_peaks(torch.device("cpu"), baseline)
        print(peaks["memory/host_peak_gb"], peaks["memory/device_peak_gb"], flush=True)
        # Both ranks leave together and close the group: a rank exiting while its peer's gloo threads still hold
        # the connection can abort the peer at exit ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
    """)
    store = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(r), str(store)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    for out, _ in outs:
        host, device = (float(v) for v in out.split()[-2:])
        assert 0.38 <= host <= 0.6 and device == 0.0  # rank 1's 400 MB (rank 0 wrote 100 MB), on both ranks
