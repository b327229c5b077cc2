"""The host work of a decode step: what the engine costs around a model that costs nothing.

Builds the LLM stage on a tiny checkpoint (Qwen3-ASR's by default, `--family omni` for the embedded
Qwen3-Omni one), swaps its decoder for a stand-in whose forward does no work and whose logits are rows of a
fixed random table picked by the input token (a deterministic chain of ordinary text tokens: no end token, no
special token, no partial UTF-8), then times `pipeline.step()` over pure decode steps at each batch size, for
greedy requests (ASR's) and for sampled ones (temperature, top-k, top-p, repetition penalty). What is left is
the scheduler, the attention metadata, the copies to the device, the sampler, the token's read-back, the
detokenizer and the outputs. A cProfile of the same steps says where that time goes, by function.

How to run it: on this CPU, `python benchmarks/host_overhead.py` (a minute or two); on a GPU,
`python benchmarks/host_overhead.py --device cuda`, where the stand-in's decode steps are captured in CUDA
graphs as the real decoder's are, so the figures are a step's host work plus a few microseconds of kernels.
On the CPU the logits table is 4,096 tokens wide (`--logits-width`) so that the sampler's arithmetic, GPU work
on the real machine, does not swamp the host work; on a GPU it is the whole vocabulary. `--profile-top 0`
skips the profiles; `--json FILE` writes the table.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omnistage import LLM, SamplingParams
from omnistage.engine.llm_engine import LLMEngine, NewRequest

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


def ordinary_tokens(engine: LLMEngine, width: int) -> list[int]:
    """Ids below `width` that decode to whole characters on their own and end nothing."""
    special = set(engine.tokenizer.get_added_tokens_decoder()) | set(engine.eos_token_ids)
    return [
        t
        for t in range(width)
        if t not in special and (text := engine.tokenizer.decode([t])) and "\ufffd" not in text
    ]


def install_no_op(engine: LLMEngine, width: int) -> None:
    """Put the stand-in in place of the decoder, capturing its decode graphs where the real ones were."""
    runner = engine.runner
    runner.model = NoOpDecoder(ordinary_tokens(engine, width), width, engine.device)
    runner.prefill_graphs = None  # prefills run eagerly: only decode steps are timed
    if runner.graphs is not None:
        buckets = runner.graphs.captured_buckets
        runner.graphs = None
        runner.capture_graphs(buckets, engine.max_model_len, engine.config.enforce_eager)


def build(args: argparse.Namespace, workdir: Path) -> LLM:
    max_batch = max(args.batches)
    tokens = args.prompt_len + max_batch + args.warmup + args.steps + 1
    common = dict(
        device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, args.prompt_len),
        max_graph_batch=max_batch,
        compile=False,  # the stand-in replaces the decoder: nothing of it runs
        max_prefill_graph_tokens=0,
        num_kv_pages=max_batch * -(-tokens // 16) + 16,
    )
    if args.family == "omni":
        return LLM(**common)
    from omnistage.models.qwen3_asr.tiny import make_tiny

    return LLM(model=str(make_tiny(workdir / "tiny-qwen3-asr")), **common)


def is_pure_decode(engine: LLMEngine) -> bool:
    scheduler = engine.scheduler
    return scheduler.num_waiting == 0 and all(
        s.num_computed_tokens == s.num_tokens - 1 for s in scheduler.running
    )


def measure(llm: LLM, batch: int, params: SamplingParams, args: argparse.Namespace, tag: str):
    """Step times (seconds) of `args.steps` pure decode steps of `batch` requests, and their profile."""
    engine, pipeline = llm.engine, llm.pipeline
    # the first requests decode while the later ones prefill (at most one prefill step each)
    max_tokens = batch + args.warmup + args.steps + 1
    params = SamplingParams(**{**vars(params), "max_tokens": max_tokens, "seed": None})
    generator = torch.Generator().manual_seed(batch)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = torch.randint(1000, 100_000, (args.prompt_len,), generator=generator).tolist()
        assert pipeline.add_requests([NewRequest(request_id, prompt, params)]) == [None]
    while not is_pure_decode(engine):
        pipeline.step()
    for _ in range(args.warmup):
        pipeline.step()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        pipeline.step()
        times.append(time.perf_counter() - started)
    profile = None
    if args.profile_top:
        profile = cProfile.Profile()
        for request_id in ids:
            pipeline.abort(request_id)
        for request_id in ids:
            prompt = torch.randint(1000, 100_000, (args.prompt_len,), generator=generator).tolist()
            pipeline.add_requests([NewRequest(f"{request_id}-p", prompt, params)])
        while not is_pure_decode(engine):
            pipeline.step()
        for _ in range(args.warmup):
            pipeline.step()
        profile.enable()
        for _ in range(args.steps):
            pipeline.step()
        profile.disable()
        ids = [f"{request_id}-p" for request_id in ids]
    for request_id in ids:
        pipeline.abort(request_id)
    assert engine.pool.num_free == engine.pool.num_pages
    return times, profile


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


def main() -> None:
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
    p.add_argument("--profile-top", type=int, default=20, help="functions listed per profile (0: no profile)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(1)  # the host work is one thread; torch's CPU kernels would hide it behind others

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
                times, profile = measure(llm, batch, MODES[mode], args, f"{mode}{batch}")
                median = statistics.median(times)
                p90 = statistics.quantiles(times, n=10)[-1]
                results.append(dict(mode=mode, batch=batch, median_ms=median * 1e3, p90_ms=p90 * 1e3,
                                    us_per_token=median / batch * 1e6))  # fmt: skip
                print(
                    f"\n{mode} batch {batch}: median {median * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms per step"
                )
                if profile is not None:
                    print_profile(profile, args.steps, args.profile_top)
    print(f"\n{'mode':>8} {'batch':>5} {'median ms':>10} {'p90 ms':>8} {'us/token':>9}")
    for r in results:
        print(
            f"{r['mode']:>8} {r['batch']:>5} {r['median_ms']:10.3f} {r['p90_ms']:8.3f} {r['us_per_token']:9.1f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(dict(device=str(args.device), family=args.family, results=results), indent=1)
        )


if __name__ == "__main__":
    main()
