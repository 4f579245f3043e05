"""A server loaded with compiled decode steps (``ServingConfig.decode_compile``).

The test suite's servers decode eagerly by default (tests/conftest.py); this loads the tiny nested checkpoint
as a replica does with compiled steps on: every budget's plan is compiled and measured at load, before any
request, its verdict is in the start-up log and in the replica's memory report, and greedy decoding gives
the eager plan's tokens.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not torch._inductor.cpp_builder.get_cpp_compiler(), reason="torch.compile on CPU needs a C++ compiler"
    ),
]


@torch.inference_mode()
def test_compiled_decode_is_compiled_at_load_reported_and_decodes_as_the_eager_plan(tiny_nested_checkpoint, caplog):
    from components.serving.config import ServingConfig
    from components.serving.loading import LoadedModel
    from model.decode import DecodePlan

    with caplog.at_level(logging.INFO, logger="star_elastic.serving"):
        loaded = LoadedModel.load(tiny_nested_checkpoint, ServingConfig(api_key_env=None, decode_compile=True))
    ready = [r.getMessage() for r in caplog.records if "decode plans ready" in r.getMessage()]
    assert len(ready) == 1 and ready[0].count("one-row step compiled") == len(loaded.registry.names), ready
    for name in loaded.registry.names:
        budget = loaded.registry.get(name)
        plan = budget.decode_plan()
        assert plan.compile_requested and plan.compile_error is None and plan.step_ms is not None
        assert plan.compile_seconds > 0
        ids = torch.tensor([[1, 57, 34, 25, 19, 26, 7]])
        caches = [budget(ids, use_cache=True).cache for _ in range(2)]
        eager = DecodePlan(budget)
        tokens = [torch.tensor([[26]])] * 2
        for _ in range(6):
            outs = [budget(tokens[0], cache=caches[0]), eager(tokens[1], caches[1])]
            assert (outs[0].logits - outs[1].logits).abs().max().item() <= 1e-5
            tokens = [o.logits[:, -1].argmax(-1, keepdim=True) for o in outs]
            assert torch.equal(tokens[0], tokens[1])


def test_requests_never_compile_whatever_the_prompt_length_or_the_replicas_thread_count(tiny_nested_checkpoint):
    """Every graph is compiled at load: requests of new prompt lengths, alone (one-row steps) and together
    (several rows, padded, of changing count), decoded on the engine's own thread with the replica's thread
    count (a graph guards on it; a count other than the one compiled for would compile again, seconds under
    traffic), compile nothing."""
    import asyncio

    from components.serving.config import ServingConfig
    from components.serving.engine import Engine
    from components.serving.job import Job
    from components.serving.loading import LoadedModel
    from model.decode.compiled import CompiledStep
    from model.generate import SamplingParams

    before = torch.get_num_threads()
    threads = 1 if before != 1 else 2
    cfg = ServingConfig(api_key_env=None, decode_compile=True, torch_threads=threads, think_limit=8)
    try:
        loaded = LoadedModel.load(tiny_nested_checkpoint, cfg)
        plan = loaded.registry.get("full").decode_plan()
        plan.compiled = plan.compiled or CompiledStep(plan.steps, plan.norm_f, plan.lm_head)  # kept even if slower
        plan.compiled.one_row = plan.compiled.several_rows = True
        engine = Engine(loaded, cfg).start()
        prompts = [loaded.tokenizer.encode(f"<bos>Q:{q}\n<think>") for q in ("1", "2+3*4", "9-1+2*2-7")]

        async def finish(job: Job) -> None:
            while (event := await job.events.get())[1] not in ("done", "error"):
                pass
            assert event[1] == "done", event

        async def serve() -> None:
            loop = asyncio.get_running_loop()
            for prompt in prompts:  # one at a time: every step a one-row step
                job = Job(prompt, "full", "full", 4, 6, SamplingParams(), (), False, loop)
                engine.submit(job)
                await finish(job)
            # together: rows of different lengths batched (left-padded), then leaving one by one
            jobs = [
                Job(p, "full", "full", 3 + i, 5 + 2 * i, SamplingParams(), (), False, loop)
                for i, p in enumerate(prompts)
            ]
            for job in jobs:
                engine.submit(job)
            await asyncio.gather(*(finish(job) for job in jobs))

        with torch.compiler.set_stance("fail_on_recompile"):
            asyncio.run(serve())
        assert engine.stats["max_batch_size"] > 1
        engine.stop()
        assert engine.error is None
    finally:
        torch.set_num_threads(before)
