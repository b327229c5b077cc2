"""Thinker decode and prefill on one GPU: omnistage against transformers, same random weights, one run.

Builds the released Qwen3-Omni Thinker (sizes from the packaged config.json) with random bf16 weights
directly on the GPU, then measures for our engine and for transformers' thinker sharing those very
weight tensors: TPOT at several batch sizes, prefill throughput at 2k tokens, and the relative error
of our bf16 logits against transformers'. Prints a table and writes JSON.

    python benchmarks/thinker_decode.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omnistage import LLM, SamplingParams
from omnistage.bench.hf_layout import released_name, text_model
from omnistage.engine.stages.preparation import set_moe_kernel
from omnistage.models.qwen3_omni.tiny import released_config, tiny_config
from omnistage.models.qwen3_omni.tokenizer import write_tokenizer_files

log = logging.getLogger("bench")


def skeleton(directory: Path, config: dict) -> Path:
    """A checkpoint directory with a config and the tokenizer but no weights (load_format dummy)."""
    (directory / "config.json").write_text(json.dumps(config))
    write_tokenizer_files(directory)
    return directory


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 150000, (length,), generator=g).tolist()


def ours_tpot(llm: LLM, batch: int, prompt_len: int, steps: int) -> float:
    """Median wall time of the pure-decode steps of `batch` requests generating `steps` tokens each."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps, min_tokens=steps, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", random_prompt(prompt_len, i), params)
    times = []
    while engine.has_unfinished():
        pure = engine.scheduler.num_waiting == 0 and all(
            s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running
        )
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if pure and engine.scheduler.num_running == batch:
            times.append(elapsed)
    return statistics.median(times[2:]) if len(times) > 4 else float("nan")


def step_breakdown(llm: LLM, batch: int, prompt_len: int, steps: int = 16) -> dict[str, float]:
    """Median ms per decode step spent in host preparation, the graph (padded fill + replay), sampling, rest."""
    engine, runner = llm.engine, llm.engine.runner
    spent: dict[str, list[float]] = {"prepare": [], "model": [], "sample": [], "step": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            start = time.perf_counter()
            out = fn(*a, **k)
            sync()
            spent[name].append((time.perf_counter() - start) * 1e3)
            return out

        return wrapper

    saved = runner.prepare, runner.graphs.run if runner.graphs else None, engine.sampler
    runner.prepare = timed("prepare", runner.prepare)
    if runner.graphs:
        runner.graphs.run = timed("model", runner.graphs.run)
    engine.sampler = timed("sample", engine.sampler)
    try:
        params = SamplingParams(max_tokens=steps, min_tokens=steps, ignore_eos=True, temperature=0.0)
        for i in range(batch):
            engine.add_request(f"bd{batch}-{i}", random_prompt(prompt_len, i), params)
        engine.step()
        for key in spent:
            spent[key].clear()
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            spent["step"].append((time.perf_counter() - start) * 1e3)
    finally:
        runner.prepare = saved[0]
        if saved[1]:
            runner.graphs.run = saved[1]
        engine.sampler = saved[2]
    return {k: statistics.median(v[2:]) for k, v in spent.items() if len(v) > 4}


def graph_replay_ms(llm: LLM, batch: int, repeats: int = 20) -> float:
    """GPU time of one replay of the decode graph that serves `batch` (no host work), by CUDA events."""
    graphs = llm.engine.runner.graphs
    bucket = graphs.bucket_for(batch) if graphs else None
    if bucket is None:
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(bucket)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def profile_decode(llm: LLM, batch: int, path: Path) -> None:
    """The kernels of a few decode steps at `batch`, by total CUDA time, written to `path`."""
    engine = llm.engine
    params = SamplingParams(max_tokens=12, min_tokens=12, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"prof{batch}-{i}", random_prompt(64, i), params)
    for _ in range(4):
        engine.step()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(5):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    path.write_text(table)


def ours_prefill(llm: LLM, length: int, repeats: int = 5) -> float:
    """Tokens per second of one `length`-token prefill (the step that yields the first token)."""
    engine = llm.engine
    times = []
    for r in range(repeats + 1):
        engine.add_request(
            f"p{r}", random_prompt(length, 100 + r), SamplingParams(max_tokens=1, temperature=0.0)
        )
        sync()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - start)
    return length / statistics.median(times[1:])


