"""Every stage on an 80 GiB card: start a topology under a memory cap, then send its largest requests at once.

    python3 benchmarks/fit80.py --config configs/qwen3omni_colocated.yaml --gpu-memory-limit-gib 80 \\
        --a2t-compare --uncapped --out-dir $OUT                    # on the GPU machine: benchmarks/fit80.sh
    python3 benchmarks/fit80.py --tiny --device cpu --out-dir /tmp/fit80   # a CPU smoke run, small inputs

One process, one config; flags override its YAML as the CLI's do (by default the released sizes with random
bfloat16 weights):
1. start: the pipeline built under the cap, timed; per device the memory plan table, and per stage its CUDA
   graphs: the buckets it offered the plan (candidates), those the plan gave memory (planned) and those its
   graph runners hold (captured), with the bytes planned and the bytes the captures measured;
2. requests: image prompts, a long audio clip and a long 720p video with its sound (text out), the same video,
   S2S and T2S requests (speech out), all added at once and the pipeline stepped until every one ends, as the
   server's step loop does (`StepLoop`). Per request: ok or its error, its layout's seconds (the video decoded
   from its file as the offline API does it), seconds from the add to its first token and to its end, prompt
   tokens, frames and audio seconds of speech; per device the allocator's peak, retries and OOMs over the
   batch; every stage's free KV pages afterwards (all of them: nothing leaked); the warnings logged meanwhile
   (RequestOutput has no warnings field);
3. --a2t-compare: A2T at c=1 over `omnistage bench a2t`'s LibriSpeech-like clips and forced length (its
   in-process runner and sweep), the median of --passes passes after a warm-up pass. With --uncapped the
   pipeline is then released (its memory checked returned), built again without the cap and timed the same
   way: both RTFs and their ratio.
Writes $OUT/fit80_<config stem>_<cap>.json as each part ends (a run cut short keeps what it measured) and a
summary to stdout; exits non-zero if a start, a request or an A2T pass failed, or pages were left in use.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from omnistage.bench.a2t import DEFAULT_DUMMY_OUTPUT_TOKENS, sweep
from omnistage.bench.a2t_targets import inprocess_runner
from omnistage.bench.clips import SYNTH_SETS, speech_like, synth_clips, total_seconds
from omnistage.bench.skeletons import released_skeleton
from omnistage.bench.speech_targets import talker_params, text_fields
from omnistage.bench.stats import json_safe
from omnistage.bench.video_targets import write_videos
from omnistage.config import EngineConfig, load_config
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.media import MediaPolicy, VideoOptions, decode_messages
from omnistage.outputs import AUDIO_SAMPLE_RATE, RequestOutput
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.pipeline.family import build_pipeline
from omnistage.pipeline.step_loop import Add, StepLoop
from omnistage.request import SamplingParams, SpeechParams

GiB = 1 << 30
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# What a released pipeline still holds once deleted and collected: cuBLAS and CUDA-context scraps, not a stage.
RELEASED_SLACK = 1 * GiB
T2S_PROMPT = "Tell me about the history of the bicycle in a few sentences."
# Videos are named by absolute paths in their parts and read from there, as the offline API (LLM.chat) reads them.
OFFLINE_MEDIA = MediaPolicy(media_dir=Path("/"))

# Each stage's CUDA graph set: (JSON key, its stage and kind in the memory plan)
GRAPH_SETS = (
    ("thinker_decode", "Thinker", "decode"),
    ("thinker_prefill", "Thinker", "prefill"),
    ("audio_encoder", "audio encoder", "prefill"),
    ("vision_encoder", "vision encoder", "prefill"),
    ("talker", "Talker", "decode"),
    ("code_predictor", "code predictor", "decode"),
    ("code2wav", "Code2Wav", "decode"),
)


@dataclass(frozen=True)
class Inputs:
    """The batch of part 2 and the A2T set of part 3."""

    images: tuple[str, ...]  # WxH, text out
    clip_seconds: float  # one clip, text out
    video_seconds: float  # one video with its sound, text out and speech out (0: none)
    video_size: str  # WxH
    video_fps: float  # frames sampled a second
    s2s: int  # requests: a clip in, speech out
    t2s: int  # requests: a text turn, speech out
    s2s_clip_seconds: float
    output_tokens: int  # forced text of the text-out requests
    text_tokens: int  # forced text of the speaking requests
    frames: int  # forced codec frames of the speaking requests
    a2t_clips: int  # of the LibriSpeech-like set (20)
    a2t_output_tokens: int


# The video at 1 fps: at the processor's 2, 120 s of 720p lays out as 86,400 video tokens, past the 65,536 context.
RELEASED = Inputs(("448x448", "1920x1080", "2560x1440", "3840x2160"), 300.0, 120.0, "1280x720", 1.0, 2, 2, 5.0,
                  8, 40, 125, 20, DEFAULT_DUMMY_OUTPUT_TOKENS)  # fmt: skip
TINY = Inputs(("64x64", "96x64"), 2.0, 2.0, "64x48", 2.0, 1, 1, 2.0, 3, 4, 6, 2, 4)


def picture(size: str, seed: int) -> Image.Image:
    """Random RGB noise of `size` ("WxH"): the vision encoder's cost depends on the pixel count only."""
    width, height = map(int, size.split("x"))
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def cuda_devices(pipeline: Any) -> list[torch.device]:
    """The GPUs the pipeline's stages run on."""
    devices = {pipeline.device, pipeline.speech_device if pipeline.speaks else pipeline.device}
    return sorted((d for d in devices if d.type == "cuda"), key=lambda d: d.index)


