"""Routed experts of one Thinker MoE layer on one GPU: `grouped_experts` (torch._grouped_mm) against
`triton_experts`, at the released sizes (E 128, top-8, H 2048, I 768) with random bf16 weights.

For each batch T, one CUDA graph holds 48 calls (a decode step's layers), each with its own x and
routing and cycling over 4 weight sets (4.8 GB), so L2 (50 MB) keeps nothing between calls. Time per
call is the median of several replays (CUDA events) / 48. Effective TB/s counts the bytes of the
distinct experts each call touches. Also timed: the alignment alone (the Triton kernel of moe_align)
against the `torch.sort` + `searchsorted` it replaces. Exits 1 if triton_experts (with its own tiles or any
swept ones) or grouped_experts misses an fp32 reference by more than bf16 tolerance.

    python benchmarks/moe_kernels.py            # the table, ~30 s
    python benchmarks/moe_kernels.py --sweep    # also time candidate tiles of triton_experts per T
                                                # (taller and wider ones from 512 tokens)
    python benchmarks/moe_kernels.py --tokens 512,2048,8192   # prefill chunks: the TFLOP/s columns decide
    python benchmarks/moe_kernels.py --stage talker --tokens 2048,8192 --sweep   # the Talker's layer
    python benchmarks/moe_kernels.py --tokens 2048,8192 --compile   # grouped_experts compiled, as the engine's
                                                                    # decoder layers run it (torch.compile)

Past `ALIGN_KERNEL_MAX_PAIRS` the grouped path aligns its pairs by a stable sort (`moe_align.align_pairs_torch`);
`--compile` times it as the engine runs it, inside the compiled layer. The "GEMMs µs" column is the two grouped
GEMMs alone on pairs already in expert order: the rest of the grouped column is the alignment, the gather of the
rows, the activation and the weighted sum.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from dataclasses import dataclass, field

import torch

from omnistage.kernels.moe import MoeKernelConfig, default_config, triton_experts
from omnistage.kernels.moe_align import align_pairs
from omnistage.models.layers.grouped_moe import grouped_experts
from omnistage.models.layers.moe_experts import fused_experts

log = logging.getLogger("bench")

# (experts, hidden, expert width, experts a token) of each stage's MoE layers in the released Qwen3-Omni
STAGES = {"thinker": (128, 2048, 768, 8), "talker": (128, 1024, 384, 6)}
EXPERTS, HIDDEN, INTER, TOP_K = STAGES["thinker"]
CALLS, WEIGHT_SETS = 48, 4
EXPERT_BYTES = 3 * HIDDEN * INTER * 2

SWEEP = [
    MoeKernelConfig(16, 16, 128, 32, 128),
    MoeKernelConfig(16, 32, 128, 64, 128),
    MoeKernelConfig(16, 32, 128, 64, 128, num_stages=3),
    MoeKernelConfig(16, 32, 64, 64, 64, num_stages=5),
    MoeKernelConfig(16, 64, 128, 128, 128),
    MoeKernelConfig(16, 32, 256, 32, 256, num_stages=3),
    MoeKernelConfig(32, 64, 64, 64, 64),
    MoeKernelConfig(64, 64, 64, 128, 64, num_warps=8, num_stages=3),
]
# prefill chunks (hundreds of rows an expert): taller and wider tiles, each weight tile reused by more rows
SWEEP_PREFILL = [
    MoeKernelConfig(64, 64, 64, 128, 64, num_warps=8, num_stages=3),
    MoeKernelConfig(64, 128, 64, 128, 64, num_warps=4, num_stages=4),
    MoeKernelConfig(64, 128, 64, 128, 64, num_warps=8, num_stages=3),
    MoeKernelConfig(128, 64, 64, 128, 64, num_warps=8, num_stages=3),
    MoeKernelConfig(128, 128, 64, 128, 64, num_warps=8, num_stages=3),
    MoeKernelConfig(128, 128, 64, 256, 64, num_warps=8, num_stages=3),
    MoeKernelConfig(128, 128, 32, 128, 32, num_warps=4, num_stages=4),
    MoeKernelConfig(64, 256, 64, 256, 64, num_warps=8, num_stages=3),
    # each block's N tiles side by side: its rows read from memory once, not once per N tile
    MoeKernelConfig(128, 128, 64, 256, 64, num_warps=8, num_stages=3, n_inner=True),
    MoeKernelConfig(128, 128, 64, 128, 64, num_warps=8, num_stages=3, n_inner=True),
    MoeKernelConfig(64, 128, 64, 128, 64, num_warps=4, num_stages=4, n_inner=True),
    MoeKernelConfig(64, 256, 64, 256, 64, num_warps=8, num_stages=3, n_inner=True),
]
PREFILL_FROM = 512  # tokens from which the sweep takes SWEEP_PREFILL


def make_calls(num_tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    calls = []
    for _ in range(CALLS):
        x = torch.randn(num_tokens, HIDDEN, generator=g, device="cuda").bfloat16()
        probs = torch.randn(num_tokens, EXPERTS, generator=g, device="cuda").softmax(-1)
        weights, ids = probs.topk(TOP_K, dim=-1)
        calls.append((x, weights / weights.sum(-1, keepdim=True), ids))
    return calls


def graph_us(step, replays: int = 10) -> float:
    """Median µs per call of a CUDA graph of `step(i)` for i in range(CALLS)."""
    for i in range(CALLS):  # compile and warm up outside the capture
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            step(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    del graph
    return statistics.median(times)


def label(c: MoeKernelConfig) -> str:
    order = ", N inner" if c.n_inner else ""
    return f"M{c.block_m} gate-up N{c.gate_up_n} K{c.gate_up_k}, down N{c.down_n} K{c.down_k}, w{c.num_warps} s{c.num_stages}{order}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def sort_align(topk_ids: torch.Tensor) -> None:
    """A stable sort and the group ends alone: the least any alignment of the pairs costs."""
    ids, _ = torch.sort(topk_ids.reshape(-1), stable=True)
    torch.searchsorted(ids, torch.arange(EXPERTS, device=ids.device, dtype=ids.dtype), right=True)


def gemms_us(calls: list, layers: list) -> float:
    """The two grouped GEMMs of `grouped_experts` alone, each call's pairs already in expert order."""
    grouped = []
    for x, _, ids in calls:
        align = align_pairs(ids, EXPERTS, block_m=1)
        rows = x.index_select(0, align.pair_ids // TOP_K)
        hidden = torch.empty(len(rows), INTER, dtype=x.dtype, device=x.device)
        grouped.append((rows, align.expert_ends, hidden))

    def step(i):
        w13, w2 = layers[i % WEIGHT_SETS]
        rows, offsets, hidden = grouped[i]
        torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offsets)
        torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)

    return graph_us(step)


