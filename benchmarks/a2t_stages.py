"""Where the time of one audio-to-text request goes, stage by stage, at the released sizes on one GPU.

Runs a synthetic speech-like clip (5 s by default) through the engine synchronously, with the GPU
synchronised between stages: the processor (decode, log-mel, prompt), the encoders, the prefill step
(with the first sample) and the decode steps. Then one request under torch.profiler: the prefill
step's CUDA kernels and host operators by total time. Writes JSON and the profiler tables.

    python benchmarks/a2t_stages.py --seconds 5 --out-dir out/
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from omnistage.bench.clips import synth_clips
from omnistage.bench.skeletons import released_skeleton
from omnistage.config import engine_config
from omnistage.engine.stages.text import TextStage
from omnistage.models.qwen3_omni.transcription import transcription_messages
from omnistage.pipeline.qwen3_omni import Qwen3OmniPipeline
from omnistage.request import SamplingParams

log = logging.getLogger("a2t_stages")


def timed(fn, *args, **kwargs):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def one_request(engine: TextStage, audio, params: SamplingParams, name: str) -> dict[str, float]:
    """Milliseconds per stage of one request, run alone."""
    messages = transcription_messages(audio, None, None)
    prompt, preprocess = timed(engine.processor.process_chat, messages)
    _, encode = timed(engine.encoders.encode, prompt.token_ids, prompt.mm)  # the same work add_request does
    _, admit = timed(engine.add_request, name, prompt.token_ids, params, mrope=prompt.mrope, mm=prompt.mm)
    _, first = timed(engine.step)
    steps = []
    while engine.has_unfinished():
        steps.append(timed(engine.step)[1])
    return {
        "prompt_tokens": len(prompt.token_ids),
        "preprocess": preprocess,
        "encode": encode,
        "add_request": admit,
        "prefill_step": first,
        "decode_step_median": statistics.median(steps),
        "total": preprocess + admit + first + sum(steps),
    }


def profile_prefill(engine: TextStage, audio, params: SamplingParams, out_dir: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    messages = transcription_messages(audio, None, None)
    prompt = engine.processor.process_chat(messages)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.add_request("profiled", prompt.token_ids, params, mrope=prompt.mrope, mm=prompt.mm)
        engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    averages = prof.key_averages()
    (out_dir / "prefill_cuda.txt").write_text(averages.table(sort_by="cuda_time_total", row_limit=40))
    (out_dir / "prefill_cpu.txt").write_text(averages.table(sort_by="cpu_time_total", row_limit=40))
    prof.export_chrome_trace(str(out_dir / "prefill_trace.json"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--output-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    config = engine_config(
        "a2t_stages", model=str(released_skeleton()), load_format="dummy", device="cuda", dtype="bfloat16",
        max_num_seqs=1, kv_cache_memory_gib=16.0, speech=False,
    )  # fmt: skip
    engine = Qwen3OmniPipeline(config).thinker
    # each request its own clip (`Clip.heard_as`): the audio tower's cache and the prefix cache serve none
    clip = synth_clips((args.seconds,), seed=0, espeak=False)[0]
    n = args.output_tokens
    params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
    one_request(engine, clip.heard_as(-1).audio, params, "warm-up")
    runs = [one_request(engine, clip.heard_as(i).audio, params, f"r{i}") for i in range(args.repeats)]
    medians = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    for key, value in medians.items():
        log.info("%-20s %8.2f", key, value)
    profile_prefill(engine, clip.heard_as(args.repeats).audio, params, out_dir)
    result = {"seconds": args.seconds, "output_tokens": n, "engine": engine.memory_summary(),
              "median_ms": medians, "runs_ms": runs}  # fmt: skip
    (out_dir / "a2t_stages.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