def memory_now(devices: list[torch.device]) -> dict[str, dict[str, float]]:
    out = {}
    for d in devices:
        free, total = torch.cuda.mem_get_info(d)
        out[str(d)] = {
            "allocated_gib": round(torch.cuda.memory_allocated(d) / GiB, 3),
            "reserved_gib": round(torch.cuda.memory_reserved(d) / GiB, 3),
            "device_free_gib": round(free / GiB, 3),
            "device_total_gib": round(total / GiB, 3),
        }
    return out


# -- part 1: start -----------------------------------------------------------------------------------------


def _held(graphs: Any) -> tuple[list, int]:
    """A graph runner's captured buckets and the pool bytes their captures measured (none: nothing)."""
    if graphs is None:
        return [], 0
    buckets = graphs.captured_buckets
    return [list(b) if isinstance(b, tuple) else b for b in buckets], sum(graphs.graph_bytes.values())


def graph_report(pipeline: Any) -> dict[str, dict[str, Any]]:
    """Per stage: its graph set in its device's plan (candidates, planned, eager, bytes) and what it holds."""
    thinker = pipeline.thinker
    runners = {
        "thinker_decode": thinker.runner.graphs,
        "thinker_prefill": thinker.runner.prefill_graphs,
        "audio_encoder": thinker.encoders.audio_graphs,
        "vision_encoder": thinker.encoders.vision_graphs,
    }
    if pipeline.speaks:
        runners |= {
            "talker": pipeline.speech_stages.talker_stage.runner.graphs,
            "code_predictor": pipeline.speech_stages.frame_graphs,
            "code2wav": pipeline.speech_stages.code2wav_graphs,
        }
    plans = list(pipeline.plans.values())
    report = {}
    for key, stage, kind in GRAPH_SETS:
        if key not in runners:
            continue
        plan, planned = next(((p, g) for p in plans if (g := p.graph_set(stage, kind))), (None, None))
        captured, captured_bytes = _held(runners[key])
        candidates = sorted(planned.candidates.costs) if planned else []
        entry: dict[str, Any] = {
            "device": plan.device.name if plan else None,
            "unit": planned.candidates.unit if planned else None,
            "candidates": [list(b) if isinstance(b, tuple) else b for b in candidates],
            "planned": [list(b) if isinstance(b, tuple) else b for b in planned.captured] if planned else [],
            "eager": [list(b) if isinstance(b, tuple) else b for b in planned.eager] if planned else [],
            "planned_gib": round(planned.bytes / GiB, 3) if planned else 0.0,
            "captured": captured,
            "captured_gib": round(captured_bytes / GiB, 3),
        }
        entry["all_captured"] = bool(candidates) and sorted(map(str, captured)) == sorted(
            map(str, entry["candidates"])
        )
        report[key] = entry
    return report