def hf_thinker(llm: LLM, config_dict: dict, device: str):
    """transformers' thinker whose text weights ARE our tensors (shared storage; towers random)."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    config = Qwen3OmniMoeConfig(**config_dict).thinker_config
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3OmniMoeThinkerForConditionalGeneration(config)
    ours = dict(llm.engine.model.named_parameters())
    for name, param in list(hf.named_parameters()):
        mine = (
            released_name(name)
            .replace(".experts.gate_up_proj", ".experts.w13")
            .replace(".experts.down_proj", ".experts.w2")
        )
        module_name, _, leaf = name.rpartition(".")
        module = hf.get_submodule(module_name)
        if mine in ours:
            if tuple(ours[mine].shape) != tuple(param.shape):
                raise RuntimeError(f"{name}: ours {tuple(ours[mine].shape)} vs theirs {tuple(param.shape)}")
            setattr(module, leaf, torch.nn.Parameter(ours[mine], requires_grad=False))
        else:  # audio and vision towers: unused by text prompts
            fresh = torch.empty(param.shape, dtype=param.dtype, device=device).normal_(0, 0.02)
            setattr(module, leaf, torch.nn.Parameter(fresh, requires_grad=False))
    with torch.device(device):  # a meta build leaves the rotary frequencies empty: make them again
        text = text_model(hf)
        text.rotary_emb = type(text.rotary_emb)(text.rotary_emb.config)
    left = [n for n, b in text.named_buffers() if b.is_meta] + [
        n for n, p in hf.named_parameters() if p.is_meta
    ]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")
    return hf.eval()


@torch.inference_mode()
def hf_tpot(hf, batch: int, prompt_len: int, steps: int, cache: str | None, repeats: int = 3) -> float:
    ids = torch.tensor([random_prompt(prompt_len, i) for i in range(batch)], device=DEVICE)
    kwargs = {"do_sample": False, "pad_token_id": 151643}
    if cache:
        kwargs["cache_implementation"] = cache

    def run(n: int) -> float:
        sync()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync()
        return time.perf_counter() - start

    run(2)
    one = statistics.median(run(1) for _ in range(repeats))
    full = statistics.median(run(steps) for _ in range(repeats))
    return (full - one) / (steps - 1)


@torch.inference_mode()
def hf_prefill(hf, length: int, repeats: int = 5) -> float:
    ids = torch.tensor([random_prompt(length, 100)], device=DEVICE)
    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        hf(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync()
        times.append(time.perf_counter() - start)
    return length / statistics.median(times[1:])


@torch.inference_mode()
def logits_error(llm: LLM, hf, length: int = 64) -> float:
    """max |ours - theirs| / max |theirs| over the last-token logits of one prompt, both bf16."""
    ids = random_prompt(length, 7)
    engine = llm.engine
    captured = {}
    real = engine.runner.execute

    def spy(step):
        captured["logits"] = real(step)
        return captured["logits"]

    engine.runner.execute = spy
    try:
        engine.add_request("check", ids, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.execute = real
    ours = captured["logits"][-1].float()
    theirs = hf(input_ids=torch.tensor([ids], device=DEVICE), use_cache=False).logits[0, -1].float()
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--hf-batches", default="1,8,32")
    parser.add_argument(
        "--hf-caches", default="dynamic,static", help="transformers cache implementations to run"
    )
    parser.add_argument(
        "--hf-static-batches",
        default="1",
        help="batches for the static cache (its generate compiles per shape)",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument(
        "--kv-gib", type=float, default=16.0, help="our KV pool; the rest stays for transformers"
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run on the tiny config")
    parser.add_argument("--no-compile", action="store_true", help="leave the decoder layers uncompiled")
    parser.add_argument("--moe-kernel", default="auto", choices=["auto", "grouped_mm", "triton"])
    parser.add_argument("--compare-moe", action="store_true", help="also measure TPOT with grouped_mm MoE")
    parser.add_argument("--profile-dir", type=Path, help="write kernel tables of decode steps here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    global DEVICE
    DEVICE = "cpu" if args.tiny else "cuda"
    config_dict = tiny_config() if args.tiny else released_config()
    results: dict = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(args) | {"out": str(args.out)},
    }
    checkpoint = skeleton(Path(tempfile.mkdtemp()), config_dict)
    start = time.perf_counter()
    llm = LLM(
        model=str(checkpoint),
        load_format="dummy",
        device=DEVICE,
        dtype="bfloat16",
        kv_cache_memory_gib=args.kv_gib,
        max_num_seqs=max(int(b) for b in args.batches.split(",")),
        max_num_batched_tokens=max(args.prefill_len, 2048),
        enforce_eager=args.enforce_eager,
        compile=not args.no_compile,
        moe_kernel=args.moe_kernel,
    )
    results["engine_start_s"] = time.perf_counter() - start
    results["memory"] = llm.engine.memory_summary()
    graphs = llm.engine.runner.graphs
    results["graphs"] = graphs.captured_buckets if graphs else []
    log.info("engine ready in %.1f s: %s", results["engine_start_s"], results["memory"])

    ours = {}
    results["ours_graph_replay_ms"] = {}
    for b in map(int, args.batches.split(",")):
        ours[b] = ours_tpot(llm, b, args.prompt_len, args.steps)
        if DEVICE == "cuda":
            results["ours_graph_replay_ms"][b] = graph_replay_ms(llm, b)
        log.info(
            "ours: batch %d TPOT %.2f ms (graph replay %s ms)",
            b,
            ours[b] * 1e3,
            results["ours_graph_replay_ms"].get(b),
        )
    results["ours_tpot_ms"] = {b: t * 1e3 for b, t in ours.items()}
    if args.compare_moe and DEVICE == "cuda" and llm.engine.runner.graphs:
        # the same engine and weights with the other MoE kernel: switch, recapture the graphs, measure again
        engine = llm.engine
        set_moe_kernel(engine.model, "grouped_mm")
        engine.runner.capture_graphs(
            list(engine.plan.captured(engine.name, "decode")), engine.max_model_len, False
        )
        results["ours_grouped_mm_tpot_ms"] = {}
        for b in map(int, args.batches.split(",")):
            results["ours_grouped_mm_tpot_ms"][b] = ours_tpot(llm, b, args.prompt_len, args.steps) * 1e3
            log.info(
                "ours with grouped_mm MoE: batch %d TPOT %.2f ms", b, results["ours_grouped_mm_tpot_ms"][b]
            )
        set_moe_kernel(engine.model, args.moe_kernel)
        engine.runner.capture_graphs(
            list(engine.plan.captured(engine.name, "decode")), engine.max_model_len, False
        )
    if DEVICE == "cuda" and llm.engine.runner.graphs:
        results["ours_step_breakdown_ms"] = {b: step_breakdown(llm, b, args.prompt_len) for b in (1, 32)}
        log.info("step breakdown (ms): %s", results["ours_step_breakdown_ms"])
    if args.profile_dir:
        for b in (1, 32):
            profile_decode(llm, b, args.profile_dir / f"profile_decode_b{b}.txt")
    results["ours_prefill_tok_s"] = ours_prefill(llm, args.prefill_len)
    log.info("ours: prefill %d tokens at %.0f tok/s", args.prefill_len, results["ours_prefill_tok_s"])

    if not args.skip_hf:
        hf = hf_thinker(llm, config_dict, DEVICE)
        results["logits_rel_err"] = logits_error(llm, hf)
        log.info("logits relative error ours vs transformers (bf16): %.3e", results["logits_rel_err"])
        results["hf_prefill_tok_s"] = hf_prefill(hf, args.prefill_len)
        log.info("transformers: prefill %.0f tok/s", results["hf_prefill_tok_s"])
        for cache in args.hf_caches.split(","):
            key = f"hf_{cache}_tpot_ms"
            results[key] = {}
            batches = args.hf_static_batches if cache == "static" else args.hf_batches
            for b in map(int, batches.split(",")):
                try:
                    results[key][b] = (
                        hf_tpot(hf, b, args.prompt_len, args.steps, None if cache == "dynamic" else cache)
                        * 1e3
                    )
                except Exception as exc:  # report, keep measuring the rest
                    results[key][b] = f"failed: {type(exc).__name__}: {exc}"[:200]
                log.info("transformers %s cache: batch %d TPOT %s ms", cache, b, results[key][b])

    print(f"\nengine start {results['engine_start_s']:.1f} s; {results['memory']}")
    print(
        "\n| batch | ours TPOT ms | graph replay ms | "
        + " | ".join(f"hf {c} ms" for c in args.hf_caches.split(","))
        + " |"
    )
    for b in map(int, args.batches.split(",")):
        hf_cols = [results.get(f"hf_{c}_tpot_ms", {}).get(b, "-") for c in args.hf_caches.split(",")]
        cols = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in hf_cols]
        replay = results["ours_graph_replay_ms"].get(b, float("nan"))
        print(f"| {b} | {results['ours_tpot_ms'][b]:.2f} | {replay:.2f} | " + " | ".join(cols) + " |")
    print(
        f"prefill {args.prefill_len} tok/s: ours {results['ours_prefill_tok_s']:.0f}, "
        f"transformers {results.get('hf_prefill_tok_s', float('nan')):.0f}; logits rel err {results.get('logits_rel_err')}"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
