"""A projection of one row on the GPU as a Triton GEMV, for the shapes where cuBLAS picks a slow kernel.

At one row a projection streams its weight once, so its time should be the weight's bytes over the memory's
bandwidth. For most shapes cuBLAS gets close; for a few it does not: on an H200 the 2,048-to-1,024 `o_proj`
of the Talker and the code predictor takes 12.5 µs in a CUDA graph and the Talker's 768-to-1,024 shared-expert
`down_proj` 6.2 µs, where this kernel took 6.9 and 3.4 with its first fixed blocks (`benchmarks/small_gemm.py`).
How the work is best cut (output columns a program, the block of the row it streams at once, warps) depends
on the shape and the GPU, as does which shapes cuBLAS serves badly: so `linear.adopt_gemv` times cuBLAS and
each of a few configurations (`ONE_ROW_CONFIGS`) on the device at start, and keeps the fastest.

`gemv` is a custom op (`torch.library.triton_op`), so a compiled layer keeps it as one kernel and a CUDA graph
captures it. GPU only: imported where it runs.
"""

from __future__ import annotations

import functools
import logging
import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

log = logging.getLogger(__name__)

BLOCK_N = (
    8  # output columns a program by default: one row's product block is BLOCK_N x BLOCK_K values in registers
)
COPIES = 20  # calls in the graph `graph_us` times
# (block_n, block_k, num_warps) tried for one row by `fastest_config`: from few programs that each stream long
# blocks to many that each read a row or two of the weight. Which wins depends on the shape and the GPU: at one
# row the time is the weight's bytes in flight at once, and how many programs an SM holds.
ONE_ROW_CONFIGS = (
    (8, 256, 4),
    (4, 512, 4),
    (4, 1024, 4),
    (2, 1024, 4),
    (2, 2048, 8),
    (1, 2048, 4),
    (8, 512, 8),
    (16, 256, 8),
)


@triton.jit
def _weight_block(w_ptr, cols, ks, out_features, in_features):
    """The weight's rows `cols`, columns `ks`, in float32 (zeros past its edges)."""
    return tl.load(
        w_ptr + cols[:, None] * in_features + ks[None, :],
        mask=(cols[:, None] < out_features) & (ks[None, :] < in_features),
        other=0.0,
    ).to(tl.float32)


# Unspecialized: the count varies per step; a new divisibility class would build mid-request.
@triton.jit(do_not_specialize=["rows"])
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, rows, out_features, in_features,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[r, n] = sum_k x[r, k] w[n, k] for BLOCK_N columns n: the weight block is read once for every row. One
    row accumulates the products elementwise and reduces once at the end; several reduce each block."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ids = tl.arange(0, ROWS)
    if ROWS == 1:
        partial = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in range(0, in_features, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            w = _weight_block(w_ptr, cols, ks, out_features, in_features)
            x = tl.load(x_ptr + ks, mask=ks < in_features, other=0.0).to(tl.float32)
            partial += w * x[None, :]
        acc = tl.sum(partial, axis=1)[None, :]
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for start in range(0, in_features, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            w = _weight_block(w_ptr, cols, ks, out_features, in_features)
            x = tl.load(
                x_ptr + row_ids[:, None] * in_features + ks[None, :],
                mask=(row_ids[:, None] < rows) & (ks[None, :] < in_features),
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(
        out_ptr + row_ids[:, None] * out_features + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(row_ids[:, None] < rows) & (cols[None, :] < out_features),
    )


@triton_op("omnistage::gemv", mutates_args=())
def gemv(
    x: torch.Tensor, weight: torch.Tensor, block_n: int = BLOCK_N, block_k: int = 0, num_warps: int = 4
) -> torch.Tensor:
    """`F.linear(x, weight)` for `x` `[rows, in]` of a few rows and a contiguous `weight` `[out, in]`. `block_k`
    0: the product block a program holds (rows x block_n x block_k) is kept to 8,192 values."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    padded_rows = max(1, triton.next_power_of_2(rows))
    if not block_k:
        block_k = max(16, min(256, 8192 // (padded_rows * block_n)))
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    wrap_triton(_gemv_kernel)[(triton.cdiv(out_features, block_n),)](
        x.contiguous(), weight, out, rows, out_features, in_features,
        ROWS=padded_rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return out


def one_row_configs(in_features: int) -> list[tuple[int, int, int]]:
    """The configurations worth timing for one row of `in_features`: a block no longer than the row rounded up."""
    longest = triton.next_power_of_2(in_features)
    return sorted({(n, min(k, longest), warps) for n, k, warps in ONE_ROW_CONFIGS})


def fastest_config(weight: torch.Tensor) -> tuple[tuple[int, int, int], float] | None:
    """The fastest of `one_row_configs` for one row through `weight` on its GPU and its µs in a CUDA graph (None
    when none ran: a configuration that fails to build or launch is passed over)."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    times: dict[tuple[int, int, int], float] = {}
    for config in one_row_configs(weight.shape[1]):
        try:
            times[config] = graph_us(functools.partial(gemv, x, weight, *config))
        except Exception as exc:  # e.g. a block the GPU's registers or shared memory cannot hold
            log.warning("GEMV %s for a %s weight failed: %s", config, tuple(weight.shape), exc)
    if not times:
        return None
    best = min(times, key=times.__getitem__)
    return best, times[best]


def graph_us(call: Callable[[], object], reps: int = 20) -> float:
    """Median µs of one `call` in a CUDA graph of COPIES calls (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # not torch's default: see engine/graphs.capture_stream
        for _ in range(COPIES):
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / COPIES)
    return statistics.median(times)
