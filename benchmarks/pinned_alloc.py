"""What a pinned host buffer costs the thread that asks for it: the encoder cache keeps a video's vision rows
(a 30 s 720p video's ~350 MB with their deepstack levels) and every clip's rows (Qwen3-ASR's: 50-800 KB) in
pinned memory, allocated on the engine's thread. Times `torch.empty(..., pin_memory=True)` of each size, fresh
(a new process's first) and again after the last was freed (torch's caching host allocator then hands the block
back), and the copy of that many bytes from the GPU into it; then 200 small blocks of each size held at once,
each a new block, the median per block.

    python3 benchmarks/pinned_alloc.py          # GPU machine, a few seconds
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
      python3 benchmarks/pinned_alloc.py        # torch's other way: malloc, then registered by 8 threads
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8,\
pinned_reserve_segment_size_mb:1024 python3 benchmarks/pinned_alloc.py   # omnistage's: new blocks reserved
"""

from __future__ import annotations

import os
import statistics
import time

import torch


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    torch.empty(1, device="cuda")  # the CUDA context first, untimed
    start = time.perf_counter()
    first = torch.empty(4096, dtype=torch.uint8, pin_memory=True)  # with a reserve set, it is made now
    print(f"the process's first pinning (4 KiB): {1e3 * (time.perf_counter() - start):.1f} ms")
    del first
    for kib in (64, 256, 1024):
        held, times = [], []
        for _ in range(200):
            start = time.perf_counter()
            held.append(torch.empty(kib << 10, dtype=torch.uint8, pin_memory=True))
            times.append(time.perf_counter() - start)
        print(f"{kib:5d} KiB: 200 new blocks held, median {1e6 * statistics.median(times):7.1f} µs a block")
        del held
    for mib in (16, 90, 354, 700):
        size = mib << 20
        start = time.perf_counter()
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        fresh = time.perf_counter() - start
        device = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        copy = time.perf_counter() - start
        del host
        start = time.perf_counter()
        again = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        reused = time.perf_counter() - start
        del again, device
        print(
            f"{mib:5d} MiB: pinned fresh {1e3 * fresh:8.1f} ms, again {1e3 * reused:6.2f} ms, "
            f"GPU to it {1e3 * copy:6.1f} ms ({size / copy / 1e9:.1f} GB/s)"
        )


if __name__ == "__main__":
    main()