def start(config: EngineConfig) -> tuple[Any, dict[str, Any]]:
    """The pipeline of `config` and what its start shows: time, plans, graphs, memory."""
    started = time.perf_counter()
    pipeline = build_pipeline(config)
    record: dict[str, Any] = {"start_s": round(time.perf_counter() - started, 2)}
    plans = list(pipeline.plans.values())
    record["plans"] = {p.device.name: p.table() for p in plans}
    record["graphs"] = graph_report(pipeline)
    record["summary"] = pipeline.memory_summary()
    record["memory_after_start"] = memory_now(cuda_devices(pipeline))
    return pipeline, record


# -- part 2: the batch -------------------------------------------------------------------------------------


@dataclass
class Planned:
    """One request of the batch before it is added."""

    name: str
    kind: str  # image, audio, video (text out), s2s, t2s, v2s (speech out)
    messages: list[dict]
    params: SamplingParams
    speech: SpeechParams | None = None
    video: VideoOptions = VideoOptions()  # how its videos are decoded


SPEAKING = ("s2s", "t2s", "v2s")


def video_requests(
    inputs: Inputs, media_dir: Path, text: SamplingParams, spoken: SamplingParams, speech: SpeechParams
) -> list[Planned]:
    """The long video with its sound, written under `media_dir` once and named by its path in two requests:
    one answered in text, one spoken (none where `inputs.video_seconds` is 0)."""
    if not inputs.video_seconds:
        return []
    width, height = map(int, inputs.video_size.split("x"))
    (video,) = write_videos([inputs.video_seconds], (width, height), media_dir, source_fps=2)
    options = VideoOptions(use_audio_in_video=True, fps=inputs.video_fps)
    turn = [{"role": "user", "content": [{"type": "video", "video": str(video.path)},
                                         {"type": "text", "text": "What happens, and what is said?"}]}]  # fmt: skip
    name = f"{inputs.video_seconds:g}s"
    return [
        Planned(f"video-{name}", "video", turn, text, video=options),
        Planned(f"v2s-{name}", "v2s", turn, spoken, speech, video=options),
    ]


def batch(inputs: Inputs, media_dir: Path) -> list[Planned]:
    text = SamplingParams(**text_fields(inputs.output_tokens, True))
    spoken = SamplingParams(**text_fields(inputs.text_tokens, True))
    speech = SpeechParams(voice="ethan", talker=talker_params(inputs.frames, True))

    def turn(part: dict, question: str) -> list[dict]:
        return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]

    out = [
        Planned(
            f"image-{size}", "image", turn({"type": "image", "image": picture(size, i)}, "Describe it."), text
        )
        for i, size in enumerate(inputs.images)
    ]
    clip = speech_like(inputs.clip_seconds, 0)
    out.append(Planned(f"audio-{inputs.clip_seconds:g}s", "audio", turn({"type": "audio", "audio": clip},
                       "What is said?"), text))  # fmt: skip
    out += video_requests(inputs, media_dir, text, spoken, speech)
    out += [
        Planned(f"s2s-{i}", "s2s", [{"role": "user", "content": [{"type": "audio", "audio": speech_like(
            inputs.s2s_clip_seconds, 100 + i)}]}], spoken, speech)
        for i in range(inputs.s2s)
    ]  # fmt: skip
    out += [
        Planned(f"t2s-{i}", "t2s", [{"role": "user", "content": T2S_PROMPT}], spoken, speech)
        for i in range(inputs.t2s)
    ]
    return out


