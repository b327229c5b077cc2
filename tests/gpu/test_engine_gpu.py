"""The engine on a GPU over the tiny checkpoint: graphs equal eager, GPU equals the CPU reference.

Each engine takes a while to start on a GPU (the floor measured on the largest inputs, graphs captured,
layers compiled), so tests of one configuration share one engine, and the two that need an engine each of
their own with compiled layers are marked slow (benchmarks/gpu_tests.sh leaves them out unless asked).
"""

import re

import numpy as np
import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.engine.buckets import prefill_buckets

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello", "The capital of France is", "1, 2, 3, 4,", "你好，世界", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def tokens(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages
    return [o.outputs[0].token_ids for o in outs]


def test_graphs_equal_eager(tiny_checkpoint):
    # the same kernels both ways (no compile), so only graph replay and batch padding differ
    common = dict(
        model=str(tiny_checkpoint),
        dtype="bfloat16",
        page_size=4,
        kv_cache_memory_gib=0.05,
        max_graph_batch=8,
        compile=False,
        speech=False,  # the Thinker's graphs alone: the speech stages' have tests of their own
    )
    graphs = LLM(device="cuda", **common)
    assert graphs.engine.runner.graphs.captured_buckets == [1, 2, 4, 8]
    assert graphs.engine.runner.prefill_graphs.captured_buckets == prefill_buckets(2048)
    summary = graphs.engine.memory_summary()
    assert "decode CUDA graphs for batch 1, 2, 4, 8" in summary
    assert "prefill CUDA graphs for steps of 16..2048 tokens of up to 64 sequences (15 buckets" in summary
    eager = LLM(device="cuda", enforce_eager=True, **common)
    assert eager.engine.runner.graphs is None and eager.engine.runner.prefill_graphs is None
    assert "no CUDA graphs (enforce_eager)" in eager.engine.memory_summary()
    assert tokens(graphs) == tokens(eager)
    # each prompt alone: its prefill replays a prefill graph
    replays = []
    runner = graphs.engine.runner.prefill_graphs
    runner.on_replay = replays.append
    alone = [graphs.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert replays == [16] * 4  # "Hello" is one token: a decode-shaped step, which a decode graph takes
    assert alone == [eager.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.slow
def test_serving_compiles_nothing_after_start(tiny_checkpoint):
    """Start-up runs every compiled variant traffic needs: prompts of new lengths, alone and batched, with
    audio, chunked, and decode batches beyond the graphs add no compiled graph."""
    from torch._dynamo.utils import counters

    llm = LLM(
        model=str(tiny_checkpoint), device="cuda", dtype="bfloat16", page_size=4, kv_cache_memory_gib=0.05,
        max_graph_batch=2, max_num_batched_tokens=600,
    )  # fmt: skip
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0
    prompts = [" ".join(["word"] * n) for n in (3, 40, 70, 300, 700)]
    llm.generate(prompts, GREEDY)
    for prompt in prompts:
        llm.generate(prompt, GREEDY)
    clip = (0.3 * np.sin(np.arange(48000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    llm.chat(
        [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": "Hi"}]}],
        GREEDY,
    )
    assert counters["stats"]["unique_graphs"] == compiled


def test_gpu_float32_agrees_with_the_cpu_reference(tiny_checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    text_only = dict(model=str(tiny_checkpoint), dtype="float32", page_size=4, speech=False)
    gpu = LLM(device="cuda", kv_cache_memory_gib=0.05, **text_only)
    assert gpu.engine.runner.graphs is None  # float32 MoE is the host-syncing loop: eager, and it says so
    cpu = LLM(device="cpu", num_kv_pages=256, **text_only)
    ours, reference = tokens(gpu), tokens(cpu)
    agree = sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y)) / sum(len(x) for x in ours)
    assert agree >= 0.9, f"only {agree:.0%} of greedy tokens agree with the CPU reference"


# uncompiled: the plan is the same, and the capped engine starts in a fraction of the time
CAPPED = dict(device="cuda", dtype="bfloat16", gpu_memory_limit_gib=2.0, compile=False)


@pytest.fixture(scope="module")
def capped(tiny_checkpoint):
    """One engine under a 2 GiB cap, for the plan's own test and for `omnistage plan`'s."""
    try:
        return LLM(model=str(tiny_checkpoint), **CAPPED)
    finally:  # the cap is process-wide: give later tests the whole card back
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_memory_limit_caps_the_plan(capped):
    plan = capped.engine.plan
    assert plan.limit == 2 << 30
    assert plan.weights + plan.floor + plan.reserve + plan.kv_bytes + plan.graph_bytes <= 2 << 30
    assert "memory plan (gpu_memory_limit: 2.00 GiB)" in plan.table()


@pytest.mark.slow
def test_the_floor_holds_the_encoders_on_the_largest_inputs(tiny_checkpoint):
    """The plan's floor counts each tower on the largest input the processor admits (a 300 s clip, a
    3584x3584 image) and the prefill beside the encoder rows a request holds; a request with a 290 s clip
    and a 3840x2160 image then peaks within it."""
    from PIL import Image

    llm = LLM(
        model=str(tiny_checkpoint), device="cuda", dtype="bfloat16", page_size=4, kv_cache_memory_gib=0.05,
        enforce_eager=True,
    )  # fmt: skip
    plan = llm.engine.plan
    phases = {name: size for name, size, _ in plan.phases}
    towers = {"audio encoder", "audio prefill", "vision encoder", "image prefill"}
    assert set(phases) == {"text prefill", *towers, "Talker prefill", "Code2Wav"}  # the tiny model speaks
    assert min(phases.values()) > 0 and plan.floor == max(phases.values())
    assert "300 s clip" in plan.table() and "3584x3584 image" in plan.table()
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (2160, 3840, 3), dtype=np.uint8))
    clip = (0.3 * rng.standard_normal(290 * 16000)).astype(np.float32)
    content = [{"type": "image", "image": image}, {"type": "audio", "audio": clip}]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = llm.chat([{"role": "user", "content": content}], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert torch.cuda.max_memory_allocated() - base <= plan.floor


def test_plan_prints_the_gpu_plan_under_a_cap(tiny_checkpoint, capped, capsys, monkeypatch):
    """`omnistage plan` parses its flags into the capped engine's configuration; what it then builds is
    that engine (one start for both tests), whose plan it prints."""
    import omnistage.pipeline.family
    from omnistage.cli import main
    from omnistage.config import engine_config

    built = []

    def build_pipeline(config):
        built.append(config)
        return capped.pipeline

    monkeypatch.setattr(omnistage.pipeline.family, "build_pipeline", build_pipeline)
    argv = ["plan", "--model", str(tiny_checkpoint), "--device", "cuda", "--dtype", "bfloat16",
            "--gpu-memory-limit-gib", "2", "--no-compile"]  # fmt: skip
    assert main(argv) == 0
    assert built == [engine_config(model=str(tiny_checkpoint), **CAPPED)]
    printed = capsys.readouterr().out
    assert "memory plan (gpu_memory_limit: 2.00 GiB)" in printed
    assert re.search(r"^ {4}Talker +\d+\.\d\d GiB  [\d,]+ pages ×", printed, re.M)  # its pool, planned beside
