"""What a pinned host buffer costs the thread that asks for it: the encoder cache keeps a video's vision rows
(a 30 s 720p video's ~350 MB with their deepstack levels) in pinned memory, allocated on the engine's thread.
Times `torch.empty(..., pin_memory=True)` of each size, fresh (a new process's first) and again after the
last was freed (torch's caching host allocator then hands the block back), and the copy of that many bytes
from the GPU into it.

    python3 benchmarks/pinned_alloc.py          # GPU machine, a few seconds
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
      python3 benchmarks/pinned_alloc.py        # torch's other way: malloc, then registered by 8 threads
"""

from __future__ import annotations

import os
import time

import torch


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
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
