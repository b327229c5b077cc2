"""Where a benchmark's engine time goes, step by step: every model step of every stage, its shape and its time.

    python benchmarks/step_trace.py --out $OUT/trace_asr.json -- bench a2t --load-format dummy \
        --skeleton qwen3-asr-0.6b --device cuda --concurrency 128 --repeats 2

Runs the `omnistage` command after `--` in this process with the stages' step functions wrapped: the Thinker's
(or Qwen3-ASR decoder's) `TokenRunner.execute`, the Talker's `RowRunner.execute`, the hand-off's Talker
prompts (`Handoff.start_talkers`, rows: the requests), the code predictor's frames (`Handoff.launch_frames`),
Code2Wav's decode calls (`Code2WavStreamer._decode`), the encoder stage's calls (`EncoderStage.encode_many`,
rows: the prompts with media) and the engine loop's admissions (`StepLoop._admit`, rows: the requests, their
encoding within), so that the time between two steps can be split; and within the hand-off, its pieces: the
prompts' rows gathered (`talker_prompts`), the media rows' copy to the host, each prompt's positions and prefix
keys, and the Talker's `add` (rows: the prompts' rows). Each call is timed between CUDA
synchronisations (`--no-sync`: host time only, the GPU left to run ahead), so a step's time is its GPU work
and the host's launches together; the synchronisations cost the decode-ahead overlap, so the benchmark's own
figures in the same run are slower than without the trace. Each call is classified by its shape: a pure
decode step (graphs replay those up to the largest bucket), one sequence's prefill chunk (prefill graphs up
to theirs), or a step of several chunks with prompt rows (always eager). Writes every call and a summary per
stage and class (count, total, mean and median ms, rows) to --out and prints the summary; and whether each step offered to the prefill graphs replayed one.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from in_process import command_of, command_parser, reraise, run

from omnistage.engine.graphs import PrefillGraphs
from omnistage.engine.stages.encoders import EncoderStage
from omnistage.engine.stages.row_runner import RowRunner
from omnistage.engine.stages.rows import RowStage
from omnistage.engine.stages.token_runner import TokenRunner
from omnistage.models.qwen3_omni.code2wav_streamer import Code2WavStreamer
from omnistage.pipeline import handoff
from omnistage.pipeline.handoff import Handoff
from omnistage.pipeline.step_loop import StepLoop

Record = dict[str, Any]


def shape(chunks: list[Any]) -> tuple[str, int, int]:
    """(class, rows, chunks) of a step over `chunks`."""
    rows = sum(c.num_tokens for c in chunks)
    if all(c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens for c in chunks):
        return "decode", rows, len(chunks)
    return ("one prefill chunk" if len(chunks) == 1 else "mixed, several chunks"), rows, len(chunks)


def _timed(records: list[Record], stage: str, sync: bool, describe: Callable[..., tuple[str, int, int]]):
    def wrap(fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            kind, rows, chunks = describe(*args, **kwargs)
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync and torch.cuda.is_available():
                    torch.cuda.synchronize()
                end = time.perf_counter()
                records.append(
                    {
                        "stage": stage,
                        "kind": kind,
                        "rows": rows,
                        "chunks": chunks,
                        "at": end,
                        "ms": (end - start) * 1e3,
                    }
                )

        return timed

    return wrap


def _count_replays(records: list[Record], runner: type) -> None:
    """Record whether each prefill graph `run` replayed a graph or declined the step (run eagerly then)."""
    run = runner.run

    def counted(self: Any, embeds: torch.Tensor, positions: torch.Tensor, meta: Any, *rest: Any) -> Any:
        out = run(self, embeds, positions, meta, *rest)
        kind = "replayed" if out is not None else "declined"
        rows, chunks = embeds.shape[0], meta.seq_lens.shape[0]
        records.append({"stage": "prefill graphs", "kind": kind, "rows": rows, "chunks": chunks, "ms": 0.0})
        return out

    runner.run = counted


def install(records: list[Record], sync: bool) -> None:
    """Wrap the stages' step functions (class attributes: every instance the command builds is traced) and the
    hand-off's pieces (module functions, looked up in `handoff` at each call)."""
    timed: list[tuple[Any, str, str, Callable[..., tuple[str, int, int]]]] = [
        (TokenRunner, "execute", "Thinker", lambda self, step, *a, **k: shape(step.chunks)),
        (RowRunner, "execute", "Talker", lambda self, chunks: shape(chunks)),
        (
            Handoff,
            "launch_frames",
            "code predictor",
            lambda self, flights: ("frames", sum(len(f.chunks) for f in flights), 0),
        ),
        (Handoff, "start_talkers", "hand-off", lambda self, speeches: ("Talker prompts", len(speeches), 0)),
        (
            Code2WavStreamer,
            "_decode",
            "Code2Wav",
            lambda self, size, ids: (f"{size}-frame chunks", len(ids), 0),
        ),
        (EncoderStage, "encode_many", "encoders", lambda self, prompts, *a, **k: ("media", len(prompts), 0)),
        (StepLoop, "_admit", "engine loop", lambda self, requests: ("admitted", len(requests), 0)),
        # the hand-off's Talker prompts, piece by piece (rows: the prompts' rows)
        (
            handoff,
            "talker_prompts",
            "hand-off",
            lambda talker, tokens, tts, table, sources: (
                "prompts' rows gathered",
                sum(len(s.ids) for s in sources),
                0,
            ),
        ),
        (
            Handoff,
            "media_on_host",
            "hand-off",
            lambda self, sources: ("media rows to the host", sum(len(s.media_hidden) for s in sources), 0),
        ),
        (
            handoff,
            "talker_positions",
            "hand-off",
            lambda prompt, *a: ("prompt's positions", len(prompt.rope_ids), 0),
        ),
        (handoff, "talker_keys", "hand-off", lambda ids, *a: ("prompt's prefix keys", len(ids), 0)),
        (
            RowStage,
            "add",
            "hand-off",
            lambda self, request_id, embeds, *a, **k: ("Talker add", len(embeds), 0),
        ),
    ]
    for owner, name, stage, describe in timed:
        setattr(owner, name, _timed(records, stage, sync, describe)(getattr(owner, name)))
    _count_replays(records, PrefillGraphs)