class _Warnings(logging.Handler):
    """Collects the warnings logged (and `warnings.warn`ed) while the batch runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.name}: {record.getMessage()}")


def run_batch(pipeline: Any, planned: list[Planned], inputs: Inputs, timeout_s: float) -> dict[str, Any]:
    """Lay every prompt out, add them all at once and step until all end (or `timeout_s` passes)."""
    records: dict[str, dict[str, Any]] = {}
    new = []
    for p in planned:
        record = records[p.name] = {"name": p.name, "kind": p.kind, "ok": False, "error": None}
        began = time.perf_counter()
        try:
            messages = decode_messages(p.messages, OFFLINE_MEDIA, p.video)
            prompt = pipeline.processor.process_chat(
                messages, True, pipeline.max_model_len, p.video.use_audio_in_video
            )
        except Exception as exc:  # a request refused at its layout is a result, not the end of the run
            record["error"] = f"{type(exc).__name__}: {exc}"
            continue
        record["preprocess_s"] = round(time.perf_counter() - began, 3)
        record["prompt_tokens"] = len(prompt.token_ids)
        new.append(
            NewRequest(p.name, prompt.token_ids, p.params, prompt.prompt, prompt.mrope, prompt.mm, p.speech)
        )
    finals: dict[str, RequestOutput] = {}
    added = time.perf_counter()

    def deliver(items: list[tuple[str, RequestOutput | Exception]]) -> None:
        now = time.perf_counter() - added
        for request_id, item in items:
            record = records[request_id]
            if isinstance(item, Exception):
                record["error"], record["wall_s"] = f"{type(item).__name__}: {item}", round(now, 3)
                continue
            if item.outputs[0].token_ids:
                record.setdefault("first_token_s", round(now, 3))
            if item.audio_delta is not None and len(item.audio_delta):
                record.setdefault("first_audio_s", round(now, 3))
            if item.finished:
                finals[request_id], record["wall_s"] = item, round(now, 3)
                print(f"  {now:7.2f} s  {request_id} finished", flush=True)

    devices = cuda_devices(pipeline)
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    before = {d: torch.cuda.memory_stats(d) for d in devices}
    handler = _Warnings()
    logging.getLogger().addHandler(handler)
    logging.captureWarnings(True)
    loop = StepLoop(pipeline, deliver)
    # a batch that stops making progress: every thread's stack on stderr, at most once a minute
    faulthandler.dump_traceback_later(60, repeat=True, file=sys.__stderr__)
    try:
        loop.handle([Add(r) for r in new])
        steps = 0
        while pipeline.has_unfinished():
            if steps % 100 == 0:
                retries = {str(d): torch.cuda.memory_stats(d).get("num_alloc_retries", 0) for d in devices}
                print(
                    f"  {time.perf_counter() - added:7.2f} s  step {steps}: {pipeline.stats()}, allocator "
                    f"retries {retries}",
                    flush=True,
                )
            if time.perf_counter() - added > timeout_s:
                for request_id in {r.request_id for r in new} - set(finals):
                    pipeline.abort(request_id)
                    records[request_id]["error"] = f"not finished within {timeout_s:g} s"
                break
            loop.step()
            steps += 1
        for d in devices:
            torch.cuda.synchronize(d)
    finally:
        faulthandler.cancel_dump_traceback_later()
        logging.captureWarnings(False)
        logging.getLogger().removeHandler(handler)
    for request_id, out in finals.items():
        _judge(records[request_id], out, inputs)
    peaks = {}
    for d in devices:
        stats = torch.cuda.memory_stats(d)
        peaks[str(d)] = {
            "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated(d) / GiB, 3),
            "max_memory_reserved_gib": round(torch.cuda.max_memory_reserved(d) / GiB, 3),
            "alloc_retries": stats.get("num_alloc_retries", 0) - before[d].get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0) - before[d].get("num_ooms", 0),
        }
    stats = pipeline.stats()
    pools = {"thinker": [stats["kv_pages_free"], stats["kv_pages_total"]]}
    if "talker_kv_pages_total" in stats:
        pools["talker"] = [stats["talker_kv_pages_free"], stats["talker_kv_pages_total"]]
    return {
        "requests": list(records.values()),
        "wall_s": round(time.perf_counter() - added, 3),
        "steps": steps,
        "peak_by_device": peaks,
        "kv_pages_free_total": pools,
        "pages_all_free": all(free == total for free, total in pools.values()),
        "warnings": handler.seen,
        "all_ok": all(r["ok"] for r in records.values()),
    }


def _judge(record: dict[str, Any], out: RequestOutput, inputs: Inputs) -> None:
    """Fill a finished request's figures; ok when it ended without error at the lengths it was forced to."""
    completion = out.outputs[0]
    record["finish_reason"] = completion.finish_reason
    record["output_tokens"] = len(completion.token_ids)
    speaks = record["kind"] in SPEAKING
    want = inputs.text_tokens if speaks else inputs.output_tokens
    problems = [out.error] if out.error else []
    if completion.finish_reason in ("error", "abort"):
        problems.append(f"finish_reason {completion.finish_reason}")
    if record["output_tokens"] != want:
        problems.append(f"{record['output_tokens']} text tokens, not the {want} forced")
    if speaks:
        record["frames"] = out.num_audio_frames
        record["audio_s"] = round(len(out.audio) / AUDIO_SAMPLE_RATE, 3) if out.audio is not None else 0.0
        if out.num_audio_frames != inputs.frames:
            problems.append(f"{out.num_audio_frames} frames, not the {inputs.frames} forced")
    record["error"] = "; ".join(problems) or None
    record["ok"] = not problems


