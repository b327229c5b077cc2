"""The host work of a decode step: what the engine costs around a model that costs nothing.

Builds the LLM stage on a tiny checkpoint (Qwen3-ASR's by default, `--family omni` for the embedded
Qwen3-Omni one), swaps its decoder for a stand-in whose forward does no work and whose logits are rows of a
fixed random table picked by the input token (a deterministic chain of ordinary text tokens: no end token, no
special token, no partial UTF-8), then times `pipeline.step()` over pure decode steps at each batch size, for
greedy requests (ASR's) and for sampled ones (temperature, top-k, top-p, repetition penalty). What is left is
the scheduler, the attention metadata, the copies to the device, the sampler, the token's read-back, the
detokenizer and the outputs. A cProfile of the same steps says where that time goes, by function. Last, the
same requests stream through the in-process server's AsyncPipeline (its engine thread, the event loop taking
each output): the "served ms" column is the median time between a request's outputs there, a token (an
output carries `--stream-interval` tokens; 1 by default, Qwen3-ASR's server 4), so the difference from "step
ms" is what the serving loop adds to every step.

How to run it: on this CPU, `python benchmarks/host_overhead.py` (a minute); on a GPU,
`python benchmarks/host_overhead.py --device cuda`, where the stand-in's decode steps are captured in CUDA
graphs as the real decoder's are, so the figures are a step's host work plus a few microseconds of kernels.
On the CPU the logits table is 4,096 tokens wide (`--logits-width`) so that the sampler's arithmetic, GPU work
on the real machine, does not swamp the host work; on a GPU it is the whole vocabulary. `--profile-top 0`
skips the profiles, `--no-served` the AsyncPipeline; `--json FILE` writes the table.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omnistage import LLM, SamplingParams
from omnistage.engine.stages.text import TextStage
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.pipeline.async_pipeline import AsyncPipeline

CHAIN_ROWS = 64  # rows of the logits table: the next token depends on the current one modulo this
SAMPLED = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
MODES = {"greedy": SamplingParams(temperature=0.0), "sampled": SAMPLED}


class NoOpDecoder(torch.nn.Module):
    """A decoder with the real one's call signature that computes nothing: the "hidden state" of a row is its
    input id, and its logits are row `id % CHAIN_ROWS` of a fixed table over the allowed tokens."""

    def __init__(self, allowed: list[int], width: int, device: torch.device, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        table = torch.full((CHAIN_ROWS, width), -1e4)
        table[:, allowed] = torch.randn(CHAIN_ROWS, len(allowed), generator=generator)
        self.register_buffer("table", table.to(device))

    def forward(
        self, input_ids, positions, kv_caches, meta, inputs_embeds=None, deepstack=None, tap_layer=None
    ):
        return input_ids

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table.index_select(0, hidden.remainder(CHAIN_ROWS))


def ordinary_tokens(engine: TextStage, width: int) -> list[int]:
    """Ids below `width` that decode to whole characters on their own and end nothing."""
    special = set(engine.tokenizer.get_added_tokens_decoder()) | set(engine.eos_token_ids)
    return [
        t
        for t in range(width)
        if t not in special and (text := engine.tokenizer.decode([t])) and "\ufffd" not in text
    ]


def install_no_op(engine: TextStage, width: int) -> None:
    """Put the stand-in in place of the decoder, capturing its decode graphs where the real ones were."""
    runner = engine.runner
    runner.model = NoOpDecoder(ordinary_tokens(engine, width), width, engine.device)
    runner.prefill_graphs = None  # prefills run eagerly: only decode steps are timed
    runner.keep_taps, runner.tap_rows = False, None  # nothing for a Talker: the stand-in has no hidden states
    if runner.graphs is not None:
        buckets = runner.graphs.captured_buckets
        runner.graphs = None
        runner.capture_graphs(buckets, engine.max_model_len, engine.settings.engine.enforce_eager)


def build(args: argparse.Namespace, workdir: Path) -> LLM:
    max_batch = max(args.batches + [int(b) for b in args.loaded.split(",") if b])
    tokens = args.prompt_len + max_batch + args.warmup + args.steps + 1
    common = dict(
        device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        page_size=16,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, args.prompt_len),
        compile=False,  # the stand-in replaces the decoder: nothing of it runs
        stream_interval=args.stream_interval,
        num_kv_pages=max_batch * -(-tokens // 16) + 16,
    )
    if args.device != "cpu":  # a CPU stage captures no graphs, and refuses a key that asks for them
        common |= dict(max_graph_batch=max_batch, max_prefill_graph_tokens=0)
    if args.family == "omni":
        return LLM(**common)
    from omnistage.models.qwen3_asr.tiny import make_tiny

    return LLM(model=str(make_tiny(workdir / "tiny-qwen3-asr")), **common)


def is_pure_decode(engine: TextStage) -> bool:
    scheduler = engine.scheduler
    return scheduler.num_waiting == 0 and all(
        s.num_computed_tokens == s.num_tokens - 1 for s in scheduler.running
    )


def requests(batch: int, params: SamplingParams, args: argparse.Namespace, tag: str) -> list[NewRequest]:
    """`batch` requests of random prompts that all decode through `args.warmup + args.steps` steps together."""
    # the first requests decode while the later ones prefill (at most one prefill step each)
    max_tokens = batch + args.warmup + args.steps + 1
    params = SamplingParams(**{**vars(params), "max_tokens": max_tokens, "seed": None})
    generator = torch.Generator().manual_seed(batch)
    return [
        NewRequest(
            f"{tag}-{i}",
            torch.randint(1000, 100_000, (args.prompt_len,), generator=generator).tolist(),
            params,
        )
        for i in range(batch)
    ]


def decode_steps(
    llm: LLM, batch: int, params: SamplingParams, args: argparse.Namespace, tag: str, timed: bool
):
    """Run `args.steps` pure decode steps of `batch` requests (after the prefills and `args.warmup` steps):
    their wall times (seconds) if `timed`, else their cProfile."""
    engine, pipeline = llm.engine, llm.pipeline
    batch_requests = requests(batch, params, args, tag)
    assert pipeline.add_requests(batch_requests) == [None] * batch
    while not is_pure_decode(engine):
        pipeline.step()
    for _ in range(args.warmup):
        pipeline.step()
    times, profile = [], cProfile.Profile()
    for _ in range(args.steps):
        started = time.perf_counter()
        if not timed:
            profile.enable()
        pipeline.step()
        if not timed:
            profile.disable()
        times.append(time.perf_counter() - started)
    for request in batch_requests:
        pipeline.abort(request.request_id)
    assert engine.pool.num_free == engine.pool.num_pages
    return times if timed else profile


def loaded_steps(
    llm: LLM, batch: int, params: SamplingParams, args: argparse.Namespace, tag: str, timed: bool
):
    """A server's steady state at concurrency `batch`: each request asks for `args.loaded_tokens` tokens of an
    `args.loaded_prompt`-token prompt and is replaced by a new one as soon as it ends, so that most steps
    prefill arrivals beside the decode rows (Qwen3-ASR at c=128: ~4 a step). `args.steps` steps are timed
    after `args.warmup`, each with the admission of the arrivals before it; their wall times (seconds) and
    the arrivals each admitted if `timed`, else their cProfile."""
    engine, pipeline = llm.engine, llm.pipeline
    params = SamplingParams(**{**vars(params), "max_tokens": args.loaded_tokens, "seed": None})
    generator = torch.Generator().manual_seed(batch)
    count = 0

    def arrivals(n: int) -> list[NewRequest]:
        nonlocal count
        prompts = torch.randint(1000, 100_000, (n, args.loaded_prompt), generator=generator).tolist()
        count += n
        return [NewRequest(f"{tag}-{count - n + i}", p, params) for i, p in enumerate(prompts)]

    first = arrivals(batch)
    assert pipeline.add_requests(first) == [None] * batch
    live = {r.request_id for r in first}
    times, admitted, profile = [], [], cProfile.Profile()
    for i in range(args.warmup + args.steps):
        started = time.perf_counter()
        if not timed and i >= args.warmup:
            profile.enable()
        ended = {o.request_id for o in pipeline.step() if o.finished}
        new = arrivals(len(ended & live))
        live = (live - ended) | {r.request_id for r in new}
        if new:
            assert pipeline.add_requests(new) == [None] * len(new)
        if not timed and i >= args.warmup:
            profile.disable()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
            admitted.append(len(new))
    for request_id in live:
        pipeline.abort(request_id)
    while engine.has_unfinished():
        pipeline.step()
    assert engine.pool.num_free == engine.pool.num_pages
    return (times, admitted) if timed else profile


def served_gaps(
    engine: AsyncPipeline, batch: int, params: SamplingParams, args: argparse.Namespace, tag: str
):
    """Seconds a token between a request's consecutive outputs (an output carries `--stream-interval` tokens),
    streamed through the in-process server's AsyncPipeline, while all `batch` requests decode."""

    async def stream(request: NewRequest) -> list[tuple[float, int]]:
        outputs = engine.generate(request)
        return [(time.perf_counter(), len(out.outputs[0].token_ids)) async for out in outputs]

    async def run() -> list[list[tuple[float, int]]]:
        return await asyncio.gather(*(stream(r) for r in requests(batch, params, args, tag)))

    stamps = asyncio.run(run())
    start, end = max(s[0][0] for s in stamps), min(s[-1][0] for s in stamps)
    pairs = [(a, b) for s in stamps for a, b in zip(s, s[1:], strict=False)]
    gaps = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in pairs]
    within = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in pairs if start <= a[0] and b[0] <= end]
    # a slow reader gets several steps' tokens in one output, so a short run may leave no gap inside the
    # window where all decode: then every gap, and none where each request came in one output
    return within or gaps


