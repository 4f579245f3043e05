"""Peak memory of one KD loss + backward (reference vs chunked) and of a student step with and without
per-block activation checkpointing (CPU, each case in its own process).

Each case runs in a fresh Python process with ``MALLOC_MMAP_THRESHOLD_=65536``, so every large tensor
is its own mmap that is returned to the system when freed and the resident set follows the bytes
alive. The process builds its inputs, records its resident set, resets the high-water mark
(``/proc/self/clear_refs``), runs the measured code, and reports ``VmHWM - VmRSS before``: the peak of
what the measured code added on top of its inputs (gradients it leaves behind included).

* KD: student hidden (1, T, H) and ``lm_head`` (V, H) in float32, teacher logits (1, T, V) given.
  Reference: ``kd_loss(lm_head(h), teacher)`` and backward; chunked: ``chunked_kd_loss`` at a few chunk
  sizes. The reference holds several float32 (T, V) tensors; the chunked loss holds a few
  (chunk, V) ones plus the gradients.
* Checkpointing: a float32 student of every layer kind, forward (no logits) + chunked KD + backward, with
  ``HybridLM.gradient_checkpointing`` off and on.

    python benchmarks/bench_kd_memory.py            # Linux only (reads /proc)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(fn) -> float:
    """MB the call adds at its peak above the resident set before it."""
    import gc

    gc.collect()
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    fn()
    return (_status_kb("VmHWM") - before) / 1024


def _case_kd(mode: str, tokens: int, hidden: int, vocab: int, chunk: int) -> float:
    import torch
    import torch.nn.functional as F

    from model.elastic.kd_chunked import chunked_kd_loss
    from model.elastic.losses import kd_loss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).requires_grad_()
    teacher = torch.randn(1, tokens, vocab, generator=g)
    mask = torch.ones(1, tokens, dtype=torch.bool)

    def run() -> None:
        if mode == "reference":
            loss = kd_loss(F.linear(h, w), teacher, mask)
        else:
            loss = chunked_kd_loss(h, w, teacher, mask, chunk_size=chunk)
        loss.backward()

    return _measure(run)


def _case_ckpt(mode: str, tokens: int) -> float:
    import torch

    from model.config import HybridConfig
    from model.elastic.kd_chunked import chunked_kd_loss
    from model.hybrid import HybridLM

    cfg = HybridConfig(
        vocab_size=512, hidden_size=256, pattern="M*EMEM-E", num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, intermediate_size=512, mamba_num_heads=16, mamba_head_dim=32, n_groups=2,
        ssm_state_size=32, chunk_size=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=512,
    )  # fmt: skip
    model = HybridLM(cfg).init_weights(0).train()
    model.gradient_checkpointing = mode == "checkpointing"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=g)
    teacher = torch.randn(1, tokens, cfg.vocab_size, generator=g)

    def run() -> None:
        out = model(ids, skip_logits=True)
        chunked_kd_loss(out.hidden, model.lm_head.weight, teacher, chunk_size=256).backward()

    return _measure(run)


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.case == "kd":
        mb = _case_kd(args.mode, args.tokens, args.hidden, args.vocab, args.chunk)
    else:
        mb = _case_ckpt(args.mode, args.tokens)
    print(json.dumps({"peak_mb": mb}))


def _run_child(*extra: str) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, __file__, "--child", *extra], env=env, capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=["kd", "ckpt"], default="kd", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="reference", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the KD case (T)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the KD case (H)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary of the KD case (V)")
    parser.add_argument("--chunk", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-tokens", type=int, default=2048, help="tokens of the checkpointing case")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    common = ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    common += ["--threads", str(args.threads)]
    one = args.tokens * args.vocab * 4 / MB
    print(f"KD loss + backward, T={args.tokens}, H={args.hidden}, V={args.vocab}, float32 "
          f"(one (T, V) float32 tensor = {one:.0f} MB)")  # fmt: skip
    print("| loss | peak above inputs (MB) |\n|---|---|")
    print(f"| reference kd_loss(lm_head(h)) | {_run_child('--case', 'kd', '--mode', 'reference', *common):.0f} |")
    for chunk in (1024, 256, 64):
        if chunk <= args.tokens:
            mb = _run_child("--case", "kd", "--mode", "chunked", "--chunk", str(chunk), *common)
            print(f"| chunked_kd_loss, chunk {chunk} | {mb:.0f} |")
    print(f"\nstudent forward + chunked KD + backward, 8 layers (M*EMEM-E), hidden 256, T={args.ckpt_tokens}, float32")
    print("| activations | peak above inputs (MB) |\n|---|---|")
    for mode in ("plain", "checkpointing"):
        extra = ["--case", "ckpt", "--mode", mode, "--tokens", str(args.ckpt_tokens), "--threads", str(args.threads)]
        print(f"| {mode} | {_run_child(*extra):.0f} |")


if __name__ == "__main__":
    main()