# -- part 3: A2T -------------------------------------------------------------------------------------------


def a2t(pipeline: Any, clips: list, output_tokens: int, passes: int) -> dict[str, Any]:
    """`omnistage bench a2t`'s in-process pass at c=1 on this pipeline: a warm-up pass, then `passes` passes."""
    engine = AsyncPipeline(pipeline)
    try:
        run = inprocess_runner(engine, output_tokens, output_tokens)
        [summary] = asyncio.run(sweep(run, clips, [1], warmup=len(clips), repeats=passes))
    finally:
        engine.shutdown()
    return summary


def release() -> dict[str, Any]:
    """After the last reference to a pipeline is gone: collect it, give its memory back to every GPU, lift its
    cap (the plan set the allocator's fraction), and say what is still held; if a stage's memory is, also
    after dropping torch.compile's caches (their graphs may keep tensors they were traced with)."""
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]

    def collect() -> dict[str, dict[str, float]]:
        gc.collect()
        for d in devices:
            torch.cuda.synchronize(d)
        torch.cuda.empty_cache()  # every device's cache
        return memory_now(devices)

    def held(memory: dict[str, dict[str, float]]) -> bool:
        return any(m["allocated_gib"] * GiB > RELEASED_SLACK for m in memory.values())

    gc.unfreeze()  # AsyncPipeline froze everything loaded so far out of the collector's view
    for d in devices:
        torch.cuda.set_per_process_memory_fraction(1.0, d)
    result: dict[str, Any] = {"memory_after_collect": collect()}
    if held(result["memory_after_collect"]):
        torch._dynamo.reset()
        result["memory_after_dynamo_reset"] = collect()
    result["released"] = not held(list(result.values())[-1])
    return result


# -- the run -----------------------------------------------------------------------------------------------