def print_profile(profile: cProfile.Profile, steps: int, top: int) -> None:
    """The functions with the most time of their own, per step, and where their callers' time went."""
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    print(f"    {'own us/step':>11} {'cum us/step':>11} {'calls/step':>10}  function")
    for (filename, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(filename).name}:{line}" if line else filename
        print(
            f"    {own / steps * 1e6:11.1f} {cumulative / steps * 1e6:11.1f} {calls / steps:10.1f}  {name} ({where})"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--family", choices=["asr", "omni"], default="asr")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--modes", default="greedy,sampled", help=f"among {', '.join(MODES)}")
    p.add_argument("--prompt-len", type=int, default=1500, help="prompt tokens (a 2-minute clip: ~1,500)")
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per batch size")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--logits-width", type=int, default=None, help="default: 4096 on a CPU, the vocabulary on a GPU"
    )
    p.add_argument("--loaded", default="", help="concurrencies of a steady state with arrivals, e.g. 64,128")
    p.add_argument(
        "--loaded-prompt", type=int, default=75, help="prompt tokens of each arrival (a 4.7 s clip's)"
    )
    p.add_argument("--loaded-tokens", type=int, default=33, help="tokens each arrival asks for")
    p.add_argument("--profile-top", type=int, default=20, help="functions listed per profile (0: no profile)")
    p.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the steps through the in-process server's AsyncPipeline")  # fmt: skip
    p.add_argument("--stream-interval", type=int, default=1,
                   help="a streamed reply's tokens per output in the served rows (Qwen3-ASR serves 4 by default)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]

    with tempfile.TemporaryDirectory() as workdir:
        llm = build(args, Path(workdir))
        engine = llm.engine
        width = args.logits_width or (4096 if engine.device.type == "cpu" else engine.vocab_size)
        install_no_op(engine, width)
        graphs = engine.runner.graphs.captured_buckets if engine.runner.graphs else []
        print(f"{args.family} tiny on {engine.device}; decode graphs {graphs or 'none'}; logits width {width}; "
              f"prompt {args.prompt_len} tokens; {args.steps} steps per row")  # fmt: skip
        results = []
        for mode in args.modes.split(","):
            for batch in args.batches:
                times = decode_steps(llm, batch, MODES[mode], args, f"{mode}{batch}", timed=True)
                median = statistics.median(times)
                results.append(dict(mode=mode, batch=batch, median_ms=median * 1e3,
                                    p90_ms=statistics.quantiles(times, n=10)[-1] * 1e3,
                                    us_per_token=median / batch * 1e6))  # fmt: skip
                print(f"\n{mode} batch {batch}: median {median * 1e3:.3f} ms per step")
                if args.profile_top:
                    profile = decode_steps(llm, batch, MODES[mode], args, f"{mode}{batch}p", timed=False)
                    print_profile(profile, args.steps, args.profile_top)
            for batch in [int(b) for b in args.loaded.split(",") if b]:
                times, admitted = loaded_steps(llm, batch, MODES[mode], args, f"{mode}{batch}l", timed=True)
                median = statistics.median(times)
                results.append(dict(mode=f"{mode} loaded", batch=batch, median_ms=median * 1e3,
                                    p90_ms=statistics.quantiles(times, n=10)[-1] * 1e3,
                                    us_per_token=median / batch * 1e6,
                                    arrivals_per_step=statistics.mean(admitted)))  # fmt: skip
                print(f"\n{mode} loaded batch {batch}: median {median * 1e3:.3f} ms per step, "
                      f"{statistics.mean(admitted):.1f} arrivals a step")  # fmt: skip
                if args.profile_top:
                    profile = loaded_steps(llm, batch, MODES[mode], args, f"{mode}{batch}lp", timed=False)
                    print_profile(profile, args.steps, args.profile_top)
        if args.served:
            served = AsyncPipeline(
                llm.pipeline
            )  # last: it starts a thread that steps the pipeline from now on
            for r in (r for r in results if r["mode"] in MODES):
                gaps = served_gaps(served, r["batch"], MODES[r["mode"]], args, f"{r['mode']}{r['batch']}s")
                if gaps:
                    r["served_median_ms"] = statistics.median(gaps) * 1e3
            served.shutdown()
    print(f"\n{'mode':>8} {'batch':>5} {'step ms':>8} {'p90 ms':>8} {'us/token':>9} {'served ms':>10}")
    for r in results:
        served_ms = f"{r['served_median_ms']:10.3f}" if "served_median_ms" in r else f"{'-':>10}"
        print(f"{r['mode']:>8} {r['batch']:>5} {r['median_ms']:8.3f} {r['p90_ms']:8.3f} {r['us_per_token']:9.1f} "
              f"{served_ms}")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps(dict(device=str(args.device), family=args.family, results=results), indent=1)
        )
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)  # the host work is one thread; torch's CPU kernels would hide it behind others
    main()