def summarize(records: list[Record]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r["stage"], r["kind"]), []).append(r)
    rows = []
    for (stage, kind), items in sorted(groups.items(), key=lambda kv: -sum(r["ms"] for r in kv[1])):
        times = [r["ms"] for r in items]
        rows.append(
            {
                "stage": stage,
                "kind": kind,
                "count": len(items),
                "total_ms": round(sum(times), 1),
                "mean_ms": round(statistics.mean(times), 3),
                "median_ms": round(statistics.median(times), 3),
                "rows_median": statistics.median(r["rows"] for r in items),
                "rows_max": max(r["rows"] for r in items),
                "chunks_max": max(r["chunks"] for r in items),
            }
        )
    return rows


def table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| stage | step | count | total ms | mean ms | median ms | rows median | rows max | chunks max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summary:
        lines.append(
            f"| {s['stage']} | {s['kind']} | {s['count']} | {s['total_ms']:.1f} | {s['mean_ms']:.2f} | "
            f"{s['median_ms']:.2f} | {s['rows_median']:g} | {s['rows_max']} | {s['chunks_max']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = command_parser(__doc__)
    parser.add_argument("--out", required=True, help="JSON file for every call and the summary")
    parser.add_argument("--no-sync", dest="sync", action="store_false", help="host time only")
    args = parser.parse_args()
    command = command_of(args)
    records: list[Record] = []
    install(records, args.sync)
    failure = run(command)
    summary = summarize(records)
    with open(args.out, "w") as f:
        json.dump({"command": command, "sync": args.sync, "summary": summary, "calls": records}, f)
    print(table(summary))
    reraise(failure)


if __name__ == "__main__":
    main()
