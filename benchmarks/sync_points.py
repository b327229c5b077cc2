"""Where a serving engine's threads wait for the GPU: every synchronising CUDA call, counted by where it was made.

    python benchmarks/sync_points.py --out $OUT/sync_asr.json -- bench a2t --load-format dummy \
        --skeleton qwen3-asr-0.6b --device cuda --concurrency 128 --rounds 4 --repeats 1

Runs the `omnistage` command after `--` in this process. Once the first request reaches a text stage (the
engine built, its graphs captured), `torch.cuda.set_sync_debug_mode("warn")` makes torch warn at every call
that waits for the device: a blocking copy (`.to("cpu")`, a pageable copy to or from the GPU, `.tolist()`,
`.item()`), `nonzero`, a stream or device synchronisation. Each warning is counted by its thread and the
omnistage frames of its stack (innermost last). A thread that waits while the GPU still runs the step launched
ahead (the engine's decode ahead) gives up that overlap: on the engine's thread only the settling of the step in
flight should wait. Writes every site with its count to --out and prints the busiest.
"""

from __future__ import annotations

import collections
import json
import threading
import traceback
import warnings
from typing import Any

import torch
from in_process import command_of, command_parser, reraise, run

from omnistage.engine.stages.text_admission import TextAdmission

Site = tuple[str, tuple[str, ...]]


def _site() -> tuple[str, ...]:
    """The omnistage frames of the calling stack, outermost first (the last few: where the wait is)."""
    frames = [
        f"{f.filename.rsplit('omnistage/', 1)[-1]}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()
        if "/omnistage/" in f.filename
    ]
    return tuple(frames[-6:])


def install(counts: collections.Counter[Site]) -> None:
    """Count every synchronisation warning from the first admitted request on."""
    shown = warnings.showwarning

    def show(message: Any, category: type[Warning], *rest: Any, **kwargs: Any) -> None:
        if "synchronizing CUDA operation" in str(message):
            counts[(threading.current_thread().name, _site())] += 1
            return
        shown(message, category, *rest, **kwargs)

    warnings.showwarning = show
    warnings.simplefilter("always")
    add = TextAdmission.add

    def first_add(self: TextAdmission, requests: list[Any]) -> list[Exception | None]:
        if torch.cuda.is_available() and torch.cuda.get_sync_debug_mode() == 0:
            torch.cuda.set_sync_debug_mode("warn")
        return add(self, requests)

    TextAdmission.add = first_add  # type: ignore[method-assign]


def main() -> None:
    parser = command_parser(__doc__)
    parser.add_argument("--out", required=True, help="JSON file of every site and its count")
    parser.add_argument("--top", type=int, default=25, help="sites printed")
    args = parser.parse_args()
    command = command_of(args)
    counts: collections.Counter[Site] = collections.Counter()
    install(counts)
    failure = run(command)
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)
    sites = [
        {"thread": thread, "count": n, "stack": list(stack)} for (thread, stack), n in counts.most_common()
    ]
    with open(args.out, "w") as f:
        json.dump({"command": command, "sites": sites}, f, indent=1)
    print(f"{sum(counts.values())} synchronising calls at {len(counts)} sites")
    for s in sites[: args.top]:
        print(f"{s['count']:8d}  {s['thread']}")
        for frame in s["stack"]:
            print(f"          {frame}")
    reraise(failure)


if __name__ == "__main__":
    main()