@dataclass
class Row:
    tokens: int
    experts: float  # distinct experts a call touches, mean over the calls
    grouped_us: float
    triton_us: float
    align_us: float
    sort_us: float
    gemms_us: float
    err_triton: float
    err_grouped: float
    sweep: list[tuple[MoeKernelConfig, float, float]] = field(default_factory=list)  # tiles, µs, rel err

    def tbps(self, us: float) -> float:
        return self.experts * EXPERT_BYTES / us / 1e6

    def tflops(self, us: float) -> float:
        """The routed pairs' GEMM FLOPs (gate and up, then down) per second: what a prefill chunk's T
        weighs, where the weights are read once for many rows."""
        return 2 * self.tokens * TOP_K * 3 * HIDDEN * INTER / us / 1e6


def measure(num_tokens: int, layers: list, reference: tuple, sweep: bool, grouped=grouped_experts) -> Row:
    calls = make_calls(num_tokens, seed=num_tokens)

    def run(experts, i, **kwargs):
        w13, w2 = layers[i % WEIGHT_SETS]
        x, weights, ids = calls[i]
        return experts(x, w13, w2, weights, ids, **kwargs)

    x, weights, ids = calls[0]
    want = fused_experts(x.float(), *reference, weights, ids)
    block_m = default_config(num_tokens * TOP_K, EXPERTS).block_m
    row = Row(
        tokens=num_tokens,
        experts=statistics.mean(len(torch.unique(c[2])) for c in calls),
        grouped_us=graph_us(lambda i: run(grouped, i)),
        triton_us=graph_us(lambda i: run(triton_experts, i)),
        align_us=graph_us(lambda i: align_pairs(calls[i][2], EXPERTS, block_m)),
        sort_us=graph_us(lambda i: sort_align(calls[i][2])),
        gemms_us=gemms_us(calls, layers),
        err_triton=rel(run(triton_experts, 0), want),
        err_grouped=rel(run(grouped, 0), want),
    )
    if sweep:
        for config in SWEEP_PREFILL if num_tokens >= PREFILL_FROM else SWEEP:
            us = graph_us(lambda i, c=config: run(triton_experts, i, config=c), replays=5)
            row.sweep.append((config, us, rel(run(triton_experts, 0, config=config), want)))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128", help="batch sizes T, comma separated")
    parser.add_argument("--sweep", action="store_true", help="also time the candidate tiles in SWEEP")
    parser.add_argument("--compile", action="store_true", help="grouped_experts under torch.compile(dynamic)")
    parser.add_argument("--stage", choices=sorted(STAGES), default="thinker", help="whose MoE layer's sizes")
    args = parser.parse_args()
    global EXPERTS, HIDDEN, INTER, TOP_K, EXPERT_BYTES
    EXPERTS, HIDDEN, INTER, TOP_K = STAGES[args.stage]
    EXPERT_BYTES = 3 * HIDDEN * INTER * 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5

    layers = [(rand(EXPERTS, 2 * INTER, HIDDEN), rand(EXPERTS, HIDDEN, INTER)) for _ in range(WEIGHT_SETS)]
    reference = (layers[0][0].float(), layers[0][1].float())
    device = torch.cuda.get_device_name()
    log.info("weights: %d sets of %.2f GB on %s", WEIGHT_SETS, EXPERTS * EXPERT_BYTES / 1e9, device)

    grouped = torch.compile(grouped_experts, dynamic=True) if args.compile else grouped_experts
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        rows.append(row := measure(num_tokens, layers, reference, args.sweep, grouped))
        log.info("T=%d: grouped %.1f µs, triton %.1f µs", num_tokens, row.grouped_us, row.triton_us)

    print(
        f"\n{device}, E {EXPERTS}, top-{TOP_K}, H {HIDDEN}, I {INTER}, bf16; µs per call, CUDA graph of {CALLS}"
        + ("; grouped_experts compiled" if args.compile else "")
    )
    print(
        "| T | experts | grouped µs | triton µs | speedup | grouped TB/s | triton TB/s | grouped TFLOP/s | "
        "triton TFLOP/s | GEMMs µs | GEMMs TFLOP/s | align µs | sort µs | rel err triton / grouped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.tokens} | {r.experts:.1f} | {r.grouped_us:.1f} | {r.triton_us:.1f} | "
            f"{r.grouped_us / r.triton_us:.2f}x | {r.tbps(r.grouped_us):.2f} | {r.tbps(r.triton_us):.2f} | "
            f"{r.tflops(r.grouped_us):.0f} | {r.tflops(r.triton_us):.0f} | {r.gemms_us:.1f} | "
            f"{r.tflops(r.gemms_us):.0f} | {r.align_us:.1f} | {r.sort_us:.1f} | {r.err_triton:.1e} / {r.err_grouped:.1e} |"
        )
    if args.sweep:
        print("\n| T | config | µs | TB/s | TFLOP/s | rel err |\n|---|---|---|---|---|---|")
        for r in rows:
            best = min(us for _, us, _ in r.sweep)
            for config, us, err in r.sweep:
                print(
                    f"| {r.tokens} | {label(config)} | {us:.1f}{' **best**' if us == best else ''} | "
                    f"{r.tbps(us):.2f} | {r.tflops(us):.0f} | {err:.1e} |"
                )

    failures = [
        r for r in rows if r.err_triton > 1e-2 or r.err_grouped > 2e-2 or any(e > 1e-2 for *_, e in r.sweep)
    ]
    for r in failures:
        log.error(
            "T=%d misses the fp32 reference: triton %.2e, grouped %.2e, swept tiles up to %.2e",
            r.tokens,
            r.err_triton,
            r.err_grouped,
            max((e for *_, e in r.sweep), default=0.0),
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