def one_build(
    config: EngineConfig,
    args: argparse.Namespace,
    inputs: Inputs,
    clips: list,
    record: dict,
    save: Callable[[], None],
    requests: bool,
) -> None:
    """Start `config`, run the batch (`requests`) and A2T (with --a2t-compare), each part into `record` and
    saved as it ends. The pipeline is unreferenced once this returns."""
    record["gpu_memory_limit_gib"] = config.gpu_memory_limit_gib
    try:
        pipeline, started = start(config)
    except Exception as exc:  # e.g. the stages do not fit the cap: the run's finding, in the JSON
        record["start_error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
        save()
        return
    record |= started
    save()
    print(f"\n== {record['label']}: started in {started['start_s']:.1f} s ==")
    for table in started["plans"].values():
        print(table)
    print(started["summary"])
    print(graphs_text(started["graphs"]))
    if requests:
        with tempfile.TemporaryDirectory(prefix="fit80-") as media_dir:
            planned = batch(inputs, Path(media_dir))
            record["batch"] = run_batch(pipeline, planned, inputs, args.batch_timeout_s)
        save()
        print(batch_text(record["batch"]))
    if args.a2t_compare:
        try:
            record["a2t"] = a2t(pipeline, clips, inputs.a2t_output_tokens, args.passes)
        except Exception as exc:
            record["a2t"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
        print(f"A2T c=1: {record['a2t']}")


def graphs_text(graphs: dict[str, dict[str, Any]]) -> str:
    lines = ["graphs per stage: captured / candidates (planned)"]
    for key, g in graphs.items():
        lines.append(
            f"  {key:<16} {len(g['captured']):>3}/{len(g['candidates']):<3} ({len(g['planned'])} planned, "
            f"{g['planned_gib']:.2f} GiB planned, {g['captured_gib']:.2f} GiB captured) on {g['device']}"
            + (f"; eager: {g['eager']}" if g["eager"] else "")
        )
    return "\n".join(lines)


def batch_text(result: dict[str, Any]) -> str:
    lines = [
        f"batch of {len(result['requests'])} requests at once: {result['wall_s']:.1f} s, {result['steps']} steps"
    ]
    for r in result["requests"]:
        speech = f"  {r['frames']} frames, {r['audio_s']:.1f} s audio" if "frames" in r else ""
        lines.append(
            f"  {r['name']:<16} {'ok' if r['ok'] else 'FAILED':<6} {r.get('wall_s', float('nan')):8.2f} s  "
            f"(first token {r.get('first_token_s', float('nan')):.2f} s)  {r.get('prompt_tokens', 0):>6} "
            f"prompt tokens{speech}{'  ' + r['error'] if r['error'] else ''}"
        )
    for device, peak in result["peak_by_device"].items():
        lines.append(f"  {device}: peak allocated {peak['max_memory_allocated_gib']:.2f} GiB, reserved "
                     f"{peak['max_memory_reserved_gib']:.2f} GiB, {peak['alloc_retries']} retries, {peak['ooms']} OOMs")  # fmt: skip
    lines.append(
        f"  KV pages free/total: {result['kv_pages_free_total']} (all free: {result['pages_all_free']})"
    )
    lines += [f"  warning: {w}" for w in result["warnings"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, help="YAML topology (default: configs/qwen3omni_colocated.yaml; "
                        "with --tiny configs/tiny.yaml)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny checkpoint, small inputs")
    parser.add_argument("--model", help="checkpoint directory (default: the released sizes, no weights)")
    parser.add_argument(
        "--load-format", choices=["safetensors", "dummy"], help="default: dummy (--tiny: safetensors)"
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: the config's")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="default: bfloat16 (--tiny: the config's)")  # fmt: skip
    parser.add_argument("--gpu-memory-limit-gib", type=float, help="the cap (default: the config's)")
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    inputs = parser.add_argument_group("inputs (default: the released set, or a small one with --tiny)")
    inputs.add_argument("--images", nargs="*", help="image sizes WxH, text out")
    inputs.add_argument("--clip-seconds", type=float, help="one audio clip, text out")
    inputs.add_argument("--video-seconds", type=float,
                        help="one video with its sound, text out and speech out (0: none)")  # fmt: skip
    inputs.add_argument("--video-size", help="the video's WxH")
    inputs.add_argument("--video-fps", type=float, help="the video's frames sampled a second")
    inputs.add_argument("--s2s", type=int, help="speech-to-speech requests")
    inputs.add_argument("--t2s", type=int, help="text-to-speech requests (a chat turn, its reply spoken)")
    inputs.add_argument("--s2s-clip-seconds", type=float)
    inputs.add_argument("--output-tokens", type=int, help="forced text of the text-out requests")
    inputs.add_argument("--text-tokens", type=int, help="forced text of the speaking requests")
    inputs.add_argument("--frames", type=int, help="forced codec frames of the speaking requests")
    inputs.add_argument("--a2t-clips", type=int, help="first N clips of the LibriSpeech-like set")
    inputs.add_argument("--a2t-output-tokens", type=int)
    parser.add_argument("--no-requests", action="store_true", help="skip the batch of part 2")
    parser.add_argument("--batch-timeout-s", type=float, default=400.0, help="abort what is unfinished then")
    parser.add_argument("--a2t-compare", action="store_true", help="A2T at c=1 on this pipeline")
    parser.add_argument(
        "--uncapped", action="store_true", help="then A2T again after a rebuild without the cap"
    )
    parser.add_argument(
        "--passes", type=int, default=3, help="timed A2T passes (median) after one warm-up pass"
    )
    parser.add_argument("--no-espeak", dest="espeak", action="store_false",
                        help="speech-like A2T clips even where espeak-ng is installed")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    base = TINY if args.tiny else RELEASED
    given = {f.name: getattr(args, f.name) for f in fields(Inputs) if getattr(args, f.name) is not None}
    inputs = replace(base, **given | ({"images": tuple(args.images)} if args.images is not None else {}))
    path = args.config or CONFIGS / ("tiny.yaml" if args.tiny else "qwen3omni_colocated.yaml")
    overrides = {
        "model": None if args.tiny else args.model or str(released_skeleton()),
        "load_format": args.load_format or (None if args.tiny else "dummy"),
        "device": args.device,
        "dtype": args.dtype or (None if args.tiny else "bfloat16"),
    }
    config = load_config(path, **overrides, gpu_memory_limit_gib=args.gpu_memory_limit_gib)
    if args.tiny and config.model is not None:
        raise SystemExit(f"--tiny runs the embedded checkpoint, but {path} names model {config.model}: "
                         "give a config without one (configs/tiny.yaml)")  # fmt: skip
    if args.uncapped and config.gpu_memory_limit_gib is None:
        raise SystemExit("--uncapped compares with a capped run: give --gpu-memory-limit-gib")
    cap = config.gpu_memory_limit_gib
    label = f"{cap:g}gib" if cap is not None else "uncapped"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"fit80_{path.stem}_{label}.json"
    results: dict[str, Any] = {
        "config": str(path),
        "settings": {**overrides, "gpu_memory_limit_gib": cap},
        "inputs": {f.name: getattr(inputs, f.name) for f in fields(Inputs)},
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "runs": [],
    }

    def save() -> None:
        out.write_text(json.dumps(json_safe(results), indent=2) + "\n")

    clips = []
    if args.a2t_compare:
        clips = synth_clips(SYNTH_SETS["librispeech"], espeak=None if args.espeak else False)[
            : inputs.a2t_clips
        ]
        results["a2t_set"] = {"clips": len(clips), "audio_s": round(total_seconds(clips), 3),
                              "output_tokens": inputs.a2t_output_tokens, "passes": args.passes}  # fmt: skip
    capped = {"label": label}
    results["runs"].append(capped)
    one_build(config, args, inputs, clips, capped, save, requests=not args.no_requests)
    if args.uncapped:
        capped["release"] = release()
        save()
        print(f"released: {capped['release']}")
        uncapped = {"label": "uncapped"}
        results["runs"].append(uncapped)
        one_build(load_config(path, **overrides), args, inputs, clips, uncapped, save, requests=False)
        rtfs = [run.get("a2t", {}).get("rtf") for run in (capped, uncapped)]
        if all(rtfs):
            results["a2t_compare"] = {"capped_rtf": rtfs[0], "uncapped_rtf": rtfs[1],
                                      "ratio": round(rtfs[0] / rtfs[1], 4)}  # fmt: skip
            print(f"A2T c=1 RTF: capped {rtfs[0]:.2f}, uncapped {rtfs[1]:.2f}, ratio {rtfs[0] / rtfs[1]:.3f}")
    runs = results["runs"]
    results["all_ok"] = all(
        "start_error" not in r
        and r.get("batch", {}).get("all_ok", True)
        and r.get("batch", {}).get("pages_all_free", True)
        and "error" not in r.get("a2t", {})
        for r in runs
    )
    save()
    print(f"wrote {out}; all ok: {results['all_ok']}")
    return results


if __name__ == "__main__":
    raise SystemExit(0 if main()["all_ok"] else 1)
